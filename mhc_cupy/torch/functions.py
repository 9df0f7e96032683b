"""The mHC operators as differentiable torch functions (``mhc_cupy.torch``'s op half).

Autograd Functions and ``torch.library`` custom operators around the
functional ``*_fwd`` / ``*_bwd`` API; the routes (eager / compiled), devices,
streams and gradient order are described in :mod:`mhc_cupy.torch`.  Imported
through the package, which checks that torch is installed first.
"""

import inspect
from typing import Optional

import torch
from torch import Tensor

from .. import _checks, _convention
from .._convention import DEFAULT
from .._dispatch import run as _run
from .._settings import NAMES as _SETTINGS, LayerSettings
from ._link import autograd_pre as _autograd_pre, check_convention as _check_convention, tag as _tag
from ._link import tensor_key as _tensor_key
from ._transforms import active as _transform_active, refuse as _refuse_transform
from .._interop import ArrayInfo
from .. import ops as _ops
from ..ops.layer import fold_post_dx
from ..ops.spec import shape_of as _shape_of

__all__ = [
    "sinkhorn_knopp", "rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute",
    "mhc_post_op", "mhc_pre_op", "mhc_coeffs", "mhc_layer_pre", "mhc_layer_post", "mhc_head",
]

#: Namespace of the custom operators: ``torch.ops.mhc_cupy.<name>``.
NAMESPACE = "mhc_cupy"

_F32 = torch.float32
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


# ------------------------------------------------------------------ helpers
_is_compiling = torch.compiler.is_compiling


# Both run on every eager call: plain loops (a generator in any() costs more).
def _use_custom_op(*tensors) -> bool:
    """True inside torch.compile / export, or for tensor subclasses (fake, functional, ...).  Every
    public op calls it before any autograd Function or kernel: under a torch.func transform it raises
    NotImplementedError (:mod:`mhc_cupy.torch._transforms`)."""
    if _is_compiling():
        return True
    if _transform_active():
        _refuse_transform()
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and isinstance(t, Tensor):
            return True
    return False  # non-tensors (a list, None for a tensor) go on to the functional API, which names them


def _same_tensor(a: Tensor, b) -> bool:
    """a is b's data (same address, shape and strides), b a tensor or None."""
    return b is not None and _tensor_key(a) == _tensor_key(b)


def _needs_autograd(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    except AttributeError:  # not a tensor: the functional API raises a TypeError naming it
        return False
    return False


def _validate(planner, tensors: dict, **params) -> None:
    """Run the functional API's own checks on fake tensors (static shapes only).

    Gives the same TypeError / ValueError at trace time as the eager call.
    With symbolic (dynamic) shapes the check is left to the real op at run time.
    """
    infos = {}
    for name, t in tensors.items():
        if t is None:
            infos[name] = None
            continue
        shape = tuple(t.shape)
        if not all(type(s) is int for s in shape):
            return
        dtype = _DTYPE_NAME.get(t.dtype) or str(t.dtype).replace("torch.", "")
        infos[name] = ArrayInfo(shape, dtype, ("cpu", 0))
    planner(infos, **params)


def _op(name: str):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _flat(name: str, settings: LayerSettings) -> dict:
    """The arguments of custom operator ``name`` that are settings, from ``settings``."""
    names = _SETTINGS_ARGS[name]
    return dict(zip(names, settings.values(names)))


#: Custom ops that run another kernel's spec (``mhc_cupy.ops.SPECS``) than their own name.
_SPEC_OF = {"rmsnorm_weight_bwd": "rmsnorm_bwd"}


def _fake(name: str, impl):
    """The fake (meta) function of custom op ``name``, derived from its op spec.

    Runs the functional API's checks (:func:`_validate`), then returns empty
    outputs of the spec's shapes and dtypes: the gradient of an input shaped
    like that input (its dtype for an activation, else float32; none for an
    absent optional input), a new output over the token dims of the spec's
    reference input (x's dtype for an activation, else float32).
    """
    spec = _ops.SPECS[_SPEC_OF.get(name, name)]
    signature = inspect.signature(impl)

    def fake(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()  # the dispatcher may leave out trailing arguments at their defaults
        bound = call.arguments
        tensors = {k: bound.get(k) for k in spec.names}
        _validate(spec.planner, tensors, **{p: bound[p] for p in spec.params})
        ref = tensors[spec.ref.name]
        lead = tuple(ref.shape[:ref.dim() - spec.ref.rank])
        sizes = spec.sizes({k: None if t is None else tuple(t.shape) for k, t in tensors.items()})
        outs = []
        for o in spec.outputs:
            t = tensors[o.name] if spec.is_grad(o) else ref
            if t is None:
                continue
            shape = tuple(t.shape) if spec.is_grad(o) else _shape_of(o, lead, sizes)
            outs.append(t.new_empty(shape, dtype=t.dtype if o.kind == "activation" else _F32))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return fake


def _register(name: str, impl):
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(_fake(name, impl))
    return op


def _function(name: str, forward, setup_context, backward):
    """An eager ``autograd.Function`` around the functional API.

    Written in the classic ``forward(ctx, *args)`` style, which calls the same
    ``setup_context``: its ``apply`` costs about a third of the
    ``setup_context``-style one (5.9 vs 18.7 us per call measured on a 2-core
    CPU host), and this route exists to keep per-call host overhead low.
    """

    def fwd(ctx, *args):
        out = forward(*args)
        setup_context(ctx, args, out)
        return out

    # The backward runs the functional API on raw pointers: it records no graph,
    # so a second-order gradient through it would silently treat it as a
    # constant.  once_differentiable makes double backward raise instead.
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(fwd),
        "backward": staticmethod(torch.autograd.function.once_differentiable(backward)),
    })


