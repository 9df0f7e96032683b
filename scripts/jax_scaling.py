"""Whether ``mhc_cupy.jax.mhc_stack`` is bound by the host (its buffer_callbacks) or by the GPU: the
fwd+bwd time of 16 mHC layers (C 2048, n 4, bf16, sublayer tanh; ``lax.scan`` and ``unroll=True``) and of
``jax.jit`` of the same maths, at 8192 and 1024 tokens; mhc_stack with and without the callbacks' launch
replay (``mhc_cupy._jax_kernels.REPLAY``, read when a callback runs: one compiled program serves both).
GPU-bound times shrink with the tokens; host-bound ones stay.  Wall clock of the jitted call +
``block_until_ready`` (median of 10 after 3); "callbacks": the host time a step spends inside mhc_cupy's
buffer_callbacks (their Python and the launches they queue; mean of the 10).

    python scripts/jax_scaling.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import mhc_cupy.jax as mj
from mhc_cupy import _jax_kernels
from mhc_cupy.bench.baselines import jnp_mhc_layer

# the host time spent inside mhc_cupy's buffer_callbacks (our Python and the launches it queues), summed over
# every callback a step runs: set before anything is traced (the callbacks are made when a plan is)
_SPENT = [0.0]
_make_callback = _jax_kernels._make_callback


def _timed_callback(*args, **kwargs):
    callback = _make_callback(*args, **kwargs)

    def timed(*a):
        t = time.perf_counter()
        try:
            return callback(*a)
        finally:
            _SPENT[0] += time.perf_counter() - t

    return timed


_jax_kernels._make_callback = _timed_callback

L, C, n = 16, 2048, 4
params = mj.mhc_stack_init(jax.random.PRNGKey(0), L, dim=C, n_streams=n)
impls = {"mhc_stack": lambda p, x: mj.mhc_stack(p, x, jnp.tanh),
         "mhc_stack unroll": lambda p, x: mj.mhc_stack(p, x, jnp.tanh, unroll=True),
         "jax.jit stack": lambda p, x: jax.lax.scan(lambda h, pl: (jnp_mhc_layer(pl, h, jnp.tanh), None), x, p)[0]}


def median_ms(f, args) -> tuple:
    """(median ms a step, ms a step inside mhc_cupy's callbacks, mean over the timed steps)."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    ts, _SPENT[0] = [], 0.0
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3, _SPENT[0] / len(ts) * 1e3


for T in (8192, 1024):
    kx, kg = jax.random.split(jax.random.PRNGKey(T))
    x = jax.random.normal(kx, (T, n, C), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (T, n, C), jnp.float32).astype(jnp.bfloat16)
    row = []
    for name, fn in impls.items():
        step = jax.jit(lambda p, x, g, fn=fn: jax.vjp(fn, p, x)[1](g))
        for replay in ((False, True) if name.startswith("mhc_stack") else (False,)):
            _jax_kernels.REPLAY = replay
            ms, host = median_ms(step, (params, x, g))
            row.append(f"{name}{' replay' if replay else ''} {ms:.2f} ms" + (f" (callbacks {host:.2f} ms)" if host else ""))
    _jax_kernels.REPLAY = False
    print(f"T {T}, fwd+bwd: " + "; ".join(row), flush=True)
