"""The fused layer boundary (mhc_boundary_fwd, OPS.md section 12) on the GPU: against the float64
reference, the streams bitwise the post op's, the coefficients to float32 rounding of the separate
ops', bitwise repeatable; the fused kernel and the fallback both taken."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops.boundary import boundary_layout

from .helpers import ACT_TOL, assert_close, f64, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["boundary", "small"])
def _boundary_kernel_on(request):
    """The fused kernels are off by default until checked on a GPU: these tests check them, the
    tensor-core boundary kernel (boundary) and, for at most 64 tokens, the GEMV with the residual
    update inside and the pre piece's tail kernel (small)."""
    with kernel_choice(**{request.param: True}):
        yield


def _case(rng, T, n, C, dt):
    K = n * n + 2 * n
    y = rounded(rng, (T, C), dt)
    x = rounded(rng, (T, n, C), dt)
    H_post = (2 * rng.random((T, n))).astype(np.float32)
    H_res = rng.random((T, n, n)).astype(np.float32)
    H_res /= H_res.sum(-1, keepdims=True)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    alpha = np.array([0.8, 1.1, 0.9], np.float32)
    bias = (0.3 * rng.standard_normal(K)).astype(np.float32)
    return y, x, H_post, H_res, phi, alpha, bias


def _bits(a):
    a = np.ascontiguousarray(to_host(a))
    return a.view(np.uint8)


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("T,C", [(1, 64), (3, 200), (127, 1000), (300, 512), (65, 24), (5, 28)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_boundary_matches_reference_and_separate_ops(rng, dt, n, T, C, convention):
    args = _case(rng, T, n, C, dt)
    g = [to_gpu(a) for a in args]
    with poisoned_allocations():
        got = m.mhc_boundary_fwd(*g, convention=convention)
        again = m.mhc_boundary_fwd(*g, convention=convention)
        out = m.mhc_post_op_fwd(*g[:4], convention=convention)
        sep = m.mhc_layer_pre_fwd(out, *g[4:], convention=convention)
    for a, b in zip(got, again):
        assert np.array_equal(_bits(a), _bits(b)), "bitwise repeatable"
    assert np.array_equal(_bits(got[0]), _bits(out)), "the streams are the post op's, bit for bit"
    ref = R.mhc_boundary_fwd(*args, convention=convention)
    assert_close(got[0], ref[0], ACT_TOL[dt], "out")
    # the next layer's pieces from the same (rounded) streams: as the separate ops, to float32 sums
    assert_close(got[1], sep[0], ACT_TOL[dt], "layer_in")
    for a, b, name in zip(got[2:5], sep[1:4], ("H_pre", "H_post", "H_res")):
        assert_close(a, b, 2e-4, name)
    assert_close(got[5], sep[4], 1e-4, "stats", scale="max")
    ref_pre = R.mhc_layer_pre_fwd(to_host(out), *args[4:], convention=convention)
    for a, b, name in zip(got[2:5], ref_pre[1:4], ("H_pre", "H_post", "H_res")):
        assert_close(a, b, 1e-3, name)
    assert_close(got[1], ref_pre[0], 2 * ACT_TOL[dt], "layer_in vs reference")


def test_boundary_takes_the_fused_kernel_where_it_applies():
    """The layout rule the cases above rely on: n <= 6 and C % 8 == 0 fuse, others fall back."""
    assert boundary_layout(127, 4, 1000) is not None and boundary_layout(5, 4, 28) is None
    assert boundary_layout(3, 6, 200) is not None and boundary_layout(3, 8, 200) is None


def test_boundary_offset_views_fall_back_with_the_same_values(rng):
    """A view 2 elements into its buffer (not 16-byte aligned) takes the separate kernels: same out bits."""
    import cupy as cp

    T, n, C, dt = 33, 4, 256, "bfloat16"
    args = _case(rng, T, n, C, dt)
    g = [to_gpu(a) for a in args]
    buf = cp.empty(T * n * C + 2, dtype=g[1].dtype)
    xv = buf[2:].reshape(T, n, C)
    xv[...] = g[1]
    with poisoned_allocations():
        a = m.mhc_boundary_fwd(g[0], xv, *g[2:])
        b = m.mhc_boundary_fwd(*g)
    assert np.array_equal(_bits(a[0]), _bits(b[0]))
    for u, v, name in zip(a[1:], b[1:], ("layer_in", "H_pre", "H_post", "H_res", "stats")):
        assert_close(u, v, 2e-3 if name == "layer_in" else 2e-4, name, scale="max")


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])  # (the two sum orders of the kernel)
def test_boundary_huge_values_keep_the_scaled_sum_of_squares(rng, dt):
    """Streams past float32's square range: the saved sum of squares is minus the scaled sum (as
    mhc_layer_pre_fwd keeps it; the kernel sums it again from out only then), and the coefficients stay
    finite."""
    T, n, C = 67, 4, 512
    y, x, H_post, H_res, phi, alpha, bias = _case(rng, T, n, C, dt)
    x = (f64(x) * 1e20).astype(x.dtype)
    x[1::2] /= 1e20  # every other token's rows stay in range (their sums are not scaled)
    g = [to_gpu(a) for a in (y, x, H_post, H_res, phi, alpha, bias)]
    with poisoned_allocations():
        got = m.mhc_boundary_fwd(*g)
        sep = m.mhc_layer_pre_fwd(m.mhc_post_op_fwd(*g[:4]), *g[4:])
    q, q_sep = f64(to_host(got[5]))[..., -1], f64(to_host(sep[4]))[..., -1]
    assert np.isfinite(q).all() and (q[0::2] < 0).all() and (q[1::2] > 0).all(), q
    np.testing.assert_allclose(q, q_sep, rtol=1e-5)
    ref = R.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias)
    for a, b, name in zip(got[2:5], ref[2:5], ("H_pre", "H_post", "H_res")):
        assert_close(a, b, 1e-3, name)
