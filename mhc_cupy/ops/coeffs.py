"""The mHC coefficient path: raw coefficients from the residual stream (OPS.md section 8,
paper Eqs. 14-18), ``kernels_cu/coeffs.cu``.

Per token: H~ = vec(x) @ phi, r = sqrt(mean(vec(x)^2) + eps), h = alpha_grp H~ / r + bias,
split into h_pre_raw [n], h_post_raw [n], h_res_raw [n, n].  The launch layout
(column chunks, D ranges, token splits) depends only on shapes and dtypes and is the same
on every device, so results are bitwise reproducible for given shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple


from .. import _checks, _convention, reference
from .._convention import DEFAULT
from .._dispatch import Plan, run
from .._jit import uses_wgmma
from ._launch import (ITEMSIZE, CTYPE, MAX_GRID, column_sum, f32, i32, i64, launch, launch_grid_stride, tokens_of,
                      vec8)
from .stream import check_x
from .spec import ALPHA, BIAS, H_POST_RAW, H_PRE_RAW, H_RES_RAW, PHI, X, Kernel, optional_grads

_FILE = "coeffs.cu"
_NT = 256  # threads per block of the GEMM kernels (kernels_cu/coeffs.cu NT)
_WARPS = _NT // 32
_MIN_STEPS_PER_RANGE = 4  # a D range of the forward GEMM spans at least this many steps
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
_MAX_PARTIAL_FLOATS = 16 * 2**20  # dphi partials of the backward: at most 64 MiB
#: Longest vec(x) (D = n * C): the kernels index positions of D in 32 bits,
#: with overshoots of up to a D range past D (phi is D x (n^2 + 2n) floats: 12 GiB at n = 1).
_MAX_D = 2**30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def columns(n: int) -> int:
    """K = n*n + 2n columns of phi (pre | post | res)."""
    return n * n + 2 * n


def padded_row(K: int) -> int:
    """Row stride of dH [T, K+1] (column K holds c), rounded up to a multiple of 4."""
    return _cdiv(K + 1, 4) * 4


# ------------------------------------------------------------------ checks
def check_vec_x(info, op: str):
    """(dtype, lead dims, n, C, D = n*C) of an x whose vec(x) feeds the coefficient GEMM."""
    dt, lead, n, C = check_x("x", info)
    if C == 0:
        raise ValueError(f"x has shape {tuple(info.shape)}; {op} needs C >= 1 "
                         "(the RMS of an empty vector is undefined)")
    D = n * C
    if D > _MAX_D:
        raise ValueError(f"x has shape {tuple(info.shape)}: n * C = {D} exceeds the supported maximum "
                         f"2^30 = {_MAX_D} of the coefficient path")
    return dt, lead, n, C, D


def _check(infos, eps, with_grads: bool, eps_name: str = "eps"):
    dt, lead, n, C, D = check_vec_x(infos["x"], "mhc_coeffs")
    K = columns(n)
    for name, shape, why in (("phi", (D, K), "[n*C, n*n + 2n] with n, C of x; columns pre | post | res"),
                             ("alpha", (3,), "(alpha_pre, alpha_post, alpha_res)"),
                             ("bias", (K,), "[n*n + 2n], the column order of phi")):
        _checks.coefficient(name, infos[name])
        _checks.expect_shape(name, infos[name].shape, shape, why)
    if with_grads:
        for name, shape in (("grad_h_pre_raw", lead + (n,)), ("grad_h_post_raw", lead + (n,)),
                            ("grad_h_res_raw", lead + (n, n))):
            if infos[name] is not None:
                _checks.coefficient(name, infos[name])
                _checks.expect_shape(name, infos[name].shape, shape, "the shape of the forward output")
    return dt, lead, n, C, D, K, tokens_of(lead), _checks.eps(eps_name, eps)


def _zero(ptr, count: int, stream, offset: int = 0) -> None:
    """float32 zeros over ptr[offset : offset + count]."""
    if count:
        launch(_FILE, "mhc_coeffs_zero_kernel", (min(_cdiv(count, _NT), 1024), 1, 1), (_NT, 1, 1),
               (ptr + 4 * offset, i64(count)), stream)

def zero_param_grads(dphi, dalpha, dbias, D: int, K: int, stream) -> None:
    """Zero parameter gradients (no tokens)."""
    for ptr, count in ((dphi, D * K), (dalpha, 3), (dbias, K)):
        _zero(ptr, count, stream)


def param_grad_plan(x_shape, dt: str, tokens: int, D: int, K: int, scratch: dict, body, ref) -> Plan:
    """The Plan of a backward giving (dx, dphi, dalpha, dbias): ``scratch`` name -> (shape, dtype),
    ``body(p, outs, scratch by name, stream)`` launching the kernels; with zero tokens the
    parameter gradients are zero-filled instead."""

    def run_kernels(p, outs, sc, stream):
        if tokens == 0:
            zero_param_grads(*outs[1:], D, K, stream)
        else:
            body(p, outs, sc, stream)

    return Plan([(x_shape, dt), ((D, K), "float32"), ((3,), "float32"), ((K,), "float32")], run_kernels, ref,
                scratch=scratch, empty=False)


def launch_finish(tokens, D, n, K, eps, *, part, splits: int, alpha, bias, h_pre, h_post, h_res, stats, stream):
    """h (and stats, unless None) from the per-D-range sums part [splits, T, K+1]."""
    launch(_FILE, "mhc_coeffs_fwd_finish_kernel", (min(_cdiv(tokens * K, _NT), MAX_GRID), 1, 1), (_NT, 1, 1),
           (part, alpha, bias, h_pre, h_post, h_res, stats, i64(tokens), i32(D), i32(n), i32(K), i32(splits),
            f32(eps)), stream)


def launch_prep(tokens, D, n, K, KP, eps, *, part, splits: int, grads: tuple, alpha, dH, qa, dalpha, dbias, stream):
    """dH | c and the per-token dalpha terms from the sums and the raw-coefficient gradients
    ``grads`` = (pre, post, res) pointers (None = zero), then dalpha and dbias summed over tokens."""
    launch(_FILE, "mhc_coeffs_bwd_prep_kernel", (min(_cdiv(tokens, _WARPS), MAX_GRID), 1, 1), (_NT, 1, 1),
           (part, *grads, alpha, dH, qa, i64(tokens), i32(D), i32(n), i32(K), i32(KP), i32(splits), f32(eps)), stream)
    column_sum(qa, dalpha, tokens, 3, stream)
    for ptr, offset, cols in zip(grads, (0, n, 2 * n), (n, n, n * n)):
        if ptr is None:
            _zero(dbias, cols, stream, offset)
        else:
            column_sum(ptr, dbias + 4 * offset, tokens, cols, stream)



# ------------------------------------------------ tensor-core forward GEMM layout
_MMA_MT = 2  # 16-token MMA tiles per warp of the forward (kernels_cu/coeffs.cu mhc_coeffs_mma_fwd_kernel)
_MMA_TOK = 4 * _MMA_MT * 16  # tokens per block (4 warps)
_MMA_MAX_NTILE = 6  # 8-column tiles per block: accumulators 4 * MT * NTILE per thread
_MMA_ROW_BYTES = 128  # bytes of each token row per pipeline stage of the forward GEMM (32 positions a sub-step)
#: cp.async pipeline depth of the forward GEMM (at most): 16-bit x 2 stages of 128-byte row pieces (H200,
#: bf16 n = 4 / 8 / 16: 0-5 % faster than 3 stages, 3 blocks per SM instead of 2); float32 x as before (not re-timed)
_MMA_STAGES = {"bfloat16": 2, "float16": 2, "float32": 4}
_MMA_BWD_STAGES = 3  # and of the backward
#: Dynamic shared memory a block may use on every supported GPU: the opt-in limit of
#: sm_86 / sm_89 / sm_120 (99 KiB; sm_80 has 163 KiB, sm_90 227 KiB).  The pipelines
#: use fewer stages when the deepest one would need more (float32 x), and the n = 4 backward of
#: 16-bit x with the layer's g staged 2 for occupancy (MmaBwd.pipeline); the depth does not
#: change the order of any sum.
_SMEM_PORTABLE = 101376


def pipeline_stages(fixed: int, per_stage: int, most: int) -> int:
    """The deepest pipeline (<= most, >= 2 stages) whose shared memory fits _SMEM_PORTABLE."""
    for stages in range(most, 2, -1):
        if fixed + stages * per_stage <= _SMEM_PORTABLE:
            return stages
    return 2


def mma_sub(dt: str) -> int:
    """32-position sub-steps per stage of mhc_coeffs_mma_fwd_kernel: _MMA_ROW_BYTES of each token row
    (HBM serves 64-byte pieces of many rows at about 57 % of the copy bandwidth, 128-byte ones at
    full speed: H200, scripts/hbm_row_pieces.py)."""
    return max(1, _MMA_ROW_BYTES // (32 * ITEMSIZE[dt]))


def mma_fwd_smem(dt: str, ntile: int) -> tuple[int, int]:
    """(stages, dynamic shared bytes) of mhc_coeffs_mma_fwd_kernel: per stage, x [128 tokens][32 sub]
    and phi [3 planes][ntile * 8][32 sub bf16]."""
    per_stage = mma_sub(dt) * (_MMA_TOK * 32 * ITEMSIZE[dt] + 3 * ntile * 8 * 64)
    stages = pipeline_stages(0, per_stage, _MMA_STAGES[dt])
    return stages, stages * per_stage
_MMA_TARGET_BLOCKS = 1024  # 128-thread blocks; a constant (not the SM count): same bits on every GPU

# The forward GEMM on wgmma (mhc_coeffs_wg_fwd_kernel; bf16 x on devices that NVRTC targets as
# sm_90a): the same D ranges and token tiles as the mma.sync kernel (128 tokens a block), its own
# column chunks of at most _WG_MAX_KC columns.  Its sums are not the mma.sync kernel's (other MMA
# shapes, sums of squares on CUDA cores), so H~ differs in the last bits between sm_90 and other
# GPUs; on one GPU the bits depend on the values only (aligned or not, the same sums).  Only from
# _WG_MIN_K columns: on the H200 the wgmma kernel was slower at K = 24 and 35 (n = 4, 5: 0.28 against
# 0.20 ms at 16384 x 4096 x 4) and faster at K = 63, 80, 288 (n = 7, 8, 16: 0.33 against 0.48 ms at
# 16384 x 2048 x 8, 0.60 against 0.81 ms at 8192 x 1024 x 16); K = 48 (n = 6) not measured.
_WG_FWD = True
_WG_MIN_K = 63  # n >= 7
_WG_MT = 2  # m64 token tiles per block
assert 64 * _WG_MT == _MMA_TOK, "the wgmma forward walks the mma.sync layout's token tiles"
_WG_MAX_KC = 96  # columns per block (N of the wgmma)
_WG_SMEM = 113 * 1024  # dynamic shared memory a block (two blocks an SM on sm_90)


class MmaLayout(NamedTuple):
    """Launch layout of mhc_coeffs_mma_fwd_kernel (depends on shapes and the dtype of x only)."""

    ntile: int  # 8-column tiles per column chunk
    ncc: int  # column chunks
    Kp: int  # padded columns of the phi planes: ncc * ntile * 8
    Dp: int  # padded positions of the phi planes: a multiple of 32 * mma_sub(dt)
    tiles: int  # token tiles of _MMA_TOK tokens
    splits: int  # D ranges (part's leading dim)
    d_split: int  # positions per D range, a multiple of 32 * mma_sub(dt)
    wg_kc: int = 0  # columns per chunk of mhc_coeffs_wg_fwd_kernel (0: not used; bf16, K >= _WG_MIN_K only)
    wg_ncc: int = 0  # its column chunks

    @property
    def planes_shape(self):
        return (3, max(self.Kp, self.wg_ncc * self.wg_kc), self.Dp), "bfloat16"

    def wg_smem(self) -> tuple[int, int]:
        """(stages, dynamic shared bytes) of mhc_coeffs_wg_fwd_kernel: per stage x [128 tokens][64
        positions] and phi [3][wg_kc][64] bf16."""
        per_stage = _WG_MT * 64 * 128 + 3 * self.wg_kc * 128
        stages = max(2, min(4, _WG_SMEM // per_stage))
        return stages, stages * per_stage


def mma_layout(tokens: int, D: int, K: int, dt: str) -> MmaLayout:
    """Column chunks, token tiles and D ranges of the tensor-core forward GEMM.

    D is split only when token tiles x column chunks give fewer than
    _MMA_TARGET_BLOCKS blocks, and never below _MIN_STEPS_PER_RANGE steps per range.
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
    if dt == "bfloat16" and K >= _WG_MIN_K:  # (step = 64 positions: the wgmma kernel's stage)
        wg_ncc = _cdiv(K, _WG_MAX_KC)
        wg_kc = 8 * _cdiv(_cdiv(K, 8), wg_ncc)
    return MmaLayout(ntile, ncc, ncc * ntile * 8, units * step, tiles, splits, per * step, wg_kc, wg_ncc)


