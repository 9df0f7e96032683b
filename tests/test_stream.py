"""The stream ops and the post op (OPS.md sections 3-6; one kernel family, kernels_cu/stream.cu):
``stream_mix``, ``stream_aggregate``, ``stream_distribute``, ``mhc_post_op``, forward and
backward: CPU and GPU cases.

CPU: the float64 NumPy reference against float64 torch autograd of plain-torch forwards
(tests/paper_oracle.py), shared and per-token coefficients, zero tokens and several leading dims.

GPU (``gpu_test``: skipped without a GPU, CuPy allocations NaN-poisoned): the kernels against
the float64 reference on inputs rounded to the activation dtype, so what is left is the
float32 arithmetic and one rounding of each output.  Coefficients are per token and M / H_res
non-symmetric, so a transposed or shared coefficient fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from gpu.helpers import ACT_TOL, COEF_TOL, DTYPES, NS, SIZES, assert_close, coef, rounded, to_gpu
from harness import gpu_test
from paper_oracle import assert_reference, t_aggregate, t_distribute, t_mix, t_post, torch_vjp

GPU = gpu_test()


# ============================================================ CPU
# ----------------------------------------------------------------------------------------------
# the reference against float64 torch autograd
# ----------------------------------------------------------------------------------------------

SHAPES = [((0,), 4, 7), ((1,), 1, 1), ((3,), 2, 1000), ((127,), 4, 64),
          ((2, 3), 3, 7), ((3,), 8, 64), ((2, 3), 16, 7), ((), 4, 7)]


def _check_vs_torch(fwd, bwd, oracle, inputs, g, names):
    """fwd(*inputs) and bwd(g, *inputs) against float64 torch autograd of oracle, to 1e-12."""
    (out_ref,), grads_ref = torch_vjp(oracle, list(inputs), [g])
    assert_reference(fwd(*inputs), out_ref, 1e-12)
    grads = bwd(g, *inputs)
    assert len(grads) == len(names)
    for name, a, b in zip(names, grads, grads_ref):
        assert_reference(a, b, 1e-12, name)


@pytest.mark.parametrize("lead,n,C", SHAPES)
def test_stream_mix(rng, lead, n, C):
    x = rng.normal(size=lead + (n, C))
    M = rng.normal(size=lead + (n, n))          # non-symmetric
    _check_vs_torch(R.stream_mix_fwd, R.stream_mix_bwd, t_mix, (x, M), rng.normal(size=x.shape), ("dx", "dM"))


@pytest.mark.parametrize("lead,n,C", SHAPES)
@pytest.mark.parametrize("shared", [False, True])
def test_stream_aggregate(rng, lead, n, C, shared):
    x = rng.normal(size=lead + (n, C))
    h = rng.normal(size=(n,) if shared else lead + (n,))
    _check_vs_torch(R.stream_aggregate_fwd, R.stream_aggregate_bwd, t_aggregate, (x, h), rng.normal(size=lead + (C,)),
                    ("dx", "dh"))


@pytest.mark.parametrize("lead,n,C", SHAPES)
@pytest.mark.parametrize("shared", [False, True])
def test_stream_distribute(rng, lead, n, C, shared):
    y = rng.normal(size=lead + (C,))
    h = rng.normal(size=(n,) if shared else lead + (n,))
    _check_vs_torch(R.stream_distribute_fwd, R.stream_distribute_bwd, t_distribute, (y, h),
                    rng.normal(size=lead + (n, C)), ("dy", "dh"))


@pytest.mark.parametrize("lead,n,C", SHAPES)
def test_mhc_post_op(rng, lead, n, C):
    y = rng.normal(size=lead + (C,))
    x = rng.normal(size=lead + (n, C))
    H_post = 2 / (1 + np.exp(-rng.normal(size=lead + (n,))))
    H_res = rng.normal(size=lead + (n, n))      # non-symmetric
    _check_vs_torch(R.mhc_post_op_fwd, R.mhc_post_op_bwd, t_post, (y, x, H_post, H_res),
                    rng.normal(size=lead + (n, C)), ("dy", "dx", "dH_post", "dH_res"))

# ============================================================ GPU
# ------------------------------------------------------------------ mix / post
@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_stream_mix_on_gpu(rng, dt, n, T, C):
    x = rounded(rng, (T, n, C), dt)
    M = coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), dt)
    out = m.stream_mix_fwd(to_gpu(x), to_gpu(M))
    assert_close(out, R.stream_mix_fwd(x, M), ACT_TOL[dt], "out")
    dx, dM = m.stream_mix_bwd(to_gpu(g), to_gpu(x), to_gpu(M))
    rdx, rdM = R.stream_mix_bwd(g, x, M)
    assert_close(dx, rdx, ACT_TOL[dt], "dx")
    assert_close(dM, rdM, COEF_TOL, "dM")


@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_post_op(rng, dt, n, T, C):
    y = rounded(rng, (T, C), dt)
    x = rounded(rng, (T, n, C), dt)
    Hp = coef(rng, (T, n))
    Hr = coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), dt)
    out = m.mhc_post_op_fwd(to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr))
    assert_close(out, R.mhc_post_op_fwd(y, x, Hp, Hr), ACT_TOL[dt], "out")
    got = m.mhc_post_op_bwd(to_gpu(g), to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr))
    ref = R.mhc_post_op_bwd(g, y, x, Hp, Hr)
    for name, a, b, tol in zip(("dy", "dx", "dH_post", "dH_res"), got, ref,
                               (ACT_TOL[dt], ACT_TOL[dt], COEF_TOL, COEF_TOL)):
        assert_close(a, b, tol, name)


@GPU
@pytest.mark.parametrize("n", [17, 32])
@pytest.mark.parametrize("T,C", [(3, 7), (127, 64), (3, 4096)])
def test_mix_and_post_large_n(rng, n, T, C):
    """Large n for stream mix and the post op: n up to the documented maximum of 32."""
    dt = "bfloat16"
    x, y = rounded(rng, (T, n, C), dt), rounded(rng, (T, C), dt)
    M, Hp = coef(rng, (T, n, n)), coef(rng, (T, n))
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
@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
@pytest.mark.parametrize("shared", [False, True])
def test_aggregate_distribute(rng, dt, n, T, C, shared):
    x = rounded(rng, (T, n, C), dt)
    y = rounded(rng, (T, C), dt)
    h = coef(rng, (n,) if shared else (T, n))
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
