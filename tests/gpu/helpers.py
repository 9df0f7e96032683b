"""GPU test helpers: host <-> device with bf16, NaN-poisoned allocations, tolerances."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np

NP_DTYPE = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}

#: Tolerances for activation outputs, relative to the output scale: one
#: rounding to the dtype (unit roundoff 2^-8, 2^-11, 2^-24) plus float32
#: accumulation; the reference runs in float64 on the same rounded inputs.
ACT_TOL = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5}
#: Coefficient gradients are float32 sums over C (and tokens): relative error
#: grows like sqrt(C) * 2^-24; 1e-4 of the scale is a safe bound up to C ~ 1e5.
COEF_TOL = 1e-4


def torch_cuda_ok() -> bool:
    """CuPy and PyTorch both see a CUDA device (the torch adapter's GPU tests need both)."""
    try:
        import cupy
        import torch

        return bool(cupy.cuda.is_available()) and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import or driver failure means: skip
        return False


def rounded(rng, shape, dtype: str, scale=1.0):
    """Random normal data already rounded to ``dtype`` (float64 copy for the reference, typed copy)."""
    a = (rng.standard_normal(shape) * scale).astype(NP_DTYPE[dtype])
    return a


def to_gpu(a):
    import cupy as cp

    if a.dtype == NP_DTYPE["bfloat16"]:
        return cp.asarray(a.view(np.uint16)).view(a.dtype)
    return cp.asarray(a)


def to_host(a):
    import cupy as cp

    if a.dtype == NP_DTYPE["bfloat16"]:
        return cp.asnumpy(a.view(cp.uint16)).view(NP_DTYPE["bfloat16"])
    return cp.asnumpy(a)


def f64(a):
    return np.asarray(a, dtype=np.float64)


def assert_close(got, ref, tol, what="", scale=None):
    """All finite (poisoned outputs are NaN) and |got - ref| <= tol * (|ref| + scale).

    ``scale`` defaults to rms(ref); pass the size of the terms when the result
    is a cancellation of larger terms (e.g. RMSNorm dx)."""
    got = f64(to_host(got) if not isinstance(got, np.ndarray) else got)
    ref = f64(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite (unwritten?) elements"
    if ref.size == 0:
        return
    if scale is None:
        scale = float(np.sqrt(np.mean(ref**2)))
    scale = max(scale, 1e-30)
    err = np.abs(got - ref)
    bound = tol * (np.abs(ref) + scale)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (
        f"{what}: max error {err.max():.3e} (scale {scale:.3e}, tol {tol}); worst at flat index {worst}: "
        f"got {got.flat[worst]!r}, ref {ref.flat[worst]!r}"
    )


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation in the block starts as 0xFF bytes (NaN in bf16/f16/f32)."""
    import cupy as cp

    pool = cp.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        if size:
            cp.cuda.runtime.memset(mem.ptr, 0xFF, size)
        return mem

    cp.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(pool.malloc)
