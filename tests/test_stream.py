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


@GPU
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("n,T,C", [(5, 3, 7), (7, 127, 64), (7, 5, 1001), (5, 4, 264), (12, 2, 16384)])
def test_post_op_bwd_tensor_cores(rng, convention, dt, n, T, C):
    """The post backward's tensor-core path (n >= 5, 16-bit g, x, y): scalar and vector loads, 4 and
    8 warps, one and two 8-row tiles of [x; y], long rows; g also 2 bytes off 16-byte alignment
    (the scalar path at C % 8 == 0) and g = x (dH_res's diagonal a sum of squares: no cancellation
    hides an error of the accumulation)."""
    import cupy as cp

    y, x = rounded(rng, (T, C), dt), rounded(rng, (T, n, C), dt)
    Hp, Hr = coef(rng, (T, n)), coef(rng, (T, n, n))
    for g, offset in ((rounded(rng, (T, n, C), dt), False), (rounded(rng, (T, n, C), dt), True), (x, False)):
        gd = to_gpu(g)
        if offset:
            view = cp.empty(gd.size + 1, gd.dtype)[1:].reshape(gd.shape)
            view[...] = gd
            gd = view
        got = m.mhc_post_op_bwd(gd, to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr), convention=convention)
        ref = R.mhc_post_op_bwd(g, y, x, Hp, Hr, convention)
        for name, a, b, tol in zip(("dy", "dx", "dH_post", "dH_res"), got, ref,
                                   (ACT_TOL[dt], ACT_TOL[dt], COEF_TOL, COEF_TOL)):
            assert_close(a, b, tol, f"{name} (offset g: {offset})")


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


# ----------------------------------------------------- post backward dispatch (CPU, dry run)
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("n,C,dt,tg,mma", [(4, 64, "bfloat16", "bfloat16", False), (5, 12, "bfloat16", "bfloat16", True),
                                           (8, 4096, "float16", "float16", True), (8, 64, "bfloat16", "float32", False),
                                           (32, 64, "float32", "float32", False)])
def test_post_bwd_dispatch(convention, n, C, dt, tg, mma):
    """mhc_post_op_bwd / mhc_layer_post_bwd take the tensor-core post backward for n >= 5 with 16-bit
    g, x, y (4 warps below C 256, 8 from it; the scalar path for C % 8 != 0), the post op adding dx
    as the mix forward of g by H_res transposed (res_t inverted); else the CUDA-core kernel."""
    from mhc_cupy import _jit
    from mhc_cupy._interop import ArrayInfo
    from mhc_cupy.ops import layer, post
    from mhc_cupy.ops._launch import CTYPE

    def info(shape, dtype="float32"):
        return ArrayInfo(tuple(shape), dtype, ("cuda", 0), 1 << 20, None)

    T = 3
    infos = {"grad": info((T, n, C), tg), "layer_out": info((T, C), dt), "x": info((T, n, C), dt),
             "H_post": info((T, n)), "H_res": info((T, n, n))}
    res_t = int(convention == "deepseek")
    for planner, with_dx in ((post._plan_bwd, True), (layer._plan_post_bwd, False)):
        with _jit.dry_run() as launches:
            plan = planner(infos, convention=convention)
            plan.launch({k: v.ptr for k, v in infos.items()}, [1 << 21] * len(plan.outputs), [], 0)
        exprs = [expr for _, expr, *_ in launches]
        if not mma:
            assert [e.split("<")[0] for e in exprs] == ["mhc_stream_mix_distribute_bwd_kernel"]
            continue
        vec, warps = ("true" if C % 8 == 0 else "false"), (8 if C >= 256 else 4)
        assert exprs[0].replace(" ", "") == f"mhc_stream_post_bwd_mma_kernel<{CTYPE[dt]},{n},{vec},{warps}>"
        assert launches[0][3] == (32 * warps, 1, 1) and launches[0][4][-1] == res_t
        if with_dx:  # dx_j = sum_i M_ij g_i: the mix forward of g, H_res transposed where the op's is not
            assert len(exprs) == 2 and exprs[1].startswith("mhc_stream_mix_distribute_fwd_kernel")
            assert exprs[1].replace(" ", "").endswith(",true,false>") and launches[1][4][-1] == 1 - res_t
        else:
            assert len(exprs) == 1


