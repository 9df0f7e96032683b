"""The mHC operators as differentiable torch functions (``mhc_cupy.torch``'s op half).

Each op runs its functional ``*_fwd`` / ``*_bwd`` kernels; the routes (eager / compiled), devices,
streams and gradient order are described in :mod:`mhc_cupy.torch`.  Everything an op shares with
the others is generated from the op table (``mhc_cupy.ops.SPECS``): its ``torch.library`` custom
operators (schema, fake function), its autograd (the eager ``autograd.Function`` and the custom
operator's registration, one backward for both) and its public function's signature (that of the
functional ``*_bwd`` less its incoming gradients), by :mod:`mhc_cupy.torch._factory` and
:mod:`mhc_cupy._adapter`; Sinkhorn's and the pre op's settings are resolved there into one
:class:`mhc_cupy._settings.LayerSettings`.  Written by hand, only what an op needs beyond that (the
``prepare`` hooks: ``_BY_HAND`` here, with :data:`mhc_cupy._adapter.BY_HAND`, shared with JAX; each gets
the arguments by name and returns only the kernel parameters it changes, so a new parameter passes):

======================================  ======================================================
op                                      by hand
======================================  ======================================================
``rmsnorm``                             with a weight, on a GPU, while autograd records: C
                                        checked against the weighted backward's limit now, not
                                        in backward (its backward operators with and without
                                        the weight are generated: an optional input with a
                                        gradient)
``mhc_coeffs``                          ``eps`` resolved per ``convention`` (not a kernel
                                        parameter)
``mhc_post_op``                         ``convention`` checked before anything runs
``mhc_layer_pre``, ``mhc_layer_post``   the fused layer pieces: x_link carries the post op's
                                        part of dx into the pre piece's backward (two autograd
                                        Functions, below); their custom operators are generated
======================================  ======================================================

Each public function's docstring is written here.  Imported through the package, which checks
that torch is installed first.
"""

import dataclasses
import weakref

import torch
from torch import Tensor

from .. import _adapter, _convention, _settings
from .._convention import DEFAULT
from .._dispatch import run as _run_plan
from .._kernel_choice import current as _current_choice, restored as _restored
from .._settings import LayerSettings
from .. import ops as _ops
from ..ops.layer import fold_post_dx
from ._factory import NAMESPACE  # noqa: F401 - re-exported: mhc_cupy.torch.NAMESPACE
from ._factory import REGISTERED as _REGISTERED, Op as _Op, call as _call, is_compiling as _is_compiling
from ._factory import register as _register
from ._factory import eager_apply, first_order as _first_order
from ._factory import needs_autograd as _needs_autograd, use_custom_op as _use_custom_op
from ._link import autograd_pre as _autograd_pre, check_convention as _check_convention, tag as _tag
from ._link import link as _mark_link, stream_key as _stream_key, tensor_key as _tensor_key
from ._link import version as _version

__all__ = [
    "sinkhorn_knopp", "rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute",
    "mhc_post_op", "mhc_pre_op", "mhc_coeffs", "mhc_layer_pre", "mhc_layer_post", "mhc_head",
]


def _settings_kw(**given) -> dict:
    """The planner's keyword arguments of an op that takes the layer's settings: resolved once
    (:class:`LayerSettings`); traced by torch.compile, where they may be symbolic values, the
    given values with the convention's defaults, which the custom operator's fake checks."""
    if _is_compiling():
        return _settings.filled(**given)
    return {"settings": LayerSettings.resolve(**given)}


# ------------------------------------------------------------ what ops need by hand
def _rmsnorm_weighted_c(x, weight, **_) -> dict:
    """With a weight, on a GPU, while autograd records: C checked against the weighted backward's limit."""
    if weight is not None and isinstance(x, Tensor) and x.is_cuda and x.ndim and _needs_autograd(x, weight):
        _ops.rmsnorm.check_weighted_c(x.shape[-1], ("cuda", x.device.index))
    return {}


#: The ``prepare`` hooks (:func:`mhc_cupy._adapter.public`) of the ops that need one, by op.
_BY_HAND = {**_adapter.BY_HAND, "rmsnorm": _rmsnorm_weighted_c}


def _public(op: str, doc: str):
    op_ = _Op(op)
    return _adapter.public(op, doc, __name__, op_.body, op_.namespace(), _BY_HAND.get(op), _settings_kw)


