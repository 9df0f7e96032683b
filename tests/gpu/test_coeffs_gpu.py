"""The coefficient path (OPS.md section 8) on the GPU against the float64 reference.

Inputs are rounded to the activation dtype first and the reference runs in float64 on
exactly those values, so what is left is the kernels' float32 arithmetic:

* h (forward): a float32 dot product over D = n*C terms.  The kernel sums each lane's
  D / (32 E) terms in sequence, then a butterfly over 32 lanes and at most 64 D ranges,
  so the error is a few units of 2^-24 times sqrt(number of terms) times the size of the
  terms; with phi ~ 1/sqrt(D) the terms are ~1/sqrt(D) and h ~ 1, which gives ~1e-6
  relative at D = 16384.  COEF_TOL = 1e-4 of the output scale leaves a wide margin.
* dx: dH phi^T (K float32 terms) minus c x, rounded once to the activation dtype, so
  ACT_TOL (one rounding) on the scale of its two terms (they may cancel).
* dphi: float32 sums over tokens of x dH (fixed order): COEF_TOL of its scale.
* dalpha, dbias: float32 sums over tokens (and columns) of terms of random sign; the
  scale is the root sum of squares of the terms, the natural size of such a sum.
Every CuPy allocation is NaN-poisoned, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from .helpers import ACT_TOL, COEF_TOL, assert_close, f64, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["bfloat16", "float16", "float32"]
NS = [1, 2, 3, 4, 8]
# (tokens, C): C = 1 and 7 give D with no vector path for odd n (scalar loads); 64, 1000
# the vectorised one; T = 1 and 3 split D over blocks (few token tiles), T = 127 / 1000
# several token tiles (T = 1000 with C = 1000 also splits D, and splits the dphi sum over tokens).
SIZES = [(1, 1), (3, 7), (127, 64), (1000, 1000)]
ALPHA = np.array([0.7, -1.3, 0.4], np.float32)


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_allocations():
        yield


def _case(rng, T, n, C, dt, lead=None):
    lead = (T,) if lead is None else lead
    D, K = n * C, n * n + 2 * n
    x = rounded(rng, lead + (n, C), dt)
    phi = (rng.standard_normal((D, K)) / np.sqrt(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(K)).astype(np.float32)
    g = (rng.standard_normal(lead + (n,)).astype(np.float32), rng.standard_normal(lead + (n,)).astype(np.float32),
         rng.standard_normal(lead + (n, n)).astype(np.float32))
    return x, phi, ALPHA.copy(), bias, g


def _terms(g, x, phi, alpha, eps=1e-5):
    """Sizes of the terms behind dx, dalpha, dbias (for the tolerance scales)."""
    n, C = x.shape[-2], x.shape[-1]
    K = n * n + 2 * n
    xt = f64(x).reshape(-1, n * C)
    gh = np.concatenate([f64(v).reshape(-1, w) if v is not None else np.zeros((xt.shape[0], w))
                         for v, w in zip(g, (n, n, n * n))], -1)
    a = np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(n * n, alpha[2])])
    H = xt @ f64(phi)
    rinv = 1 / np.sqrt(np.mean(xt**2, -1, keepdims=True) + eps)
    dH = gh * a * rinv
    s = (gh * a * H).sum(-1, keepdims=True)
    dx_scale = max(float(np.sqrt(np.mean((dH @ f64(phi).T) ** 2))), float(np.sqrt(np.mean((s * rinv**3 * xt / (n * C)) ** 2))))
    alpha_scale = float(np.sqrt(np.sum((gh * H * rinv) ** 2)))
    bias_scale = float(np.sqrt(np.sum(gh**2) / K))
    return dx_scale, alpha_scale, bias_scale


def _check_bwd(got, ref, g, x, phi, alpha, dt, what=""):
    dx_scale, alpha_scale, bias_scale = _terms(g, x, phi, alpha)
    assert got[0].dtype == x.dtype
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], what + "dx", scale=dx_scale)
    assert_close(got[1], ref[1], COEF_TOL, what + "dphi")
    assert_close(got[2], ref[2], COEF_TOL, what + "dalpha", scale=alpha_scale)
    assert_close(got[3], ref[3], COEF_TOL, what + "dbias", scale=bias_scale)


def _run(x, phi, alpha, bias, g):
    gpu = [to_gpu(v) for v in (x, phi, alpha, bias)]
    h = m.mhc_coeffs_fwd(*gpu)
    grads = m.mhc_coeffs_bwd(*[None if v is None else to_gpu(v) for v in g], *gpu)
    return h, grads


def _check(rng, T, n, C, dt, lead=None):
    x, phi, alpha, bias, g = _case(rng, T, n, C, dt, lead)
    h, got = _run(x, phi, alpha, bias, g)
    for a, b, name in zip(h, R.mhc_coeffs_fwd(x, phi, alpha, bias), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert a.dtype == np.float32
        assert_close(a, b, COEF_TOL, name)
    _check_bwd(got, R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_coeffs(rng, dt, n, T, C):
    _check(rng, T, n, C, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 1000])
def test_coeffs_wide(rng, dt, T):
    """n = 4, C = 4096 (D = 16384): many steps per block; T = 1000 splits D and the dphi sum."""
    _check(rng, T, 4, 4096, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T,C", [(3, 32768), (1000, 4096)])
def test_coeffs_float32_accurate_over_long_rows(rng, dt, T, C):
    """h to ~float32 accuracy at D = n*C up to 131072: a float32 sum of D terms in any sane order
    is good to a few 1e-7 of max |h| here (H~ ~ 1).  The tensor cores' own accumulation truncates;
    summing a D range's thousands of MMAs in it gave 1e-5 .. 4e-5 (H200), so each step's MMAs go
    into a fresh accumulator added in float32.  2e-6 fails the truncating sum and passes the fix."""
    n = 4
    x, phi, alpha, bias, _ = _case(rng, T, n, C, dt)
    got = m.mhc_coeffs_fwd(*(to_gpu(v) for v in (x, phi, alpha, bias)))
    for a, r, what in zip(got, R.mhc_coeffs_fwd(x, phi, alpha, bias), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert_close(to_host(a), r, 2e-6, what, scale="max")


@pytest.mark.parametrize("n,T,C", [(16, 127, 64), (16, 3, 1000), (5, 50, 33), (32, 2, 16)])
def test_coeffs_large_n(rng, n, T, C):
    """n > 4: column chunks in the forward, the separate dx / dphi kernels in the backward."""
    _check(rng, T, n, C, "bfloat16")


def test_leading_dims(rng):
    _check(rng, None, 4, 64, "bfloat16", lead=(2, 3, 5))


@pytest.mark.parametrize("present", [(True, False, False), (False, True, False), (False, False, True),
                                     (False, False, False)])
def test_missing_gradients(rng, present):
    n, T, C = 4, 77, 96
    x, phi, alpha, bias, g = _case(rng, T, n, C, "bfloat16")
    g = tuple(v if p else None for v, p in zip(g, present))
    _, got = _run(x, phi, alpha, bias, g)
    ref = R.mhc_coeffs_bwd(*g, x, phi, alpha, bias)
    if any(present):
        _check_bwd(got, ref, g, x, phi, alpha, "bfloat16")
    else:
        for a in got:
            assert (f64(to_host(a)) == 0).all()


def test_zero_tokens(rng):
    x, phi, alpha, bias, g = _case(rng, 0, 4, 64, "bfloat16")
    h, got = _run(x, phi, alpha, bias, g)
    assert [v.shape for v in h] == [(0, 4), (0, 4), (0, 4, 4)]
    assert got[0].shape == x.shape
    for a in got[1:]:  # written, not left poisoned
        assert (to_host(a) == 0).all()


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_offset_views(rng, dt):
    """x one element off alignment (scalar path) and phi one float off: same as contiguous."""
    import cupy as cp

    n, T, C = 4, 37, 1000
    x, phi, alpha, bias, g = _case(rng, T, n, C, dt)
    xbuf = to_gpu(np.concatenate([rounded(rng, (1,), dt), x.reshape(-1)]))
    x_off = xbuf[1:].reshape(x.shape)
    pbuf = to_gpu(np.concatenate([np.zeros(1, np.float32), phi.reshape(-1)]))
    phi_off = pbuf[1:].reshape(phi.shape)
    h = m.mhc_coeffs_fwd(x_off, phi_off, to_gpu(alpha), to_gpu(bias))
    for a, b in zip(h, R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        assert_close(a, b, COEF_TOL, "h offset")
    got = m.mhc_coeffs_bwd(*[to_gpu(v) for v in g], x_off, phi_off, to_gpu(alpha), to_gpu(bias))
    _check_bwd(got, R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt, "offset ")
    # a non-contiguous x (copied by the dispatcher) gives the same bits as the contiguous one
    x_t = cp.ascontiguousarray(to_gpu(x).transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not x_t.flags.c_contiguous
    a = m.mhc_coeffs_fwd(x_t, to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    b = m.mhc_coeffs_fwd(to_gpu(x), to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    for u, v in zip(a, b):
        assert np.array_equal(to_host(u), to_host(v))


def test_all_zero_token_stays_finite(rng):
    """eps keeps r > 0: a zero token gives h = bias and finite gradients."""
    x, phi, alpha, bias, g = _case(rng, 5, 4, 64, "float32")
    x[2] = 0
    h, got = _run(x, phi, alpha, bias, g)
    assert np.allclose(to_host(h[0])[2], bias[:4]) and np.allclose(to_host(h[2])[2].reshape(-1), bias[8:])
    for a in got:
        assert np.isfinite(f64(to_host(a))).all()


def test_bitwise_deterministic(rng):
    """Identical calls give identical bits (fixed-order sums, no atomics), on every path:
    D ranges + finish kernel (T = 1000, C = 1000), token splits of dphi + column sums."""
    n, T, C = 4, 1000, 1000
    x, phi, alpha, bias, g = _case(rng, T, n, C, "bfloat16")
    first = [to_host(a) for a in (*_run(x, phi, alpha, bias, g)[0], *_run(x, phi, alpha, bias, g)[1])]
    second = [to_host(a) for a in (*_run(x, phi, alpha, bias, g)[0], *_run(x, phi, alpha, bias, g)[1])]
    for a, b in zip(first, second):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    x8, phi8, alpha8, bias8, g8 = _case(rng, 300, 8, 100, "bfloat16")
    a = [to_host(v) for v in _run(x8, phi8, alpha8, bias8, g8)[1]]
    b = [to_host(v) for v in _run(x8, phi8, alpha8, bias8, g8)[1]]
    for u, v in zip(a, b):
        assert np.array_equal(u.view(np.uint8), v.view(np.uint8))


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    n, T, C = 4, 64, 256
    x, phi, alpha, bias, g = _case(rng, T, n, C, "float32")
    t = [torch.from_numpy(v).cuda() for v in (x, phi, alpha, bias)]
    xb = t[0].to(torch.bfloat16)
    h = m.mhc_coeffs_fwd(xb, *t[1:])
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in h)
    xr = xb.float().cpu().numpy()
    for a, b in zip(h, R.mhc_coeffs_fwd(xr, phi, alpha, bias)):
        assert_close(a.cpu().numpy(), b, COEF_TOL, "torch h")
    got = m.mhc_coeffs_bwd(*[torch.from_numpy(v).cuda() for v in g], xb, *t[1:])
    assert got[0].dtype == torch.bfloat16
    host = [got[0].float().cpu().numpy()] + [v.cpu().numpy() for v in got[1:]]
    _check_bwd(host, R.mhc_coeffs_bwd(*g, xr, phi, alpha, bias), g, xr, phi, alpha, "bfloat16", "torch ")
