"""The coefficient path's backward for K > 32 (n > 4): dphi (``kernels_cu/coeffs_dphi.cu``) and dx
(``kernels_cu/coeffs_dx.cu``) on tensor cores as two kernels, with their layout (SplitBwd: column
chunks, token splits, which dx kernel for which n / dtype / device), launches and the kernels'
launch descriptions.  The measurements behind the layout: benchmarks/coeffs_layout.md,
"Backward, n > 4"."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..._jit import uses_wgmma
from ..._kernel_choice import current
from .._launch import ITEMSIZE, KernelSpec, column_sum, vec8
from .bwd import TensorCoreBwd, split_cols, split_rows
from .common import (_MAX_PARTIAL_FLOATS, _MAX_SPLITS, _MMA_BWD_STAGES, _SMEM_PORTABLE, _cdiv, mma_token_splits,
                     pipeline_stages, planes)

_DPHI_FILE, _DX_FILE = "coeffs_dphi.cu", "coeffs_dx.cu"
_MMA_DPHI_NQ = 5  # 8-column tiles per block of mhc_coeffs_mma_dphi_kernel: 16 * NQ accumulators per thread
#: 8-column MMA tiles per warp of mhc_coeffs_mma_dx_kernel (32 columns).  The kernel also takes 8
#: (64 columns, the same dx bit for bit), measured slower: its larger phi tile fits fewer blocks per SM.
_DX_NT = 4
#: Least warps per 2 x 99 KiB of shared memory (about an SM's) for the dx with phi resident
#: (mhc_coeffs_mma_dx_kernel); below it the dx streams phi beside dH (mhc_coeffs_mma_dx_tile_kernel):
#: resident for n 5-8 at 16 bits and 5, 6, 8 in float32.
_DX_MIN_WARPS = 8

#: per stage x [16][256] T (token rows padded by 16 bytes) and dH_c [3][8 NQ][16] bf16
MMA_DPHI = KernelSpec(
    _DPHI_FILE, "mhc_coeffs_mma_dphi_kernel", "typename T, bool VEC, int NQ, int STAGES",
    "const T* x, const __nv_bfloat16* dH_c, float* dphi, i64 tokens, i64 tokens_p, int D, int K, int Kc, int ncc, "
    "i64 t_split",
    smem=(lambda T, NQ, STAGES: STAGES * (16 * (256 * ITEMSIZE[T] + 16) + 3 * 8 * NQ * 32),
          "mhc_coeffs::mma_dphi_smem"))
#: the CUDA-core dphi (any K; the head's, ops/head.py)
BWD_DPHI = KernelSpec(_DPHI_FILE, "mhc_coeffs_bwd_dphi_kernel", "typename T, int E, int KC",
                      "const T* x, const float* dH, float* dphi, i64 tokens, int D, int K, int KP, int ncc, "
                      "int dblocks, i64 t_split")
_DX_PARAMS = ("const T* x, const __nv_bfloat16* phi_r, const __nv_bfloat16* dH_r, const float* dH, const TG* g, "
              "const TG* g_li, const float* H_pre, const float* H_res, const TG* gx, T* dx, i64 tokens, i64 tokens_p, "
              "int n, int C, int K, int KP, int groups, i64 t_split, int res_t")
_LAYER_GRADS = ("g", "g_li", "H_pre", "H_res", "gx")  # absent: None
#: the phi rows of its W streams' 8 NT columns [PO][8 NT W][16 KS], then per stage dH_r [PO][16][16 KS], bf16
MMA_DX = KernelSpec(
    _DX_FILE, "mhc_coeffs_mma_dx_kernel",
    "typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int NT, int STAGES", _DX_PARAMS,
    nullable=_LAYER_GRADS,
    smem=(lambda T, KS, W, NT, STAGES: (8 * NT * W + STAGES * 16) * 16 * KS * 2 * planes(T), "mhc_coeffs::mma_dx_smem"))
#: per stage dH_r [PO][BT][32] and phi_r [PO][32 W][32] bf16, BT = 16 (4 / W) MT tokens
MMA_DX_TILE = KernelSpec(
    _DX_FILE, "mhc_coeffs_mma_dx_tile_kernel",
    "typename T, typename TG, bool VEC, bool LAYER, int KS, int W, int MT, int STAGES", _DX_PARAMS,
    nullable=_LAYER_GRADS,
    smem=(lambda T, W, MT, STAGES: STAGES * planes(T) * (16 * (4 // W) * MT + 32 * W) * 64,
          "mhc_coeffs::mma_dx_tile_smem"))
#: phi's two planes [2][NB][16 KS], then per stage dH [2][64][16 KS], bf16
WG_DX = KernelSpec(
    _DX_FILE, "mhc_coeffs_wg_dx_kernel", "bool LAYER, int KS, int NB, int STAGES",
    "const __nv_bfloat16* x, const __nv_bfloat16* phi_r, const __nv_bfloat16* dH_r, const float* dH, "
    "const __nv_bfloat16* g, const __nv_bfloat16* g_li, const float* H_pre, const float* H_res, "
    "const __nv_bfloat16* gx, __nv_bfloat16* dx, i64 tokens, i64 tokens_p, int n, int C, int K, int KP, i64 t_split, "
    "int res_t", nullable=_LAYER_GRADS,
    smem=(lambda KS, NB, STAGES: 4 * NB * 16 * KS + STAGES * 256 * 16 * KS, "mhc_coeffs::wg_dx_smem"))


def dx_smem(w: int, nt: int, K16: int, dt: str) -> tuple[int, int]:
    """(stages, dynamic shared bytes) of mhc_coeffs_mma_dx_kernel (MMA_DX) with W = w, NT = nt."""
    def size(stages):
        return MMA_DX.smem(T=dt, KS=K16 // 16, W=w, NT=nt, STAGES=stages)

    stages = pipeline_stages(size, _MMA_BWD_STAGES)
    return stages, size(stages)


def _dx_tiles(n: int, K16: int, dt: str, min_warps: int) -> tuple[int, int] | None:
    """(W warps (streams) per block, NT column tiles per warp) of mhc_coeffs_mma_dx_kernel: NT =
    _DX_NT and the most W of 4, 2, 1 dividing n whose shared memory fits the portable limit with
    at least min_warps warps per twice that; None: the tile dx (phi streamed)."""
    for w in (4, 2, 1):
        if n % w:
            continue
        smem = dx_smem(w, _DX_NT, K16, dt)[1]
        if smem <= _SMEM_PORTABLE and w * (2 * _SMEM_PORTABLE // smem) >= min_warps:
            return w, _DX_NT
    return None


_DX_TILE_MT = 2  # 16-token m tiles per warp of the tile kernel (accumulators 16 MT per thread)


def dx_tile_layout(n: int, K: int, dt: str) -> tuple[int, int, int, int, int]:
    """(W streams per block, MT, KS (even), stages, dynamic shared bytes) of
    mhc_coeffs_mma_dx_tile_kernel (MMA_DX_TILE): 4 warps, W = 2 for even n else 1."""
    w = 2 if n % 2 == 0 else 1

    def size(stages):
        return MMA_DX_TILE.smem(T=dt, W=w, MT=_DX_TILE_MT, STAGES=stages)

    stages = pipeline_stages(size, _MMA_BWD_STAGES)
    return w, _DX_TILE_MT, _cdiv(K, 32) * 2, stages, size(stages)


# The dx on wgmma (mhc_coeffs_wg_dx_kernel; bf16 x with C % 8 == 0, 16-byte aligned x, dx and layer
# gradients, the layer gradients bf16, on devices that NVRTC targets as sm_90a): a block keeps the phi
# rows of _WG_DX_NB positions (two bf16 planes) resident and walks 64 tokens a step, _WG_DX_STAGES
# stages of dH; only where two blocks fit an SM (_WG_DX_SMEM each), which with K >= _WG_DX_MIN_K is
# n = 5 .. 9, where it was measured faster, and unless the kernel choice in force when the layout is
# made says wg_dx=False (SplitBwd.wgmma).  The tensor core sums the same products in the same k-step
# order as the mma.sync kernels; the tests hold the two to one bf16 rounding.
_WG_DX_MIN_K = 35  # n >= 5
_WG_DX_NB = 128
_WG_DX_STAGES = 2
_WG_DX_SMEM = 113 * 1024


def wg_dx_layout(K: int) -> tuple[int, int, int] | None:
    """(NB positions a block, stages, dynamic shared bytes) of mhc_coeffs_wg_dx_kernel (WG_DX); None
    where that exceeds _WG_DX_SMEM (K > 112: n > 9) or K < _WG_DX_MIN_K."""
    smem = WG_DX.smem(KS=_cdiv(K, 16), NB=_WG_DX_NB, STAGES=_WG_DX_STAGES)
    return (_WG_DX_NB, _WG_DX_STAGES, smem) if K >= _WG_DX_MIN_K and smem <= _WG_DX_SMEM else None


@dataclass(frozen=True)
class SplitBwd(TensorCoreBwd):
    """Layout and scratch of the backward for K > 32 (n > 4): dphi on tensor cores
    (mhc_coeffs_mma_dphi_kernel, columns in chunks of 8 * nq), dx on tensor cores
    (mhc_coeffs_mma_dx_kernel) where its phi rows leave _DX_MIN_WARPS warps per SM, else with phi
    streamed beside dH (mhc_coeffs_mma_dx_tile_kernel); on wgmma (mhc_coeffs_wg_dx_kernel) where
    wg_dx_runs."""

    dt: str
    # _DX_MIN_WARPS when the layout is made: a plan keeps the scratch it sized for its dx kernel.
    # The derived layout below is cached per instance (cached_property): the launch reads it on
    # every call.
    min_warps: int = field(default_factory=lambda: _DX_MIN_WARPS)
    # whether the wgmma dx may run: the kernel choice in force when the layout is made (wg_dx,
    # mhc_cupy._kernel_choice), kept by the plan
    wgmma: bool = field(default_factory=lambda: current().runs("wg_dx"))

    @cached_property
    def ncc(self) -> int:  # column chunks of dphi
        return _cdiv(_cdiv(self.K, 8), _MMA_DPHI_NQ)

    @cached_property
    def nq(self) -> int:  # 8-column tiles per chunk
        return _cdiv(_cdiv(self.K, 8), self.ncc)

    @cached_property
    def pblocks(self) -> int:
        return _cdiv(self.n * self.C, 256)

    @cached_property
    def dphi_splits(self) -> tuple[int, int]:
        """(splits, tokens per split) of the dphi reduction (partials as MmaBwd's)."""
        most = min(_MAX_SPLITS, _MAX_PARTIAL_FLOATS // (self.n * self.C * self.K))
        return mma_token_splits(self.tokens, self.pblocks * self.ncc, most)

    @cached_property
    def dx_kind(self) -> str:
        """"resident" (mhc_coeffs_mma_dx_kernel) or "tile" (mhc_coeffs_mma_dx_tile_kernel), as
        _dx_tiles chooses."""
        return "tile" if self.dx_tiles is None else "resident"

    @cached_property
    def dx_tiles(self) -> tuple[int, int] | None:
        """(W, NT) of mhc_coeffs_mma_dx_kernel where it runs, else None."""
        return _dx_tiles(self.n, self.K16, self.dt, self.min_warps)

    @cached_property
    def tile_layout(self) -> tuple[int, int, int, int, int] | None:
        """dx_tile_layout of the tile dx where it runs, else None."""
        return dx_tile_layout(self.n, self.K, self.dt) if self.dx_kind == "tile" else None

    @cached_property
    def dx_K16(self) -> int:
        """Columns of the bf16 planes of phi and dH that the tensor-core dx reads (tile: K16 rounded
        up to an even number of k-steps)."""
        return 16 * self.tile_layout[2] if self.dx_kind == "tile" else self.K16

    @cached_property
    def dx_splits(self) -> tuple[int, int]:
        """(token ranges, tokens per range) of the tensor-core dx (no reduction; grid y <= 65535;
        tile: tokens per range a multiple of its tokens a step)."""
        if self.dx_kind == "tile":
            w, mt = self.tile_layout[:2]
            bt = 16 * (4 // w) * mt
            splits, _ = mma_token_splits(self.tokens, _cdiv(self.C, 32) * (self.n // w), 65535)
            per = _cdiv(_cdiv(max(self.tokens, 1), splits), bt) * bt
            return _cdiv(max(self.tokens, 1), per), per
        w, nt = self.dx_tiles
        return mma_token_splits(self.tokens, _cdiv(self.C, 8 * nt) * (self.n // w), 65535)

    @cached_property
    def wg_dx(self) -> tuple[int, int, int] | None:
        """wg_dx_layout for bf16 x where the kernel choice lets it run (``wgmma``), else None: where the
        wgmma dx may run; whether it does is decided at launch (the device, dtypes, alignment:
        wg_dx_runs)."""
        return wg_dx_layout(self.K) if self.dt == "bfloat16" and self.wgmma else None

    @cached_property
    def wg_splits(self) -> tuple[int, int]:
        """(token ranges, tokens per range, a multiple of 64) of the wgmma dx."""
        splits, _ = mma_token_splits(self.tokens, _cdiv(self.n * self.C, self.wg_dx[0]), 65535)
        per = _cdiv(_cdiv(max(self.tokens, 1), splits), 64) * 64
        return _cdiv(max(self.tokens, 1), per), per

    def wg_dx_runs(self, tg: str, *ptrs) -> bool:
        """Whether launch_split_bwd runs the wgmma dx: a layout (wg_dx), layer gradients (if any) of dtype tg
        bf16, C % 8 == 0, every given pointer (x, dx, layer gradients) 16-byte aligned, a device with
        wgmma."""
        return self.wg_dx is not None and tg == "bfloat16" and vec8(self.C, *ptrs) and uses_wgmma()

    @cached_property
    def dphi_pipeline(self) -> tuple[int, int]:
        """(stages, dynamic shared bytes) of mhc_coeffs_mma_dphi_kernel (MMA_DPHI)."""
        def size(stages):
            return MMA_DPHI.smem(T=self.dt, NQ=self.nq, STAGES=stages)

        stages = pipeline_stages(size, _MMA_BWD_STAGES)
        return stages, size(stages)

    @cached_property
    def dx_pipeline(self) -> tuple[int, int]:
        """(stages, dynamic shared bytes) of the tensor-core dx (dx_smem)."""
        return dx_smem(*self.dx_tiles, self.K16, self.dt)

    def scratch(self) -> dict:
        """name -> (shape, dtype): what the launches need besides dH (bf16 planes of dH and phi)."""
        D = self.n * self.C
        out = {"dH_c": ((3, self.ncc * self.nq * 8, self.tokens_p), "bfloat16"),
               "phi_r": ((3, D, self.dx_K16), "bfloat16"), "dH_r": ((3, self.tokens_p, self.dx_K16), "bfloat16")}
        if self.dphi_splits[0] > 1:
            out["dphi_part"] = ((self.dphi_splits[0], D, self.K), "float32")
        return out


def launch_split_bwd(b: SplitBwd, dt: str, *, x, phi, dH, KP: int, dx, dphi, sc: dict, stream, tg: str | None = None,
                     g=None, g_li=None, H_pre=None, H_res=None, gx=None, res_t=False):
    """dx = dH phi^T - c x (+ H_pre_i g_li + sum_j H_res[j, i] g_j + gx_i for those given; with
    ``res_t``, convention="deepseek", sum_j H_res[i, j] g_j) and dphi for K > 32; sc holds the
    buffers named by b.scratch() (dphi partials summed here)."""
    D, K = b.n * b.C, b.K
    layer = g is not None or g_li is not None or gx is not None
    tg = tg or dt
    Kc = b.ncc * b.nq * 8
    split_cols(dH, sc["dH_c"], b.tokens, K, KP, b.tokens_p, Kc, stream)
    splits, t_split = b.dphi_splits
    out = sc["dphi_part"] if splits > 1 else dphi
    MMA_DPHI.bind(T=dt, VEC=vec8(D, x), NQ=b.nq, STAGES=b.dphi_pipeline[0]).launch(
        (b.pblocks * b.ncc, splits, 1), (128, 1, 1), stream, x=x, dH_c=sc["dH_c"], dphi=out, tokens=b.tokens,
        tokens_p=b.tokens_p, D=D, K=K, Kc=Kc, ncc=b.ncc, t_split=t_split)
    if splits > 1:
        column_sum(out, dphi, splits, D * K, stream)
    dx_args = dict(x=x, phi_r=sc["phi_r"], dH_r=sc["dH_r"], dH=dH, g=g, g_li=g_li, H_pre=H_pre, H_res=H_res, gx=gx,
                   dx=dx, tokens=b.tokens, tokens_p=b.tokens_p, n=b.n, C=b.C, K=K, KP=KP, res_t=int(res_t))
    if b.wg_dx_runs(tg, x, dx, g, g_li, gx):
        _split_rows(b, phi, dH, KP, b.K16, 0, sc, stream)
        (nb, stages, _), (dsplits, dt_split) = b.wg_dx, b.wg_splits
        WG_DX.bind(LAYER=layer, KS=b.K16 // 16, NB=nb, STAGES=stages).launch(
            (_cdiv(D, nb), dsplits, 1), (128, 1, 1), stream, **dx_args, t_split=dt_split)
        return
    K16 = b.dx_K16
    kc = 0 if b.dx_kind == "tile" else K16 // 16  # k-steps per chunk of the planes' fragment order (0: none)
    _split_rows(b, phi, dH, KP, K16, kc, sc, stream)
    dsplits, dt_split = b.dx_splits
    common = dict(T=dt, TG=tg, VEC=vec8(b.C, x, dx, g, g_li, gx), LAYER=layer, KS=K16 // 16)
    if b.dx_kind == "tile":
        w, mt, _, stages, _ = b.tile_layout
        kernel, grid, block = MMA_DX_TILE.bind(**common, W=w, MT=mt, STAGES=stages), _cdiv(b.C, 32), 128
    else:
        (w, nt), stages = b.dx_tiles, b.dx_pipeline[0]
        kernel, grid, block = MMA_DX.bind(**common, W=w, NT=nt, STAGES=stages), _cdiv(b.C, 8 * nt), 32 * w
    kernel.launch((grid * (b.n // w), dsplits, 1), (block, 1, 1), stream, **dx_args, groups=b.n // w,
                  t_split=dt_split)


def _split_rows(b: SplitBwd, phi, dH, KP: int, K16: int, kc: int, sc: dict, stream) -> None:
    """phi and dH into the bf16 planes phi_r [3, D, K16] and dH_r [3, tokens_p, K16] of the tensor-core
    dx: columns in fragment order of kc k-steps a chunk (kc = 0: their own order); dH with rows g, g + 8
    interleaved where kc != 0 (mhc_coeffs_mma_dx_kernel's A operand)."""
    D = b.n * b.C
    split_rows(phi, sc["phi_r"], D, b.K, b.K, D, K16, kc, False, stream)
    split_rows(dH, sc["dH_r"], b.tokens, b.K, KP, b.tokens_p, K16, kc, kc != 0, stream)