# ------------------------------------------------------------------ the ops
sinkhorn_knopp = _public("sinkhorn_knopp", """Differentiable Sinkhorn-Knopp projection onto doubly-stochastic matrices (OPS.md section 1).

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
    """)

rmsnorm = _public("rmsnorm", """Differentiable RMSNorm over the last dim (OPS.md section 2).

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
    """)

stream_mix = _public("stream_mix", """Differentiable stream mix: out_i = sum_j M_ij x_j per token (OPS.md section 3).

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
    """)

stream_aggregate = _public("stream_aggregate", """Differentiable weighted stream sum: out = sum_i h_i x_i (OPS.md section 4).

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
    """)

stream_distribute = _public("stream_distribute", """Differentiable stream distribute: out_i = h_i y (OPS.md section 5).

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
    """)

mhc_post_op = _public("mhc_post_op", """Differentiable mHC residual update (OPS.md section 6, paper Eq. 3).

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
    """)

mhc_pre_op = _public("mhc_pre_op", """Differentiable mHC pre op: coefficient activations and layer input (OPS.md section 7, paper Eq. 8).

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
    """)

mhc_coeffs = _public("mhc_coeffs", """Differentiable per-token mHC coefficients (OPS.md section 8, paper Eqs. 14-18).

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
    """)

mhc_head = _public("mhc_head", """Differentiable mHC head: n streams -> one hidden state (OPS.md section 11, DeepSeek-V4 ``hc_head``).

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
    """)

#: Custom operators that run another kernel's spec (``mhc_cupy.ops.SPECS``) than their own name.
_SPEC_OF = {name: r.kernel.name for name, r in _REGISTERED.items() if name != r.kernel.name}


# ----------------------------------------------------- fused layer pieces
# OPS.md section 9: the coefficient path and the pre op in one forward; the post op's
# backward; one backward writing the layer's dx once.  The pre piece returns ``x_link``
# (a view of x) that only the post piece consumes, and the post piece's backward sends the
# post op's part of dx back along it: for n <= 4 g, the gradient of the layer's output, from
# which the pre piece's backward computes H_res^T g itself (grad_out); above, the post op's dx
# from its own backward, which the pre piece's backward adds (grad_x; ops.layer.fold_post_dx).
# (the boundary: layer_post and layer_pre's forwards in one, NextPre; the layer_in forms for inference, forward only)
for _name in ("mhc_layer_pre_fwd", "mhc_layer_pre_bwd", "mhc_layer_post_bwd", "mhc_boundary_fwd", "mhc_boundary_bwd",
              "mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"):
    _register(_name, _ops.SPECS[_name])


def _same_tensor(a: Tensor, b) -> bool:
    """a is b's data (same address, shape and strides), b a tensor or None."""
    return b is not None and _tensor_key(a) == _tensor_key(b)


