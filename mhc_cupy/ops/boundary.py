"""The fused layer boundary's forward (OPS.md section 12, "Fused boundary"): layer l's residual
update and layer l+1's pre piece in one call,

    out, layer_in, H_pre, H_post, H_res, stats = mhc_boundary_fwd(y, x, H_post_l, H_res_l, phi, alpha, bias)

equal to ``out = mhc_post_op_fwd(y, x, H_post_l, H_res_l)`` then ``mhc_layer_pre_fwd(out, phi, alpha,
bias)``, where the post op and the coefficient GEMM share one pass over the tile being written
(``kernels_cu/boundary.cu``): the streams are read once less per boundary.  ``out`` has the post op's
bits; the coefficient sums run over other D ranges than ``mhc_layer_pre_fwd``'s, so H~ and the
coefficients may differ from it in the last float32 bits (both float32-accurate, bitwise repeatable).
Shapes the fused kernel does not take (n > 6, C % 8 != 0, unaligned views, more shared memory than
the GPU has) run the two ops' kernels, with their bits; so does every call unless the kernel choice in
force says ``boundary=True`` (``mhc_cupy._kernel_choice``: off by default; OPS.md section 12 gives the
kernel's status).  At most 64 tokens under ``small=True``: the CUDA-core GEMV
computes, stores and uses the residual update (``kernels_cu/coeffs_gemv.cu``, the post op's bits), then one
kernel does the rest of the pre piece: two launches.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

from .. import reference
from .._convention import DEFAULT
from .._dispatch import Plan, run
from .._jit import uses_wgmma
from .._kernel_choice import current as current_choice
from .._settings import LayerSettings, takes_settings
from ._launch import MAX_GRID, KernelSpec, vec8
from .coeffs import check as _check_coeffs, launch_mma_gemm, mma_layout
from .coeffs.common import _MAX_SPLITS, _MMA_TARGET_BLOCKS, _SMEM_PORTABLE, _cdiv
from .coeffs.fwd import SPLIT_PHI_FWD, launch_gemv
from .layer import (_PARAMS, _STATS, PRE_BWD_GRADS, PRE_BWD_INPUTS, PRE_BWD_PARAMS, _plan_pre_bwd, launch_pre_from_sums,
                    pre_outputs, raw_coefficient_scratch)
from .post import _check as _check_post
from .spec import ALPHA, BIAS, H_POST, H_PRE, H_RES, LAYER_IN, LAYER_OUT, PHI, X, Arg, Kernel
from .stream import launch_mix_distribute_fwd

_FILE = "boundary.cu"
_TOK = 64  # tokens per block
_MAX_NTILE = 6  # 8-column tiles: every column in one block (K = n*n + 2n <= 48: n <= 6)
_UNIT = 64  # channels: the D ranges (splits) are whole multiples, whatever the stage size
_SMEM_SM90 = 227 * 1024  # opt-in dynamic shared memory of a block on sm_90

#: per stage phi [n][3][8 NTILE][32 SUB] bf16 (x and y go straight to registers), then the block's
#: H_post and H_res rows [64][n + n*n] float32
BOUNDARY_FWD = KernelSpec(
    _FILE, "mhc_boundary_fwd_kernel", "typename T, int N, int NTILE, int STAGES, int SUB",
    "const T* x, const T* y, const float* h_post, const float* h_res, T* out, const __nv_bfloat16* planes, "
    "float* part, i64 tokens, int C, int Dp, int K, i64 tiles, int c_split, int res_t",
    smem=(lambda T, N, NTILE, STAGES, SUB: STAGES * N * 3 * NTILE * 8 * 64 * SUB + 64 * (N + N * N) * 4,
          "mhc_boundary::fwd_smem"))


class BoundaryLayout(NamedTuple):
    """Grid of mhc_boundary_fwd_kernel: the D ranges depend on the shapes only (so do the bits)."""

    ntile: int  # 8-column tiles (every column)
    tiles: int  # token tiles of _TOK tokens
    splits: int  # channel ranges (part's leading dim)
    c_split: int  # channels per range, a multiple of _UNIT
    Dp: int  # padded positions of the phi planes (>= n*C, a multiple of 64)

    @property
    def planes_shape(self):
        return (3, self.ntile * 8, self.Dp), "bfloat16"


def boundary_layout(tokens: int, n: int, C: int) -> Optional[BoundaryLayout]:
    """The fused kernel's grid, or None where it does not apply (n > 6, C % 8 != 0, no tokens)."""
    ntile = _cdiv(n * n + 2 * n, 8)
    if ntile > _MAX_NTILE or C % 8 or tokens == 0:
        return None
    tiles = _cdiv(tokens, _TOK)
    units = _cdiv(C, _UNIT)
    splits = max(1, min(_cdiv(_MMA_TARGET_BLOCKS, tiles), units, _MAX_SPLITS))
    per = _cdiv(units, splits)
    splits = _cdiv(units, per)  # no empty range
    if tiles * splits > MAX_GRID:
        return None
    return BoundaryLayout(ntile, tiles, splits, per * _UNIT, _cdiv(n * C, 64) * 64)


