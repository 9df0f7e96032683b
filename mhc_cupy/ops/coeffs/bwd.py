"""The coefficient path's backward up to the tensor-core GEMMs, and those GEMMs for K <= 32
(``kernels_cu/coeffs_bwd.cu``): dH | c from the forward's sums (prep), zero-filled gradients, the
bf16 planes of dH and phi, and dx and dphi in one kernel (MmaBwd: its layout and launch); the
kernels' launch descriptions.  The measurements behind the layout: benchmarks/coeffs_layout.md,
"Backward, n <= 4"."""

from __future__ import annotations

from dataclasses import dataclass

from .._launch import ITEMSIZE, MAX_GRID, KernelSpec, column_sum, vec8
from .common import (_MAX_PARTIAL_FLOATS, _MAX_SPLITS, _MMA_BWD_STAGES, _NT, _cdiv, mma_token_splits,
                     pipeline_stages, planes)

_FILE = "coeffs_bwd.cu"
_WARPS = _NT // 32

PREP = KernelSpec(
    _FILE, "mhc_coeffs_bwd_prep_kernel", "",
    "const float* part, const float* g_pre, const float* g_post, const float* g_res, const float* alpha, float* dH, "
    "float* qa, i64 tokens, int D, int n, int K, int KP, int splits, float eps", nullable=("g_pre", "g_post", "g_res"))
ZERO = KernelSpec(_FILE, "mhc_coeffs_zero_kernel", "", "float* out, i64 count")
SPLIT_ROWS = KernelSpec(_FILE, "mhc_coeffs_split_rows_kernel", "",
                        "const float* src, __nv_bfloat16* planes, i64 rows, int K, int ld, i64 rows_p, int K16, "
                        "int KC, int pairs")
SPLIT_COLS = KernelSpec(_FILE, "mhc_coeffs_split_cols_kernel", "",
                        "const float* src, __nv_bfloat16* planes, i64 tokens, int K, int ld, i64 tokens_p, int Kp8")


def _mma_bwd_smem(T, TG, VEC, LAYER, N, KS, NQ, STAGES):
    """The block's phi rows [PO][64 N][16 KS] bf16, then per stage x [16][64 N] T (token rows padded by
    16 bytes), dH_r [PO][16][16 KS] and dH_c [3][8 NQ][16] bf16, and where the layer's g is staged
    (LAYER, VEC, 16-bit TG) g [N][16][64] TG."""
    PO, K16, staged = planes(T), 16 * KS, LAYER and VEC and ITEMSIZE[TG] == 2
    stage = 16 * (64 * N * ITEMSIZE[T] + 16) + PO * 16 * K16 * 2 + 3 * 8 * NQ * 32 + (
        N * 16 * 64 * ITEMSIZE[TG] if staged else 0)
    return PO * 64 * N * K16 * 2 + STAGES * stage


_MMA_BWD_TEMPLATE = "typename T, typename TG, bool VEC, bool LAYER, int N, int KS, int NQ, int STAGES"
_MMA_BWD_PARAMS = (
    "const T* x, const __nv_bfloat16* phi_r, const __nv_bfloat16* dH_r, const __nv_bfloat16* dH_c, const float* dH, "
    "const TG* g, const TG* g_li, const float* H_pre, const float* H_res, const TG* gx, T* dx, float* dphi, "
    "i64 tokens, i64 tokens_p, int C, int K, int KP, i64 t_split, int res_t")
_MMA_BWD_NULLABLE = ("g", "g_li", "H_pre", "H_res", "gx")
MMA_BWD = KernelSpec(_FILE, "mhc_coeffs_mma_bwd_kernel", _MMA_BWD_TEMPLATE, _MMA_BWD_PARAMS,
                     nullable=_MMA_BWD_NULLABLE, smem=(_mma_bwd_smem, "mhc_coeffs::mma_bwd_smem"))
#: MMA_BWD (LAYER) that also writes the previous layer's dy_prev = sum_i H_post_prev_i dx_i (OPS.md
#: section 12, "Fused boundary backward")
MMA_BWD_DY = KernelSpec(_FILE, "mhc_coeffs_mma_bwd_dy_kernel", _MMA_BWD_TEMPLATE,
                        _MMA_BWD_PARAMS + ", const float* H_post_prev, T* dy_prev", nullable=_MMA_BWD_NULLABLE,
                        smem=(_mma_bwd_smem, "mhc_coeffs::mma_bwd_smem"))