# ----------------------------------------------------- column sums (parameter gradients over tokens)
def _strided_sum(part, r0, S):
    """NumPy float32 emulation of stream.cu strided_column_sum: rows r0, r0 + S, ... into 8
    accumulators (index (r - r0) / S mod 8), added in order from +0."""
    acc = np.zeros((8, part.shape[1]), np.float32)
    for i, r in enumerate(range(r0, part.shape[0], S)):
        acc[i % 8] += part[r]
    v = np.zeros(part.shape[1], np.float32)
    for k in range(8):
        v += acc[k]
    return v


def _column_sum_order(part, Y):
    """mhc_column_sum_kernel's order with blockDim.y = Y: thread row y sums rows y, y + Y, ...,
    then the Y partials are added in order from +0."""
    tot = np.zeros(part.shape[1], np.float32)
    for y in range(Y):
        tot += _strided_sum(part, y, Y) if y < part.shape[0] else np.float32(0)
    return tot


def test_column_sum_orders_agree_for_few_rows(rng):
    """The claim behind mhc_column_sum_few_kernel (rows <= 64): its order (one thread, 8
    accumulators over rows 0, 1, ...) gives the 32 x 8 block kernel's bits, signed zeros,
    infinities and NaN included; beyond 64 rows it does not (so the check can fail)."""
    for rows in range(1, 66):
        part = (rng.standard_normal((rows, 40)) * np.exp(rng.uniform(-30, 30, (rows, 1)))).astype(np.float32)
        part[:, :4] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32), (rows, 4))
        part[:, 4] = -0.0
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, sums past float32's range
            a, b = _strided_sum(part, 0, 1), _column_sum_order(part, 8)
        same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert same if rows <= 64 else not same, rows


@GPU
@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 70001), (3, (1 << 20) + 257), (3, 33), (8, 1000), (9, 1000),
                                       (63, 257), (64, 5000), (65, 100), (256, 40), (257, 40), (300, 7), (5000, 3)])
def test_column_sum(rng, rows, cols):
    """_launch.column_sum (the deterministic sums of dphi partials and of per-token dalpha / dbias /
    dweight terms): float32 values of both signs and of different magnitudes, against float64
    (at most 64 additions deep in every kernel at these shapes, so 64 float32 ulps of the sum of
    magnitudes bound the error), and bitwise against a NumPy emulation of the kernel's order.
    Rows <= 64 take the one-thread-per-column kernel (grid-stride past 2^20 columns), whose bits
    are the 32 x 8 block kernel's (so both emulations must match it)."""
    import cupy as cp

    from mhc_cupy.ops._launch import column_sum

    part = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, 1)))).astype(np.float32)
    p = cp.asarray(part)
    out = cp.full(cols, cp.nan, cp.float32)
    column_sum(p.data.ptr, out.data.ptr, rows, cols, cp.cuda.get_current_stream().ptr)
    got = cp.asnumpy(out)
    exact = part.astype(np.float64).sum(0)
    scale = np.abs(part).astype(np.float64).sum(0)
    assert np.all(np.abs(got - exact) <= 64 * 2.0**-24 * scale), "column_sum against float64"
    if cols > 32 or rows <= 256:  # not the narrow kernel (its own warp-level order)
        Y = 32 if rows > 256 else 8
        np.testing.assert_array_equal(got.view(np.uint32), _column_sum_order(part, Y).view(np.uint32))
    if rows <= 64:
        np.testing.assert_array_equal(got.view(np.uint32), _strided_sum(part, 0, 1).view(np.uint32))
