"""Every GPU op, forward and backward, against the float64 NumPy reference.

Inputs are random normal data rounded to the activation dtype; the reference
runs in float64 on exactly those rounded values, so the only error left is the
kernel's float32 arithmetic and its one rounding of each output.  Every
CuPy allocation is pre-filled with NaN, so an unwritten output element fails.
Coefficients are per token and M / H_res are non-symmetric, so a transposed or
shared coefficient fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from harness import TOL

from .helpers import ACT_TOL, COEF_TOL, assert_close, f64, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["bfloat16", "float16", "float32"]
NS = [1, 2, 3, 4, 8, 16]
# (tokens, C): C = 1 and 7 take the scalar path, 64 / 1000 / 4096 the vectorised one;
# 4096 needs several accesses per thread; tokens 1, 3, 127, 1000.
SIZES = [(1, 1), (3, 7), (127, 64), (1000, 1000), (3, 4096)]
SINKHORN_TOL = TOL["sinkhorn"].value  # float32 through 20 normalisation steps, relative to the scale


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_allocations():
        yield


def _coef(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _lead(T):
    return (T,)


# ------------------------------------------------------------------ mix / post
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_stream_mix(rng, dt, n, T, C):
    x = rounded(rng, (T, n, C), dt)
    M = _coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), dt)
    out = m.stream_mix_fwd(to_gpu(x), to_gpu(M))
    assert_close(out, R.stream_mix_fwd(x, M), ACT_TOL[dt], "out")
    dx, dM = m.stream_mix_bwd(to_gpu(g), to_gpu(x), to_gpu(M))
    rdx, rdM = R.stream_mix_bwd(g, x, M)
    assert_close(dx, rdx, ACT_TOL[dt], "dx")
    assert_close(dM, rdM, COEF_TOL, "dM")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_post_op(rng, dt, n, T, C):
    y = rounded(rng, (T, C), dt)
    x = rounded(rng, (T, n, C), dt)
    Hp = _coef(rng, (T, n))
    Hr = _coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), dt)
    out = m.mhc_post_op_fwd(to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr))
    assert_close(out, R.mhc_post_op_fwd(y, x, Hp, Hr), ACT_TOL[dt], "out")
    got = m.mhc_post_op_bwd(to_gpu(g), to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr))
    ref = R.mhc_post_op_bwd(g, y, x, Hp, Hr)
    for name, a, b, tol in zip(("dy", "dx", "dH_post", "dH_res"), got, ref,
                               (ACT_TOL[dt], ACT_TOL[dt], COEF_TOL, COEF_TOL)):
        assert_close(a, b, tol, name)


@pytest.mark.parametrize("n", [17, 32])
@pytest.mark.parametrize("T,C", [(3, 7), (127, 64), (3, 4096)])
def test_mix_and_post_large_n(rng, n, T, C):
    """Large n for stream mix and the post op: n up to the documented maximum of 32."""
    dt = "bfloat16"
    x, y = rounded(rng, (T, n, C), dt), rounded(rng, (T, C), dt)
    M, Hp = _coef(rng, (T, n, n)), _coef(rng, (T, n))
    g = rounded(rng, (T, n, C), dt)
    assert_close(m.stream_mix_fwd(to_gpu(x), to_gpu(M)), R.stream_mix_fwd(x, M), ACT_TOL[dt], "mix out")
    for name, a, b, tol in zip(("dx", "dM"), m.stream_mix_bwd(to_gpu(g), to_gpu(x), to_gpu(M)),
                               R.stream_mix_bwd(g, x, M), (ACT_TOL[dt], COEF_TOL)):
        assert_close(a, b, tol, "mix " + name)
    assert_close(m.mhc_post_op_fwd(to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(M)), R.mhc_post_op_fwd(y, x, Hp, M),
                 ACT_TOL[dt], "post out")
    got = m.mhc_post_op_bwd(to_gpu(g), to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(M))
    for name, a, b, tol in zip(("dy", "dx", "dH_post", "dH_res"), got, R.mhc_post_op_bwd(g, y, x, Hp, M),
                               (ACT_TOL[dt], ACT_TOL[dt], COEF_TOL, COEF_TOL)):
        assert_close(a, b, tol, "post " + name)


# ------------------------------------------------------- aggregate / distribute
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
@pytest.mark.parametrize("shared", [False, True])
def test_aggregate_distribute(rng, dt, n, T, C, shared):
    x = rounded(rng, (T, n, C), dt)
    y = rounded(rng, (T, C), dt)
    h = _coef(rng, (n,) if shared else (T, n))
    gy = rounded(rng, (T, C), dt)
    gx = rounded(rng, (T, n, C), dt)
    assert_close(m.stream_aggregate_fwd(to_gpu(x), to_gpu(h)), R.stream_aggregate_fwd(x, h), ACT_TOL[dt], "agg out")
    dx, dh = m.stream_aggregate_bwd(to_gpu(gy), to_gpu(x), to_gpu(h))
    rdx, rdh = R.stream_aggregate_bwd(gy, x, h)
    assert_close(dx, rdx, ACT_TOL[dt], "agg dx")
    assert_close(dh, rdh, COEF_TOL, "agg dh")
    assert_close(m.stream_distribute_fwd(to_gpu(y), to_gpu(h)), R.stream_distribute_fwd(y, h), ACT_TOL[dt], "dist out")
    dy, dh = m.stream_distribute_bwd(to_gpu(gx), to_gpu(y), to_gpu(h))
    rdy, rdh = R.stream_distribute_bwd(gx, y, h)
    assert_close(dy, rdy, ACT_TOL[dt], "dist dy")
    assert_close(dh, rdh, COEF_TOL, "dist dh")


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dt", DTYPES)
# Row widths of the register-cached kernels (K = 1 to 8 vectors per thread at
# 16-bit dtypes; see ops/rmsnorm.cached_layout) and past them: 49152 runs the
# two-pass forward and the cached backward, 57352 two-pass in both directions.
@pytest.mark.parametrize("T,C", SIZES + [(3, 6000), (5, 16384), (2, 28672), (2, 49152), (2, 57352)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rmsnorm(rng, dt, T, C, weighted):
    x = rounded(rng, (T, C), dt, scale=3.0)
    g = rounded(rng, (T, C), dt)
    w = _coef(rng, (C,)) if weighted else None
    wg = None if w is None else to_gpu(w)
    assert_close(m.rmsnorm_fwd(to_gpu(x), 1e-5, wg), R.rmsnorm_fwd(x, 1e-5, w), ACT_TOL[dt], "y")
    got = m.rmsnorm_bwd(to_gpu(g), to_gpu(x), 1e-5, wg)
    ref = R.rmsnorm_bwd(g, x, 1e-5, w)
    # dx = r g' - x r^3 mean(g' x) cancels terms of size r |g'| (completely at C = 1)
    r = 1 / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + 1e-5)
    term = float(np.sqrt(np.mean((r * f64(g) * (1 if w is None else w)) ** 2)))
    if weighted:
        assert_close(got[0], ref[0], ACT_TOL[dt] * 2, "dx", scale=term)
        assert_close(got[1], ref[1], COEF_TOL, "dw")
    else:
        assert_close(got, ref, ACT_TOL[dt] * 2, "dx", scale=term)


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1e-20])
def test_rmsnorm_p1_rows(eps):
    """Edge rows: zero rows, tiny rows, a single nonzero, a constant row; the kernel uses the given eps."""
    C = 1000
    rows = np.zeros((6, C), np.float32)
    rng = np.random.default_rng(7)
    rows[1] = rng.standard_normal(C) * 1e-4
    rows[2] = rng.standard_normal(C) * 1e-11
    rows[3, 17] = 2.5
    rows[4] = 0.75
    rows[5] = rng.standard_normal(C)
    g = rng.standard_normal((6, C)).astype(np.float32)
    y = to_host(m.rmsnorm_fwd(to_gpu(rows), eps))
    assert_close(y, R.rmsnorm_fwd(rows, eps), 1e-5, "y")
    assert (y[0] == 0).all()
    dx = to_host(m.rmsnorm_bwd(to_gpu(g), to_gpu(rows), eps))
    assert np.isfinite(dx).all()
    ref = R.rmsnorm_bwd(g, rows, eps)
    for r in range(6):
        # dx is a difference of two terms of size r*|g|: compare on that scale
        scale = np.abs(g[r]).max() / np.sqrt(np.mean(f64(rows[r]) ** 2) + eps)
        assert np.abs(dx[r] - ref[r]).max() <= 1e-4 * scale, f"row {r}"
    if eps == 1e-20:
        ms = np.mean(f64(rows[1]) ** 2)
        assert abs(np.sqrt(np.mean(f64(y[1]) ** 2)) - np.sqrt(ms / (ms + eps))) < 1e-4


# ------------------------------------------------------------------ Sinkhorn
@pytest.mark.parametrize("n", NS + [17, 32])
@pytest.mark.parametrize("T", [1, 3, 127, 1000])
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_sinkhorn_unrolled(rng, n, T, scale):
    L = _coef(rng, (T, n, n), scale)
    G = _coef(rng, (T, n, n))
    P = m.sinkhorn_knopp_fwd(to_gpu(L))
    assert_close(P, R.sinkhorn_knopp_fwd(L), SINKHORN_TOL, "P")
    dL = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L)))
    assert_close(dL, R.sinkhorn_knopp_bwd(G, L), 20 * SINKHORN_TOL if scale > 1 else SINKHORN_TOL, "dL")
    assert np.abs(f64(dL).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(dL).max()), "rows of dL must sum to 0"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("num_iters", [0, 1, 5, 20, 200])
def test_sinkhorn_iters_and_history(rng, n, num_iters):
    """num_iters = 200 keeps its step history in global scratch instead of shared memory."""
    L = _coef(rng, (33, n, n))
    G = _coef(rng, (33, n, n))
    assert_close(m.sinkhorn_knopp_fwd(to_gpu(L), num_iters), R.sinkhorn_knopp_fwd(L, num_iters), SINKHORN_TOL, "P")
    assert_close(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), num_iters),
                 R.sinkhorn_knopp_bwd(G, L, num_iters), 5 * SINKHORN_TOL, "dL")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_implicit(rng, n):
    L = _coef(rng, (200, n, n))
    G = _coef(rng, (200, n, n))
    got = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), 20, 1e-8, "implicit"))
    assert_close(got, R.sinkhorn_knopp_bwd(G, L, 20, 1e-8, "implicit"), 1e-3, "implicit dL")
    assert np.abs(f64(got).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(got).max())


def _sinkhorn_f32(L, num_iters=20, eps=1e-8):
    """The forward evaluated in float32 (what the kernel can represent)."""
    P = np.exp(L - L.max(-1, keepdims=True), dtype=np.float32)
    for _ in range(num_iters):
        P = P / (P.sum(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
        P = P / (P.sum(-2, keepdims=True, dtype=np.float32) + np.float32(eps))
    return P


def test_sinkhorn_large_logits_and_n1(rng):
    """Logits of scale 100: exp(L) would overflow without the row-max shift; most
    exp(L - max) underflow in float32, so the float32 evaluation is the reference."""
    L = _coef(rng, (50, 4, 4), 100.0)
    P = to_host(m.sinkhorn_knopp_fwd(to_gpu(L)))
    assert np.isfinite(P).all()
    assert_close(P, _sinkhorn_f32(L), 1e-4, "P")
    assert_close(to_host(m.sinkhorn_knopp_fwd(to_gpu(L / 10))), R.sinkhorn_knopp_fwd(L / 10), SINKHORN_TOL, "P/10")
    dL = to_host(m.sinkhorn_knopp_bwd(to_gpu(_coef(rng, (50, 4, 4))), to_gpu(L), grad_mode="implicit"))
    assert np.isfinite(dL).all()
    L1 = _coef(rng, (9, 1, 1))
    assert (to_host(m.sinkhorn_knopp_fwd(to_gpu(L1))) == 1).all()
    assert (to_host(m.sinkhorn_knopp_bwd(to_gpu(L1), to_gpu(L1))) == 0).all()


# ------------------------------------------------------------------ pre op
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS + [32])
@pytest.mark.parametrize("T,C", SIZES)
@pytest.mark.parametrize("grad_mode", ["unrolled", "implicit"])
def test_pre_op(rng, dt, n, T, C, grad_mode):
    if grad_mode == "implicit" and (dt != "bfloat16" or C > 64):
        pytest.skip("implicit mode: one dtype and small C are enough (the Sinkhorn part is dtype-free)")
    x = rounded(rng, (T, n, C), dt)
    hp, hq, hr = _coef(rng, (T, n), 2.0), _coef(rng, (T, n), 2.0), _coef(rng, (T, n, n), 2.0)
    got = m.mhc_pre_op_fwd(to_gpu(x), to_gpu(hp), to_gpu(hq), to_gpu(hr))
    ref = R.mhc_pre_op_fwd(x, hp, hq, hr)
    for name, a, b, tol in zip(("layer_in", "H_pre", "H_post", "H_res"), got, ref,
                               (ACT_TOL[dt], 1e-6, 1e-6, SINKHORN_TOL)):
        assert_close(a, b, tol, name)
    g = rounded(rng, (T, C), dt)
    gpre, gpost, gres = _coef(rng, (T, n)), _coef(rng, (T, n)), _coef(rng, (T, n, n))
    got = m.mhc_pre_op_bwd(to_gpu(g), to_gpu(gpre), to_gpu(gpost), to_gpu(gres), to_gpu(x), to_gpu(hp),
                           to_gpu(hq), to_gpu(hr), grad_mode=grad_mode)
    ref = R.mhc_pre_op_bwd(g, gpre, gpost, gres, x, hp, hq, hr, grad_mode=grad_mode)
    for name, a, b, tol in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), got, ref,
                               (ACT_TOL[dt], COEF_TOL, 1e-5, 5e-3)):
        assert_close(a, b, tol, name)


def test_pre_op_missing_grads(rng):
    n, T, C = 4, 21, 1000
    x = rounded(rng, (T, n, C), "bfloat16")
    hp, hq, hr = _coef(rng, (T, n)), _coef(rng, (T, n)), _coef(rng, (T, n, n))
    gres = _coef(rng, (T, n, n))
    got = m.mhc_pre_op_bwd(None, None, None, to_gpu(gres), to_gpu(x), to_gpu(hp), to_gpu(hq), to_gpu(hr))
    ref = R.mhc_pre_op_bwd(None, None, None, gres, x, hp, hq, hr)
    for name, a, b in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), got, ref):
        assert_close(a, b, 5e-3, name)
    assert (to_host(got[0]) == 0).all() and (to_host(got[2]) == 0).all()


# ------------------------------------------------------ layouts and dtypes
def test_f32_incoming_gradients(rng):
    n, T, C = 4, 50, 4096
    x = rounded(rng, (T, n, C), "bfloat16")
    M = _coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), "float32")
    dx, dM = m.stream_mix_bwd(to_gpu(g), to_gpu(x), to_gpu(M))
    assert dx.dtype == x.dtype
    rdx, rdM = R.stream_mix_bwd(g, x, M)
    assert_close(dx, rdx, ACT_TOL["bfloat16"], "dx")
    assert_close(dM, rdM, COEF_TOL, "dM")


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_offset_and_strided_views(rng, dt):
    """Layouts: a base pointer one element off alignment, odd C, non-contiguous views."""
    import cupy as cp

    n, T, C = 4, 37, 1000
    buf = to_gpu(rounded(rng, (T * n * C + 1,), dt))
    x_off = buf[1:].reshape(T, n, C)  # misaligned base
    M = _coef(rng, (T, n, n))
    ref = R.stream_mix_fwd(to_host(x_off), M)
    assert_close(m.stream_mix_fwd(x_off, to_gpu(M)), ref, ACT_TOL[dt], "offset")
    x_t = cp.ascontiguousarray(x_off.transpose(0, 2, 1)).transpose(0, 2, 1)  # non-contiguous view
    assert not x_t.flags.c_contiguous
    assert_close(m.stream_mix_fwd(x_t, to_gpu(M)), ref, ACT_TOL[dt], "strided")
    M_t = cp.ascontiguousarray(to_gpu(M).transpose(0, 2, 1)).transpose(0, 2, 1)
    assert_close(m.stream_mix_fwd(x_t, M_t), ref, ACT_TOL[dt], "strided M")
    # odd C: rows after the first are misaligned
    xo = rounded(rng, (T, n, 13), dt)
    assert_close(m.stream_mix_fwd(to_gpu(xo), to_gpu(M)), R.stream_mix_fwd(xo, M), ACT_TOL[dt], "odd C")
    # weight at an offset
    wbuf = to_gpu(_coef(rng, (C + 1,)))
    y = rounded(rng, (T, C), dt)
    assert_close(m.rmsnorm_fwd(to_gpu(y), 1e-5, wbuf[1:]), R.rmsnorm_fwd(y, 1e-5, to_host(wbuf[1:])),
                 ACT_TOL[dt], "rmsnorm weight offset")


def test_leading_dims_and_zero_tokens(rng):
    x = rounded(rng, (2, 3, 4, 64), "bfloat16")
    M = _coef(rng, (2, 3, 4, 4))
    assert_close(m.stream_mix_fwd(to_gpu(x), to_gpu(M)), R.stream_mix_fwd(x, M), ACT_TOL["bfloat16"], "lead")
    x0 = to_gpu(rounded(rng, (0, 5, 4, 64), "bfloat16"))
    M0 = to_gpu(_coef(rng, (0, 5, 4, 4)))
    assert m.stream_mix_fwd(x0, M0).shape == (0, 5, 4, 64)
    dx, dM = m.stream_mix_bwd(x0, x0, M0)
    assert dx.shape == x0.shape and dM.shape == M0.shape
    h = to_gpu(_coef(rng, (4,)))
    dx, dh = m.stream_aggregate_bwd(to_gpu(rounded(rng, (0, 5, 64), "bfloat16")), x0, h)
    assert (to_host(dh) == 0).all()
    assert m.sinkhorn_knopp_fwd(M0).shape == M0.shape


def test_size_one_dims_any_strides(rng):
    """Size-1 dims with odd strides are treated as contiguous (no copy, same result)."""
    import cupy as cp

    x = to_gpu(rounded(rng, (1, 1, 1, 8), "float32"))
    x_odd = cp.lib.stride_tricks.as_strided(x, shape=(1, 1, 1, 8), strides=(0, 999 * 4, 4, 4))
    M = to_gpu(np.ones((1, 1, 1, 1), np.float32) * 2)
    assert_close(m.stream_mix_fwd(x_odd, M), 2 * to_host(x), 1e-6, "size-1 dims")


# ------------------------------------------------------------ determinism
def test_backward_bitwise_deterministic_under_load(rng):
    """Determinism under load: identical backward calls give identical bits, while another stream runs a matmul."""
    import cupy as cp

    n, T, C = 4, 4096, 4096
    x, g = to_gpu(rounded(rng, (T, n, C), "bfloat16")), to_gpu(rounded(rng, (T, n, C), "bfloat16"))
    y = to_gpu(rounded(rng, (T, C), "bfloat16"))
    Hp, Hr = to_gpu(_coef(rng, (T, n))), to_gpu(_coef(rng, (T, n, n)))
    h = to_gpu(_coef(rng, (n,)))
    w = to_gpu(_coef(rng, (n * C,)))
    noise = cp.cuda.Stream(non_blocking=True)
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)

    def run():
        with noise:
            a @ a
        return [to_host(t) for t in (*m.mhc_post_op_bwd(g, y, x, Hp, Hr), *m.stream_aggregate_bwd(y, x, h),
                                      *m.rmsnorm_bwd(g.reshape(T, n * C), x.reshape(T, n * C), 1e-5, w),
                                      m.sinkhorn_knopp_bwd(Hr, Hr))]

    first, second = run(), run()
    for a1, a2 in zip(first, second):
        assert np.array_equal(a1.view(np.uint8), a2.view(np.uint8))


# ----------------------------------------------------------------- errors
def test_errors_name_the_argument(rng):
    import cupy as cp

    x = to_gpu(rounded(rng, (3, 4, 8), "bfloat16"))
    M = to_gpu(_coef(rng, (3, 4, 4)))
    with pytest.raises(TypeError, match="x has dtype float64"):
        m.stream_mix_fwd(x.astype(cp.float64), M)
    with pytest.raises(TypeError, match="M has dtype"):
        m.stream_mix_fwd(x, M.astype(cp.float16))
    with pytest.raises(TypeError, match="x has dtype int8"):
        m.stream_mix_fwd(x.astype(cp.int8), M)
    with pytest.raises(ValueError, match="M has shape"):
        m.stream_mix_fwd(x, M[:, :3])
    with pytest.raises(ValueError, match="supported n is 1 to 32"):
        m.sinkhorn_knopp_fwd(cp.zeros((2, 33, 33), cp.float32))
    with pytest.raises(ValueError, match="same device"):
        m.stream_mix_fwd(x, to_host(M))
    with pytest.raises(ValueError, match="grad_mode"):
        m.sinkhorn_knopp_bwd(M, M, grad_mode="exact")
    # the context is still healthy after the refusals
    assert_close(m.stream_mix_fwd(x, M), R.stream_mix_fwd(to_host(x), to_host(M)), ACT_TOL["bfloat16"], "after")


# --------------------------------------------------------- zero copy / interop
def test_zero_copy_torch_jax_cupy_through_stream_mix(rng):
    """A torch bf16 tensor, a jax array and a cupy array go through stream_mix_fwd without a copy."""
    import cupy as cp

    n, T, C = 4, 16, 256
    xh = rounded(rng, (T, n, C), "bfloat16")
    Mh = _coef(rng, (T, n, n))
    ref = R.stream_mix_fwd(xh, Mh)
    seen = []  # the input pointers the kernel receives
    import mhc_cupy.ops.stream as st

    real = st.launch_mix_distribute_fwd

    def spy(dt, n_, C_, tokens, **kw):
        seen.append(kw["x"])
        return real(dt, n_, C_, tokens, **kw)

    st.launch_mix_distribute_fwd = spy
    try:
        xc = to_gpu(xh)
        out = m.stream_mix_fwd(xc, to_gpu(Mh))
        assert isinstance(out, cp.ndarray) and seen[-1] == xc.data.ptr
        assert_close(out, ref, ACT_TOL["bfloat16"], "cupy")
        torch = pytest.importorskip("torch")
        xt = torch.from_dlpack(xc)
        assert xt.dtype == torch.bfloat16
        out = m.stream_mix_fwd(xt, torch.from_dlpack(to_gpu(Mh)))
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and seen[-1] == xt.data_ptr()
        assert_close(cp.from_dlpack(out), ref, ACT_TOL["bfloat16"], "torch")
        jax = pytest.importorskip("jax")
        if jax.devices()[0].platform == "gpu":
            xj = jax.dlpack.from_dlpack(xc)
            out = m.stream_mix_fwd(xj, jax.dlpack.from_dlpack(to_gpu(Mh)))
            assert isinstance(out, jax.Array) and seen[-1] == xj.unsafe_buffer_pointer()
            assert_close(np.asarray(out), ref, ACT_TOL["bfloat16"], "jax")
    finally:
        st.launch_mix_distribute_fwd = real


def test_foreign_dlpack_producer(rng):
    """An object with only __dlpack__ / __dlpack_device__ works ("any DLPack framework")."""
    import cupy as cp

    class Foreign:
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, *args, **kwargs):
            return self._a.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    x = rounded(rng, (5, 3, 40), "float32")
    M = _coef(rng, (5, 3, 3))
    out = m.stream_mix_fwd(Foreign(to_gpu(x)), Foreign(to_gpu(M)))
    assert isinstance(out, cp.ndarray)
    assert_close(out, R.stream_mix_fwd(x, M), ACT_TOL["float32"], "foreign")