def _at_pass_end(callback) -> None:
    """``callback()`` once the backward pass running now ends (what one node hands another is dropped
    there where the other did not run in it: a ``torch.autograd.grad`` that does not reach it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _hand_to_pre(pre, g_sent, layer_out) -> None:
    """A residual update's backward hands its pre piece's backward (``pre``, its ctx) the gradient it sent
    along x_link and, where the fused boundary backward left the coefficient gradients to it, the sublayer
    output (else None, clearing an earlier pass's): taken by that backward; a sublayer output it did not take
    is dropped at the pass's end (a later pass through a retained graph would count its sums twice).  The
    unfused hand-over adds no callback to every layer's backward: a stale g_sent is only compared with."""
    pre.g_sent, pre.layer_out = g_sent, layer_out
    if layer_out is not None:
        def drop():
            pre.g_sent = pre.layer_out = None

        _at_pass_end(drop)


class BoundaryGrad:
    """The fused boundary backward's hand-over between layer l's residual update and layer l+1's pre
    piece (OPS.md section 12, "Fused boundary backward"; kernel choice ``boundary_bwd``).  Layer l+1's
    pre-piece backward runs ``mhc_boundary_bwd`` with layer l's ``H_post``: besides dx_{l+1} (the
    gradient of layer l's output) it returns dy_l = sum_i H_post_i dx_{l+1, i}, kept here with dx_{l+1}.
    Layer l's residual-update backward takes dy_l where its incoming gradient is that dx (same data:
    nothing else used layer l's output) and hands the coefficient gradients (dH_post, dH_res) to layer
    l's pre-piece backward (``layer_out``), whose pass over the streams computes them: the post op's
    own pass over g, x and y is gone."""

    __slots__ = ("H_post", "version", "dx", "dx_version", "dy")

    def __init__(self, H_post: Tensor):
        self.H_post, self.version = H_post.detach(), H_post._version
        self.dx = self.dx_version = self.dy = None

    def give(self, dx: Tensor, dy: Tensor) -> None:
        """Layer l+1's pre-piece backward returns dx (with its version: a hook may change the gradient in
        place before layer l's residual update gets it) and dy for it; dropped at the pass's end if not
        taken (layer l's residual update not reached)."""
        self.dx, self.dx_version, self.dy = dx, dx._version, dy
        _at_pass_end(self.drop)

    def drop(self) -> None:
        self.dx = self.dx_version = self.dy = None

    def h_post(self):
        """Layer l's H_post, or None where it changed in place since the forward (then no fusion: layer l's
        residual update's own backward raises autograd's error for it)."""
        return self.H_post if self.H_post._version == self.version else None

    def take(self, g: Tensor):
        """dy_l for layer l's residual update, whose incoming gradient is g: kept where g is the dx_{l+1}
        that came with it (once), else None."""
        dx, version, dy = self.dx, self.dx_version, self.dy
        self.drop()
        return dy if dy is not None and _same_tensor(g, dx) and g._version == version else None


class NextPre:
    """The next layer's pre piece, fused into a layer's residual update by a stack
    (``mhc_boundary_fwd``, OPS.md section 12): that layer's parameters and settings go in; its
    outputs for the streams this residual update returns come out, taken once by its
    :func:`layer_pre` call on exactly those streams, unchanged (not after an in-place change).
    ``fuse_bwd``: the backward across the boundary fused too (:class:`BoundaryGrad`, set by :meth:`run`
    where the residual update records gradients).  ``params``: the next layer's phi, alpha and bias as read
    for this (before any float32 cast): its call takes the outputs only where it
    reads the very same tensor objects, not changed in place since (else the outputs would be the old
    parameters' while its backward differentiates the new ones; a stack does not fuse into a layer with
    forward pre-hooks, which run after this reading and may change them unseen, through ``.data``)."""

    __slots__ = ("phi", "alpha", "bias", "settings", "out_key", "out_ref", "outputs", "fuse_bwd", "grad", "params",
                 "param_keys")

    def __init__(self, phi, alpha, bias, settings: LayerSettings, fuse_bwd: bool, params):
        self.phi, self.alpha, self.bias, self.settings, self.fuse_bwd = phi, alpha, bias, settings, fuse_bwd
        self.out_key = self.out_ref = self.outputs = self.grad = None
        self.params = tuple(params)
        self.param_keys = tuple(_version(p) for p in self.params)

    def run(self, layer_out, x, H_post, H_res, grad: bool = False) -> Tensor:
        """The residual update (bitwise mhc_post_op_fwd's) and the next pre piece's outputs, kept;
        ``grad``: the update records gradients (a :class:`BoundaryGrad` where ``fuse_bwd``)."""
        out, *rest = _run_plan(_ops.SPECS["mhc_boundary_fwd"].planner, {
            "layer_out": layer_out, "x": x, "H_post": H_post, "H_res": H_res, "phi": self.phi, "alpha": self.alpha,
            "bias": self.bias}, settings=self.settings)
        self.out_key, self.out_ref, self.outputs = _stream_key(out), weakref.ref(out), tuple(rest)
        self.grad = BoundaryGrad(H_post) if grad and self.fuse_bwd else None
        return out

    def take(self, x: Tensor, params):
        """((layer_in, H_pre, H_post, H_res, stats), BoundaryGrad or None) computed for x, once; None for
        other streams (also where the residual update's output is gone: a forward hook replaced it, and
        another tensor, a pre-hook's, may have its address and so its key), and where ``params``, the
        (phi, alpha, bias) that the next layer's call reads, are not those the outputs were computed from
        (other tensors, or the same changed in place since)."""
        if self.outputs is None or self.out_ref() is None or _stream_key(x) != self.out_key:
            return None
        if not all(p is q and _version(p) == v for p, q, v in zip(params, self.params, self.param_keys)):
            self.outputs = None
            return None
        outputs, self.outputs = self.outputs, None
        return outputs, self.grad


class _LayerPreFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, alpha, bias, kw, custom, given=None, prev=None):
        layer_in, H_pre, H_post, H_res, stats = given or _call("mhc_layer_pre_fwd", custom, {
            "x": x, "phi": phi, "alpha": alpha, "bias": bias}, kw)
        ctx.save_for_backward(x, phi, alpha, bias, stats, H_pre, H_res)
        ctx.kw, ctx.custom, ctx.convention = kw, custom, _adapter.flat(("convention",), kw)[0]
        # the fused boundary backward (BoundaryGrad): the previous layer's hand-over, and this layer's
        # sublayer output where this layer's residual update left its coefficient gradients to us
        ctx.prev, ctx.layer_out = prev, None
        ctx.choice = None if custom else _current_choice()  # (torch.compile cannot read a context variable)
        # which H_res this backward folds in (H_res^T g): mhc_layer_post must get this one
        ctx.h_res_key = None if custom else _tensor_key(H_res)
        ctx.set_materialize_grads(False)
        return layer_in, x.view_as(x), H_post, H_res

    @staticmethod
    @_first_order
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
        layer_out, ctx.layer_out = ctx.layer_out, None
        arrays = {"grad_layer_in": g_layer_in, "grad_out": g_out if fold else None, "grad_H_post": g_H_post,
                  "grad_H_res": g_H_res, "grad_x": None if fold else g_out, "x": x, "phi": phi, "alpha": alpha,
                  "bias": bias, "stats": stats, "H_pre": H_pre, "H_res": H_res, "layer_out": layer_out}
        # (x needing no gradient: no dx, so no dy for the previous layer, which is then not reached)
        H_post_prev = ctx.prev.h_post() if ctx.prev is not None and ctx.needs_input_grad[0] else None
        # under the forward's kernel choice (backward may run outside its block: after it, or in autograd's
        # thread for CUDA tensors): the fused boundary backward's ops were set up by one with boundary_bwd
        with _restored(ctx.choice):
            if H_post_prev is not None:  # and the previous layer's dy (BoundaryGrad)
                dx, dphi, dalpha, dbias, dy = _call("mhc_boundary_bwd", ctx.custom, {
                    **arrays, "H_post_prev": H_post_prev}, ctx.kw)
                ctx.prev.give(dx, dy)
            else:
                dx, dphi, dalpha, dbias = _call("mhc_layer_pre_bwd", ctx.custom, arrays, ctx.kw)
        return dx, dphi, dalpha, dbias, None, None, None, None