def launch_mma_gemm(dt, D, K, tokens, *, x, phi, part, planes, mma: MmaLayout, stream):
    """Raw H~ and sums of squares per D range into part [splits, T, K+1], on tensor cores
    (phi split into three bf16 planes first: kernels_cu/coeffs.cu, tensor-core path): bf16 x on
    a device with wgmma (sm_90a) mhc_coeffs_wg_fwd_kernel, else mhc_coeffs_mma_fwd_kernel."""
    vec = "true" if vec8(D, x) else "false"
    if _WG_FWD and mma.wg_kc and uses_wgmma():
        launch_grid_stride(_FILE, "mhc_coeffs_split_phi_wg_kernel", 3 * mma.wg_ncc * mma.wg_kc * mma.Dp,
                           (phi, planes, i32(D), i32(K), i32(mma.Dp), i32(mma.wg_kc), i32(mma.wg_ncc)), stream)
        stages, smem = mma.wg_smem()
        launch(_FILE, f"mhc_coeffs_wg_fwd_kernel<{vec},{mma.wg_kc},{_WG_MT},{stages}>",
               (mma.wg_ncc * mma.tiles * mma.splits, 1, 1), (128, 1, 1),
               (x, planes, part, i64(tokens), i32(D), i32(mma.Dp), i32(K), i32(mma.wg_ncc), i64(mma.tiles),
                i32(mma.d_split)), stream, smem)
        return
    launch_grid_stride(_FILE, "mhc_coeffs_split_phi_fwd_kernel", mma.Kp * mma.Dp,
                       (phi, planes, i32(D), i32(K), i32(mma.Dp), i32(mma.Kp)), stream)
    stages, smem = mma_fwd_smem(dt, mma.ntile)
    launch(_FILE, f"mhc_coeffs_mma_fwd_kernel<{CTYPE[dt]},{vec},{_MMA_MT},{mma.ntile},{stages},{mma_sub(dt)}>",
           (mma.ncc * mma.tiles * mma.splits, 1, 1), (128, 1, 1),
           (x, planes, part, i64(tokens), i32(D), i32(mma.Dp), i32(K), i32(mma.Kp), i32(mma.ncc),
            i64(mma.tiles), i32(mma.d_split)), stream, smem)


