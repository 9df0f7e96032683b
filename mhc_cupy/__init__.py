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
from . import ops as _ops
from .ops import *  # noqa: F401,F403 - the functional API: every op's *_fwd / *_bwd (ops.__all__)

__version__ = "0.1.0"

__all__ = [*_ops.__all__, "warmup", "MIN_N", "MAX_N", "MAX_NUM_ITERS", "AutogradNotRecordedWarning",
           "KernelCompileError"]
