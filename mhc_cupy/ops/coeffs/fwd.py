"""The coefficient path's forward GEMM and finish (``kernels_cu/coeffs_fwd.cu``): the kernels'
launch descriptions, their layout (column chunks, token tiles, D ranges, pipeline depth, mma.sync
or wgmma) and launches.  The measurements behind the layout constants:
benchmarks/coeffs_layout.md, "Forward"."""

from __future__ import annotations

from typing import NamedTuple

from ..._jit import uses_wgmma
from ..._kernel_choice import current
from .._launch import ITEMSIZE, MAX_GRID, KernelSpec, vec8
from .common import _MAX_SPLITS, _MMA_TARGET_BLOCKS, _NT, _cdiv, pipeline_stages

_FILE = "coeffs_fwd.cu"
_MIN_STEPS_PER_RANGE = 4  # a D range of the forward GEMM spans at least this many steps
_MMA_MT = 2  # 16-token MMA tiles per warp of mhc_coeffs_mma_fwd_kernel
_MMA_TOK = 4 * _MMA_MT * 16  # tokens per block (4 warps)
_MMA_MAX_NTILE = 6  # 8-column tiles per block: accumulators 4 * MT * NTILE per thread
_MMA_ROW_BYTES = 128  # bytes of each token row per pipeline stage of the forward GEMM (32 positions a sub-step)
#: cp.async pipeline depth of the forward GEMM (at most): 16-bit x 2 stages of 128-byte row pieces.
_MMA_STAGES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The forward GEMM on wgmma (mhc_coeffs_wg_fwd_kernel; bf16 x on devices that NVRTC targets as
# sm_90a): the same D ranges and token tiles as the mma.sync kernel (128 tokens a block), its own
# column chunks of at most _WG_MAX_KC columns.  Its sums are not the mma.sync kernel's (other MMA
# shapes, sums of squares on CUDA cores), so H~ differs in the last bits between sm_90 and other
# GPUs; on one GPU the bits depend on the values only (aligned or not, the same sums).  Only from
# _WG_MIN_K columns, where it was measured faster, and unless the kernel choice in force when the
# layout is made says wg_fwd=False (mhc_cupy._kernel_choice).
_WG_MIN_K = 63  # n >= 7
_WG_MT = 2  # m64 token tiles per block
assert 64 * _WG_MT == _MMA_TOK, "the wgmma forward walks the mma.sync layout's token tiles"
_WG_MAX_KC = 96  # columns per block (N of the wgmma)
_WG_SMEM = 113 * 1024  # dynamic shared memory a block (two blocks an SM on sm_90)

# The two forward GEMMs (mma.sync, wgmma) each split phi into bf16 planes and take the same parameters
# but for x's type and their column layout (the mma.sync kernel's Kp, the wgmma kernel's KC).
_SPLIT_PHI = "const float* phi, __nv_bfloat16* planes, int D, int K, int Dp, "
_GEMM = ("const {x}* x, const __nv_bfloat16* planes, float* part, i64 tokens, int D, int Dp, int K, {cols}int ncc, "
         "i64 tiles, int d_split")
SPLIT_PHI_FWD = KernelSpec(_FILE, "mhc_coeffs_split_phi_fwd_kernel", "", _SPLIT_PHI + "int Kp")
#: x [4 MT 16 tokens][32 SUB positions] and phi [3][8 NTILE][32 SUB] bf16 a stage
MMA_FWD = KernelSpec(
    _FILE, "mhc_coeffs_mma_fwd_kernel", "typename T, bool VEC, int MT, int NTILE, int STAGES, int SUB",
    _GEMM.format(x="T", cols="int Kp, "),
    smem=(lambda T, MT, NTILE, STAGES, SUB: STAGES * SUB * (4 * MT * 16 * 32 * ITEMSIZE[T] + 3 * NTILE * 8 * 64),
          "mhc_coeffs::mma_fwd_smem"))
SPLIT_PHI_WG = KernelSpec(_FILE, "mhc_coeffs_split_phi_wg_kernel", "", _SPLIT_PHI + "int KC, int ncc")
#: x [64 MT tokens][64 positions] and phi [3][KC][64] bf16 a stage
WG_FWD = KernelSpec(_FILE, "mhc_coeffs_wg_fwd_kernel", "bool VEC, int KC, int MT, int STAGES",
                    _GEMM.format(x="__nv_bfloat16", cols=""),
                    smem=(lambda KC, MT, STAGES: STAGES * (64 * MT * 128 + 3 * KC * 128), "mhc_coeffs::wg_fwd_smem"))
FINISH = KernelSpec(
    _FILE, "mhc_coeffs_fwd_finish_kernel", "",
    "const float* part, const float* alpha, const float* bias, float* h_pre, float* h_post, float* h_res, "
    "float* stats, i64 tokens, int D, int n, int K, int splits, float eps", nullable=("stats",))


def mma_sub(dt: str) -> int:
    """32-position sub-steps per stage of mhc_coeffs_mma_fwd_kernel: _MMA_ROW_BYTES of each token row
    (HBM serves 128-byte pieces of many rows faster than 64-byte ones)."""
    return max(1, _MMA_ROW_BYTES // (32 * ITEMSIZE[dt]))


def mma_fwd_smem(dt: str, ntile: int) -> tuple[int, int]:
    """(stages, dynamic shared bytes) of mhc_coeffs_mma_fwd_kernel (MMA_FWD) with NTILE = ntile."""
    def size(stages):
        return MMA_FWD.smem(T=dt, MT=_MMA_MT, NTILE=ntile, STAGES=stages, SUB=mma_sub(dt))

    stages = pipeline_stages(size, _MMA_STAGES[dt])
    return stages, size(stages)


# The forward GEMM for a few tokens on CUDA cores (mhc_coeffs_gemv_fwd_kernel, coeffs_gemv.cu): phi
# read as float32 (no planes pass), over about _GEMV_BLOCKS blocks; for at most SMALL_MAX_TOKENS tokens,
# where the kernel choice in force says small (off by default: checked correct on the H200, slower there under CUDA graphs).
SMALL_MAX_TOKENS = 64
_GEMV_BLOCKS = 256
_GEMV_THREADS = 256
_GEMV_MAX_OUTS = 8  # outputs per thread (the kernel's GEMV_MAX_OUTS)
_GEMV_SMEM_FLOATS = 12288  # its static shared memory (GEMV_SMEM_FLOATS)
GEMV_FWD = KernelSpec("coeffs_gemv.cu", "mhc_coeffs_gemv_fwd_kernel", "typename T, bool POST",
                      "const T* x, const float* phi, float* part, i64 tokens, int D, int K, int tt, int outs, "
                      "int rows, int d_split, const T* y, const float* h_post, const float* h_res, T* out, int C, "
                      "int n, int res_t", nullable=("y", "h_post", "h_res", "out"))


def few_tokens(tokens: int) -> bool:
    """At most SMALL_MAX_TOKENS tokens under the kernel choice small or tail (read now: when a plan is made):
    the pre piece after the GEMM in one launch, and a token's columns over several blocks in the kernels
    without column reductions (the post op's forward; ops._launch.column_blocks, the same bits)."""
    if tokens > SMALL_MAX_TOKENS:
        return False
    choice = current()
    return choice.runs("small") or choice.runs("tail")


class GemvLayout(NamedTuple):
    """Launch layout of mhc_coeffs_gemv_fwd_kernel (shapes only: the bits do not depend on the GPU)."""

    tt: int  # tokens per block (a token group)
    groups: int  # token groups
    outs: int  # outputs per thread
    rows: int  # rows of phi staged at a time
    splits: int  # D ranges
    d_split: int  # positions per range


def gemv_layout(tokens: int, D: int, K: int) -> GemvLayout:
    """The D ranges: about _GEMV_BLOCKS blocks, each range at least 32 rows (or what shared memory holds);
    a block stages its whole range at once where it fits (one HBM round trip for phi: at one token, C 7168,
    n 4, 112 rows; the chunks do not change the order of any sum, so neither the bits)."""
    tt = max(1, min(tokens, 16, _GEMV_THREADS * _GEMV_MAX_OUTS // (K + 1)))
    fit = max(1, _GEMV_SMEM_FLOATS // (K + tt))  # rows of phi and x that shared memory holds
    groups = _cdiv(tokens, tt)
    d_split = max(min(32, fit), _cdiv(D, _cdiv(_GEMV_BLOCKS, groups)))
    return GemvLayout(tt, groups, _cdiv(tt * (K + 1), _GEMV_THREADS), min(fit, d_split), _cdiv(D, d_split), d_split)


class MmaLayout(NamedTuple):
    """Launch layout of mhc_coeffs_mma_fwd_kernel (depends on shapes and the dtype of x only)."""

    ntile: int  # 8-column tiles per column chunk
    ncc: int  # column chunks
    Kp: int  # padded columns of the phi planes: ncc * ntile * 8
    Dp: int  # padded positions of the phi planes: a multiple of 32 * mma_sub(dt)
    tiles: int  # token tiles of _MMA_TOK tokens
    splits: int  # D ranges (part's leading dim)
    d_split: int  # positions per D range, a multiple of 32 * mma_sub(dt)
    wg_kc: int = 0  # columns per chunk of mhc_coeffs_wg_fwd_kernel (0: not used; bf16, K >= _WG_MIN_K, wg_fwd only)
    wg_ncc: int = 0  # its column chunks
    gemv: GemvLayout | None = None  # a few tokens: the GEMV instead (then splits, d_split are its)
    tail: bool = False  # a few tokens: the pre piece after the GEMM in one launch (kernel choice small or tail)

    @property
    def planes_shape(self):
        if self.gemv is not None:  # (no planes)
            return (1,), "bfloat16"
        return (3, max(self.Kp, self.wg_ncc * self.wg_kc), self.Dp), "bfloat16"

    def wg_smem(self) -> tuple[int, int]:
        """(stages, dynamic shared bytes) of mhc_coeffs_wg_fwd_kernel (WG_FWD): as many stages (2 to 4)
        as fit _WG_SMEM."""
        stages = max(2, min(4, _WG_SMEM // WG_FWD.smem(KC=self.wg_kc, MT=_WG_MT, STAGES=1)))
        return stages, WG_FWD.smem(KC=self.wg_kc, MT=_WG_MT, STAGES=stages)


def mma_layout(tokens: int, D: int, K: int, dt: str) -> MmaLayout:
    """Column chunks, token tiles and D ranges of the tensor-core forward GEMM.

    D is split only when token tiles x column chunks give fewer than
    _MMA_TARGET_BLOCKS blocks, and never below _MIN_STEPS_PER_RANGE steps per range.  The wgmma
    kernel's chunks (wg_kc, wg_ncc) only where it may run: bf16, K >= _WG_MIN_K and the kernel
    choice in force (``wg_fwd``, :mod:`mhc_cupy._kernel_choice`; read here, when a plan is made).  At
    most SMALL_MAX_TOKENS tokens: the GEMV instead under ``small``, the one-launch pre piece after the GEMM
    (``tail``: ops.layer.launch_pre_from_sums) under ``small`` or ``tail``.
    """
    nt_total = _cdiv(K, 8)
    ncc = _cdiv(nt_total, _MMA_MAX_NTILE)
    ntile = _cdiv(nt_total, ncc)
    tiles = max(1, _cdiv(tokens, _MMA_TOK))
    step = 32 * mma_sub(dt)
    units = _cdiv(D, step)
    want = _cdiv(_MMA_TARGET_BLOCKS, ncc * tiles)
    splits = max(1, min(want, units // _MIN_STEPS_PER_RANGE, _MAX_SPLITS))
    per = _cdiv(units, splits)
    splits = _cdiv(units, per)  # no empty range
    if ncc * tiles * splits > MAX_GRID:
        raise ValueError(f"x has {tokens} tokens; mhc_coeffs supports at most "
                         f"{MAX_GRID // (ncc * splits) * _MMA_TOK} tokens at this n")
    wg_kc = wg_ncc = 0
    if dt == "bfloat16" and K >= _WG_MIN_K and current().runs("wg_fwd"):  # (step = 64: the wgmma kernel's stage)
        wg_ncc = _cdiv(K, _WG_MAX_KC)
        wg_kc = 8 * _cdiv(_cdiv(K, 8), wg_ncc)
    if tokens <= SMALL_MAX_TOKENS and current().runs("small"):
        g = gemv_layout(max(tokens, 1), D, K)
        return MmaLayout(ntile, ncc, ncc * ntile * 8, units * step, tiles, g.splits, g.d_split, gemv=g, tail=True)
    return MmaLayout(ntile, ncc, ncc * ntile * 8, units * step, tiles, splits, per * step, wg_kc, wg_ncc,
                     tail=few_tokens(tokens))


def launch_mma_gemm(dt, D, K, tokens, *, x, phi, part, planes, mma: MmaLayout, stream):
    """Raw H~ and sums of squares per D range into part [splits, T, K+1], on tensor cores
    (phi split into three bf16 planes first): where ``mma`` has wgmma chunks (mma_layout), on a
    device with wgmma (sm_90a), mhc_coeffs_wg_fwd_kernel, else mhc_coeffs_mma_fwd_kernel."""
    if mma.gemv is not None:
        launch_gemv(dt, D, K, tokens, mma.gemv, x=x, phi=phi, part=part, stream=stream)
        return
    vec = vec8(D, x)
    split = dict(phi=phi, planes=planes, D=D, K=K, Dp=mma.Dp)
    gemm = dict(x=x, planes=planes, part=part, tokens=tokens, D=D, Dp=mma.Dp, K=K, tiles=mma.tiles, d_split=mma.d_split)
    if mma.wg_kc and uses_wgmma():
        SPLIT_PHI_WG.launch_grid_stride(3 * mma.wg_ncc * mma.wg_kc * mma.Dp, stream, **split, KC=mma.wg_kc,
                                        ncc=mma.wg_ncc)
        WG_FWD.bind(VEC=vec, KC=mma.wg_kc, MT=_WG_MT, STAGES=mma.wg_smem()[0]).launch(
            (mma.wg_ncc * mma.tiles * mma.splits, 1, 1), (128, 1, 1), stream, **gemm, ncc=mma.wg_ncc)
        return
    SPLIT_PHI_FWD.launch_grid_stride(mma.Kp * mma.Dp, stream, **split, Kp=mma.Kp)
    MMA_FWD.bind(T=dt, VEC=vec, MT=_MMA_MT, NTILE=mma.ntile, STAGES=mma_fwd_smem(dt, mma.ntile)[0],
                 SUB=mma_sub(dt)).launch((mma.ncc * mma.tiles * mma.splits, 1, 1), (128, 1, 1), stream, **gemm,
                                         Kp=mma.Kp, ncc=mma.ncc)


def launch_gemv(dt, D, K, tokens, g: GemvLayout, *, x, phi, part, stream, post=None):
    """mhc_coeffs_gemv_fwd_kernel: part from x, or with ``post`` = dict(y, h_post, h_res, out, C, n,
    res_t) from the residual update out = post op(y, x) it computes and stores (the fused boundary)."""
    extra = post or dict(y=None, h_post=None, h_res=None, out=None, C=D, n=1, res_t=0)
    GEMV_FWD.bind(T=dt, POST=post is not None).launch(
        (g.splits, g.groups, 1), (_GEMV_THREADS, 1, 1), stream, x=x, phi=phi, part=part, tokens=tokens, D=D, K=K,
        tt=g.tt, outs=g.outs, rows=g.rows, d_split=g.d_split, **extra)


def launch_finish(tokens, D, n, K, eps, *, part, splits: int, alpha, bias, h_pre, h_post, h_res, stats, stream):
    """h (and stats, unless None) from the per-D-range sums part [splits, T, K+1]."""
    FINISH.launch((min(_cdiv(tokens * K, _NT), MAX_GRID), 1, 1), (_NT, 1, 1), stream, part=part, alpha=alpha,
                  bias=bias, h_pre=h_pre, h_post=h_post, h_res=h_res, stats=stats, tokens=tokens, D=D, n=n, K=K,
                  splits=splits, eps=eps)
