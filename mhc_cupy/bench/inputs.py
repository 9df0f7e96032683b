"""Benchmark inputs (random, in the op's dtypes) and zero-copy sharing with PyTorch and JAX."""

from __future__ import annotations

import math

import numpy as np

from .specs import SPECS, shape_of

# ------------------------------------------------------------------------------- inputs
def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


_bf16_kernel = None


def _cupy_f32_to_act(a, dtype: str):
    """float32 CuPy array -> activation dtype (bf16 by round-to-nearest-even on the bits)."""
    import cupy as cp

    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(cp.float16)
    global _bf16_kernel
    if _bf16_kernel is None:
        _bf16_kernel = cp.ElementwiseKernel("uint32 u", "uint16 r", "r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16",
                                            "mhc_bench_f32_to_bf16")
    return _bf16_kernel(a.view(cp.uint32)).view(_np_dtype("bfloat16"))


def make_inputs(op: str, T: int, C: int, n: int, dtype: str, seed: int = 0, xp: str = "numpy") -> dict:
    """Random inputs of ``op`` and upstream gradients of its outputs.

    Returns ``{"in": [...], "grads": [...]}`` in the order of ``SPECS``; standard normal
    values (phi scaled by 1/sqrt(n*C)), activations in ``dtype``, the rest float32.
    ``xp``: "numpy" (host) or "cupy" (current device).  ``C`` is ignored by ops that
    do not use it.
    """
    C = C or 1
    s = SPECS[op]
    if xp == "cupy":
        import cupy as cp

        rng = cp.random.default_rng(seed)

        def draw(shape):
            return rng.standard_normal(shape, dtype=cp.float32)

        def act(a):
            return _cupy_f32_to_act(a, dtype)
    else:
        rng = np.random.default_rng(seed)

        def draw(shape):
            return rng.standard_normal(shape, dtype=np.float32)

        def act(a):
            return a.astype(_np_dtype(dtype))

    def arrays(specs):
        out = []
        for name, kind, code in specs:
            a = draw(shape_of(code, T, C, n))
            if name == "phi":
                a *= np.float32(1.0 / math.sqrt(n * C))
            out.append(act(a) if kind == "act" else a)
        return out

    return {"in": arrays(s["inputs"]), "grads": arrays(s["outputs"])}


def _cupy_to_torch(a):
    import cupy as cp
    import torch

    if a.dtype == _np_dtype("bfloat16"):
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _cupy_to_jax(a, device=None):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    bf16 = a.dtype == _np_dtype("bfloat16")
    src = a.view(cp.int16) if bf16 else a
    try:
        j = jax.dlpack.from_dlpack(src)
    except Exception:  # no zero-copy import: go through the host
        j = jax.device_put(cp.asnumpy(src), device)
    return jax.lax.bitcast_convert_type(j, jnp.bfloat16) if bf16 else j


def _to_cupy_f32(a):
    """A CuPy float32 copy of a CuPy / torch / jax array (for comparisons)."""
    import cupy as cp

    mod = type(a).__module__
    if mod.startswith("torch"):
        import torch

        t = a.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return _bits_to_f32(cp.from_dlpack(t.view(torch.int16)).view(cp.uint16))
        return cp.from_dlpack(t).astype(cp.float32)
    if not isinstance(a, cp.ndarray):  # jax
        import jax
        import jax.numpy as jnp

        if a.dtype == jnp.bfloat16:
            return _bits_to_f32(cp.from_dlpack(jax.lax.bitcast_convert_type(a, jnp.uint16)))
        return cp.from_dlpack(a).astype(cp.float32)
    if a.dtype == _np_dtype("bfloat16"):
        return _bits_to_f32(a.view(cp.uint16))
    return a.astype(cp.float32)


def _bits_to_f32(u16):
    import cupy as cp

    return (u16.astype(cp.uint32) << 16).view(cp.float32)


def _max_rel_err(ours, theirs) -> float:
    """max over outputs of ||ours - theirs|| / ||theirs|| (float32, on the GPU)."""
    import cupy as cp

    worst = 0.0
    for a, b in zip(_as_tuple(ours), _as_tuple(theirs), strict=True):
        a, b = _to_cupy_f32(a), _to_cupy_f32(b)
        den = float(cp.linalg.norm(b.ravel()))
        num = float(cp.linalg.norm((a - b).ravel()))
        worst = max(worst, num / den if den > 0 else num)
    return worst


def _as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)

