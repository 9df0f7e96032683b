"""The coefficient path (OPS.md section 8) through mhc_cupy.torch and mhc_cupy.jax (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from mhc_cupy import reference as R


def _inputs(rng, lead=(2, 3), n=3, C=7):
    K = n * n + 2 * n
    x = rng.standard_normal(lead + (n, C)).astype(np.float32)
    phi = (rng.standard_normal((n * C, K)) * 0.2).astype(np.float32)
    alpha = np.array([0.3, -0.7, 1.2], np.float32)
    bias = rng.standard_normal(K).astype(np.float32)
    return x, phi, alpha, bias


def test_torch_forward_backward_and_compile(rng):
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt

    x, phi, alpha, bias = (torch.from_numpy(a).requires_grad_() for a in _inputs(rng))
    outs = mt.mhc_coeffs(x, phi, alpha, bias)
    for got, ref in zip(outs, R.mhc_coeffs_fwd(*(t.detach().numpy() for t in (x, phi, alpha, bias)))):
        np.testing.assert_allclose(got.detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    g_pre, g_res = torch.randn_like(outs[0]), torch.randn_like(outs[2])
    loss = (outs[0] * g_pre).sum() + (outs[2] * g_res).sum()  # h_post_raw unused: a None gradient
    grads = torch.autograd.grad(loss, (x, phi, alpha, bias))
    ref = R.mhc_coeffs_bwd(g_pre.numpy(), None, g_res.numpy(), *(t.detach().numpy() for t in (x, phi, alpha, bias)))
    for got, r in zip(grads, ref):
        np.testing.assert_allclose(got.numpy(), r, rtol=1e-4, atol=1e-4)
    compiled = torch.compile(lambda *a: mt.mhc_coeffs(*a)[2].sum(), backend="aot_eager", fullgraph=True)
    grads_c = torch.autograd.grad(compiled(x, phi, alpha, bias), (x, phi))
    grads_e = torch.autograd.grad(mt.mhc_coeffs(x, phi, alpha, bias)[2].sum(), (x, phi))
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("jax_on_cpu")
def test_jax_jit_grad_vmap(rng):
    jax = pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    x, phi, alpha, bias = _inputs(rng, lead=(5,), n=4, C=16)
    for got, ref in zip(mj.mhc_coeffs(x, phi, alpha, bias), R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)

    def loss(x, phi, alpha, bias):
        a, _, c = mj.mhc_coeffs(x, phi, alpha, bias)
        return (a**2).sum() + (1.5 * c).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, phi, alpha, bias)
    h_pre = R.mhc_coeffs_fwd(x, phi, alpha, bias)[0]
    ref = R.mhc_coeffs_bwd(2 * h_pre, None, np.full((5, 4, 4), 1.5), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(got), r, rtol=1e-4, atol=1e-4)
    xb = np.stack([x, -2 * x])
    batched = jax.vmap(lambda xx: mj.mhc_coeffs(xx, phi, alpha, bias))(xb)
    np.testing.assert_allclose(np.asarray(batched[2][1]), R.mhc_coeffs_fwd(-2 * x, phi, alpha, bias)[2],
                               rtol=1e-5, atol=1e-5)
    per_example = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None, None, None))(xb, phi, alpha, bias)
    np.testing.assert_allclose(np.asarray(per_example[1]), np.asarray(jax.grad(loss, argnums=1)(-2 * x, phi, alpha, bias)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("jax_on_cpu")
def test_jax_mhc_layer_matches_reference(rng):
    """mhc_cupy.jax.mhc_layer = H_res x + H_post^T f(H_pre x) with coefficients from the coefficient path."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import mhc_cupy.jax as mj

    n, C = 4, 16
    params = mj.mhc_init(jax.random.PRNGKey(0), C, n)
    params["alpha"] = jnp.asarray([0.5, 0.4, 0.3], jnp.float32)  # away from init, so every path matters
    x = rng.standard_normal((3, n, C)).astype(np.float32)
    W = (rng.standard_normal((C, C)) * 0.3).astype(np.float32)

    def f(h):
        return jnp.tanh(h @ W)

    out = mj.mhc_layer(params, x, f)
    p = {k: np.asarray(v) for k, v in params.items()}
    h = R.mhc_coeffs_fwd(x, p["phi"], p["alpha"], p["bias"])
    layer_in, _, H_post, H_res = R.mhc_pre_op_fwd(x, *h)
    ref = R.mhc_post_op_fwd(np.tanh(layer_in @ W), x, H_post, H_res)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    # differentiable end to end, under jit
    g = jax.jit(jax.grad(lambda p_, x_: mj.mhc_layer(p_, x_, f).sum()))(params, x)
    assert all(np.isfinite(np.asarray(v)).all() for v in g.values())
    # at init the layer is close to a plain residual x + f(mean of streams) for equal streams
    init = mj.mhc_init(jax.random.PRNGKey(1), C, n)
    xe = np.repeat(rng.standard_normal((3, 1, C)).astype(np.float32), n, axis=1)
    np.testing.assert_allclose(np.asarray(mj.mhc_layer(init, xe, f)), xe + np.tanh(xe @ W), atol=0.05)
