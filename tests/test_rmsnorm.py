"""RMSNorm, ``rmsnorm_fwd`` / ``rmsnorm_bwd`` (OPS.md section 2): CPU and GPU cases.

CPU: the float64 NumPy reference against float64 torch autograd of a plain-torch RMSNorm
(tests/paper_oracle.py), with and without a weight, including rows that make the RMS
statistics hard (``_p1_rows``: zero, tiny-scale, single-nonzero and constant rows), and the functional API's
edge cases.

GPU (``gpu_test``: skipped without a GPU, CuPy allocations NaN-poisoned): the kernels against
the float64 reference on inputs rounded to the activation dtype, so what is left is the
float32 arithmetic and one rounding of each output (``ACT_TOL``).  Rows whose sum of squares
overflows float32 are in tests/gpu/test_gpu_defects_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from gpu.helpers import ACT_TOL, COEF_TOL, DTYPES, SIZES, assert_close, coef, f64, rounded, to_gpu, to_host
from harness import gpu_test
from paper_oracle import LEADS, assert_reference, t_rmsnorm, torch_vjp

GPU = gpu_test()


# ============================================================ CPU
# ----------------------------------------------------------------------------------------------
# the reference against float64 torch autograd
# ----------------------------------------------------------------------------------------------

def _p1_rows(rng, C):
    """Rows: zero, scale 1e-4, scale 1e-11, scale 1e-8, single nonzero, constant, normal."""
    def scaled(s):  # random signs, magnitudes in [0.5, 1.5] * s
        return rng.choice([-1.0, 1.0], size=C) * rng.uniform(0.5, 1.5, size=C) * s

    rows = np.stack([
        np.zeros(C),
        scaled(1e-4),
        scaled(1e-11),
        scaled(1e-8),
        np.eye(C)[C // 2] * 0.37,
        np.full(C, -2.5),
        rng.normal(size=C),
    ])
    return rows


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1e-20])
@pytest.mark.parametrize("C", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_weight", [False, True])
def test_rmsnorm_p1(rng, eps, C, with_weight):
    x = _p1_rows(rng, C)
    g = rng.normal(size=x.shape)
    w = rng.normal(size=C) if with_weight else None
    y = R.rmsnorm_fwd(x, eps=eps, weight=w)
    res = R.rmsnorm_bwd(g, x, eps=eps, weight=w)
    if with_weight:
        (y_ref,), (dx_ref, dw_ref) = torch_vjp(lambda a, b: t_rmsnorm(a, eps, b), [x, w], [g])
        dx, dw = res
        assert_reference(dw, dw_ref, 1e-10, "dw")
    else:
        (y_ref,), (dx_ref,) = torch_vjp(lambda a: t_rmsnorm(a, eps), [x], [g])
        dx = res
        assert isinstance(dx, np.ndarray)
    # compare row by row: the rows have wildly different scales; dx = r g' - x r^3 mean(g' x)
    # is a difference of terms of size r |g'|, which may cancel almost completely
    r = 1 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    gp = g if w is None else g * w
    for i in range(x.shape[0]):
        assert_reference(y[i], y_ref[i], 1e-12, f"y row {i}")
        assert_reference(dx[i], dx_ref[i], 1e-10, f"dx row {i}", scale=r[i] * np.abs(gp[i]).max())
    assert np.all(np.isfinite(dx))
    # zero row: zero output, finite gradient
    np.testing.assert_array_equal(y[0], 0.0)
    y_unw = R.rmsnorm_fwd(x, eps=eps)
    rms = np.sqrt(np.mean(y_unw ** 2, axis=-1))
    ms = np.mean(x ** 2, axis=-1)
    np.testing.assert_allclose(rms, np.sqrt(ms / (ms + eps)), rtol=1e-12)
    if eps == 1e-20:
        # scale 1e-4, 1e-8 rows and up normalise to RMS ~1. The 1e-11 row has mean square
        # ~1e-22 < eps, so its RMS is sqrt(ms / (ms + 1e-20)) ~ 0.1 -- far from the ~3e-9 a
        # backend that hard-codes eps=1e-5 would give.
        np.testing.assert_allclose(rms[[1, 3, 4, 5, 6]], 1.0, atol=1e-3)
        assert 0.03 < rms[2] < 0.3


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("C", [1, 7, 64, 1000])
def test_rmsnorm_random(rng, lead, C):
    x = rng.normal(size=lead + (C,)) * 2
    g = rng.normal(size=x.shape)
    w = rng.normal(size=C)
    (y_ref,), (dx_ref, dw_ref) = torch_vjp(lambda a, b: t_rmsnorm(a, 1e-5, b), [x, w], [g])
    assert_reference(R.rmsnorm_fwd(x, weight=w), y_ref, 1e-12)
    dx, dw = R.rmsnorm_bwd(g, x, weight=w)
    r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    assert_reference(dx, dx_ref, 1e-10, scale=np.abs(r * g * w).max(initial=0.0))
    assert_reference(dw, dw_ref, 1e-10)
    if x.size == 0:
        np.testing.assert_array_equal(dw, np.zeros(C))


def test_functional_rmsnorm_bwd_weight_c0():
    import mhc_cupy

    x = np.zeros((3, 0), np.float32)
    dx, dw = mhc_cupy.rmsnorm_bwd(x, x, weight=np.zeros(0, np.float32))
    assert dx.shape == (3, 0) and dw.shape == (0,) and dw.dtype == np.float32

# ============================================================ GPU
# ------------------------------------------------------------------ RMSNorm
@GPU
@pytest.mark.parametrize("dt", DTYPES)
# Row widths of the register-cached kernels (K = 1 or 2 vectors per thread at
# 16-bit dtypes; see ops/rmsnorm.cached_layout; 8184: the widest) and of the
# two-pass ones on wide rows (1024 vectors or more: 8192 and up at 16-bit dtypes;
# 16383: one element a vector at 1024 threads; 57352: 7169 vectors, not a whole
# number per thread).
@pytest.mark.parametrize("T,C", SIZES + [(3, 6000), (3, 8184), (5, 8192), (3, 16383), (2, 28672), (2, 49152),
                                         (2, 57352)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rmsnorm(rng, dt, T, C, weighted):
    x = rounded(rng, (T, C), dt, scale=3.0)
    g = rounded(rng, (T, C), dt)
    w = coef(rng, (C,)) if weighted else None
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


@GPU
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
