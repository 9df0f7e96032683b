"""How :func:`mhc_cupy.torch.mhc_layer_post` knows the :func:`mhc_cupy.torch.mhc_layer_pre` call it
completes (the fused layer's two halves, OPS.md section 9), and the checks it runs on that.

* The convention: ``mhc_layer_pre`` marks its H_res with the convention it ran under (a Python
  attribute on the tensor object, :func:`tag`), in every mode: with or without autograd recording,
  with frozen parameters, and under ``torch.compile`` (Dynamo traces the attribute and the check,
  so a mismatch raises the ValueError while tracing; under fullgraph=True Dynamo's own error,
  carrying its message).  :func:`check_convention`
  refuses an ``mhc_layer_post`` whose convention differs (the paper and DeepSeek-V4 post ops
  differ: H_res or its transpose).  An H_res that is not the pre half's output as returned (a copy,
  a slice, ``detach()``) carries no mark and is not checked.
* While autograd records: :func:`autograd_pre`, the pre half's backward node behind ``x_link``
  (checked to be one by the mark :func:`link` puts on x_link, not by the node's type name, with the
  same convention and the same H_res), which receives the post op's part of dx.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The attribute of mhc_layer_pre's H_res that names its convention (:func:`tag`).
_MARK = "_mhc_convention"


def tensor_key(t: Tensor) -> tuple:
    """What identifies a tensor's data here: address, shape and strides."""
    return t.data_ptr(), tuple(t.shape), t.stride()


def version(t: Tensor):
    """t's version counter, which an in-place change of its data bumps (None for an inference tensor, which
    has none: its in-place changes are not seen)."""
    return None if t.is_inference() else t._version


def stream_key(t: Tensor) -> tuple:
    """:func:`tensor_key` with the dtype, the device and the :func:`version`: the same tensor changed in place
    has another key."""
    return (*tensor_key(t), t.dtype, t.device, version(t))


def tag(H_res: Tensor, convention: str) -> Tensor:
    """``H_res`` (an output of mhc_layer_pre) marked as made under ``convention``: the tensor itself,
    or under torch.compile a view of it (Dynamo traces an attribute statement on a tensor that a
    traced torch op made, not on a custom op's or autograd Function's output)."""
    if torch.compiler.is_compiling():
        H_res = H_res.view_as(H_res)
    H_res._mhc_convention = convention  # an attribute statement: Dynamo does not trace setattr() on tensors
    return H_res


def _mismatch(convention: str, pre_convention: str) -> ValueError:
    return ValueError(f"mhc_layer_post got convention={convention!r} but mhc_layer_pre ran with "
                      f"convention={pre_convention!r}; give both halves the same convention")


def check_convention(H_res, convention: str) -> None:
    """ValueError if ``H_res`` is marked (:func:`tag`) with another convention than ``convention``."""
    made = getattr(H_res, _MARK, None)
    if made is not None and made != convention:
        raise _mismatch(convention, made)


def link(x_link: Tensor) -> Tensor:
    """``x_link`` (mhc_layer_pre's output while autograd records) marked with its own backward node, so
    that :func:`autograd_pre` can tell it is that output, unchanged: a view, a copy or an in-place
    change of it (which gives it another node) carries no or another mark.  Eager mode only (Dynamo
    does not trace the attribute; under torch.compile the check is skipped)."""
    if not torch.compiler.is_compiling():
        x_link._mhc_pre_node = x_link.grad_fn
    return x_link


def autograd_pre(x_link: Tensor, H_res: Tensor, convention: str):
    """The autograd node of the mhc_layer_pre call that made ``x_link`` (its ctx), checked: ValueError
    if x_link is not such an output as returned (:func:`link`), that call ran under another convention,
    or ``H_res`` is not that call's H_res (its backward folds that H_res^T g into dx)."""
    pre = x_link.grad_fn
    if pre is None or getattr(x_link, "_mhc_pre_node", None) is not pre:
        raise ValueError("x_link must be the x_link output of mhc_layer_pre, as it returned it (its backward "
                         "receives this op's output gradient); got a tensor whose grad_fn is "
                         f"{type(pre).__name__}")
    if pre.convention != convention:  # the pre half's backward folds this op's dx in its convention
        raise _mismatch(convention, pre.convention)
    if pre.h_res_key is not None and tensor_key(H_res) != pre.h_res_key:
        raise ValueError("H_res must be the H_res output of the mhc_layer_pre call that made x_link (its "
                         "backward folds that H_res^T g into dx); for another H_res use mhc_post_op")
    return pre
