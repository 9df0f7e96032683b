"""The coefficient path through mhc_cupy.torch and mhc_cupy.jax on the GPU, against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from mhc_cupy import reference as R

pytestmark = pytest.mark.gpu


def _inputs(rng, T=37, n=4, C=1000):
    K = n * n + 2 * n
    x = rng.standard_normal((T, n, C)).astype(np.float32)
    phi = (rng.standard_normal((n * C, K)) * 0.05).astype(np.float32)
    alpha = np.array([0.3, -0.7, 1.2], np.float32)
    bias = rng.standard_normal(K).astype(np.float32)
    return x, phi, alpha, bias


def _close(got, ref, tol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = np.sqrt(np.mean(ref**2)) + 1e-30
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= tol * scale, np.abs(got - ref).max() / scale


def test_torch_cuda(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import mhc_cupy.torch as mt

    x, phi, alpha, bias = _inputs(rng)
    xt = torch.from_numpy(x).cuda().requires_grad_()
    pt, at, bt = (torch.from_numpy(a).cuda().requires_grad_() for a in (phi, alpha, bias))
    outs = mt.mhc_coeffs(xt, pt, at, bt)
    for got, ref in zip(outs, R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        _close(got.detach().cpu().numpy(), ref, 1e-4)
    g = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(sum((o * gi).sum() for o, gi in zip(outs, g)), (xt, pt, at, bt))
    ref = R.mhc_coeffs_bwd(*(gi.cpu().numpy() for gi in g), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        _close(got.cpu().numpy(), r, 1e-4)


def test_jax_gpu(rng):
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("jax has no GPU")
    import mhc_cupy.jax as mj

    x, phi, alpha, bias = _inputs(rng)

    def loss(x, phi, alpha, bias):
        a, b, c = mj.mhc_coeffs(x, phi, alpha, bias)
        return (a**2).sum() + b.sum() + (1.5 * c).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jax.device_put(a) for a in (x, phi, alpha, bias)))
    h_pre = R.mhc_coeffs_fwd(x, phi, alpha, bias)[0]
    ref = R.mhc_coeffs_bwd(2 * h_pre, np.ones_like(h_pre), np.full((x.shape[0], 4, 4), 1.5), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        _close(np.asarray(got), r, 1e-4)
