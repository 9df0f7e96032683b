"""The fused boundary backward (OPS.md section 12, "Fused boundary backward") on the GPU, under
kernel_choice(boundary_bwd=True) (off by default until these pass): ``mhc_layer_pre_bwd(layer_out=)``
and ``mhc_boundary_bwd`` against the unfused ops they replace (bitwise for n <= 4, where the post
op's backward runs the CUDA-core kernel whose sums the merged pass repeats; to float32 rounding of the
coefficient sums above, where it runs on tensor cores) and the float64 reference, bitwise repeatable;
``MHCStack(fuse_boundaries=True)``'s gradients bitwise the unfused stack's for n <= 4."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice

from .helpers import ACT_TOL, assert_close, poisoned_allocations, rounded, to_gpu, to_host, torch_cuda_ok

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _boundary_bwd_on():
    with kernel_choice(boundary_bwd=True):
        yield


def _bits(a):
    return np.ascontiguousarray(to_host(a)).view(np.uint8)


def _case(rng, T, n, C, dt, tg, convention):
    """A layer's backward inputs on the host (gradients in tg), with its pre piece's outputs."""
    K = n * n + 2 * n
    x = rounded(rng, (T, n, C), dt)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    alpha = np.array([0.8, 1.1, 0.9], np.float32)
    bias = (0.3 * rng.standard_normal(K)).astype(np.float32)
    _, H_pre, H_post, H_res, stats = R.mhc_layer_pre_fwd(x, phi, alpha, bias, convention=convention)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    a = dict(x=x, phi=phi, alpha=alpha, bias=bias, stats=f32(stats), H_pre=f32(H_pre), H_res=f32(H_res))
    y, g_li = rounded(rng, (T, C), dt), rounded(rng, (T, C), tg)
    g = rounded(rng, (T, n, C), tg)
    return a, f32(H_post), y, g, g_li


@pytest.mark.parametrize("dt,tg", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
                                   ("bfloat16", "float32")])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("T,C", [(1, 64), (3, 200), (127, 1000), (300, 512), (65, 24), (5, 28)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_boundary_bwd_matches_the_unfused_ops_and_the_reference(rng, dt, tg, n, T, C, convention):
    a, H_post, y, g, g_li = _case(rng, T, n, C, dt, tg, convention)
    gp = (0.1 * rng.standard_normal((T, n))).astype(np.float32)
    H_post_prev = (2 * rng.random((T, n))).astype(np.float32)
    d = {k: to_gpu(v) for k, v in a.items()}
    y_d, g_d, gli_d, gp_d, hpp_d = (to_gpu(v) for v in (y, g, g_li, gp, H_post_prev))
    with poisoned_allocations():
        got = m.mhc_boundary_bwd(gli_d, g_d, gp_d, None, **d, layer_out=y_d, H_post_prev=hpp_d,
                                 convention=convention)
        again = m.mhc_boundary_bwd(gli_d, g_d, gp_d, None, **d, layer_out=y_d, H_post_prev=hpp_d,
                                   convention=convention)
        pre = m.mhc_layer_pre_bwd(gli_d, g_d, gp_d, None, **d, layer_out=y_d, convention=convention)
        _, dHp, dHr = m.mhc_layer_post_bwd(g_d, y_d, d["x"], to_gpu(H_post), d["H_res"], convention=convention)
        want = m.mhc_layer_pre_bwd(gli_d, g_d, dHp + gp_d, dHr, **d, convention=convention)
        dy_want, _, _ = m.mhc_layer_post_bwd(got[0], y_d, d["x"], hpp_d, d["H_res"], convention=convention)
    names = ("dx", "dphi", "dalpha", "dbias", "dy_prev")
    for u, v, name in zip(got, again, names):
        assert np.array_equal(_bits(u), _bits(v)), f"{name} bitwise repeatable"
    for u, v, name in zip(got, pre, names):
        assert np.array_equal(_bits(u), _bits(v)), f"{name}: mhc_boundary_bwd's is mhc_layer_pre_bwd's"
    if n <= 4:  # the same per-token sums in the same order; dy_prev in the post op's order
        for u, v, name in zip(got, want, names):
            assert np.array_equal(_bits(u), _bits(v)), f"{name}: bitwise the unfused ops'"
        assert np.array_equal(_bits(got[4]), _bits(dy_want)), "dy_prev: bitwise the post op's dy"
    else:
        assert_close(got[0], want[0], ACT_TOL[dt], "dx vs the unfused ops")
        for u, v, name in zip(got[1:4], want[1:4], names[1:4]):
            assert_close(u, v, 1e-3, name, scale="max")
        assert np.array_equal(_bits(got[4]), _bits(m.stream_aggregate_fwd(got[0], hpp_d))), "dy_prev"
    ref = R.mhc_boundary_bwd(g_li, g, gp, None, **a, layer_out=y, H_post_prev=H_post_prev, convention=convention)
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], "dx vs reference")
    for u, v, name in zip(got[1:4], ref[1:4], names[1:4]):
        assert_close(u, v, 2e-3, f"{name} vs reference", scale="max")
    assert_close(got[4], R.stream_aggregate_fwd(to_host(got[0]), H_post_prev), ACT_TOL[dt], "dy_prev vs reference")


@pytest.mark.skipif(not torch_cuda_ok(), reason="needs torch with CUDA")
@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("n,C", [(4, 64), (2, 200), (4, 28)])
def test_stack_gradients_bitwise_the_unfused_stack(rng, n, C, recompute):
    import torch

    import mhc_cupy.torch as mt

    torch.manual_seed(int(rng.integers(1 << 30)))
    layers = [mt.MHC(C, n, torch.nn.Linear(C, C), alpha_init=1.0).cuda().to(torch.bfloat16) for _ in range(4)]
    x = torch.randn(300, n, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(300, n, C, device="cuda", dtype=torch.bfloat16)

    def grads(fused):
        stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)
        for p in [x, *stack.parameters()]:
            p.grad = None
        with kernel_choice(boundary_bwd=fused):
            stack(x).backward(g)
        return [x.grad.clone(), *(p.grad.clone() for p in stack.parameters())]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)
