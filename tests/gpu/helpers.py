"""GPU test helpers: host <-> device with bf16, NaN-poisoned allocations (tolerances: ``harness.TOL``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from harness import NP_DTYPES, TOL, assert_close, f64, to_host  # noqa: F401 - re-exported for the GPU tests


#: Activation outputs (per dtype name) and float32 coefficient sums: rows of ``harness.TOL``.
ACT_TOL = TOL["activation"]
COEF_TOL = TOL["coefficient"].value
SINKHORN_TOL = TOL["sinkhorn"].value  # float32 through 20 normalisation steps, relative to the scale

#: The GPU cases' grid: activation dtypes, streams n, (tokens, C): C = 1 and 7 take the scalar
#: path, 64 / 1000 / 4096 the vectorised one; 4096 needs several accesses per thread.
DTYPES = ["bfloat16", "float16", "float32"]
NS = [1, 2, 3, 4, 8, 16]
SIZES = [(1, 1), (3, 7), (127, 64), (1000, 1000), (3, 4096)]


def coef(rng, shape, scale=1.0):
    """float32 coefficients (random normal times ``scale``)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def torch_cuda_ok() -> bool:
    """CuPy and PyTorch both see a CUDA device (the torch adapter's GPU tests need both)."""
    try:
        import cupy
        import torch

        return bool(cupy.cuda.is_available()) and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import or driver failure means: skip
        return False


#: Skip unless CuPy and PyTorch both see a CUDA device.
needs_torch = pytest.mark.skipif(not torch_cuda_ok(), reason="needs torch with CUDA")


def jax_gpu_ok() -> bool:
    """CuPy and JAX both see a CUDA device (the JAX adapter's GPU tests need both)."""
    try:
        import cupy
        import jax

        return bool(cupy.cuda.is_available()) and len(jax.devices("gpu")) > 0
    except Exception:  # noqa: BLE001 - any import or driver failure means: skip
        return False


#: The marks of a JAX GPU test module (``pytestmark = JAX_GPU``).
JAX_GPU = [pytest.mark.gpu, pytest.mark.skipif(not jax_gpu_ok(), reason="needs a CUDA GPU for both CuPy and JAX")]


def rounded(rng, shape, dtype: str, scale=1.0):
    """Random normal data already rounded to ``dtype`` (float64 copy for the reference, typed copy)."""
    a = (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])
    return a


def to_gpu(a):
    import cupy as cp

    if a.dtype == NP_DTYPES["bfloat16"]:
        return cp.asarray(a.view(np.uint16)).view(a.dtype)
    return cp.asarray(a)


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation in the block starts as 0xFF bytes (NaN in bf16/f16/f32).

    The fill is queued on the stream current in the allocating thread, the stream CuPy's pool
    hands the memory out for and the op then writes it on.  (A plain ``cudaMemset`` goes on the
    legacy default stream, which is not ordered with a non-blocking stream: the fill could land
    after the op had written the buffer, and a correct result read back as NaN.)
    """
    import cupy as cp

    pool = cp.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(pool.malloc)