def zero(ptr, count: int, stream, offset: int = 0) -> None:
    """float32 zeros over ptr[offset : offset + count]."""
    if count:
        ZERO.launch((min(_cdiv(count, _NT), 1024), 1, 1), (_NT, 1, 1), stream, out=ptr + 4 * offset, count=count)


def zero_param_grads(dphi, dalpha, dbias, D: int, K: int, stream) -> None:
    """Zero parameter gradients (no tokens)."""
    for ptr, count in ((dphi, D * K), (dalpha, 3), (dbias, K)):
        zero(ptr, count, stream)


def launch_prep(tokens, D, n, K, KP, eps, *, part, splits: int, grads: tuple, alpha, dH, qa, dalpha, dbias, stream):
    """dH | c and the per-token dalpha terms from the sums and the raw-coefficient gradients
    ``grads`` = (pre, post, res) pointers (None = zero), then dalpha and dbias summed over tokens."""
    g_pre, g_post, g_res = grads
    PREP.launch((min(_cdiv(tokens, _WARPS), MAX_GRID), 1, 1), (_NT, 1, 1), stream, part=part, g_pre=g_pre,
                g_post=g_post, g_res=g_res, alpha=alpha, dH=dH, qa=qa, tokens=tokens, D=D, n=n, K=K, KP=KP,
                splits=splits, eps=eps)
    column_sum(qa, dalpha, tokens, 3, stream)
    for ptr, offset, cols in zip(grads, (0, n, 2 * n), (n, n, n * n)):
        if ptr is None:
            zero(dbias, cols, stream, offset)
        else:
            column_sum(ptr, dbias + 4 * offset, tokens, cols, stream)


def split_rows(src, dst, rows: int, K: int, ld: int, rows_p: int, K16: int, kc: int, pairs: bool, stream) -> None:
    """src [rows, K] float32 (row stride ld) into the bf16 planes dst [3, rows_p, K16]: columns in
    fragment order of kc k-steps a chunk (0: their own order), rows g, g + 8 interleaved with
    ``pairs`` (mhc_coeffs_split_rows_kernel)."""
    SPLIT_ROWS.launch_grid_stride(rows_p * K16, stream, src=src, planes=dst, rows=rows, K=K, ld=ld, rows_p=rows_p,
                                  K16=K16, KC=kc, pairs=int(pairs))


def split_cols(dH, dst, tokens: int, K: int, KP: int, tokens_p: int, Kc: int, stream) -> None:
    """The first K columns of dH [tokens, KP] into the bf16 planes dst [3, Kc, tokens_p], transposed
    (mhc_coeffs_split_cols_kernel)."""
    SPLIT_COLS.launch_grid_stride(tokens_p * Kc, stream, src=dH, planes=dst, tokens=tokens, K=K, ld=KP,
                                  tokens_p=tokens_p, Kp8=Kc)


@dataclass(frozen=True)
class TensorCoreBwd:
    """Shape of the tensor-core backward: dH and phi split into bf16 planes of K16 columns
    (rows padded to tokens_p tokens, a multiple of 16)."""

    n: int
    C: int
    K: int
    tokens: int

    @property
    def K16(self):
        return _cdiv(self.K, 16) * 16

    @property
    def tokens_p(self):
        return _cdiv(max(self.tokens, 1), 16) * 16


