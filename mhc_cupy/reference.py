"""Float64 NumPy reference implementations of every mhc_cupy operator.

These functions are the test oracles for the GPU kernels. They follow the operator contract
``docs/OPS.md`` (section numbers are quoted in each docstring) and are written for clarity,
not speed: plain vectorised NumPy, no other dependency.

Conventions shared by every function:

* Inputs may be NumPy arrays (or anything ``np.asarray`` accepts) of any float dtype:
  float16, float32, float64 or ``ml_dtypes.bfloat16``. They are converted with
  ``np.asarray(a, dtype=np.float64)`` first; all arithmetic happens in float64 and every
  returned array is float64. Casting to the activation / coefficient dtype is the caller's job.
* ``...`` is any number of leading token dims, including none and including zero-size dims
  (zero tokens give empty outputs of the right shape; gradients of shared parameters are then
  zeros).
* ``n`` is the number of residual streams, ``C`` the hidden size.
* Shapes are *not* validated here (the dispatcher does that before calling); a function given
  inconsistent shapes may raise a NumPy broadcasting error or return nonsense.
* Backward functions return the vector-Jacobian product of the matching forward with the
  incoming gradient(s). Where a backward takes several incoming gradients, ``None`` means zero.
"""

from __future__ import annotations

# the references, by what they compute (one module each; no other dependency than NumPy)
from ._reference_ops import (  # noqa: F401 - sections 1-7
    mhc_post_op_bwd, mhc_post_op_fwd, mhc_pre_op_bwd, mhc_pre_op_fwd, rmsnorm_bwd, rmsnorm_fwd,
    sinkhorn_knopp_bwd, sinkhorn_knopp_fwd, stream_aggregate_bwd, stream_aggregate_fwd, stream_distribute_bwd,
    stream_distribute_fwd, stream_mix_bwd, stream_mix_fwd,
)
from ._reference_coeffs import (  # noqa: F401 - sections 8, 9, 11, 12
    mhc_boundary_bwd, mhc_boundary_fwd, mhc_coeffs_bwd, mhc_coeffs_fwd, mhc_head_bwd, mhc_head_fwd, mhc_layer_pre_bwd,
    mhc_layer_pre_fwd,
)
from ._reference_layer_in import mhc_layer_pre_fp8_fwd, mhc_layer_pre_norm_fwd  # noqa: F401 - section 13

__all__ = [
    "sinkhorn_knopp_fwd",
    "sinkhorn_knopp_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "stream_mix_fwd",
    "stream_mix_bwd",
    "stream_aggregate_fwd",
    "stream_aggregate_bwd",
    "stream_distribute_fwd",
    "stream_distribute_bwd",
    "mhc_post_op_fwd",
    "mhc_post_op_bwd",
    "mhc_pre_op_fwd",
    "mhc_pre_op_bwd",
    "mhc_coeffs_fwd",
    "mhc_coeffs_bwd",
    "mhc_head_fwd",
    "mhc_head_bwd",
    "mhc_layer_pre_norm_fwd",
    "mhc_layer_pre_fp8_fwd",
]
