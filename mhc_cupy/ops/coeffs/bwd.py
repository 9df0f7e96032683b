"""The coefficient path's backward up to the tensor-core GEMMs, and those GEMMs for K <= 32
(``kernels_cu/coeffs_bwd.cu``): dH | c from the forward's sums (prep), zero-filled gradients, the
bf16 planes of dH and phi, and dx and dphi in one kernel (MmaBwd: its layout and launch).
The measurements behind the layout: benchmarks/coeffs_layout.md, "Backward, n <= 4"."""

from __future__ import annotations

from dataclasses import dataclass

from .._launch import CTYPE, ITEMSIZE, MAX_GRID, column_sum, f32, i32, i64, launch, launch_grid_stride, vec8
from .common import (_MAX_PARTIAL_FLOATS, _MAX_SPLITS, _MMA_BWD_STAGES, _NT, _cdiv, mma_token_splits,
                     pipeline_stages, planes)

_FILE = "coeffs_bwd.cu"
_WARPS = _NT // 32


def zero(ptr, count: int, stream, offset: int = 0) -> None:
    """float32 zeros over ptr[offset : offset + count]."""
    if count:
        launch(_FILE, "mhc_coeffs_zero_kernel", (min(_cdiv(count, _NT), 1024), 1, 1), (_NT, 1, 1),
               (ptr + 4 * offset, i64(count)), stream)


def zero_param_grads(dphi, dalpha, dbias, D: int, K: int, stream) -> None:
    """Zero parameter gradients (no tokens)."""
    for ptr, count in ((dphi, D * K), (dalpha, 3), (dbias, K)):
        zero(ptr, count, stream)


def launch_prep(tokens, D, n, K, KP, eps, *, part, splits: int, grads: tuple, alpha, dH, qa, dalpha, dbias, stream):
    """dH | c and the per-token dalpha terms from the sums and the raw-coefficient gradients
    ``grads`` = (pre, post, res) pointers (None = zero), then dalpha and dbias summed over tokens."""
    launch(_FILE, "mhc_coeffs_bwd_prep_kernel", (min(_cdiv(tokens, _WARPS), MAX_GRID), 1, 1), (_NT, 1, 1),
           (part, *grads, alpha, dH, qa, i64(tokens), i32(D), i32(n), i32(K), i32(KP), i32(splits), f32(eps)), stream)
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
    launch_grid_stride(_FILE, "mhc_coeffs_split_rows_kernel", rows_p * K16,
                       (src, dst, i64(rows), i32(K), i32(ld), i64(rows_p), i32(K16), i32(kc), i32(pairs)), stream)


def split_cols(dH, dst, tokens: int, K: int, KP: int, tokens_p: int, Kc: int, stream) -> None:
    """The first K columns of dH [tokens, KP] into the bf16 planes dst [3, Kc, tokens_p], transposed
    (mhc_coeffs_split_cols_kernel)."""
    launch_grid_stride(_FILE, "mhc_coeffs_split_cols_kernel", tokens_p * Kc,
                       (dH, dst, i64(tokens), i32(K), i32(KP), i64(tokens_p), i32(Kc)), stream)


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
        path) g [n][16][64].  With g staged at n = 4, 2 stages (3 blocks per SM where an SM has
        228 KiB; with 3 stages 2 blocks fit)."""
        nw, K16, Kp8, PO = 64 * self.n, self.K16, self.Kp8, planes(dt)
        fixed = PO * nw * K16 * 2
        stage = 16 * (nw * ITEMSIZE[dt] + 16) + PO * 16 * K16 * 2 + 3 * Kp8 * 32
        if g_staged:
            stage += self.n * 16 * 64 * 2
        stages = pipeline_stages(fixed, stage, 2 if g_staged and self.n == 4 else _MMA_BWD_STAGES)
        return stages, fixed + stages * stage


def mma_bwd(tokens: int, n: int, C: int, K: int) -> MmaBwd:
    """The layout of mhc_coeffs_mma_bwd_kernel for these shapes."""
    # dphi partials [splits, n*C, K]: at most _MAX_SPLITS of at most _MAX_PARTIAL_FLOATS floats in all
    return MmaBwd(n, C, K, tokens, *mma_token_splits(tokens, _cdiv(C, 64),
                                                     min(_MAX_SPLITS, _MAX_PARTIAL_FLOATS // (n * C * K))))


def launch_mma_bwd(b: MmaBwd, dt: str, *, x, phi, dH, KP: int, dx, dphi, sc: dict, stream, tg: str | None = None,
                   g=None, g_li=None, H_pre=None, H_res=None, gx=None, res_t=False):
    """dx = dH phi^T - c x (+ H_pre_i g_li + sum_j H_res[j, i] g_j + gx_i for those given; with
    ``res_t``, convention="deepseek", sum_j H_res[i, j] g_j) and dphi, on tensor cores; sc holds the
    buffers named by b.scratch() (dphi partials summed here)."""
    D = b.n * b.C
    layer = g is not None or g_li is not None or gx is not None  # any layer gradient alone adds its dx term
    tg = tg or dt
    split_rows(phi, sc["phi_r"], D, b.K, b.K, D, b.K16, b.K16 // 16, False, stream)
    split_rows(dH, sc["dH_r"], b.tokens, b.K, KP, b.tokens_p, b.K16, b.K16 // 16, False, stream)
    split_cols(dH, sc["dH_c"], b.tokens, b.K, KP, b.tokens_p, b.Kp8, stream)
    vec = "true" if vec8(b.C, x, dx, g, g_li, gx) else "false"
    out = sc["dphi_part"] if b.splits > 1 else dphi
    stages, smem = b.pipeline(dt, g_staged=layer and vec == "true" and ITEMSIZE[tg] == 2)  # the kernel's GS
    launch(_FILE, f"mhc_coeffs_mma_bwd_kernel<{CTYPE[dt]},{CTYPE[tg]},{vec},{'true' if layer else 'false'},"
                  f"{b.n},{b.K16 // 16},{b.Kp8 // 8},{stages}>",
           (_cdiv(b.C, 64), b.splits, 1), (32 * b.n, 1, 1),
           (x, sc["phi_r"], sc["dH_r"], sc["dH_c"], dH, g, g_li, H_pre, H_res, gx, dx, out, i64(b.tokens),
            i64(b.tokens_p), i32(b.C), i32(b.K), i32(KP), i64(b.t_split), i32(res_t)),
           stream, smem)
    if b.splits > 1:
        column_sum(out, dphi, b.splits, D * b.K, stream)