def boundary_pipeline(dt: str, n: int, ntile: int, smem_limit: int) -> Optional[tuple]:
    """(STAGES, SUB) of mhc_boundary_fwd_kernel: 3 stages of phi's rows for 32 channels (SUB 1) where
    they fit in ``smem_limit`` bytes, else 2, else None (the separate kernels run).  Neither changes any
    sum's order.  (At n = 4, bf16: 60 KiB a block, 150 registers: 3 blocks an SM on an H200.)"""
    for stages in (3, 2):
        if BOUNDARY_FWD.smem(T=dt, N=n, NTILE=ntile, STAGES=stages, SUB=1) <= smem_limit:
            return stages, 1
    return None


def launch_boundary_gemm(dt, n, C, K, tokens, res_t, b: BoundaryLayout, pipe: tuple, *, x, y, H_post, H_res, phi,
                         out, part, planes, stream):
    """out = the post op and part [splits, T, K+1] = out's H~ and sums of squares per channel range."""
    Kp = b.ntile * 8
    SPLIT_PHI_FWD.launch_grid_stride(Kp * b.Dp, stream, phi=phi, planes=planes, D=n * C, K=K, Dp=b.Dp, Kp=Kp)
    BOUNDARY_FWD.bind(T=dt, N=n, NTILE=b.ntile, STAGES=pipe[0], SUB=pipe[1]).launch(
        (b.tiles * b.splits, 1, 1), (128, 1, 1), stream, x=x, y=y, h_post=H_post, h_res=H_res, out=out, planes=planes,
        part=part, tokens=tokens, C=C, Dp=b.Dp, K=K, tiles=b.tiles, c_split=b.c_split, res_t=int(res_t))


@takes_settings
def _plan_fwd(infos, s: LayerSettings):
    dt, lead, n, C, tokens, res_t = _check_post(infos, s.convention)
    _, _, _, _, D, K, _, rms_eps = _check_coeffs(infos, s.rms_eps, False, eps_name="rms_eps")
    mma = mma_layout(tokens, D, K, dt)
    b = boundary_layout(tokens, n, C) if current_choice().runs("boundary") else None
    # one part and one planes buffer for either path (which one runs depends on the pointers too)
    part = max(mma.splits, b.splits if b else 0) * tokens * (K + 1)
    planes = max(math.prod(mma.planes_shape[0]), math.prod(b.planes_shape[0]) if b else 0)
    scratch = {"part": ((part,), "float32"), "planes": ((planes,), "bfloat16"), **raw_coefficient_scratch(tokens, n)}

    def run_kernels(p, outs, sc, stream):
        out = outs[0]
        pipe = b and boundary_pipeline(dt, n, b.ntile, _SMEM_SM90 if uses_wgmma() else _SMEM_PORTABLE)
        if mma.gemv is not None:  # a few tokens: the residual update inside the GEMV (kernel choice small)
            launch_gemv(dt, D, K, tokens, mma.gemv, x=p["x"], phi=p["phi"], part=sc["part"], stream=stream,
                        post=dict(y=p["layer_out"], h_post=p["H_post"], h_res=p["H_res"], out=out, C=C, n=n,
                                  res_t=int(res_t)))
            splits = mma.splits
        elif pipe and vec8(C, p["x"], p["layer_out"], out):
            launch_boundary_gemm(dt, n, C, K, tokens, res_t, b, pipe, x=p["x"], y=p["layer_out"], H_post=p["H_post"],
                                 H_res=p["H_res"], phi=p["phi"], out=out, part=sc["part"], planes=sc["planes"],
                                 stream=stream)
            splits = b.splits
        else:
            launch_mix_distribute_fwd(dt, n, C, tokens, x=p["x"], M=p["H_res"], y=p["layer_out"], h=p["H_post"],
                                      h_stride=n, out=out, stream=stream, res_t=res_t, split=mma.tail)
            launch_mma_gemm(dt, D, K, tokens, x=out, phi=p["phi"], part=sc["part"], planes=sc["planes"], mma=mma,
                            stream=stream)
            splits = mma.splits
        launch_pre_from_sums(dt, n, C, D, K, tokens, rms_eps, s, x=out, part=sc["part"], splits=splits,
                             alpha=p["alpha"], bias=p["bias"], outs=outs[1:], sc=sc, stream=stream,
                             tail=mma.tail)

    def ref(a):
        return reference.mhc_boundary_fwd(a["layer_out"], a["x"], a["H_post"], a["H_res"], a["phi"], a["alpha"],
                                          a["bias"], s.num_iters, s.eps, rms_eps, s.convention, s.hc_eps, s.post_mult)

    return Plan([(infos["x"].shape, dt)] + pre_outputs(lead, n, C, K, dt), run_kernels, ref, scratch=scratch,
                empty=tokens == 0)


