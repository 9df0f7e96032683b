"""Bad input on the GPU fast path (issue 15): parameter validation that does
not depend on what ran before, the autograd warning on a fast-path hit, the
num_iters bound, zero tokens with a huge leading dim, and double backward
through the torch adapter on CUDA tensors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _dispatch

from .helpers import torch_cuda_ok

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch_cuda_ok(), reason="needs torch with CUDA")]


def _cuda(shape, grad=False, dtype=None):
    import torch

    return torch.randn(shape, device="cuda", dtype=dtype or torch.float32).requires_grad_(grad)


def test_fast_path_params_type_strict():
    """num_iters=True / 1.0 and eps=True raise on the GPU even after a cached call with 1 / 1.0."""
    L, x = _cuda((5, 4, 4)), _cuda((5, 64))
    for _ in range(2):  # the second call takes the fast path
        m.sinkhorn_knopp_fwd(L, num_iters=1)
        m.sinkhorn_knopp_bwd(L, L, num_iters=1)
        m.rmsnorm_fwd(x, eps=1.0)
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match="num_iters must be an int"):
            m.sinkhorn_knopp_fwd(L, num_iters=bad)
        with pytest.raises(TypeError, match="num_iters must be an int"):
            m.sinkhorn_knopp_bwd(L, L, num_iters=bad)
    with pytest.raises(TypeError, match="eps must be a float"):
        m.rmsnorm_fwd(x, eps=True)
    with pytest.raises(ValueError, match="num_iters must be in 0..10000"):
        m.sinkhorn_knopp_fwd(L, num_iters=2**31)


def test_fast_path_warns_autograd_not_recorded(monkeypatch):
    """A fast-path hit with tensors that require grad warns once (the first call ran under no_grad)."""
    import torch

    monkeypatch.setattr(_dispatch, "_autograd_warned", set())
    x, M = _cuda((5, 4, 64), grad=True), _cuda((5, 4, 4))
    with torch.no_grad():
        m.stream_mix_fwd(x, M)  # plans and records: the next call is a fast-path hit
    with pytest.warns(m.AutogradNotRecordedWarning, match="mhc_cupy.torch.stream_mix"):
        out = m.stream_mix_fwd(x, M)
    assert out.grad_fn is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.stream_mix_fwd(x, M)  # once per op
        with torch.no_grad():
            m.stream_mix_fwd(x, M)


def test_zero_tokens_huge_leading_dim_on_gpu():
    import torch

    lead, n, C = (2**40, 0), 4, 8
    z = lambda *s: torch.zeros(lead + s, device="cuda")  # noqa: E731
    x, y, h, M, K = z(n, C), z(C), z(n), z(n, n), n * n + 2 * n
    phi, alpha, bias = torch.zeros(n * C, K, device="cuda"), torch.ones(3, device="cuda"), torch.zeros(K, device="cuda")
    assert m.sinkhorn_knopp_fwd(M).shape == M.shape
    assert m.mhc_pre_op_fwd(x, h, h, M)[0].shape == y.shape
    assert m.mhc_coeffs_fwd(x, phi, alpha, bias)[2].shape == M.shape
    dx, dphi, dalpha, dbias = m.mhc_coeffs_bwd(h, h, M, x, phi, alpha, bias)
    assert dx.shape == x.shape and not dphi.any() and not dalpha.any() and not dbias.any()
    torch.cuda.synchronize()


def test_double_backward_raises_on_cuda():
    import torch

    import mhc_cupy.torch as mt

    x, M = _cuda((3, 4, 64), grad=True), _cuda((3, 4, 4))
    (g,) = torch.autograd.grad((mt.stream_mix(x, M) ** 2).sum() + (x**3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
    np.testing.assert_allclose(g.detach().cpu().numpy(),
                               (2 * torch.einsum("tij,tic->tjc", M, mt.stream_mix(x, M)) + 3 * x**2)
                               .detach().cpu().numpy(), rtol=1e-4, atol=1e-4)