class _LayerPostFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer_out, x_link, H_post, H_res, convention, pre, custom, nxt=None):
        ctx.save_for_backward(layer_out, x_link, H_post, H_res)
        ctx.custom, ctx.convention, ctx.pre = custom, convention, pre
        ctx.choice = None if custom else _current_choice()  # (torch.compile cannot read a context variable)
        if nxt is not None:
            out = nxt.run(layer_out, x_link, H_post, H_res, grad=True)
            ctx.boundary = nxt.grad  # the next layer's pre-piece backward hands us dy (BoundaryGrad)
            return out
        return _call("mhc_post_op_fwd", custom, {"layer_out": layer_out, "x": x_link, "H_post": H_post,
                                                 "H_res": H_res}, {"convention": convention})

    @staticmethod
    @_first_order
    def backward(ctx, g):
        layer_out, x_link, H_post, H_res = ctx.saved_tensors
        fold = fold_post_dx(x_link.shape[-2])
        boundary = getattr(ctx, "boundary", None)
        dy = boundary.take(g) if boundary is not None and fold and ctx.pre is not None else None
        if dy is not None:  # the fused boundary backward: dy from the next layer's, dH from our pre piece's
            _hand_to_pre(ctx.pre, g, layer_out)
            return dy, g, None, None, None, None, None, None
        arrays = {"grad": g, "layer_out": layer_out, "x": x_link, "H_post": H_post, "H_res": H_res}
        kw = {"convention": ctx.convention}
        with _restored(ctx.choice):  # (the forward's kernel choice, wherever autograd runs this)
            if fold or not ctx.needs_input_grad[1]:  # g itself (the pre piece adds H_res^T g), or no dx wanted
                (dy, dH_post, dH_res), sent = _call("mhc_layer_post_bwd", ctx.custom, arrays, kw), g if fold else None
            else:  # the post op's dx, which the pre piece's backward adds
                dy, sent, dH_post, dH_res = _call("mhc_post_op_bwd", ctx.custom, arrays, kw)
        if ctx.pre is not None:  # the pre piece checks that x_link's gradient is this and nothing else
            _hand_to_pre(ctx.pre, sent, None)  # (the reference also keeps autograd from summing into it in place)
        return dy, sent, dH_post, dH_res, None, None, None, None  # travels to _LayerPreFn.backward along x_link


