"""mhc_cupy: CUDA kernels for mHC (Manifold-Constrained Hyper-Connections, arXiv 2512.24880).

Functional API: explicit ``*_fwd`` / ``*_bwd`` calls that take PyTorch, JAX,
CuPy, NumPy or any DLPack tensors without copying, return the caller's
framework, and launch on the caller's current stream.  CPU inputs run the
NumPy reference (``mhc_cupy.reference``).  Framework adapters with autograd:
``mhc_cupy.torch`` and ``mhc_cupy.jax``; the functional API records no
autograd graph (torch tensors that require grad give an
``AutogradNotRecordedWarning``, once per op).  Operator contract: OPS.md.

No framework is imported here (``import torch`` in this file would be
shadowed by the ``mhc_cupy.torch`` submodule).
"""

from ._checks import MAX_N, MAX_NUM_ITERS, MIN_N
from ._dispatch import AutogradNotRecordedWarning
from ._kernels import warmup
from ._nvrtc import KernelCompileError
from .ops import (
    mhc_coeffs_bwd,
    mhc_coeffs_fwd,
    mhc_head_bwd,
    mhc_head_fwd,
    mhc_layer_post_bwd,
    mhc_layer_pre_bwd,
    mhc_layer_pre_fwd,
    mhc_post_op_bwd,
    mhc_post_op_fwd,
    mhc_pre_op_bwd,
    mhc_pre_op_fwd,
    rmsnorm_bwd,
    rmsnorm_fwd,
    sinkhorn_knopp_bwd,
    sinkhorn_knopp_fwd,
    stream_aggregate_bwd,
    stream_aggregate_fwd,
    stream_distribute_bwd,
    stream_distribute_fwd,
    stream_mix_bwd,
    stream_mix_fwd,
)

__version__ = "0.1.0"

__all__ = [
    "sinkhorn_knopp_fwd", "sinkhorn_knopp_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
    "stream_mix_fwd", "stream_mix_bwd", "stream_aggregate_fwd", "stream_aggregate_bwd",
    "stream_distribute_fwd", "stream_distribute_bwd", "mhc_post_op_fwd", "mhc_post_op_bwd",
    "mhc_pre_op_fwd", "mhc_pre_op_bwd", "mhc_coeffs_fwd", "mhc_coeffs_bwd",
    "mhc_layer_pre_fwd", "mhc_layer_pre_bwd", "mhc_layer_post_bwd", "mhc_head_fwd", "mhc_head_bwd",
    "warmup", "MIN_N", "MAX_N", "MAX_NUM_ITERS", "AutogradNotRecordedWarning", "KernelCompileError",
]
