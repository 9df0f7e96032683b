"""Stream mix, aggregate and distribute (OPS.md sections 3-5), ``kernels_cu/stream.cu``.

The launchers here are shared with the post op and the pre op: stream mix
and stream distribute are the residual-update kernel
``mhc_post_op_*_kernel`` without its layer-output term or without its
residual term.
"""

from __future__ import annotations

from .. import _checks, reference
from .._dispatch import Plan, run
from ._launch import (CTYPE, column_blocks, column_sum, f32, grid_for, i32, i64, launch, threads_for, tokens_of, vec8,
                      vec_width)
from .spec import GRAD_X, X, Arg, Kernel

_FILE = "stream.cu"


def _b(v: bool) -> str:
    return "true" if v else "false"


def dh_rows(n: int) -> int:
    """Rows of dH_res reduced per pass of the backward (RB * n accumulators per thread)."""
    return n if n <= 4 else min(n, max(1, 32 // n))


# ------------------------------------------------------------------ checks
def check_x(name: str, info, dtype=None):
    """(dtype, lead dims, n, C) of a [..., n, C] activation."""
    dt = _checks.activation(name, info, dtype)
    _checks.min_ndim(name, info, 2, "[..., n, C]")
    n, C = info.shape[-2], _checks.row_length(name, info)
    _checks.streams(n, name)
    return dt, tuple(info.shape[:-2]), n, C


def check_y(name: str, info, lead, C, dtype):
    _checks.activation(name, info, dtype)
    _checks.expect_shape(name, info.shape, lead + (C,), "[..., C] with the token dims and C of x")


def _expect_per_token(name: str, info, lead, n, tail: tuple, why: str, x_shape=None):
    """ValueError unless info.shape == lead + tail.  With ``x_shape`` (the
    [..., n, C] tensor x that gave lead and n) a mismatch names both x and
    ``name``: either may be the wrong one (say x lacking its stream dim)."""
    shape, expected = tuple(info.shape), tuple(lead) + tail
    if shape == expected:
        return
    k = len(tail)
    if x_shape is None or len(shape) < k or any(s != shape[-1] for s in shape[-k:]):
        _checks.expect_shape(name, shape, expected, why)
    raise ValueError(
        f"x has shape {tuple(x_shape)} (read as [..., n, C]: token dims {tuple(lead)}, n = {n}) but {name} has "
        f"shape {shape} ({why}: token dims {shape[:-k]}, n = {shape[-1]}); they disagree: {name} needs "
        f"{expected} for this x, or x needs ({', '.join(map(str, shape[:-k] + (shape[-1],)))}, C) for this {name}")


def check_matrix(name: str, info, lead, n, x_shape=None):
    _checks.coefficient(name, info)
    _expect_per_token(name, info, lead, n, (n, n), "one n x n matrix per token", x_shape)


def check_h(name: str, info, lead, n, allow_shared: bool, x_shape=None) -> bool:
    """True when h is shared ([n]), False when per token ([..., n])."""
    _checks.coefficient(name, info)
    if allow_shared and tuple(info.shape) == (n,) and lead != ():
        return True
    _expect_per_token(name, info, lead, n, (n,), "per-token [..., n]" + (" or shared [n]" if allow_shared else ""),
                      None if allow_shared and len(info.shape) == 1 else x_shape)
    return False


def check_grad(name: str, info, shape, dtype, what: str = "the shape of the forward output") -> str:
    tg = _checks.gradient(name, info, dtype)
    _checks.expect_shape(name, info.shape, shape, what)
    return tg


# --------------------------------------------------------------- launchers
def launch_mix_distribute_fwd(dt, n, C, tokens, *, out, stream, x=None, M=None, y=None, h=None, h_stride=0,
                              res_t=False, split=False):
    """out_i = sum_j M_ij x_j + h_i y: stream mix (x, M), distribute (y, h) or both (the post op,
    M = H_res, h = H_post); ``h_stride``: 0 for a shared h [n], n for one per token; ``res_t``: M
    transposed (out_j = sum_i M_ij x_i, the post op under convention="deepseek"); ``split``: a token's
    columns over several blocks (:func:`column_blocks`; the same bits)."""
    E = vec_width(n, C, [(p, dt) for p in (x, y, out) if p is not None])
    threads = threads_for(C, E)
    expr = f"mhc_stream_mix_distribute_fwd_kernel<{CTYPE[dt]},{n},{E},{_b(x is not None)},{_b(y is not None)}>"
    launch(_FILE, expr, grid_for(tokens, column_blocks(tokens, C, E, threads) if split else 1), (threads, 1, 1),
           (x, y, h, i64(h_stride), M, out, i64(tokens), i32(C), i32(res_t)), stream)


# The post op's backward (x and y given) runs its reductions on tensor cores
# (mhc_stream_post_bwd_mma_kernel) for 16-bit g, x, y and n >= this, with dx, where asked, as the
# mix forward of g by M transposed; below it the CUDA-core kernel needs few passes over the rows
# (the fused layer's, no dx, at 16384 x 2048 x 8 on the H200: 0.90 -> 0.42 ms per call).
POST_BWD_MMA_MIN_N = 5


#: Stages of the cp.async ring of the post backward under the kernel choice post_pipe.
POST_BWD_PIPE_STAGES = 2


def launch_mix_distribute_bwd(dt, tg, n, C, tokens, *, g, stream, x=None, M=None, y=None, h=None, h_stride=0,
                              dx=None, dy=None, dh=None, dM=None, res_t=False, pipe=False):
    """Backward of :func:`launch_mix_distribute_fwd` (incoming gradient g); an absent (None)
    output is not written (dx, dy: activation dtype; dh, dM: float32 per token).  ``pipe`` (the plan's
    kernel choice post_pipe): the CUDA-core kernel with x and y, n <= 4 and 16-byte vectors of 16-bit g, x,
    y loads them through a cp.async ring (mhc_stream_mix_distribute_bwd_kernel<..., STAGES>: the same bits)."""
    has_x, has_y = x is not None, y is not None
    if has_x and has_y and dt == tg and dt != "float32" and n >= POST_BWD_MMA_MIN_N:
        vec = vec8(C, g, x, y)
        warps = 8 if C >= 256 else 4
        launch(_FILE, f"mhc_stream_post_bwd_mma_kernel<{CTYPE[dt]},{n},{_b(vec)},{warps}>", grid_for(tokens),
               (32 * warps, 1, 1), (g, x, y, h, i64(h_stride), dy, dh, dM, i64(tokens), i32(C), i32(res_t)), stream)
        if dx is not None:  # dx_j = sum_i M_ij g_i
            launch_mix_distribute_fwd(dt, n, C, tokens, x=g, M=M, out=dx, stream=stream, res_t=not res_t)
        return
    E = vec_width(n, C, [(g, tg)] + [(p, dt) for p in (x, y, dx, dy) if p is not None])
    rb = dh_rows(n) if has_x else 1
    threads = threads_for(C, E)
    st = POST_BWD_PIPE_STAGES if pipe and has_x and has_y and dt == tg != "float32" and E == 8 and rb >= n else 0
    expr = (f"mhc_stream_mix_distribute_bwd_kernel<{CTYPE[dt]},{CTYPE[tg]},{n},{E},{rb},{_b(has_x)},{_b(has_y)}"
            + (f",{st}>" if st else ">"))  # (STAGES 0, the default: left out of the name)
    launch(_FILE, expr, grid_for(tokens), (threads, 1, 1),
           (g, x, y, h, i64(h_stride), M, dx, dy, dh, dM, i64(tokens), i32(C), i32(res_t)), stream,
           st * (2 * n + 1) * threads * 16)


def launch_layer_post_pre_bwd(dt, tg, n, C, tokens, *, g, x, y, g_li, h_pre_raw, g_post, g_res, d_pre, d_post, d_res,
                              stream, res_t=False):
    """The post op's dH_post, dH_res (+ g_post, g_res where not None) and the pre op's d_pre =
    (sum_c g_li_c x_ic) s (1 - s), s = sigmoid(h_pre_raw), in one pass (OPS.md section 12, "Fused
    boundary backward"); g_li None counts as zero.  The per-token sums have the bits of
    :func:`launch_mix_distribute_bwd` and :func:`launch_aggregate_bwd` (``act=1``) where the arrays'
    alignment gives the three launches one vector width."""
    E = vec_width(n, C, [(g, tg), (x, dt), (y, dt), (g_li, tg)])
    launch(_FILE, f"mhc_layer_post_pre_bwd_kernel<{CTYPE[dt]},{CTYPE[tg]},{n},{E},{dh_rows(n)}>", grid_for(tokens),
           (threads_for(C, E), 1, 1),
           (g, x, y, g_li, h_pre_raw, g_post, g_res, d_pre, d_post, d_res, i64(tokens), i32(C), i32(res_t)), stream)


def launch_aggregate_fwd(dt, n, C, tokens, *, x, h, h_stride, out, stream):
    E = vec_width(n, C, [(x, dt), (out, dt)])
    launch(_FILE, f"mhc_stream_aggregate_fwd_kernel<{CTYPE[dt]},{n},{E}>", grid_for(tokens),
           (threads_for(C, E), 1, 1), (x, h, i64(h_stride), out, i64(tokens), i32(C)), stream)


def launch_aggregate_bwd(dt, tg, n, C, tokens, *, g, x, h, h_stride, dx, dh, stream, act=0, gh=None, shift=0.0):
    """dx_i = h_i g, dh_i = sum_c g_c x_ic; ``act=1`` (the pre op): h = sigmoid(h_raw) + shift."""
    E = vec_width(n, C, [(g, tg), (x, dt), (dx, dt)])  # g may be None (zero gradient)
    launch(_FILE, f"mhc_stream_aggregate_bwd_kernel<{CTYPE[dt]},{CTYPE[tg]},{n},{E},{act}>", grid_for(tokens),
           (threads_for(C, E), 1, 1), (g, x, h, i64(h_stride), gh, dx, dh, i64(tokens), i32(C), f32(shift)), stream)


# ------------------------------------------------------------------- mix
def _plan_mix_fwd(infos):
    dt, lead, n, C = check_x("x", infos["x"])
    check_matrix("M", infos["M"], lead, n, infos["x"].shape)
    tokens = tokens_of(lead)

    def run_kernels(p, outs, sc, stream):
        launch_mix_distribute_fwd(dt, n, C, tokens, x=p["x"], M=p["M"], out=outs[0], stream=stream)

    return Plan([(infos["x"].shape, dt)], run_kernels,
                lambda a: (reference.stream_mix_fwd(a["x"], a["M"]),), single=True, empty=tokens * C == 0)


def _plan_mix_bwd(infos):
    dt, lead, n, C = check_x("x", infos["x"])
    check_matrix("M", infos["M"], lead, n, infos["x"].shape)
    tg = check_grad("grad", infos["grad"], infos["x"].shape, dt)
    tokens = tokens_of(lead)

    def run_kernels(p, outs, sc, stream):
        launch_mix_distribute_bwd(dt, tg, n, C, tokens, g=p["grad"], x=p["x"], M=p["M"], dx=outs[0], dM=outs[1],
                                  stream=stream)

    return Plan([(infos["x"].shape, dt), (infos["M"].shape, "float32")], run_kernels,
                lambda a: reference.stream_mix_bwd(a["grad"], a["x"], a["M"]), empty=tokens == 0)


def stream_mix_fwd(x, M):
    """Mix the n residual streams of each token: out_i = sum_j M_ij x_j (OPS.md section 3).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32.
        M: float32 [..., n, n], one mixing matrix per token (row i makes output stream i).

    Returns:
        out: [..., n, C], dtype of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range,
        arrays on different devices.

    Notes:
        Zero copy for contiguous inputs (a non-contiguous view is copied
        first); output allocated by the caller's framework, kernel launched on
        its current stream.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_mix`` for gradients.
    """
    return run(_plan_mix_fwd, {"x": x, "M": M})


def stream_mix_bwd(grad, x, M):
    """Gradient of :func:`stream_mix_fwd` (OPS.md section 3).

    dx_j = sum_i M_ij g_i;  dM_ij = sum_c g_ic x_jc (float32 accumulation,
    fixed reduction order: bitwise reproducible).

    Args:
        grad: [..., n, C], dtype of x or float32.
        x, M: as given to the forward.

    Returns:
        (dx [..., n, C] dtype of x, dM float32 [..., n, n]).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_mix`` for gradients.
    """
    return run(_plan_mix_bwd, {"grad": grad, "x": x, "M": M})


# -------------------------------------------------------------- aggregate
def _plan_aggregate_fwd(infos):
    dt, lead, n, C = check_x("x", infos["x"])
    shared = check_h("h", infos["h"], lead, n, True, infos["x"].shape)
    tokens = tokens_of(lead)

    def run_kernels(p, outs, sc, stream):
        launch_aggregate_fwd(dt, n, C, tokens, x=p["x"], h=p["h"], h_stride=0 if shared else n, out=outs[0],
                             stream=stream)

    return Plan([(lead + (C,), dt)], run_kernels,
                lambda a: (reference.stream_aggregate_fwd(a["x"], a["h"]),), single=True, empty=tokens * C == 0)


def _h_grad_plan(infos, act: str, dt: str, lead: tuple, n: int, C: int, shared: bool, grad_shape: tuple, launch,
                 ref) -> Plan:
    """Plan of a backward whose coefficients h are per token [..., n] or shared [n] (aggregate: the
    activation ``act`` is "x"; distribute: "y"), its incoming gradient checked against
    ``grad_shape``: ``launch`` (launch_aggregate_bwd / launch_mix_distribute_bwd) writes the
    activation's gradient (d + act) and dh per token, for a shared h into scratch, then summed over
    the tokens in a fixed order (deterministic; zero tokens give dh = 0); ``ref(grad, act, h)``."""
    tg = check_grad("grad", infos["grad"], grad_shape, dt)
    tokens = tokens_of(lead)

    def run_kernels(p, outs, sc, stream):
        dh = sc["dh_per_token"] if shared else outs[1]
        if tokens:
            launch(dt, tg, n, C, tokens, g=p["grad"], h=p["h"], h_stride=0 if shared else n, dh=dh, stream=stream,
                   **{act: p[act], "d" + act: outs[0]})
        if shared:
            column_sum(dh, outs[1], tokens, n, stream)

    return Plan([(infos[act].shape, dt), (infos["h"].shape, "float32")], run_kernels,
                lambda a: ref(a["grad"], a[act], a["h"]),
                scratch={"dh_per_token": ((tokens, n), "float32")} if shared else {},
                empty=tokens == 0 and not shared)


def _plan_aggregate_bwd(infos):
    dt, lead, n, C = check_x("x", infos["x"])
    shared = check_h("h", infos["h"], lead, n, True, infos["x"].shape)
    return _h_grad_plan(infos, "x", dt, lead, n, C, shared, lead + (C,), launch_aggregate_bwd,
                        reference.stream_aggregate_bwd)


def stream_aggregate_fwd(x, h):
    """Weighted sum of the streams: out = sum_i h_i x_i (OPS.md section 4).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32).
        h: float32, per token [..., n] or shared by all tokens [n].

    Returns:
        out: [..., C], dtype of x.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_aggregate`` for gradients.
    """
    return run(_plan_aggregate_fwd, {"x": x, "h": h})


def stream_aggregate_bwd(grad, x, h):
    """Gradient of :func:`stream_aggregate_fwd` (OPS.md section 4).

    dx_i = h_i g;  dh_i = sum_c g_c x_ic per token, and for a shared h also
    summed over all tokens (fixed order: deterministic).

    Args:
        grad: [..., C], dtype of x or float32.
        x, h: as given to the forward.

    Returns:
        (dx [..., n, C] dtype of x, dh float32 of h's shape).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_aggregate`` for gradients.
    """
    return run(_plan_aggregate_bwd, {"grad": grad, "x": x, "h": h})


# ------------------------------------------------------------- distribute
def _check_distribute(infos):
    y = infos["y"]
    dt = _checks.activation("y", y)
    _checks.min_ndim("y", y, 1, "[..., C]")
    lead, C = tuple(y.shape[:-1]), _checks.row_length("y", y)
    h = infos["h"]
    _checks.coefficient("h", h)
    _checks.min_ndim("h", h, 1, "[..., n] or [n]")
    n = h.shape[-1]
    _checks.streams(n, "h")
    shared = check_h("h", h, lead, n, True)
    return dt, lead, n, C, shared


def _plan_distribute_fwd(infos):
    dt, lead, n, C, shared = _check_distribute(infos)
    tokens = tokens_of(lead)

    def run_kernels(p, outs, sc, stream):
        launch_mix_distribute_fwd(dt, n, C, tokens, y=p["y"], h=p["h"], h_stride=0 if shared else n, out=outs[0],
                                  stream=stream)

    return Plan([(lead + (n, C), dt)], run_kernels,
                lambda a: (reference.stream_distribute_fwd(a["y"], a["h"]),), single=True, empty=tokens * C == 0)


def _plan_distribute_bwd(infos):
    dt, lead, n, C, shared = _check_distribute(infos)
    return _h_grad_plan(infos, "y", dt, lead, n, C, shared, lead + (n, C), launch_mix_distribute_bwd,
                        reference.stream_distribute_bwd)


def stream_distribute_fwd(y, h):
    """Write one layer output to every stream, scaled: out_i = h_i y (OPS.md section 5).

    Args:
        y: [..., C] activations (bfloat16 / float16 / float32).
        h: float32, per token [..., n] or shared [n].

    Returns:
        out: [..., n, C], dtype of y.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_distribute`` for gradients.
    """
    return run(_plan_distribute_fwd, {"y": y, "h": h})


def stream_distribute_bwd(grad, y, h):
    """Gradient of :func:`stream_distribute_fwd` (OPS.md section 5).

    dy = sum_i h_i g_i;  dh_i = sum_c g_ic y_c (summed over tokens for a shared h).

    Returns:
        (dy [..., C] dtype of y, dh float32 of h's shape).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.stream_distribute`` for gradients.
    """
    return run(_plan_distribute_bwd, {"grad": grad, "y": y, "h": h})


# ------------------------------------------------------------------ op spec
_M, _H, _Y = Arg("M", "...nn", "coefficient"), Arg("h", "...n", "coefficient"), Arg("y", "...C", "activation")
_OUT_X, _OUT_Y = Arg("out", "...nC", "activation"), Arg("out", "...C", "activation")
KERNELS = (
    Kernel("stream_mix_fwd", _plan_mix_fwd, (X, _M), (_OUT_X,)),
    Kernel("stream_mix_bwd", _plan_mix_bwd, (X, _M), (X, _M), grads=(GRAD_X,)),
    Kernel("stream_aggregate_fwd", _plan_aggregate_fwd, (X, _H), (_OUT_Y,), shared="h"),
    Kernel("stream_aggregate_bwd", _plan_aggregate_bwd, (X, _H), (X, _H), grads=(Arg("grad", "...C", "activation"),),
           shared="h"),
    Kernel("stream_distribute_fwd", _plan_distribute_fwd, (_Y, _H), (_OUT_X,), shared="h"),
    Kernel("stream_distribute_bwd", _plan_distribute_bwd, (_Y, _H), (_Y, _H), grads=(GRAD_X,), shared="h"),
)
