"""Coefficient parameters that stay float32 when their module is cast to another dtype.

The mHC coefficient kernels take float32 phi / alpha / bias (OPS.md section 8; the head's
hc_fn / hc_scale / hc_base): :class:`Float32Parameters` makes ``module.to(torch.bfloat16)``,
``.half()``, ``.bfloat16()``, ``.double()`` and ``.type(...)`` leave them (and their gradients)
float32 and unrounded, while the rest of the module (the sublayer) is cast and device moves
(``.to(device)``, ``.cuda()``, ``.cpu()``, ``.to_empty(device=...)``) apply to everything.
"""

from __future__ import annotations

import torch
from torch import nn

_F32 = torch.float32


class Float32Parameters(nn.Module):
    """An ``nn.Module`` whose own parameters named in ``float32_parameters`` keep float32 through
    ``Module._apply`` (the method behind ``to`` / ``half`` / ``bfloat16`` / ``double`` / ``type`` /
    ``cuda`` / ``cpu`` / ``to_empty``): the conversion runs on them as on any tensor, and where it
    changed a float32 one's dtype its result is replaced by the tensor itself moved to the
    result's device (so nothing is rounded through the other dtype).  A parametrized one
    (``torch.nn.utils.parametrize``) keeps its stored ``original`` float32 so (it was rounded through
    the other dtype, and reading the computed value for its ``.grad`` warned)."""

    #: Names of this module's own float32 parameters (a subclass sets it; empty: plain nn.Module).
    float32_parameters: tuple = ()

    def _stored(self, name: str) -> list:
        """The tensors that hold parameter ``name``: the parameter itself, or where it is parametrized
        (``torch.nn.utils.parametrize``: ``name`` is then computed, not stored) its ``original`` (or
        ``original0``, ``original1``, ...), which live in ``self.parametrizations[name]`` and are cast
        there (``Module._apply`` hands the same conversion to the children)."""
        p = self._parameters.get(name)
        if p is not None:
            return [p]
        plist = self._modules.get("parametrizations")
        if plist is not None and name in plist._modules:
            return [t for k, t in plist._modules[name]._parameters.items() if k.startswith("original")]
        return []

    def _apply(self, fn, recurse=True):
        keep = set()
        for name in self.float32_parameters:
            for p in self._stored(name):
                for t in (p, p.grad):
                    if t is not None and t.dtype == _F32:
                        keep.add(id(t))
        if not keep:
            return super()._apply(fn, recurse)

        def convert(t):
            out = fn(t)
            if id(t) in keep and isinstance(out, torch.Tensor) and out.dtype != _F32:
                out = t.to(device=out.device)  # fn's device move without its cast
            return out

        return super()._apply(convert, recurse)
