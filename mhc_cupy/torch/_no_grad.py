"""``MHC.forward`` without autograd, repeated (decoding): the same kernels with less host work.

An eager ``MHC`` call under ``torch.no_grad()`` / ``torch.inference_mode()`` runs two ops through
:mod:`mhc_cupy._dispatch`'s fast path: ``mhc_layer_pre_fwd`` (five outputs and a temporary buffer),
the sublayer, then ``mhc_post_op_fwd`` (OPS.md section 9).  Of the pre op's outputs only layer_in
leaves the layer; H_pre, H_post, H_res and the RMS statistics feed the post op alone.  This lane
queues the same two fast-path entries (the launches ``_dispatch`` recorded: the same kernels,
arguments and bits) with the Python of one call, and puts those four outputs and both ops'
temporaries in one buffer: three allocations instead of seven.  Host cost of the decode-sized
forward (tokens 1, n 4, C 64, no grad; ``python scripts/host_overhead_cpu.py``, launches stubbed,
the 2-core CPU host of 2026-12-07): ~40 us through the general route, ~22.5 us through the lane.

Under the kernel choice ``lane`` (:mod:`mhc_cupy._kernel_choice`; off by default until a GPU run has
checked it) it applies to the fused layer (the default kernel choice) outside a stack's recompute / fused
boundaries, with plain tensors on the current device, once a general call of the same shapes,
dtypes, settings and kernel choice has left both entries in the fast-path cache; otherwise (and
for a sublayer output the post op's fast path would not take: another device, strides, a tensor
subclass; or grad mode, another kernel choice, device or stream left in force by the sublayer) the general
route runs, with the same results.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from .. import _dispatch
from .._dispatch import _Entry
from .._kernel_choice import current as _kernel_choice
from ..ops import SPECS
from ._factory import is_compiling, use_custom_op
from ._link import tag
from .functions import layer_post

_PRE, _POST = SPECS["mhc_layer_pre_fwd"].planner, SPECS["mhc_post_op_fwd"].planner
_F32 = torch.float32


class Lane(NamedTuple):
    """One layer's repeated no-grad call: what it is valid for and where its pieces go."""
    parts: tuple  # what it is for: the pre op's fast-path key parts (inputs' shapes, dtypes, device),
    settings: object  # the layer's settings (LayerSettings)
    choice: object  # and the kernel choice in force (KernelChoice)
    pre: _Entry
    post: _Entry
    y_part: tuple  # the sublayer output's fast-path key part (shape, dtype, device)
    size: int  # bytes of the shared buffer
    pre_outs: tuple  # offsets of H_pre, H_post, H_res and the statistics in it
    pre_scratch: tuple  # offsets of the pre op's temporaries
    post_scratch: tuple  # of the post op's


#: layer -> its Lane (not an attribute: a deep copy or pickle of the layer must not carry launches)
_LANES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POST_ARRAYS = dict.fromkeys(("layer_out", "x", "H_post", "H_res"), 0)  # the post op's inputs, all given


def _build(layer, x, fast, choice) -> Lane | None:
    """The lane for these inputs (``fast``: ``_dispatch._fast_inputs``'s) and kernel choice, from the
    fast-path entries a general call left; None while there are none."""
    pre = _dispatch._fast.get(_dispatch._key(_PRE, fast[0], {"settings": layer.settings}))
    if pre is None or pre.plan.empty:
        return None
    (li_shape, _), *coeffs = pre.plan.outputs  # layer_in, H_pre, H_post, H_res, statistics
    dev, x_part = pre.dev, fast[0][0]
    y_part = (torch.Size(li_shape), x.dtype, dev)
    parts = (y_part, x_part, (torch.Size(coeffs[1][0]), _F32, dev), (torch.Size(coeffs[2][0]), _F32, dev))
    post = _dispatch._fast.get(_dispatch._key(_POST, parts, {"convention": layer.convention}))
    if post is None or post.plan.empty or len(post.plan.outputs) != 1:
        return None
    pre_outs, end = _dispatch.pack(coeffs)
    pre_scratch, end = _dispatch.pack(pre.plan.scratch.values(), end)
    post_scratch, end = _dispatch.pack(post.plan.scratch.values(), end)
    return Lane(fast[0], layer.settings, choice, pre, post, y_part, end, pre_outs, pre_scratch, post_scratch)


def forward(layer, x, phi, alpha, bias, args: tuple, kwargs: dict):
    """``layer(x, *args, **kwargs)`` with grad mode off, through the lane, with the parameters as read (once:
    a parametrization runs at each read); None (nothing done) where it does not apply: the caller takes the
    general route."""
    if is_compiling():  # (Dynamo traces the general route; it cannot read the kernel choice, a context variable)
        return None
    choice = _kernel_choice()
    if not choice.runs("lane"):
        return None
    layer._check(x)  # (as the general route, first: its errors, in its order)
    if phi.dtype != _F32 or alpha.dtype != _F32 or bias.dtype != _F32 or use_custom_op(x, phi, alpha, bias):
        return None
    arrays = {"x": x, "phi": phi, "alpha": alpha, "bias": bias}
    fast = _dispatch._fast_inputs(arrays)
    if fast is None:
        return None
    try:
        lane = _LANES.get(layer)
    except TypeError:  # an unhashable layer (a subclass with its own __eq__)
        return None
    if lane is None or lane.parts != fast[0] or lane.settings is not layer.settings or (
            lane.choice is not choice and lane.choice != choice):  # (each kernel_choice block: a new, equal value)
        lane = _build(layer, x, fast, choice)
        if lane is None:
            return None
        _LANES[layer] = lane
    pre, post = lane.pre, lane.post
    dev, fe = pre.dev, pre.fe
    if _dispatch.current_device() != dev:
        return None
    stream = fe.stream(dev)
    layer_in = fe.empty(*pre.plan.outputs[0], x)
    buf = fe.empty((lane.size,), "uint8", x)
    base = buf.data_ptr()
    _dispatch.launch(pre, arrays, fast[1], [layer_in.data_ptr(), *[base + o for o in lane.pre_outs]],
                     [base + o for o in lane.pre_scratch], stream)
    y = layer._sublayer_output(layer_in, x, args, kwargs)
    got = _dispatch._fast_inputs({"layer_out": y, "x": x})  # (x too: the sublayer may have given it new storage)
    if (got is None or got[0] != (lane.y_part, fast[0][0]) or torch.is_grad_enabled() or use_custom_op(y)
            or _kernel_choice() is not choice or _dispatch.current_device() != dev or fe.stream(dev) != stream):
        # what the sublayer returned or left in force is not what the post entry was recorded for: the general
        # post op, on views of the buffer
        (_, _, (s_post, _), (s_res, _), _), (_, o_post, o_res, _) = pre.plan.outputs, lane.pre_outs
        H_post = buf[o_post:o_post + 4 * math.prod(s_post)].view(_F32).view(s_post)
        H_res = tag(buf[o_res:o_res + 4 * math.prod(s_res)].view(_F32).view(s_res), layer.convention)
        return layer_post(y, x, H_post, H_res, layer.convention)
    out = fe.empty(*post.plan.outputs[0], x)
    _dispatch.launch(post, _POST_ARRAYS, [*got[1], base + lane.pre_outs[1], base + lane.pre_outs[2]],
                     [out.data_ptr()], [base + o for o in lane.post_scratch], stream)
    return out
