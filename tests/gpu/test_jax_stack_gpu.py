"""GPU tests of ``mhc_cupy.jax.mhc_stack`` (issue 44 items 1 and 3, JAX side): the CUDA kernels
through XLA's buffer_callback.

* stream recompute (L_r = 2, 3, "auto") gives the value and gradients (x, phi, alpha, bias, the
  per-layer f_params) of the run without recompute bitwise, and both those of a loop of
  ``mhc_layer`` (all under ``jax.jit``), in bfloat16 and float32, both conventions;
* float32: close to the float64 plain-jnp chain of tests/test_jax_stack.py, within the layer's
  GPU bound (harness.TOL["layer_gpu"], float32) per layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import TOL, assert_close

from .helpers import JAX_GPU


pytestmark = JAX_GPU


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lead,n,C,L", [((4, 257), 4, 1024, 5), ((129,), 8, 96, 4), ((63,), 16, 40, 3)])
def test_gpu_stack_recompute_is_bitwise_no_recompute(lead, n, C, L, dtype, convention):
    import jax

    import mhc_cupy.jax as mj
    import test_jax_stack as S  # the CPU tests' helpers (tests/ is on sys.path: conftest.py)

    rng = np.random.default_rng(n * 1000 + C + L)
    params, x, g, W = S.make(rng, lead, n, C, L, dtype, convention)
    args = jax.device_put((params, x, W), jax.devices("gpu")[0])
    want = S.vjp_all(lambda p, x, W: S.loop(p, x, S.sub, W, convention=convention), args, g)
    assert want[0].devices() == {jax.devices("gpu")[0]}
    for recompute in (None, 2, 3, "auto"):
        got = S.vjp_all(lambda p, x, W: mj.mhc_stack(p, x, S.sub, W, recompute=recompute, convention=convention),
                        args, g)
        S.assert_same(got, want, f"recompute={recompute!r}")
        assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_gpu_stack_matches_a_float64_chain(convention):
    import jax
    import jax.numpy as jnp

    import mhc_cupy.jax as mj
    import test_jax_stack as S

    lead, n, C, L = (127,), 4, 96, 4
    rng = np.random.default_rng(7)
    params, x, g, W = S.make(rng, lead, n, C, L, "float32", convention)
    with jax.default_matmul_precision("highest"):  # no TF32 in the sublayer's matmul
        got = S.vjp_all(lambda p, x, W: mj.mhc_stack(p, x, S.sub, W, recompute="auto", convention=convention),
                        jax.device_put((params, x, W), jax.devices("gpu")[0]), g)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        def chain(p, x, W):
            for l in range(L):
                x = S._ref_layer(jax.tree.map(lambda a: a[l], p), x, W[l], convention)
            return x

        def as64(t):
            return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), t)

        out, vjp = jax.vjp(chain, *as64((params, x, W)))
        want = [np.asarray(a) for a in (out, *jax.tree_util.tree_leaves(vjp(as64(g))))]
    tol = TOL["layer_gpu"]["float32"][1] * L
    for name, a, w in zip(("out", "dalpha", "dbias", "dphi", "dx", "dW"), got, want):
        assert_close(a, w, tol, name)