def _plan_fwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = _check(infos, eps, False)
    mma = mma_layout(tokens, D, K, dt)
    scratch = {"part": ((mma.splits, tokens, K + 1), "float32"), "planes": mma.planes_shape}

    def run_kernels(p, outs, sc, stream):
        h_pre, h_post, h_res = outs
        launch_mma_gemm(dt, D, K, tokens, x=p["x"], phi=p["phi"], part=sc["part"], planes=sc["planes"], mma=mma,
                        stream=stream)
        launch_finish(tokens, D, n, K, eps, part=sc["part"], splits=mma.splits, alpha=p["alpha"], bias=p["bias"],
                      h_pre=h_pre, h_post=h_post, h_res=h_res, stats=None, stream=stream)

    return Plan([(lead + (n,), "float32"), (lead + (n,), "float32"), (lead + (n, n), "float32")], run_kernels,
                lambda a: reference.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], eps),
                scratch=scratch, empty=tokens == 0)


# ----------------------------------------------------------------- backward
_MMA_BWD_MAX_K = 32  # tensor-core dx / dphi for K <= 32 (n <= 4): dphi accumulators 16 * ceil(K / 8) per thread


def mma_token_splits(tokens: int, blocks: int, most: int) -> tuple[int, int]:
    """(splits, tokens per split, a multiple of 16) of a tensor-core backward kernel's token
    ranges: enough for _MMA_TARGET_BLOCKS blocks with ``blocks`` per range, at most ``most``."""
    splits = min(_cdiv(_MMA_TARGET_BLOCKS, blocks), _cdiv(tokens, _MIN_TOKENS_PER_SPLIT), most)
    per = _cdiv(_cdiv(max(tokens, 1), max(1, splits)), 16) * 16
    return _cdiv(max(tokens, 1), per), per