def _wire(name: str, fwd_impl, bwd_ops: dict, setup_context, backward):
    """Register ``<name>_fwd`` (+ autograd) and return the eager Function.

    ``backward(bwd, ctx, *grads)`` is written once; ``bwd`` maps a backward
    name to its callee: the functional wrapper (eager) or the custom op.
    """
    fwd_op = _register(f"{name}_fwd", fwd_impl)
    for k, impl in bwd_ops.items():
        _register(k, impl)
    op_bwd = {k: _op(k) for k in bwd_ops}
    fwd_op.register_autograd(lambda ctx, *g: backward(op_bwd, ctx, *g), setup_context=setup_context)
    return _function(f"_{name}_function", fwd_impl, setup_context,
                     lambda ctx, *g: backward(bwd_ops, ctx, *g))


# ----------------------------------------------------------------- Sinkhorn
def _sinkhorn_fwd_impl(logits: Tensor, num_iters: int, eps: float, grad_mode: str, convention: str = "paper") -> Tensor:
    # grad_mode is used by the backward only; it is an input so that
    # setup_context sees it.
    return _ops.sinkhorn_knopp_fwd(logits, num_iters=num_iters, eps=eps, convention=convention)


def _sinkhorn_bwd_impl(grad_P: Tensor, logits: Tensor, num_iters: int, eps: float, grad_mode: str,
                       convention: str = "paper") -> Tensor:
    return _ops.sinkhorn_knopp_bwd(grad_P, logits, num_iters=num_iters, eps=eps, grad_mode=grad_mode,
                                   convention=convention)


def _sinkhorn_setup(ctx, inputs, output):
    logits, *ctx.params = inputs
    ctx.save_for_backward(logits)


def _sinkhorn_backward(bwd, ctx, grad_P):
    (logits,) = ctx.saved_tensors
    if grad_P is None:
        return (None,) * 5
    return bwd["sinkhorn_knopp_bwd"](grad_P, logits, *ctx.params), None, None, None, None


_SinkhornFn = _wire("sinkhorn_knopp", _sinkhorn_fwd_impl,
                    {"sinkhorn_knopp_bwd": _sinkhorn_bwd_impl},
                    _sinkhorn_setup, _sinkhorn_backward)