_PRE_APPLY, _POST_APPLY = eager_apply(_LayerPreFn), eager_apply(_LayerPostFn)  # the eager route's apply


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
    return layer_pre(x, phi, alpha, bias, _settings_kw(convention=convention, num_iters=num_iters, eps=eps,
                                                       rms_eps=rms_eps, grad_mode=grad_mode, hc_eps=hc_eps,
                                                       post_mult=post_mult))


#: The settings (:class:`LayerSettings`'s fields, in its order), and those that are floats.
_SETTINGS = tuple(f.name for f in dataclasses.fields(LayerSettings))
_FLOAT_SETTINGS = tuple(f.name for f in dataclasses.fields(LayerSettings) if f.type in (float, "float"))


def _read_here(kw: dict) -> dict:
    """Under torch.compile: the settings in ``kw`` as plain values, the floats read (``float``) where
    this runs, before ``_LayerPreFn``'s body.  With dynamic=True Dynamo makes a float it reads from
    a Python object (the layer's LayerSettings, the convention's defaults) a graph input; read first
    inside the Function's body, that input belongs to the first call's subgraph, and a second
    mhc_layer_pre in the same graph (two MHC layers, an MHCStack) with the same settings object failed
    with Dynamo's "lift_tracked_freevar_to_input should not be called on root SubgraphTracer"."""
    return {k: float(v) if k in _FLOAT_SETTINGS else v for k, v in zip(_SETTINGS, _adapter.flat(_SETTINGS, kw))}


def layer_pre(x, phi, alpha, bias, kw: dict, given=None, prev: BoundaryGrad | None = None):
    """:func:`mhc_layer_pre` with its settings resolved: ``kw`` = ``{"settings": LayerSettings}`` (``MHC``
    holds its settings so), or under torch.compile the values (:func:`_settings_kw`).  ``given``: its
    forward's outputs (layer_in, H_pre, H_post, H_res, stats) already computed for x
    (:meth:`NextPre.take`, eager only), or None; ``prev``: the previous layer's :class:`BoundaryGrad` that came
    with them (the fused boundary backward), or None."""
    custom = _use_custom_op(x, phi, alpha, bias)
    if _needs_autograd(x, phi, alpha, bias):
        if custom and _is_compiling():
            kw = _read_here(kw)
        layer_in, x_link, H_post, H_res = (_LayerPreFn.apply if custom else _PRE_APPLY)(x, phi, alpha, bias, kw,
                                                                                         custom, given, prev)
        out = layer_in, _mark_link(x_link), H_post, H_res
    else:
        layer_in, _, H_post, H_res, _ = given or _call("mhc_layer_pre_fwd", custom, {
            "x": x, "phi": phi, "alpha": alpha, "bias": bias}, kw)
        out = layer_in, x, H_post, H_res
    # mhc_layer_post checks the mark in every mode
    return (*out[:3], _tag(out[3], _adapter.flat(("convention",), kw)[0]))


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
    return layer_post(layer_out, x_link, H_post, H_res, convention)


def layer_post(layer_out, x_link, H_post, H_res, convention: str, nxt: NextPre | None = None):
    """:func:`mhc_layer_post`; ``nxt`` (eager only, from a stack): the next layer's pre piece, fused
    into this residual update (OPS.md section 12; its convention is ``convention``)."""
    _check_convention(H_res, _convention.check(convention))  # H_res marked by mhc_layer_pre: every mode
    custom = _use_custom_op(layer_out, x_link, H_post, H_res)
    if custom:
        nxt = None
    if not _needs_autograd(layer_out, x_link, H_post, H_res):
        if nxt is not None:  # (the next layer's parameters may require grad: its layer_pre records their
            with torch.no_grad():  # gradient with the outputs taken, so no AutogradNotRecordedWarning here)
                return nxt.run(layer_out, x_link, H_post, H_res)
        return mhc_post_op(layer_out, x_link, H_post, H_res, convention=convention)
    pre = _autograd_pre(x_link, H_res, convention) if x_link.requires_grad and not _is_compiling() else None
    return (_LayerPostFn.apply if custom else _POST_APPLY)(layer_out, x_link, H_post, H_res, convention, pre, custom,
                                                           nxt)

