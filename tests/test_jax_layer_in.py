"""mhc_cupy.jax.mhc_layer_in (OPS.md section 13) on the CPU path: the functional ops' results, under
jax.jit too, on fresh random data; bad arguments raise naming them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mhc_cupy as m

jax = pytest.importorskip("jax")
jnp = jax.numpy
mj = pytest.importorskip("mhc_cupy.jax")

# the CPU path, GPU present or not (on a GPU machine JAX's default device is the GPU, where these ops run
# only under kernel_choice(layer_in=True): tests/gpu/test_layer_in_gpu.py checks that path)
pytestmark = pytest.mark.usefixtures("jax_on_cpu")


def _case(T, n, C, seed):
    rng = np.random.default_rng(seed)
    p = mj.mhc_init(jax.random.PRNGKey(seed), C, n)
    p = {k: jnp.asarray(np.asarray(v) + rng.normal(0, 0.05, v.shape).astype(np.float32)) for k, v in p.items()}
    x = rng.normal(0, 1, (T, n, C)).astype(ml_dtypes.bfloat16)
    w = rng.uniform(0.5, 1.5, C).astype(np.float32)
    return p, x, w


@pytest.mark.parametrize("T,n,C", [(1, 1, 8), (3, 4, 72), (127, 3, 13)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_matches_the_functional_ops(T, n, C, convention):
    p, x, w = _case(T, n, C, T * 100 + n)
    args = (np.asarray(p["phi"]), np.asarray(p["alpha"]), np.asarray(p["bias"]))
    want_norm = m.mhc_layer_pre_norm_fwd(x, *args, w, convention=convention)
    want_fp8 = m.mhc_layer_pre_fp8_fwd(x, *args, w, convention=convention)
    want_fp8_plain = m.mhc_layer_pre_fp8_fwd(x, *args, convention=convention)
    f = jax.jit(lambda x, w: (mj.mhc_layer_in(p, x, w, convention=convention),
                              mj.mhc_layer_in(p, x, w, fp8=True, convention=convention),
                              mj.mhc_layer_in(p, x, fp8=True, convention=convention)))
    for got, want in zip(f(jnp.asarray(x), jnp.asarray(w)), (want_norm, want_fp8, want_fp8_plain)):
        assert len(got) == len(want) == 6
        for g, e in zip(got, want):
            assert g.shape == e.shape and np.dtype(g.dtype) == np.dtype(e.dtype)
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(e).view(np.uint8))
    assert np.isfinite(np.asarray(want_norm[0], np.float32)).all() and np.ptp(np.asarray(want_norm[0], np.float32)) > 0


def test_bad_arguments_are_named():
    p, x, w = _case(3, 4, 16, 0)
    with pytest.raises(ValueError, match="norm_weight is None with fp8=False"):
        mj.mhc_layer_in(p, x)
    with pytest.raises(TypeError, match="params must be the dict"):
        mj.mhc_layer_in([p["phi"]], x, w)
    with pytest.raises(ValueError, match="x has shape"):
        mj.mhc_layer_in(p, x[:, 0], w)
    with pytest.raises((TypeError, ValueError), match="norm_weight"):
        mj.mhc_layer_in(p, x, w[:5])
    with pytest.raises((TypeError, ValueError), match="norm_eps"):
        mj.mhc_layer_in(p, x, w, norm_eps=-1.0)


@pytest.mark.parametrize("fp8", ["yes", None, 0, 1, np.bool_(True)])
def test_fp8_must_be_a_bool(fp8):
    """A truthy str or an int used to pick a variant silently, None the normalised one."""
    p, x, w = _case(3, 4, 16, 0)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        mj.mhc_layer_in(p, x, w, fp8=fp8)
    with pytest.raises(TypeError, match="fp8 must be a bool"):  # not jax's TracerBoolConversionError
        jax.jit(lambda x, f: mj.mhc_layer_in(p, x, w, fp8=f))(x, True)


def test_norm_eps_as_a_jax_value_is_named():
    """A JAX scalar or a traced norm_eps used to fail with 'unhashable type'; it is static: a float."""
    p, x, w = _case(3, 4, 16, 0)
    with pytest.raises(TypeError, match="norm_eps must be a float"):
        mj.mhc_layer_in(p, x, w, norm_eps=jnp.float32(1e-6))
    with pytest.raises(TypeError, match="norm_eps must be a float"):
        jax.jit(lambda e: mj.mhc_layer_in(p, x, w, norm_eps=e))(1e-6)
    want = mj.mhc_layer_in(p, x, w, norm_eps=1e-3)
    got = mj.mhc_layer_in(p, x, w, norm_eps=np.float32(1e-3))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_gradient_says_it_is_forward_only():
    """jax.grad used to fail with JAX's 'Buffer callbacks do not support JVP' (naming no mhc_cupy API)."""
    p, x, w = _case(3, 4, 16, 0)
    xf = jnp.asarray(x, jnp.float32)
    with pytest.raises(ValueError, match="mhc_layer_in is forward only"):
        jax.grad(lambda x: mj.mhc_layer_in(p, x, w)[0].sum())(xf)
    with pytest.raises(ValueError, match="mhc_layer_in is forward only"):
        jax.jvp(lambda w: mj.mhc_layer_in(p, xf, w, fp8=True)[1], (jnp.asarray(w),), (jnp.asarray(w),))
    # inputs without tangents still work under grad, and vmap / jit go through the wrapper
    g = jax.grad(lambda s: s * mj.mhc_layer_in(p, jax.lax.stop_gradient(xf), w)[1].sum())(2.0)
    assert g == mj.mhc_layer_in(p, xf, w)[1].sum()
    xb = jnp.stack([xf, 2 * xf])
    got = jax.jit(jax.vmap(lambda x: mj.mhc_layer_in(p, x, w, fp8=True)))(xb)
    want = mj.mhc_layer_in(p, xb, w, fp8=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