def sinkhorn_knopp(logits, num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", *, convention="paper"):
    """Differentiable Sinkhorn-Knopp projection onto doubly-stochastic matrices (OPS.md section 1).

    K = exp(L - rowmax(L)); then ``num_iters`` times a row step
    P <- P / (rowsum + eps) and a column step P <- P / (colsum + eps)
    (paper Eq. 9).  ``convention="deepseek"`` (OPS.md "DeepSeek-V4 convention"): the
    first row step is the softmax plus eps, P <- K / rowsum(K) + eps.

    Args:
        logits: float32 tensor [..., n, n], 1 <= n <= 32; any leading token dims.
        num_iters: iterations (row + column step each), int >= 0 (deepseek: >= 1).
            default 20.
        eps: added to every row / column sum, >= 0.  default 1e-8 (paper), 1e-6 (deepseek).
        grad_mode: backward only. "unrolled" (default): the exact gradient of
            the forward as computed.  "implicit": the gradient of the converged
            projection (implicit function theorem); it differs from "unrolled"
            as far as the forward is not converged.
        convention: "paper" (default) or "deepseek"; keyword only.

    Returns:
        P: float32 tensor [..., n, n], on the device of ``logits``.

    Raises:
        TypeError: logits not float32.  ValueError: not square, n out of
        range, bad num_iters / eps / grad_mode / convention (at trace time under torch.compile).

    Notes:
        Backward saves only ``logits`` and recomputes the iteration on chip;
        d_logits is float32 and each of its rows sums to 0.
    """
    _checks.grad_mode(grad_mode)  # fail now, not at backward
    params = (*_convention.resolve(convention, num_iters=num_iters, eps=eps), grad_mode, convention)
    if _use_custom_op(logits):
        return _op("sinkhorn_knopp_fwd")(logits, *params)
    if _needs_autograd(logits):
        return _SinkhornFn.apply(logits, *params)
    return _sinkhorn_fwd_impl(logits, *params)


# ------------------------------------------------------------------ RMSNorm
def _rmsnorm_fwd_impl(x: Tensor, eps: float, weight: Optional[Tensor]) -> Tensor:
    return _ops.rmsnorm_fwd(x, eps=eps, weight=weight)


def _rmsnorm_bwd_impl(grad: Tensor, x: Tensor, eps: float) -> Tensor:
    return _ops.rmsnorm_bwd(grad, x, eps=eps)


def _rmsnorm_weight_bwd_impl(grad: Tensor, x: Tensor, eps: float, weight: Tensor) -> tuple[Tensor, Tensor]:
    return _ops.rmsnorm_bwd(grad, x, eps=eps, weight=weight)


def _rmsnorm_setup(ctx, inputs, output):
    x, ctx.eps, weight = inputs
    ctx.save_for_backward(x, weight)


def _rmsnorm_backward(bwd, ctx, grad):
    x, weight = ctx.saved_tensors
    if grad is None:
        return None, None, None
    if weight is None:
        return bwd["rmsnorm_bwd"](grad, x, ctx.eps), None, None
    dx, dw = bwd["rmsnorm_weight_bwd"](grad, x, ctx.eps, weight)
    return dx, None, dw


_RMSNormFn = _wire("rmsnorm", _rmsnorm_fwd_impl,
                   {"rmsnorm_bwd": _rmsnorm_bwd_impl,
                    "rmsnorm_weight_bwd": _rmsnorm_weight_bwd_impl},
                   _rmsnorm_setup, _rmsnorm_backward)


def rmsnorm(x, eps=1e-5, weight=None):
    """Differentiable RMSNorm over the last dim (OPS.md section 2).

    r = 1 / sqrt(mean_c x_c^2 + eps);  out_c = x_c r (* weight_c).
    For mHC's vec(x) normalisation pass x viewed as [..., n*C].

    Args:
        x: [..., C] tensor, bfloat16 / float16 / float32.
        eps: added to the mean square, >= 0. Default 1e-5.
        weight: optional float32 [C] tensor (may be an ``nn.Parameter``).

    Returns:
        out: [..., C], dtype and device of x (statistics in float32, one
        rounding at the end).

    Raises:
        TypeError: bad dtypes.  ValueError: weight shape, devices, eps; with a weight, on a
        GPU, when gradients are recorded: C above what the weighted backward supports
        (``mhc_cupy.rmsnorm_bwd``), here rather than in backward.

    Notes:
        Backward saves x (and weight) only and recomputes r.  dx has the dtype
        of x; d_weight is float32 [C], summed over tokens in a fixed order
        (deterministic).
    """
    if weight is not None and isinstance(x, Tensor) and x.is_cuda and x.ndim and _needs_autograd(x, weight):
        _ops.rmsnorm.check_weighted_c(x.shape[-1], ("cuda", x.device.index))
    if _use_custom_op(x, weight):
        return _op("rmsnorm_fwd")(x, eps, weight)
    if _needs_autograd(x, weight):
        return _RMSNormFn.apply(x, eps, weight)
    return _rmsnorm_fwd_impl(x, eps, weight)


# --------------------------------------------------------------- stream mix
def _mix_fwd_impl(x: Tensor, M: Tensor) -> Tensor:
    return _ops.stream_mix_fwd(x, M)


def _mix_bwd_impl(grad: Tensor, x: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    return _ops.stream_mix_bwd(grad, x, M)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pair_op(name: str, fwd_impl, bwd_impl):
    """The eager Function of a two-input stream op (mix, aggregate, distribute), whose backward
    is ``<name>_bwd(grad, a, b) -> (da, db)`` of the saved inputs.  The ``_impl`` functions
    stay written out: their parameter names are the custom ops' schemas."""
    bwd_name = f"{name}_bwd"

    def backward(bwd, ctx, grad):
        a, b = ctx.saved_tensors
        if grad is None:
            return None, None
        return bwd[bwd_name](grad, a, b)

    return _wire(name, fwd_impl, {bwd_name: bwd_impl}, _save_inputs, backward)


def _call_pair(name: str, fn, fwd_impl, a, b):
    """A two-input stream op: the custom op (torch.compile), the eager Function (autograd) or
    the functional API."""
    if _use_custom_op(a, b):
        return _op(f"{name}_fwd")(a, b)
    if _needs_autograd(a, b):
        return fn.apply(a, b)
    return fwd_impl(a, b)


_MixFn = _pair_op("stream_mix", _mix_fwd_impl, _mix_bwd_impl)


def stream_mix(x, M):
    """Differentiable stream mix: out_i = sum_j M_ij x_j per token (OPS.md section 3).

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32, 1 <= n <= 32.
        M: float32 [..., n, n] tensor, one matrix per token (row i makes output stream i).

    Returns:
        out: [..., n, C], dtype and device of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range,
        tensors on different devices.

    Notes:
        Backward saves x and M.  dx has the dtype of x; dM is float32
        (fixed-order sums over C: bitwise reproducible).
    """
    return _call_pair("stream_mix", _MixFn, _mix_fwd_impl, x, M)


# --------------------------------------------------------- stream aggregate
def _aggregate_fwd_impl(x: Tensor, h: Tensor) -> Tensor:
    return _ops.stream_aggregate_fwd(x, h)


def _aggregate_bwd_impl(grad: Tensor, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    return _ops.stream_aggregate_bwd(grad, x, h)


_AggregateFn = _pair_op("stream_aggregate", _aggregate_fwd_impl, _aggregate_bwd_impl)


def stream_aggregate(x, h):
    """Differentiable weighted stream sum: out = sum_i h_i x_i (OPS.md section 4).

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32.
        h: float32 tensor, per token [..., n] or shared by all tokens [n].

    Returns:
        out: [..., C], dtype and device of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range, devices.

    Notes:
        Backward saves x and h.  dh has h's shape (float32); for a shared h it
        is summed over all tokens in a fixed order (deterministic).
    """
    return _call_pair("stream_aggregate", _AggregateFn, _aggregate_fwd_impl, x, h)


# -------------------------------------------------------- stream distribute
def _distribute_fwd_impl(y: Tensor, h: Tensor) -> Tensor:
    return _ops.stream_distribute_fwd(y, h)


def _distribute_bwd_impl(grad: Tensor, y: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    return _ops.stream_distribute_bwd(grad, y, h)


_DistributeFn = _pair_op("stream_distribute", _distribute_fwd_impl, _distribute_bwd_impl)


def stream_distribute(y, h):
    """Differentiable stream distribute: out_i = h_i y (OPS.md section 5).

    Args:
        y: [..., C] tensor, bfloat16 / float16 / float32.
        h: float32 tensor, per token [..., n] or shared [n].

    Returns:
        out: [..., n, C], dtype and device of y.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range, devices.

    Notes:
        Backward saves y and h.  dh has h's shape (float32), summed over
        tokens for a shared h in a fixed order (deterministic).
    """
    return _call_pair("stream_distribute", _DistributeFn, _distribute_fwd_impl, y, h)


# ------------------------------------------------------------------ post op
def _post_fwd_impl(layer_out: Tensor, x: Tensor, H_post: Tensor, H_res: Tensor, convention: str = "paper") -> Tensor:
    return _ops.mhc_post_op_fwd(layer_out, x, H_post, H_res, convention=convention)


def _post_bwd_impl(grad: Tensor, layer_out: Tensor, x: Tensor, H_post: Tensor, H_res: Tensor,
                   convention: str = "paper") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_post_op_bwd(grad, layer_out, x, H_post, H_res, convention=convention)


def _post_setup(ctx, inputs, output):
    *tensors, ctx.convention = inputs
    ctx.save_for_backward(*tensors)


def _post_backward(bwd, ctx, grad):
    layer_out, x, H_post, H_res = ctx.saved_tensors
    if grad is None:
        return (None,) * 5
    return (*bwd["mhc_post_op_bwd"](grad, layer_out, x, H_post, H_res, ctx.convention), None)


_PostFn = _wire("mhc_post_op", _post_fwd_impl, {"mhc_post_op_bwd": _post_bwd_impl},
                _post_setup, _post_backward)


def mhc_post_op(layer_out, x, H_post, H_res, *, convention="paper"):
    """Differentiable mHC residual update (OPS.md section 6, paper Eq. 3).

    out_i = sum_j H_res_ij x_j + H_post_i y, one rounding per output element.
    ``convention="deepseek"`` (OPS.md "DeepSeek-V4 convention"): H_res transposed,
    out_j = sum_i H_res_ij x_i + H_post_j y.

    Args:
        layer_out: y, [..., C] tensor, bfloat16 / float16 / float32.
        x: [..., n, C] tensor, same dtype, 1 <= n <= 32.
        H_post: float32 [..., n] (already activated, 2 sigmoid: the pre op's output).
        H_res: float32 [..., n, n] (the pre op's Sinkhorn output).
        convention: "paper" (default) or "deepseek"; keyword only.

    Returns:
        out: [..., n, C], dtype and device of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range, devices, bad convention.

    Notes:
        Backward saves the four inputs.  It returns (d_layer_out, dx) in the
        activation dtype and (dH_post, dH_res) in float32, without atomics:
        bitwise reproducible.
    """
    _convention.check(convention)
    if _use_custom_op(layer_out, x, H_post, H_res):
        return _op("mhc_post_op_fwd")(layer_out, x, H_post, H_res, convention)
    if _needs_autograd(layer_out, x, H_post, H_res):
        return _PostFn.apply(layer_out, x, H_post, H_res, convention)
    return _post_fwd_impl(layer_out, x, H_post, H_res, convention)


# ------------------------------------------------------------------- pre op
def _pre_fwd_impl(x: Tensor, h_pre_raw: Tensor, h_post_raw: Tensor, h_res_raw: Tensor, num_iters: int, eps: float,
                  grad_mode: str, convention: str = "paper", hc_eps: float = 0.0,
                  post_mult: float = 2.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_pre_op_fwd(x, h_pre_raw, h_post_raw, h_res_raw, num_iters=num_iters, eps=eps,
                               convention=convention, hc_eps=hc_eps, post_mult=post_mult)


def _pre_bwd_impl(grad_layer_in: Optional[Tensor], grad_H_pre: Optional[Tensor], grad_H_post: Optional[Tensor],
                  grad_H_res: Optional[Tensor], x: Tensor, h_pre_raw: Tensor, h_post_raw: Tensor, h_res_raw: Tensor,
                  num_iters: int, eps: float, grad_mode: str, convention: str = "paper", hc_eps: float = 0.0,
                  post_mult: float = 2.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_pre_op_bwd(grad_layer_in, grad_H_pre, grad_H_post, grad_H_res, x, h_pre_raw, h_post_raw,
                               h_res_raw, num_iters=num_iters, eps=eps, grad_mode=grad_mode, convention=convention,
                               hc_eps=hc_eps, post_mult=post_mult)


def _pre_setup(ctx, inputs, output):
    x, h_pre_raw, h_post_raw, h_res_raw, *ctx.params = inputs
    ctx.save_for_backward(x, h_pre_raw, h_post_raw, h_res_raw)
    # Gradients of unused outputs arrive as None (not zero tensors): the
    # backward skips their work (OPS.md section 7: None counts as zero).
    ctx.set_materialize_grads(False)


def _pre_backward(bwd, ctx, g_layer_in, g_H_pre, g_H_post, g_H_res):
    x, h_pre_raw, h_post_raw, h_res_raw = ctx.saved_tensors
    if g_layer_in is None and g_H_pre is None and g_H_post is None and g_H_res is None:
        return (None,) * 10
    dx, d_pre, d_post, d_res = bwd["mhc_pre_op_bwd"](g_layer_in, g_H_pre, g_H_post, g_H_res, x, h_pre_raw,
                                                     h_post_raw, h_res_raw, *ctx.params)
    return (dx, d_pre, d_post, d_res) + (None,) * 6


_PreFn = _wire("mhc_pre_op", _pre_fwd_impl, {"mhc_pre_op_bwd": _pre_bwd_impl},
               _pre_setup, _pre_backward)


def mhc_pre_op(x, h_pre_raw, h_post_raw, h_res_raw, num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", *,
               convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """Differentiable mHC pre op: coefficient activations and layer input (OPS.md section 7, paper Eq. 8).

    H_pre = sigmoid(h_pre_raw) + hc_eps;  H_post = post_mult sigmoid(h_post_raw);
    H_res = sinkhorn_knopp(h_res_raw, num_iters, eps, convention=convention);  layer_in = sum_i H_pre_i x_i.

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32, 1 <= n <= 32.
        h_pre_raw, h_post_raw: float32 [..., n] tensors, one set per token.
        h_res_raw: float32 [..., n, n] tensor.
        num_iters: Sinkhorn iterations, int >= 0 (deepseek: >= 1).  default 20.
        eps: Sinkhorn eps, >= 0.  default 1e-8 (paper) / 1e-6 (deepseek).
        grad_mode: Sinkhorn gradient, "unrolled" (default, exact) or
            "implicit" (converged projection); see :func:`sinkhorn_knopp`.
        convention: "paper" (default) or "deepseek" (OPS.md "DeepSeek-V4 convention"); keyword only.
        hc_eps: added to H_pre, >= 0.  default 0 (paper) / 1e-6 (deepseek).  Keyword only.
        post_mult: scale of H_post, >= 0.  default 2.  Keyword only.

    Returns:
        (layer_in [..., C] dtype of x, H_pre float32 [..., n],
        H_post float32 [..., n], H_res float32 [..., n, n]); all four are
        differentiable, on the device of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range,
        bad num_iters / eps / grad_mode, devices.

    Notes:
        Backward saves the four inputs only; the sigmoids and the Sinkhorn
        iteration are recomputed.  Outputs that the loss does not use get no
        gradient (None, counted as zero; no work for H_res's Sinkhorn backward).
    """
    _checks.grad_mode(grad_mode)  # fail now, not at backward
    num_iters, eps, hc_eps, post_mult = _convention.resolve(convention, num_iters=num_iters, eps=eps, hc_eps=hc_eps,
                                                            post_mult=post_mult)
    params = (num_iters, eps, grad_mode, convention, hc_eps, post_mult)
    if _use_custom_op(x, h_pre_raw, h_post_raw, h_res_raw):
        return _op("mhc_pre_op_fwd")(x, h_pre_raw, h_post_raw, h_res_raw, *params)
    if _needs_autograd(x, h_pre_raw, h_post_raw, h_res_raw):
        return _PreFn.apply(x, h_pre_raw, h_post_raw, h_res_raw, *params)
    return _pre_fwd_impl(x, h_pre_raw, h_post_raw, h_res_raw, *params)


# ------------------------------------------------------------ coefficients
def _coeffs_fwd_impl(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _ops.mhc_coeffs_fwd(x, phi, alpha, bias, eps=eps)


def _coeffs_bwd_impl(grad_h_pre_raw: Optional[Tensor], grad_h_post_raw: Optional[Tensor],
                     grad_h_res_raw: Optional[Tensor], x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_coeffs_bwd(grad_h_pre_raw, grad_h_post_raw, grad_h_res_raw, x, phi, alpha, bias, eps=eps)


def _coeffs_setup(ctx, inputs, output):
    x, phi, alpha, bias, ctx.eps = inputs
    ctx.save_for_backward(x, phi, alpha, bias)
    ctx.set_materialize_grads(False)  # unused outputs: None, counted as zero


def _coeffs_backward(bwd, ctx, g_pre, g_post, g_res):
    x, phi, alpha, bias = ctx.saved_tensors
    if g_pre is None and g_post is None and g_res is None:
        return (None,) * 5
    dx, dphi, dalpha, dbias = bwd["mhc_coeffs_bwd"](g_pre, g_post, g_res, x, phi, alpha, bias, ctx.eps)
    return dx, dphi, dalpha, dbias, None


_CoeffsFn = _wire("mhc_coeffs", _coeffs_fwd_impl,
                  {"mhc_coeffs_bwd": _coeffs_bwd_impl}, _coeffs_setup, _coeffs_backward)


def mhc_coeffs(x, phi, alpha, bias, eps=DEFAULT, *, convention="paper"):
    """Differentiable per-token mHC coefficients (OPS.md section 8, paper Eqs. 14-18).

    With x~ = vec(x) (length n*C), r = sqrt(mean(x~^2) + eps) and Ht = x~ phi:
    h_pre_raw = alpha[0] Ht_pre / r + bias_pre, h_post_raw = alpha[1] Ht_post / r + bias_post,
    h_res_raw = alpha[2] mat(Ht_res) / r + bias_res (columns of phi ordered pre | post | res).

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32, 1 <= n <= 32.
        phi: float32 [n*C, n*n + 2n].  alpha: float32 [3].  bias: float32 [n*n + 2n].
        eps: added to the mean square, >= 0.  default 1e-5 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek": the same maths (DeepSeek-V4's hc_fn is
            phi^T, hc_scale alpha, hc_base bias; OPS.md "DeepSeek-V4 convention"), only the default
            eps differs.  Keyword only.

    Returns:
        (h_pre_raw [..., n], h_post_raw [..., n], h_res_raw [..., n, n]), float32, differentiable
        in x, phi, alpha and bias (feed them to :func:`mhc_pre_op`).

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range, devices.

    Notes:
        One read of x computes the GEMM and the sum of squares; the backward
        recomputes them and sums the parameter gradients over tokens in a fixed
        order (deterministic).
    """
    eps = _convention.resolve(convention, rms_eps=eps)
    if _use_custom_op(x, phi, alpha, bias):
        return _op("mhc_coeffs_fwd")(x, phi, alpha, bias, eps)
    if _needs_autograd(x, phi, alpha, bias):
        return _CoeffsFn.apply(x, phi, alpha, bias, eps)
    return _coeffs_fwd_impl(x, phi, alpha, bias, eps)


# ------------------------------------------------------------------- head
def _head_fwd_impl(x: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, rms_eps: float,
                   hc_eps: float) -> Tensor:
    return _ops.mhc_head_fwd(x, hc_fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)


def _head_bwd_impl(grad: Tensor, x: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, rms_eps: float,
                   hc_eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_head_bwd(grad, x, hc_fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps)


def _head_setup(ctx, inputs, output):
    x, hc_fn, hc_scale, hc_base, ctx.rms_eps, ctx.hc_eps = inputs
    ctx.save_for_backward(x, hc_fn, hc_scale, hc_base)


def _head_backward(bwd, ctx, grad):
    x, hc_fn, hc_scale, hc_base = ctx.saved_tensors
    if grad is None:
        return (None,) * 6
    return (*bwd["mhc_head_bwd"](grad, x, hc_fn, hc_scale, hc_base, ctx.rms_eps, ctx.hc_eps), None, None)


_HeadFn = _wire("mhc_head", _head_fwd_impl, {"mhc_head_bwd": _head_bwd_impl}, _head_setup, _head_backward)


def mhc_head(x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """Differentiable mHC head: n streams -> one hidden state (OPS.md section 11, DeepSeek-V4 ``hc_head``).

    Per token, with x~ = vec(x): w = sigmoid((x~ hc_fn^T) / sqrt(mean(x~^2) + rms_eps) * hc_scale
    + hc_base) + hc_eps, out = sum_i w_i x_i.

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32, 1 <= n <= 32.
        hc_fn: float32 [n, n*C].  hc_scale: float32 [1].  hc_base: float32 [n].
        rms_eps: inside the square root, >= 0. Default 1e-6.  hc_eps: added to w, >= 0. Default 1e-6.

    Returns:
        out [..., C], dtype and device of x; differentiable in x, hc_fn, hc_scale and hc_base.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range, devices.

    Notes:
        Saves the inputs; the backward recomputes the GEMM and sums the parameter
        gradients over tokens in a fixed order (deterministic).
    """
    if _use_custom_op(x, hc_fn, hc_scale, hc_base):
        return _op("mhc_head_fwd")(x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps)
    if _needs_autograd(x, hc_fn, hc_scale, hc_base):
        return _HeadFn.apply(x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps)
    return _head_fwd_impl(x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps)


# ----------------------------------------------------- fused layer pieces
# OPS.md section 9: the coefficient path and the pre op in one forward; the post op's
# backward; one backward writing the layer's dx once.  The pre piece returns ``x_link``
# (a view of x) that only the post piece consumes, and the post piece's backward sends the
# post op's part of dx back along it: for n <= 4 g, the gradient of the layer's output, from
# which the pre piece's backward computes H_res^T g itself (grad_out); above, the post op's dx
# from its own backward, which the pre piece's backward adds (grad_x; ops.layer.fold_post_dx).
def _layer_pre_fwd_impl(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, num_iters: int, eps: float,
                        rms_eps: float, convention: str = "paper", hc_eps: float = 0.0,
                        post_mult: float = 2.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_layer_pre_fwd(x, phi, alpha, bias, num_iters=num_iters, eps=eps, rms_eps=rms_eps,
                                  convention=convention, hc_eps=hc_eps, post_mult=post_mult)


def _layer_pre_bwd_impl(grad_layer_in: Optional[Tensor], grad_out: Optional[Tensor], grad_H_post: Optional[Tensor],
                        grad_H_res: Optional[Tensor], x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                        stats: Tensor, H_pre: Tensor, H_res: Tensor, num_iters: int, eps: float, rms_eps: float,
                        grad_mode: str, convention: str = "paper", hc_eps: float = 0.0,
                        post_mult: float = 2.0, grad_x: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.mhc_layer_pre_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias, stats,
                                  H_pre, H_res, num_iters=num_iters, eps=eps, rms_eps=rms_eps, grad_mode=grad_mode,
                                  convention=convention, hc_eps=hc_eps, post_mult=post_mult, grad_x=grad_x)


def _layer_post_bwd_impl(grad: Tensor, layer_out: Tensor, x: Tensor, H_post: Tensor, H_res: Tensor,
                         convention: str = "paper") -> tuple[Tensor, Tensor, Tensor]:
    return _ops.mhc_layer_post_bwd(grad, layer_out, x, H_post, H_res, convention=convention)


_SETTINGS_ARGS = {}
for _name, _impl in (("mhc_layer_pre_fwd", _layer_pre_fwd_impl), ("mhc_layer_pre_bwd", _layer_pre_bwd_impl),
                     ("mhc_layer_post_bwd", _layer_post_bwd_impl)):
    _register(_name, _impl)
    _SETTINGS_ARGS[_name] = tuple(p for p in inspect.signature(_impl).parameters if p in _SETTINGS)


def _layer_call(name: str, custom: bool, settings: LayerSettings, arrays: dict):
    """Fused layer piece ``name`` on ``arrays`` (by the op spec's names) with ``settings``: the custom
    operator (torch.compile, tensor subclasses: the settings flattened to its arguments) or the
    functional API's planner (eager)."""
    if custom:
        return _op(name)(**arrays, **_flat(name, settings))
    return _run(_ops.SPECS[name].planner, arrays, settings=settings)


class _LayerPreFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, alpha, bias, settings, custom):
        layer_in, H_pre, H_post, H_res, stats = _layer_call("mhc_layer_pre_fwd", custom, settings,
                                                            {"x": x, "phi": phi, "alpha": alpha, "bias": bias})
        ctx.save_for_backward(x, phi, alpha, bias, stats, H_pre, H_res)
        ctx.settings, ctx.custom = settings, custom
        # which H_res this backward folds in (H_res^T g): mhc_layer_post must get this one
        ctx.h_res_key = None if custom else _tensor_key(H_res)
        ctx.set_materialize_grads(False)
        return layer_in, x.view_as(x), H_post, H_res

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_layer_in, g_out, g_H_post, g_H_res):
        x, phi, alpha, bias, stats, H_pre, H_res = ctx.saved_tensors
        sent, ctx.g_sent = getattr(ctx, "g_sent", None), None
        if g_out is not None and not ctx.custom and not _same_tensor(g_out, sent):
            # x_link's gradient must be exactly what mhc_layer_post's backward sent (the layer
            # output's gradient): anything else (x_link also used elsewhere, or without
            # mhc_layer_post) would be folded into dx as if it were, silently wrong
            raise RuntimeError(
                "mhc_layer_pre's x_link received a gradient that is not (only) mhc_layer_post's: x_link may "
                "be used for nothing but one mhc_layer_post call (use x, or x_link.detach(), elsewhere); "
                "or use mhc_pre_op / mhc_post_op, which allow any use of x")
        if g_layer_in is not None and g_out is not None and g_layer_in.dtype != g_out.dtype:
            g_layer_in = g_layer_in.to(g_out.dtype)
        fold = fold_post_dx(x.shape[-2])  # g_out: the output gradient (fold), else the post op's dx
        dx, dphi, dalpha, dbias = _layer_call("mhc_layer_pre_bwd", ctx.custom, ctx.settings, {
            "grad_layer_in": g_layer_in, "grad_out": g_out if fold else None, "grad_H_post": g_H_post,
            "grad_H_res": g_H_res, "grad_x": None if fold else g_out, "x": x, "phi": phi, "alpha": alpha, "bias": bias,
            "stats": stats, "H_pre": H_pre, "H_res": H_res})
        return dx, dphi, dalpha, dbias, None, None


class _LayerPostFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer_out, x_link, H_post, H_res, convention, pre, custom):
        ctx.save_for_backward(layer_out, x_link, H_post, H_res)
        ctx.custom, ctx.convention, ctx.pre = custom, convention, pre
        return _op("mhc_post_op_fwd")(layer_out, x_link, H_post, H_res, convention) if custom else \
            _post_fwd_impl(layer_out, x_link, H_post, H_res, convention)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        layer_out, x_link, H_post, H_res = ctx.saved_tensors
        args = (g, layer_out, x_link, H_post, H_res, ctx.convention)
        fold = fold_post_dx(x_link.shape[-2])
        if fold or not ctx.needs_input_grad[1]:  # g itself (the pre piece adds H_res^T g), or no dx wanted
            (dy, dH_post, dH_res), sent = _op("mhc_layer_post_bwd")(*args) if ctx.custom else \
                _ops.mhc_layer_post_bwd(*args[:-1], convention=ctx.convention), g if fold else None
        else:  # the post op's dx, which the pre piece's backward adds
            dy, sent, dH_post, dH_res = _op("mhc_post_op_bwd")(*args) if ctx.custom else _post_bwd_impl(*args)
        if ctx.pre is not None:  # the pre piece checks that x_link's gradient is this and nothing else
            ctx.pre.g_sent = sent  # (the reference also keeps autograd from summing into it in place)
        return dy, sent, dH_post, dH_res, None, None, None  # travels to _LayerPreFn.backward along x_link


def mhc_layer_pre(x, phi, alpha, bias, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled", *,
                  convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """Differentiable first half of the fused mHC layer (OPS.md section 9).

    The coefficient path and the pre op in one call (:func:`mhc_coeffs` then
    :func:`mhc_pre_op`).  Feed ``x_link`` (a view of x) and the coefficients to
    :func:`mhc_layer_post`, never x itself, and use x_link for nothing else: the
    layer's backward then writes dx once, with the post op's part folded in.

    Args:
        x: [..., n, C] tensor, bfloat16 / float16 / float32.
        phi, alpha, bias: float32 parameters as in :func:`mhc_coeffs`.
        num_iters, eps: Sinkhorn (defaults 20, 1e-8);  rms_eps: default 1e-5;
        grad_mode: Sinkhorn gradient, "unrolled" (default) or "implicit".
        convention, hc_eps, post_mult: as :func:`mhc_pre_op` (keyword only); under
            convention="deepseek" the defaults of eps / rms_eps are 1e-6 / 1e-6.  Give
            :func:`mhc_layer_post` the same convention.

    Returns:
        (layer_in [..., C], x_link [..., n, C], H_post float32 [..., n], H_res float32 [..., n, n]).

    Raises:
        TypeError / ValueError: as the functional ``mhc_layer_pre_fwd``.  RuntimeError (in
        backward): x_link got a gradient other than one mhc_layer_post call's (see there).
    """
    return layer_pre(x, phi, alpha, bias, LayerSettings.resolve(
        convention, num_iters=num_iters, eps=eps, rms_eps=rms_eps, grad_mode=grad_mode, hc_eps=hc_eps,
        post_mult=post_mult))


def layer_pre(x, phi, alpha, bias, settings: LayerSettings):
    """:func:`mhc_layer_pre` with its settings resolved (``MHC`` holds them so)."""
    custom = _use_custom_op(x, phi, alpha, bias)
    if _needs_autograd(x, phi, alpha, bias):
        out = _LayerPreFn.apply(x, phi, alpha, bias, settings, custom)
    else:
        layer_in, _, H_post, H_res, _ = _layer_call("mhc_layer_pre_fwd", custom, settings,
                                                    {"x": x, "phi": phi, "alpha": alpha, "bias": bias})
        out = layer_in, x, H_post, H_res
    return (*out[:3], _tag(out[3], settings.convention))  # mhc_layer_post checks the mark in every mode


def mhc_layer_post(layer_out, x_link, H_post, H_res, *, convention="paper"):
    """Differentiable second half of the fused mHC layer: the post op (OPS.md sections 6, 9).

    out_i = sum_j H_res_ij x_j + H_post_i y (convention="deepseek": H_res transposed, as
    :func:`mhc_post_op`), with x_link, H_post, H_res from :func:`mhc_layer_pre` (called with the
    same convention).  Its backward computes d_layer_out, dH_post, dH_res and hands the
    post op's part of dx to :func:`mhc_layer_pre`'s backward, which adds it before dx's
    rounding: for n <= 4 the output gradient g itself (the pre piece's backward computes
    H_res^T g; dx rounded once), for n > 4 the post op's dx, already rounded to x's dtype
    (faster; ``mhc_cupy.ops.layer.fold_post_dx``).

    Returns:
        out: [..., n, C], dtype and device of x.

    Raises:
        ValueError: a convention other than mhc_layer_pre's (checked in every mode, also under
            torch.no_grad, with frozen parameters and under torch.compile, where H_res is
            mhc_layer_pre's H_res as returned); x_link (requiring grad) is not mhc_layer_pre's
            x_link (also under a reentrant checkpoint of this call alone: checkpoint the whole
            layer, or use use_reentrant=False), or H_res is not that call's H_res.
        RuntimeError (in backward): x_link was used for anything but one mhc_layer_post call,
            so its gradient is not only this op's output gradient (eager mode; under
            torch.compile not checked: use x_link for nothing else).

    Notes:
        For n <= 4 x_link carries this op's output gradient back to mhc_layer_pre, so x_link's
        own gradient (``x_link.grad``, hooks on x_link, ``torch.autograd.grad`` w.r.t. x_link)
        is that output gradient, not dL/dx_link; dx is right.
    """
    _check_convention(H_res, _convention.check(convention))  # H_res marked by mhc_layer_pre: every mode
    if not _needs_autograd(layer_out, x_link, H_post, H_res):
        return mhc_post_op(layer_out, x_link, H_post, H_res, convention=convention)
    custom = _use_custom_op(layer_out, x_link, H_post, H_res)
    pre = _autograd_pre(x_link, H_res, convention) if x_link.requires_grad and not _is_compiling() else None
    return _LayerPostFn.apply(layer_out, x_link, H_post, H_res, convention, pre, custom)