@dataclass(frozen=True)
class _TensorCoreBwd:
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
class MmaBwd(_TensorCoreBwd):
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
        path) g [n][16][64] (kernels_cu/coeffs.cu).  With g staged at n = 4, 2 stages: 74,752 bytes
        (bf16), 3 blocks per SM where an SM has 228 KiB; with 3 stages 2 blocks fit.  (Before e54bd9e,
        with g_li staged too, 3 stages in 227 KiB measured no faster than 2 on the H200.)"""
        nw, K16, Kp8, PO = 64 * self.n, self.K16, self.Kp8, _planes(dt)
        fixed = PO * nw * K16 * 2
        stage = 16 * (nw * ITEMSIZE[dt] + 16) + PO * 16 * K16 * 2 + 3 * Kp8 * 32
        if g_staged:
            stage += self.n * 16 * 64 * 2
        stages = pipeline_stages(fixed, stage, 2 if g_staged and self.n == 4 else _MMA_BWD_STAGES)
        return stages, fixed + stages * stage


def mma_bwd(tokens: int, n: int, C: int, K: int) -> MmaBwd:
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
    launch_grid_stride(_FILE, "mhc_coeffs_split_rows_kernel", D * b.K16,
                       (phi, sc["phi_r"], i64(D), i32(b.K), i32(b.K), i64(D), i32(b.K16), i32(b.K16 // 16), i32(0)),
                       stream)
    launch_grid_stride(_FILE, "mhc_coeffs_split_rows_kernel", b.tokens_p * b.K16,
                       (dH, sc["dH_r"], i64(b.tokens), i32(b.K), i32(KP), i64(b.tokens_p), i32(b.K16),
                        i32(b.K16 // 16), i32(0)), stream)
    launch_grid_stride(_FILE, "mhc_coeffs_split_cols_kernel", b.tokens_p * b.Kp8,
                       (dH, sc["dH_c"], i64(b.tokens), i32(b.K), i32(KP), i64(b.tokens_p), i32(b.Kp8)), stream)
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


_MMA_DPHI_NQ = 5  # 8-column tiles per block of mhc_coeffs_mma_dphi_kernel: 16 * NQ accumulators per thread


def _planes(dt: str) -> int:
    """bf16 planes of phi and dH that the tensor-core dx (mhc_coeffs_mma_dx_kernel, the dx part of
    mhc_coeffs_mma_bwd_kernel) multiplies for activations of dtype dt (PO in kernels_cu/coeffs.cu)."""
    return 3 if ITEMSIZE[dt] == 4 else 2


#: 8-column MMA tiles per warp of mhc_coeffs_mma_dx_kernel (32 columns).  The kernel also takes 8
#: (64 columns, the same dx bit for bit): measured on the H200 (bf16, mhc_layer_pre_bwd) that was
#: slower, 3.48 / 4.33 ms against 2.42 / 2.94 ms at 16384 x 2560 x 6 / 16384 x 2048 x 8, because
#: its larger phi tile fits fewer blocks per SM.
_DX_NT = 4
#: Least warps per 2 x 99 KiB of shared memory (about an SM's) for the dx with phi resident
#: (mhc_coeffs_mma_dx_kernel); below it the dx streams phi beside dH (mhc_coeffs_mma_dx_tile_kernel).
#: Measured on the H200 (bf16, MHC fwd+bwd, CUDA-event medians, resident -> tile): n = 6 (18 warps)
#: 3.22 -> 3.32 ms at 16384 x 2560, n = 8 (12 warps) 3.76 -> 4.03 at 16384 x 2048; n = 9 (5 warps)
#: 5.91 -> 5.73 at 16384 x 1792, n = 10 (6) 6.65 -> 5.84, n = 12 (4) 8.12 -> 7.15, n = 14 (4)
#: 9.75 -> 8.43, n = 16 (2) 8.51 -> 5.57 at 8192 x 1024.  So resident for n 5-8 at 16 bits and 5, 6,
#: 8 in float32.  (The tile dx also replaced a CUDA-core dx, which took 40.7 against 29.7 ms at
#: 8192 x 512 x 32.)
_DX_MIN_WARPS = 8


def dx_smem(w: int, nt: int, K16: int, dt: str) -> tuple[int, int]:
    """(stages, dynamic shared bytes) of mhc_coeffs_mma_dx_kernel with W = w, NT = nt: the phi rows
    of its streams, then per stage dH_r [planes][16][K16] (kernels_cu/coeffs.cu)."""
    fixed, stage = w * 8 * nt * K16 * 2 * _planes(dt), 16 * K16 * 2 * _planes(dt)
    stages = pipeline_stages(fixed, stage, _MMA_BWD_STAGES)
    return stages, fixed + stages * stage


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
    mhc_coeffs_mma_dx_tile_kernel: 4 warps, W = 2 for even n else 1, a stage dH_r [PO][BT][32] and
    phi_r [PO][32 W][32] bf16, BT = 16 (4 / W) MT tokens (kernels_cu/coeffs.cu)."""
    w = 2 if n % 2 == 0 else 1
    bt = 16 * (4 // w) * _DX_TILE_MT
    stage = _planes(dt) * (bt + 32 * w) * 64
    stages = pipeline_stages(0, stage, _MMA_BWD_STAGES)
    return w, _DX_TILE_MT, _cdiv(K, 32) * 2, stages, stages * stage


# The dx on wgmma (mhc_coeffs_wg_dx_kernel; bf16 x with C % 8 == 0, 16-byte aligned x, dx and layer
# gradients, the layer gradients bf16, on devices that NVRTC targets as sm_90a): a block keeps the phi
# rows of _WG_DX_NB positions (two bf16 planes) resident and walks 64 tokens a step, _WG_DX_STAGES
# stages of dH; only where two blocks fit an SM (_WG_DX_SMEM each), which with K >= _WG_DX_MIN_K is
# n = 5 .. 9.  Measured on the H200 (mhc_layer_pre_bwd with g_layer_in and grad_x, per-kernel CUDA
# events, the dx kernel mma.sync -> wgmma): 0.872 -> 0.601 ms at 16384 x 3072 x 5, 0.924 -> 0.538 at
# 16384 x 1792 x 7, 0.896 -> 0.729 at 16384 x 2048 x 8 (ncu at n = 8: 8 warps an SM, registers and shared
# memory each allow 2 blocks; L2 65 %, DRAM 38 % of peak: latency-bound); slower where one block fits an SM or with 64
# positions a block (whole op 2.135 -> 2.29 ms at 16384 x 1536 x 10, 2.02 -> 2.70 at 8192 x 1024 x 16),
# and with 3 stages at n = 8 (1.678 against 1.475 ms for the whole op with 2).  The tensor core sums
# the same products in the same k-step order as the mma.sync kernels (no bit differed in those runs);
# the tests hold the two to one bf16 rounding.
_WG_DX = True
_WG_DX_MIN_K = 35  # n >= 5
_WG_DX_NB = 128
_WG_DX_STAGES = 2
_WG_DX_SMEM = 113 * 1024


def wg_dx_layout(K: int) -> tuple[int, int, int] | None:
    """(NB positions a block, stages, dynamic shared bytes) of mhc_coeffs_wg_dx_kernel: phi [2][NB][K16]
    and per stage dH [2][64][K16] bf16 (K16 = K rounded up to 16); None where that exceeds _WG_DX_SMEM
    (K > 112: n > 9) or K < _WG_DX_MIN_K."""
    K16 = _cdiv(K, 16) * 16
    smem = 4 * _WG_DX_NB * K16 + _WG_DX_STAGES * 256 * K16
    return (_WG_DX_NB, _WG_DX_STAGES, smem) if K >= _WG_DX_MIN_K and smem <= _WG_DX_SMEM else None


@dataclass(frozen=True)
class SplitBwd(_TensorCoreBwd):
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
        """wg_dx_layout for bf16 x (else None): where the wgmma dx may run; whether it does is decided
        at launch (the device, dtypes, alignment: wg_dx_runs)."""
        return wg_dx_layout(self.K) if self.dt == "bfloat16" else None

    @cached_property
    def wg_splits(self) -> tuple[int, int]:
        """(token ranges, tokens per range, a multiple of 64) of the wgmma dx."""
        splits, _ = mma_token_splits(self.tokens, _cdiv(self.n * self.C, self.wg_dx[0]), 65535)
        per = _cdiv(_cdiv(max(self.tokens, 1), splits), 64) * 64
        return _cdiv(max(self.tokens, 1), per), per

    def wg_dx_runs(self, tg: str, *ptrs) -> bool:
        """Whether launch_split_bwd runs the wgmma dx: a layout, layer gradients (if any) of dtype tg
        bf16, C % 8 == 0, every given pointer (x, dx, layer gradients) 16-byte aligned, a device with
        wgmma."""
        return _WG_DX and self.wg_dx is not None and tg == "bfloat16" and vec8(self.C, *ptrs) and uses_wgmma()

    @cached_property
    def dphi_pipeline(self) -> tuple[int, int]:
        """(stages, dynamic shared bytes) of mhc_coeffs_mma_dphi_kernel: per stage x [16][256]
        (token rows padded by 16 bytes) and dH_c [3][8 nq][16] (kernels_cu/coeffs.cu)."""
        stage = 16 * (256 * ITEMSIZE[self.dt] + 16) + 3 * self.nq * 8 * 32
        stages = pipeline_stages(0, stage, _MMA_BWD_STAGES)
        return stages, stages * stage

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
    launch_grid_stride(_FILE, "mhc_coeffs_split_cols_kernel", b.tokens_p * Kc,
                       (dH, sc["dH_c"], i64(b.tokens), i32(K), i32(KP), i64(b.tokens_p), i32(Kc)), stream)
    splits, t_split = b.dphi_splits
    out = sc["dphi_part"] if splits > 1 else dphi
    stages, smem = b.dphi_pipeline
    launch(_FILE, f"mhc_coeffs_mma_dphi_kernel<{CTYPE[dt]},{'true' if vec8(D, x) else 'false'},{b.nq},{stages}>",
           (b.pblocks * b.ncc, splits, 1), (128, 1, 1),
           (x, sc["dH_c"], out, i64(b.tokens), i64(b.tokens_p), i32(D), i32(K), i32(Kc), i32(b.ncc), i64(t_split)),
           stream, smem)
    if splits > 1:
        column_sum(out, dphi, splits, D * K, stream)
    lay = "true" if layer else "false"
    dx_args = (x, sc["phi_r"], sc["dH_r"], dH, g, g_li, H_pre, H_res, gx, dx, i64(b.tokens), i64(b.tokens_p),
               i32(b.n), i32(b.C), i32(K), i32(KP))
    if b.wg_dx_runs(tg, x, dx, g, g_li, gx):
        _split_rows(b, phi, dH, KP, b.K16, 0, sc, stream)
        (nb, stages, smem), (dsplits, dt_split) = b.wg_dx, b.wg_splits
        launch(_FILE, f"mhc_coeffs_wg_dx_kernel<{lay},{b.K16 // 16},{nb},{stages}>", (_cdiv(D, nb), dsplits, 1),
               (128, 1, 1), (*dx_args, i64(dt_split), i32(res_t)), stream, smem)
        return
    K16 = b.dx_K16
    kc = 0 if b.dx_kind == "tile" else K16 // 16  # k-steps per chunk of the planes' fragment order (0: none)
    _split_rows(b, phi, dH, KP, K16, kc, sc, stream)
    vec = "true" if vec8(b.C, x, dx, g, g_li, gx) else "false"
    dsplits, dt_split = b.dx_splits
    head = f"{CTYPE[dt]},{CTYPE[tg]},{vec},{lay},{K16 // 16}"
    if b.dx_kind == "tile":
        w, mt, _, stages, smem = b.tile_layout
        expr, grid, block = f"mhc_coeffs_mma_dx_tile_kernel<{head},{w},{mt},{stages}>", _cdiv(b.C, 32), 128
    else:
        (w, nt), (stages, smem) = b.dx_tiles, b.dx_pipeline
        expr, grid, block = f"mhc_coeffs_mma_dx_kernel<{head},{w},{nt},{stages}>", _cdiv(b.C, 8 * nt), 32 * w
    launch(_FILE, expr, (grid * (b.n // w), dsplits, 1), (block, 1, 1),
           (*dx_args, i32(b.n // w), i64(dt_split), i32(res_t)), stream, smem)


def _split_rows(b: SplitBwd, phi, dH, KP: int, K16: int, kc: int, sc: dict, stream) -> None:
    """phi and dH into the bf16 planes phi_r [3, D, K16] and dH_r [3, tokens_p, K16] of the tensor-core
    dx: columns in fragment order of kc k-steps a chunk (kc = 0: their own order); dH with rows g, g + 8
    interleaved where kc != 0 (mhc_coeffs_mma_dx_kernel's A operand)."""
    D = b.n * b.C
    launch_grid_stride(_FILE, "mhc_coeffs_split_rows_kernel", D * K16,
                       (phi, sc["phi_r"], i64(D), i32(b.K), i32(b.K), i64(D), i32(K16), i32(kc), i32(0)), stream)
    launch_grid_stride(_FILE, "mhc_coeffs_split_rows_kernel", b.tokens_p * K16,
                       (dH, sc["dH_r"], i64(b.tokens), i32(b.K), i32(KP), i64(b.tokens_p), i32(K16), i32(kc),
                        i32(kc != 0)), stream)


def backward_layout(tokens: int, n: int, C: int, K: int, dt: str):
    """The backward's dx / dphi layout: MmaBwd (one fused tensor-core kernel, K <= 32) or SplitBwd."""
    return mma_bwd(tokens, n, C, K) if K <= _MMA_BWD_MAX_K else SplitBwd(n, C, K, tokens, dt)


def launch_param_bwd(b, dt: str, **kwargs):
    """launch_mma_bwd or launch_split_bwd (keyword arguments), as backward_layout chose."""
    (launch_mma_bwd if isinstance(b, MmaBwd) else launch_split_bwd)(b, dt, **kwargs)


def _plan_bwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = _check(infos, eps, True)
    mma = mma_layout(tokens, D, K, dt)
    KP = padded_row(K)
    b = backward_layout(tokens, n, C, K, dt)
    scratch = {"part": ((mma.splits, tokens, K + 1), "float32"),  # raw H~ and sum of squares per D range
               "dH": ((tokens, KP), "float32"),  # dH | c
               "qa": ((tokens, 3), "float32"),  # per-token dalpha terms
               "planes": mma.planes_shape, **b.scratch()}  # phi split for the forward GEMM

    def body(p, outs, sc, stream):
        dx, dphi, dalpha, dbias = outs
        part, dH, qa = sc["part"], sc["dH"], sc["qa"]
        launch_mma_gemm(dt, D, K, tokens, x=p["x"], phi=p["phi"], part=part, planes=sc["planes"], mma=mma,
                        stream=stream)
        launch_prep(tokens, D, n, K, KP, eps, part=part, splits=mma.splits,
                    grads=(p["grad_h_pre_raw"], p["grad_h_post_raw"], p["grad_h_res_raw"]), alpha=p["alpha"], dH=dH,
                    qa=qa, dalpha=dalpha, dbias=dbias, stream=stream)
        launch_param_bwd(b, dt, x=p["x"], phi=p["phi"], dH=dH, KP=KP, dx=dx, dphi=dphi, sc=sc, stream=stream)

    def ref(a):
        return reference.mhc_coeffs_bwd(a["grad_h_pre_raw"], a["grad_h_post_raw"], a["grad_h_res_raw"], a["x"],
                                        a["phi"], a["alpha"], a["bias"], eps)

    return param_grad_plan(infos["x"].shape, dt, tokens, D, K, scratch, body, ref)


# ------------------------------------------------------------------ public
def mhc_coeffs_fwd(x, phi, alpha, bias, eps=DEFAULT, *, convention="paper"):
    """Raw mHC coefficients of each token from its residual stream (OPS.md section 8, paper Eqs. 14-18).

    With x~ = vec(x_t) (length D = n*C), H~ = x~ @ phi and r = sqrt(mean(x~^2) + eps):
    h_pre_raw = alpha[0] H~[:n] / r + bias[:n];  h_post_raw = alpha[1] H~[n:2n] / r + bias[n:2n];
    h_res_raw = alpha[2] H~[2n:] / r + bias[2n:], reshaped row-major to [n, n].
    The GEMM and the sum of squares share one read of x (the division by r comes after).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32, C >= 1.
        phi: float32 [n*C, n*n + 2n], columns ordered pre | post | res.
        alpha: float32 [3] = (alpha_pre, alpha_post, alpha_res).
        bias: float32 [n*n + 2n], the column order of phi.
        eps: >= 0, added to the mean square (RMSNorm eps).  default 1e-5 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek"; keyword only.  The maths is the same under
            both (DeepSeek-V4's hc_fn is phi^T, hc_scale alpha, hc_base bias: OPS.md
            "DeepSeek-V4 convention"); only the default eps differs.

    Returns:
        (h_pre_raw float32 [..., n], h_post_raw float32 [..., n], h_res_raw float32 [..., n, n]).
        Feed them to :func:`mhc_cupy.mhc_pre_op_fwd`.

    Raises:
        TypeError: x not an activation dtype, or phi / alpha / bias not float32.
        ValueError: shapes disagree, n out of range, C = 0, arrays on different devices, bad convention.

    Notes:
        Float32 accumulation in a fixed order (no atomics): bitwise reproducible.
        Zero tokens return empty outputs and launch nothing.  One or two
        launches on the caller's current stream; the backward recomputes
        everything from x (nothing but the inputs needs saving).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_coeffs`` for gradients.
    """
    return run(_plan_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias}, eps=_convention.resolve(convention,
                                                                                                     rms_eps=eps))


def mhc_coeffs_bwd(grad_h_pre_raw, grad_h_post_raw, grad_h_res_raw, x, phi, alpha, bias, eps=DEFAULT, *,
                   convention="paper"):
    """Gradient of :func:`mhc_coeffs_fwd` (OPS.md section 8).

    With g = [g_pre | g_post | vec(g_res)] per token, g' = alpha_grp g and r, H~ recomputed from x:
    dH = g' / r;  dx~ = dH @ phi^T - x~ sum_k(g'_k H~_k) / (D r^3);  dphi = sum_tokens x~^T dH;
    dalpha_j = sum_tokens sum_{k in group j} g_k H~_k / r;  dbias = sum_tokens g.

    Args:
        grad_h_pre_raw, grad_h_post_raw: float32 [..., n], or None (= zero).
        grad_h_res_raw: float32 [..., n, n], or None (= zero).
        x, phi, alpha, bias, eps, convention: as given to the forward.

    Returns:
        (dx [..., n, C] dtype of x, dphi float32 [n*C, n*n + 2n], dalpha float32 [3],
        dbias float32 [n*n + 2n]).

    Raises:
        TypeError / ValueError: as the forward; a gradient of the wrong dtype or shape.

    Notes:
        Sums over tokens (dphi, dalpha, dbias) are per-block partials added in
        a fixed order: bitwise reproducible, no atomics.  Zero tokens give an
        empty dx and zero parameter gradients.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_coeffs`` for gradients.
    """
    return run(_plan_bwd, {"grad_h_pre_raw": grad_h_pre_raw, "grad_h_post_raw": grad_h_post_raw,
                           "grad_h_res_raw": grad_h_res_raw, "x": x, "phi": phi, "alpha": alpha, "bias": bias},
               eps=_convention.resolve(convention, rms_eps=eps))


# ------------------------------------------------------------------ op spec
_INPUTS = (X, PHI, ALPHA, BIAS)
_RAW = (H_PRE_RAW, H_POST_RAW, H_RES_RAW)
KERNELS = (
    Kernel("mhc_coeffs_fwd", _plan_fwd, _INPUTS, _RAW, params={"eps": 1e-5}),
    Kernel("mhc_coeffs_bwd", _plan_bwd, _INPUTS, _INPUTS,
           grads=optional_grads(*_RAW), params={"eps": 1e-5}),
)
