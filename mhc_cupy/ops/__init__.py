"""The mHC operators: one module per family, each with its public ``*_fwd`` /
``*_bwd`` functions and their launch plans (OPS.md sections 1-13)."""

from .boundary import mhc_boundary_bwd, mhc_boundary_fwd
from .coeffs import mhc_coeffs_bwd, mhc_coeffs_fwd
from .head import mhc_head_bwd, mhc_head_fwd
from .layer import mhc_layer_post_bwd, mhc_layer_pre_bwd, mhc_layer_pre_fwd
from .layer_in import mhc_layer_pre_fp8_fwd, mhc_layer_pre_norm_fwd
from .post import mhc_post_op_bwd, mhc_post_op_fwd
from .pre import mhc_pre_op_bwd, mhc_pre_op_fwd
from .rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from .sinkhorn import sinkhorn_knopp_bwd, sinkhorn_knopp_fwd
from . import boundary, coeffs, head, layer, layer_in, post, pre, rmsnorm, sinkhorn, stream
from .stream import (
    stream_aggregate_bwd,
    stream_aggregate_fwd,
    stream_distribute_bwd,
    stream_distribute_fwd,
    stream_mix_bwd,
    stream_mix_fwd,
)

#: Every kernel entry point's spec (:class:`mhc_cupy.ops.spec.Kernel`), by name
#: (``"<op>_fwd"`` / ``"<op>_bwd"``), declared beside its planner.
_FAMILIES = (sinkhorn, rmsnorm, stream, post, pre, coeffs, layer, layer_in, head, boundary)
SPECS = {k.name: k for family in _FAMILIES for k in family.KERNELS}

__all__ = [
    "sinkhorn_knopp_fwd", "sinkhorn_knopp_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
    "stream_mix_fwd", "stream_mix_bwd", "stream_aggregate_fwd", "stream_aggregate_bwd",
    "stream_distribute_fwd", "stream_distribute_bwd", "mhc_post_op_fwd", "mhc_post_op_bwd",
    "mhc_pre_op_fwd", "mhc_pre_op_bwd", "mhc_coeffs_fwd", "mhc_coeffs_bwd",
    "mhc_layer_pre_fwd", "mhc_layer_pre_bwd", "mhc_layer_post_bwd", "mhc_head_fwd", "mhc_head_bwd",
    "mhc_boundary_fwd", "mhc_boundary_bwd", "mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd",
]