@dataclass(frozen=True)
class MmaBwd(TensorCoreBwd):
    """Layout and scratch of mhc_coeffs_mma_bwd_kernel (dx and dphi on tensor cores, K <= 32)."""

    splits: int  # token ranges (dphi partials)
    t_split: int

    @property
    def Kp8(self):
        return _cdiv(self.K, 8) * 8

    def scratch(self) -> dict:
        """name -> (shape, dtype): what the launch needs besides dH (phi and dH split into bf16 planes)."""
        D = self.n * self.C
        out = {"phi_r": ((3, D, self.K16), "bfloat16"), "dH_r": ((3, self.tokens_p, self.K16), "bfloat16"),
               "dH_c": ((3, self.Kp8, self.tokens_p), "bfloat16")}
        if self.splits > 1:
            out["dphi_part"] = ((self.splits, D, self.K), "float32")
        return out

    def pipeline(self, dt: str, g_staged: bool = False) -> tuple[int, int]:
        """(stages, dynamic shared bytes): the block's phi rows (PO planes: 2 for 16-bit x, 3 for
        float32), then per stage x [16][n][64] (token rows padded by 16 bytes), dH_r [PO][16][K16]
        and dH_c [3][Kp8][16], and with ``g_staged`` (the layer's 16-bit output gradient, vector
        path) g [n][16][64] (MMA_BWD).  With g staged at n = 4, 2 stages (3 blocks per SM where an SM
        has 228 KiB; with 3 stages 2 blocks fit)."""
        def size(stages):  # (g staged: LAYER and VEC with a 16-bit TG; else neither)
            return MMA_BWD.smem(T=dt, TG="bfloat16" if g_staged else dt, VEC=g_staged, LAYER=g_staged, N=self.n,
                                KS=self.K16 // 16, NQ=self.Kp8 // 8, STAGES=stages)

        stages = pipeline_stages(size, 2 if g_staged and self.n == 4 else _MMA_BWD_STAGES)
        return stages, size(stages)


def mma_bwd(tokens: int, n: int, C: int, K: int) -> MmaBwd:
    """The layout of mhc_coeffs_mma_bwd_kernel for these shapes."""
    # dphi partials [splits, n*C, K]: at most _MAX_SPLITS of at most _MAX_PARTIAL_FLOATS floats in all
    return MmaBwd(n, C, K, tokens, *mma_token_splits(tokens, _cdiv(C, 64),
                                                     min(_MAX_SPLITS, _MAX_PARTIAL_FLOATS // (n * C * K))))


def launch_mma_bwd(b: MmaBwd, dt: str, *, x, phi, dH, KP: int, dx, dphi, sc: dict, stream, tg: str | None = None,
                   g=None, g_li=None, H_pre=None, H_res=None, gx=None, res_t=False, H_post_prev=None, dy_prev=None):
    """dx = dH phi^T - c x (+ H_pre_i g_li + sum_j H_res[j, i] g_j + gx_i for those given; with
    ``res_t``, convention="deepseek", sum_j H_res[i, j] g_j) and dphi, on tensor cores; sc holds the
    buffers named by b.scratch() (dphi partials summed here).  ``dy_prev`` (with ``H_post_prev`` and a
    layer term): also dy_prev = sum_i H_post_prev_i dx_i, in the same launch (MMA_BWD_DY)."""
    D = b.n * b.C
    layer = g is not None or g_li is not None or gx is not None  # any layer gradient alone adds its dx term
    tg = tg or dt
    split_rows(phi, sc["phi_r"], D, b.K, b.K, D, b.K16, b.K16 // 16, False, stream)
    split_rows(dH, sc["dH_r"], b.tokens, b.K, KP, b.tokens_p, b.K16, b.K16 // 16, False, stream)
    split_cols(dH, sc["dH_c"], b.tokens, b.K, KP, b.tokens_p, b.Kp8, stream)
    vec = vec8(b.C, x, dx, g, g_li, gx)
    out = sc["dphi_part"] if b.splits > 1 else dphi
    stages = b.pipeline(dt, g_staged=layer and vec and ITEMSIZE[tg] == 2)[0]  # the kernel's GS
    dy = {} if dy_prev is None else {"H_post_prev": H_post_prev, "dy_prev": dy_prev}
    if dy and not layer:
        raise ValueError("dy_prev needs a layer term (g, g_li or gx)")
    (MMA_BWD_DY if dy else MMA_BWD).bind(T=dt, TG=tg, VEC=vec, LAYER=layer, N=b.n, KS=b.K16 // 16, NQ=b.Kp8 // 8,
                                         STAGES=stages).launch(
        (_cdiv(b.C, 64), b.splits, 1), (32 * b.n, 1, 1), stream, x=x, phi_r=sc["phi_r"], dH_r=sc["dH_r"],
        dH_c=sc["dH_c"], dH=dH, g=g, g_li=g_li, H_pre=H_pre, H_res=H_res, gx=gx, dx=dx, dphi=out, tokens=b.tokens,
        tokens_p=b.tokens_p, C=b.C, K=b.K, KP=KP, t_split=b.t_split, res_t=int(res_t), **dy)
    if b.splits > 1:
        column_sum(out, dphi, b.splits, D * b.K, stream)
