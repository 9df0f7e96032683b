"""Compatibility names: the torch layer now lives in :mod:`mhc_cupy.torch`.

``mhc_cupy.layers.X`` is the same object as ``mhc_cupy.torch.X`` (layer and
stream helpers, :mod:`mhc_cupy.torch.layers`; ``mhc_coeffs``,
:mod:`mhc_cupy.torch.functions`) or ``mhc_cupy.torch.reference.X`` (the
plain-torch oracles).  New code imports from ``mhc_cupy.torch``.
"""

from .torch import MHC, CollapseStreams, ExpandStreams, collapse_streams, expand_streams, identity_bias, mhc_coeffs
from .torch.reference import MHCReference, mhc_reference, sinkhorn_reference

__all__ = ["MHC", "MHCReference", "mhc_coeffs", "mhc_reference", "sinkhorn_reference", "identity_bias",
           "expand_streams", "collapse_streams", "ExpandStreams", "CollapseStreams"]
