"""``torch.func`` transforms (grad, vmap, jacrev, jacfwd, jvp, vjp, hessian) of the mhc_cupy.torch ops: not
supported, refused early with an error that says what to use instead.

The ops run NumPy (CPU) or CuPy kernels (GPU) on the tensors' memory, and their autograd Functions
are written in the classic ``forward(ctx, ...)`` style (a third of the per-call host cost of the
``setup_context`` style that torch.func needs) without vmap rules: under a transform PyTorch would
otherwise fail inside ``Function.apply`` with its generic "must override the setup_context
staticmethod" message, or on a batched tensor's missing storage.  ``torch.func.functional_call``
is not a transform and works.

Forward-mode AD (``torch.autograd.forward_ad`` dual tensors) is refused the same way: the kernels
read the primal's memory only, so a tangent would be silently dropped (the output none, i.e. zero).
So are batched gradients (``torch.autograd.grad(..., is_grads_batched=True)``, which
``torch.autograd.functional.jacobian`` / ``hessian`` use with ``vectorize=True``): the backward gets
the legacy vmap's batched tensors, which have no memory to read (they failed deep inside with
"Batching rule not implemented for aten::detach").
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

#: True inside any torch.func transform (a C call, ~35 ns; what ``Function.apply`` checks itself).
active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)

MESSAGE = (
    "mhc_cupy.torch does not support torch.func transforms (grad, vmap, jacrev, jacfwd, jvp, vjp, hessian): "
    "its ops run NumPy / CuPy kernels on the tensors' memory, with no torch.func rules.  For gradients use "
    "torch.autograd (loss.backward() or torch.autograd.grad; torch.func.functional_call for parameters "
    "given as a dict works); instead of vmap pass the batch as leading dims (every op and MHC / MHCHead take "
    "[..., n, C]) or loop over it")


def refuse() -> None:
    """Raise NotImplementedError (:data:`MESSAGE`); called where :data:`active` is true."""
    raise NotImplementedError(MESSAGE)


FORWARD_AD_MESSAGE = (
    "mhc_cupy.torch does not support forward-mode AD (torch.autograd.forward_ad dual tensors): its ops run "
    "NumPy / CuPy kernels on the primal's memory and would drop the tangent.  Use reverse mode "
    "(loss.backward() or torch.autograd.grad), or pass the primal (forward_ad.unpack_dual(t).primal)")


def refuse_dual(tensors) -> None:
    """Raise NotImplementedError (:data:`FORWARD_AD_MESSAGE`) if a tensor carries a forward-AD tangent.
    Only inside an open ``forward_ad.dual_level()`` can one: callers on the hot path test
    ``forward_ad._current_level >= 0`` first (a module attribute read, no call)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(FORWARD_AD_MESSAGE)


BATCHED_GRADS_MESSAGE = (
    "mhc_cupy.torch does not support batched gradients (torch.autograd.grad(..., is_grads_batched=True), "
    "torch.autograd.functional.jacobian / hessian with vectorize=True): its backward runs NumPy / CuPy kernels "
    "on the gradients' memory, with no vmap rules.  Call torch.autograd.grad once per gradient (retain_graph=True), "
    "or use jacobian / hessian with vectorize=False (the default)")

#: True for a gradient of the legacy vmap (``is_grads_batched``); a C call
_legacy_batched = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", lambda t: False)


def refuse_batched(grads) -> None:
    """Raise NotImplementedError (:data:`BATCHED_GRADS_MESSAGE`) if a gradient reaching a backward is batched."""
    for g in grads:
        if g is not None and _legacy_batched(g):
            raise NotImplementedError(BATCHED_GRADS_MESSAGE)