def mhc_boundary_fwd(layer_out, x, H_post, H_res, phi, alpha, bias, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, *,
                     convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """Layer l's residual update and layer l+1's pre piece in one call (OPS.md section 12).

    ``mhc_post_op_fwd(layer_out, x, H_post, H_res)`` (paper Eq. 3) then :func:`mhc_layer_pre_fwd`
    of its output with the next layer's phi, alpha, bias: the post op and the next layer's
    coefficient GEMM share one pass over the streams (the kernel reads x and layer_out and writes
    out once, and the GEMM and the sum of squares take out from registers).

    Args:
        layer_out: y of layer l, [..., C] (bfloat16 / float16 / float32).  x: its input streams
            [..., n, C], same dtype, 1 <= n <= 32.  H_post float32 [..., n], H_res float32 [..., n, n]:
            layer l's, from its pre piece.
        phi float32 [n*C, n*n + 2n], alpha float32 [3], bias float32 [n*n + 2n]: layer l+1's.
        num_iters, eps, rms_eps, convention, hc_eps, post_mult: as :func:`mhc_layer_pre_fwd` (one
            convention for both layers: it also sets the post op's H_res orientation).

    Returns:
        (out [..., n, C] dtype of x: layer l's output = layer l+1's input streams, bitwise as
        mhc_post_op_fwd; then layer l+1's layer_in, H_pre, H_post, H_res, stats as
        mhc_layer_pre_fwd of out, to float32 rounding of the coefficient sums).

    Raises:
        TypeError / ValueError: as mhc_post_op_fwd and mhc_layer_pre_fwd.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): ``mhc_cupy.torch.MHCStack(..., fuse_boundaries=True)``
    runs it inside a differentiable stack of layers.
    """
    return run(_plan_fwd, {"layer_out": layer_out, "x": x, "H_post": H_post, "H_res": H_res, "phi": phi,
                           "alpha": alpha, "bias": bias},
               num_iters=num_iters, eps=eps, rms_eps=rms_eps, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult)


def mhc_boundary_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias, stats, H_pre, H_res,
                     layer_out, H_post_prev, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled", *,
                     convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT, grad_x=None):
    """Backward across a layer boundary (OPS.md section 12, "Fused boundary backward"): layer l+1's
    :func:`mhc_layer_pre_bwd` (``layer_out`` its sublayer's output, or None) and layer l's d layer_out.

    dy_prev = sum_i H_post_prev_i dx_i, with dx (this call's, rounded to x's dtype) the gradient of
    layer l's output = layer l+1's input: what ``mhc_layer_post_bwd`` of layer l returns as
    d_layer_out, with its bits, so that its backward needs no pass over dx for dy.  For n <= 4 the
    dx kernel writes dy_prev from the dx values it has just stored (no pass of its own).

    Args:
        grad_layer_in ... H_res, layer_out, num_iters ... grad_x: layer l+1's, as
            :func:`mhc_layer_pre_bwd` (layer_out may be None).
        H_post_prev: float32 [..., n], layer l's H_post.

    Returns:
        (dx [..., n, C] dtype of x, dphi, dalpha, dbias as mhc_layer_pre_bwd, dy_prev [..., C] dtype of x).

    Raises:
        TypeError / ValueError: as mhc_layer_pre_bwd; H_post_prev not float32 [..., n].

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): ``mhc_cupy.torch.MHCStack(..., fuse_boundaries=True)``
    runs it inside a differentiable stack of layers where the kernel choice says ``boundary_bwd=True``.
    """
    return run(_plan_pre_bwd, {"grad_layer_in": grad_layer_in, "grad_out": grad_out, "grad_H_post": grad_H_post,
                               "grad_H_res": grad_H_res, "grad_x": grad_x, "x": x, "phi": phi, "alpha": alpha,
                               "bias": bias, "stats": stats, "H_pre": H_pre, "H_res": H_res, "layer_out": layer_out,
                               "H_post_prev": H_post_prev},
               num_iters=num_iters, eps=eps, rms_eps=rms_eps, grad_mode=grad_mode, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult)


# ------------------------------------------------------------------ op spec
KERNELS = (
    Kernel("mhc_boundary_fwd", _plan_fwd, (LAYER_OUT, X, H_POST, H_RES, PHI, ALPHA, BIAS),
           (Arg("out", "...nC", "activation"), LAYER_IN, H_PRE, Arg("H_post_next", "...n", "coefficient"),
            Arg("H_res_next", "...nn", "coefficient"), _STATS), params=_PARAMS),
    Kernel("mhc_boundary_bwd", _plan_pre_bwd, PRE_BWD_INPUTS + (Arg("H_post_prev", "...n", "coefficient"),),
           (X, PHI, ALPHA, BIAS, Arg("dy_prev", "...C", "activation")), grads=PRE_BWD_GRADS, params=PRE_BWD_PARAMS),
)
