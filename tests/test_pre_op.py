"""The pre op, ``mhc_pre_op_fwd`` / ``mhc_pre_op_bwd`` (OPS.md section 7: the activations
H_pre = sigmoid, H_post = 2 sigmoid, H_res = Sinkhorn-Knopp, and layer_in = sum_i H_pre_i x_i):
CPU and GPU cases.

CPU: the float64 NumPy reference against float64 torch autograd of a plain-torch pre op
(tests/paper_oracle.py), with every subset of incoming gradients present.

GPU (``gpu_test``: skipped without a GPU, CuPy allocations NaN-poisoned): the kernels against
the float64 reference; layer_in and dx to one rounding of the activation dtype, the
coefficient gradients to the Sinkhorn tolerance chained through the activations.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from gpu.helpers import ACT_TOL, COEF_TOL, DTYPES, NS, SINKHORN_TOL, SIZES, assert_close, coef, rounded, to_gpu, to_host
from harness import gpu_test
from paper_oracle import assert_reference, t_pre, torch_vjp

GPU = gpu_test()


# ============================================================ CPU
# ----------------------------------------------------------------------------------------------
# the reference against float64 torch autograd
# ----------------------------------------------------------------------------------------------

PRE_SHAPES = [((0,), 4, 7), ((1,), 1, 1), ((3,), 2, 1000), ((127,), 4, 64),
              ((2, 3), 3, 7), ((3,), 8, 64), ((2, 3), 16, 7)]


@pytest.mark.parametrize("lead,n,C", PRE_SHAPES)
@pytest.mark.parametrize("present", [(1, 1, 1, 1), (1, 0, 0, 1), (0, 1, 1, 0), (0, 0, 0, 0)])
def test_mhc_pre_op(rng, lead, n, C, present):
    num_iters, eps = 7, 1e-8
    x = rng.normal(size=lead + (n, C))
    hp = rng.normal(size=lead + (n,)) * 3
    hq = rng.normal(size=lead + (n,)) * 3
    hr = rng.normal(size=lead + (n, n)) * 2
    # large |raw| values to exercise the stable sigmoid
    if hp.size:
        hp.flat[0], hq.flat[0] = 800.0, -800.0
    out_shapes = [lead + (C,), lead + (n,), lead + (n,), lead + (n, n)]
    grads = [rng.normal(size=s) if p else None for s, p in zip(out_shapes, present)]

    outs_ref, grads_ref = torch_vjp(
        lambda *a: t_pre(*a, num_iters, eps), [x, hp, hq, hr], grads)
    outs = R.mhc_pre_op_fwd(x, hp, hq, hr, num_iters=num_iters, eps=eps)
    assert len(outs) == 4
    for name, a, b in zip(("layer_in", "H_pre", "H_post", "H_res"), outs, outs_ref):
        assert_reference(a, b, 1e-12, name)
        assert np.all(np.isfinite(a))
    ours = R.mhc_pre_op_bwd(*grads, x, hp, hq, hr, num_iters=num_iters, eps=eps)
    assert len(ours) == 4
    for name, a, b in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), ours, grads_ref):
        assert_reference(a, b, 1e-10, name)

    # implicit mode only changes dh_res_raw, which is the implicit Sinkhorn backward
    imp = R.mhc_pre_op_bwd(*grads, x, hp, hq, hr, num_iters=num_iters, eps=eps,
                           grad_mode="implicit")
    for a, b in zip(imp[:3], ours[:3]):
        np.testing.assert_array_equal(a, b)
    if grads[3] is None:
        np.testing.assert_array_equal(imp[3], np.zeros(hr.shape))
    else:
        np.testing.assert_array_equal(
            imp[3], R.sinkhorn_knopp_bwd(grads[3], hr, num_iters, eps, "implicit"))

# ============================================================ GPU
# ------------------------------------------------------------------ pre op
@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS + [32])
@pytest.mark.parametrize("T,C", SIZES)
@pytest.mark.parametrize("grad_mode", ["unrolled", "implicit"])
def test_pre_op(rng, dt, n, T, C, grad_mode):
    if grad_mode == "implicit" and (dt != "bfloat16" or C > 64):
        pytest.skip("implicit mode: one dtype and small C are enough (the Sinkhorn part is dtype-free)")
    x = rounded(rng, (T, n, C), dt)
    hp, hq, hr = coef(rng, (T, n), 2.0), coef(rng, (T, n), 2.0), coef(rng, (T, n, n), 2.0)
    got = m.mhc_pre_op_fwd(to_gpu(x), to_gpu(hp), to_gpu(hq), to_gpu(hr))
    ref = R.mhc_pre_op_fwd(x, hp, hq, hr)
    for name, a, b, tol in zip(("layer_in", "H_pre", "H_post", "H_res"), got, ref,
                               (ACT_TOL[dt], 1e-6, 1e-6, SINKHORN_TOL)):
        assert_close(a, b, tol, name)
    g = rounded(rng, (T, C), dt)
    gpre, gpost, gres = coef(rng, (T, n)), coef(rng, (T, n)), coef(rng, (T, n, n))
    got = m.mhc_pre_op_bwd(to_gpu(g), to_gpu(gpre), to_gpu(gpost), to_gpu(gres), to_gpu(x), to_gpu(hp),
                           to_gpu(hq), to_gpu(hr), grad_mode=grad_mode)
    ref = R.mhc_pre_op_bwd(g, gpre, gpost, gres, x, hp, hq, hr, grad_mode=grad_mode)
    for name, a, b, tol in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), got, ref,
                               (ACT_TOL[dt], COEF_TOL, 1e-5, 5e-3)):
        assert_close(a, b, tol, name)


@GPU
def test_pre_op_missing_grads(rng):
    n, T, C = 4, 21, 1000
    x = rounded(rng, (T, n, C), "bfloat16")
    hp, hq, hr = coef(rng, (T, n)), coef(rng, (T, n)), coef(rng, (T, n, n))
    gres = coef(rng, (T, n, n))
    got = m.mhc_pre_op_bwd(None, None, None, to_gpu(gres), to_gpu(x), to_gpu(hp), to_gpu(hq), to_gpu(hr))
    ref = R.mhc_pre_op_bwd(None, None, None, gres, x, hp, hq, hr)
    for name, a, b in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), got, ref):
        assert_close(a, b, 5e-3, name)
    assert (to_host(got[0]) == 0).all() and (to_host(got[2]) == 0).all()
