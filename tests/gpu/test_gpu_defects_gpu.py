"""GPU-path defects found by reading the code, each pinned by a test.

* Streams: inputs from several frameworks in one call (a torch tensor and a
  CuPy array on their own non-default streams) are ordered by events: the
  launch stream waits for the other framework's stream (which queued the input
  or its contiguous copy), and that stream then waits for the launch stream (so
  reusing a freed input or copy cannot overtake the kernel).  A call with an
  eager JAX input finishes the stream the kernel ran on, also when the array
  lives on a GPU other than the current one.  The producers are made slow on
  purpose (a kernel spinning ~0.1 s), so a missing dependency shows as NaN or
  as a stream still busy.
* Sizes: the weighted rmsnorm_bwd C limit comes from the device (opt-in shared
  memory per block minus the kernel's static shared memory); C = 2^31 - 1 runs
  (slow: 8 GiB); the implicit Sinkhorn backward at n > 8 (one warp per matrix,
  shared memory) against the float64 reference, with no local memory.

Outputs are NaN-poisoned (helpers.poisoned_allocations) where CuPy allocates them.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from .helpers import ACT_TOL, NP_DTYPES, assert_close, f64, poisoned_allocations, rounded, to_gpu, to_host, torch_cuda_ok

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz

_SPIN_SRC = r"""
extern "C" __global__ void spin_then_copy(long long cycles, float* out, const float* src, int n) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = src[i];
}
"""


def _spin(stream, out=None, src=None):
    """Queue on ``stream`` (a cupy Stream) a kernel that spins ~0.1 s, then copies src to out (float32)."""
    import cupy as cp

    kernel = cp.RawKernel(_SPIN_SRC, "spin_then_copy")
    n = 0 if out is None else out.size
    with stream:
        kernel((1,), (256,), (np.int64(SPIN_CYCLES), out, src, np.int32(n)))


def _coef(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def torch_cupy():
    if not torch_cuda_ok():
        pytest.skip("needs CUDA for both CuPy and torch")
    import cupy as cp
    import torch

    return torch, cp


# ------------------------------------------------------ streams across frameworks
def test_mixed_frameworks_launch_waits_for_the_other_stream(rng, torch_cupy):
    """torch x (first: the kernel runs on torch's stream) and a CuPy M that a slow
    kernel on CuPy's stream is still writing."""
    torch, cp = torch_cupy
    n, T, C = 4, 33, 96
    xh, Mh = rounded(rng, (T, n, C), "float32"), _coef(rng, (T, n, n))
    x = torch.from_numpy(xh).cuda()
    M_src = cp.asarray(Mh)
    M = cp.full((T, n, n), np.nan, cp.float32)
    torch.cuda.synchronize()
    cp.cuda.Device().synchronize()
    cs, ts = cp.cuda.Stream(non_blocking=True), torch.cuda.Stream()
    _spin(cs, M, M_src)
    with cs, torch.cuda.stream(ts):
        out = m.stream_mix_fwd(x, M)
    ts.synchronize()
    assert isinstance(out, torch.Tensor)
    assert_close(out.cpu().numpy(), R.stream_mix_fwd(xh, Mh), ACT_TOL["float32"], "out")


def test_mixed_frameworks_other_stream_waits_for_the_kernel(rng, torch_cupy):
    """The kernel (on torch's stream) is held back by a slow kernel; afterwards the
    caller overwrites the CuPy input on CuPy's stream, and reuses the memory of the
    contiguous copy of a CuPy view: neither may overtake the kernel."""
    torch, cp = torch_cupy
    n, T, C = 4, 33, 96
    xh, Mh = rounded(rng, (T, n, C), "float32"), _coef(rng, (T, n, n))
    x = torch.from_numpy(xh).cuda()
    torch.cuda.synchronize()
    cs, ts = cp.cuda.Stream(non_blocking=True), torch.cuda.Stream()
    for contiguous in (True, False):
        with cs:
            # the transpose of a contiguous array: a view that needs a copy
            M = cp.asarray(Mh)
            if not contiguous:
                M = cp.ascontiguousarray(M.transpose(0, 2, 1)).transpose(0, 2, 1)
        cs.synchronize()
        _spin(cp.cuda.ExternalStream(ts.cuda_stream))
        with cs, torch.cuda.stream(ts):
            out = m.stream_mix_fwd(x, M)
            M.fill(np.nan)  # on CuPy's stream
            junk = cp.full((T, n, n), np.nan, cp.float32)  # may reuse the freed copy
        ts.synchronize()
        cs.synchronize()
        del junk
        assert_close(out.cpu().numpy(), R.stream_mix_fwd(xh, Mh), ACT_TOL["float32"], f"contiguous={contiguous}")


def test_jax_input_with_torch_output_finishes_the_kernel(rng, torch_cupy):
    """A JAX input read on torch's stream: JAX cannot know, so the call returns
    only once that stream has passed the kernel."""
    torch, cp = torch_cupy
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX has no GPU")
    n, T, C = 4, 9, 64
    xh, Mh = rounded(rng, (T, n, C), "float32"), _coef(rng, (T, n, n))
    x = torch.from_numpy(xh).cuda()
    M = jax.device_put(Mh, jax.devices()[0])
    M.block_until_ready()
    torch.cuda.synchronize()
    ts = torch.cuda.Stream()
    _spin(cp.cuda.ExternalStream(ts.cuda_stream))
    with torch.cuda.stream(ts):
        out = m.stream_mix_fwd(x, M)
    assert ts.query(), "returned while the kernel reading the JAX buffer may still run"
    assert_close(out.cpu().numpy(), R.stream_mix_fwd(xh, Mh), ACT_TOL["float32"], "out")


def test_eager_jax_on_a_non_current_gpu_finishes_its_stream(rng):
    """JAX arrays on GPU 1 while CuPy's current device is 0: the call must finish
    the stream of GPU 1 the kernel ran on (it synchronised GPU 0's)."""
    import cupy as cp

    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2 or cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n, T, C = 4, 9, 64
    xh, Mh = rounded(rng, (T, n, C), "float32"), _coef(rng, (T, n, n))
    x, M = jax.device_put(xh, gpus[1]), jax.device_put(Mh, gpus[1])
    x.block_until_ready()
    M.block_until_ready()
    ordinal = gpus[1].local_hardware_id
    with cp.cuda.Device(ordinal):
        stream = cp.cuda.get_current_stream()
        _spin(stream)
    assert cp.cuda.runtime.getDevice() != ordinal
    out = m.stream_mix_fwd(x, M)
    with cp.cuda.Device(ordinal):
        assert stream.done, "returned while the kernel reading the JAX buffers may still run"
    assert set(out.devices()) == {gpus[1]}
    assert_close(np.asarray(out), R.stream_mix_fwd(xh, Mh), ACT_TOL["float32"], "out")


# ------------------------------------------------------------------ sizes
def test_weighted_rmsnorm_bwd_c_limit_from_the_device(rng):
    import cupy as cp
    from cupy_backends.cuda.api import driver

    from mhc_cupy import _jit
    from mhc_cupy.ops import rmsnorm

    rt = cp.cuda.runtime
    optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, rt.getDevice())
    static = max(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, _jit.get_function(
        "rmsnorm.cu", f"mhc_rmsnorm_bwd_kernel<__nv_bfloat16,__nv_bfloat16,{E},true>").ptr) for E in (1, 8))
    assert static <= rmsnorm._BWD_STATIC_SMEM, "the planner's static shared memory bound is too small"
    limit = (min(optin, rmsnorm._MAX_SMEM) - rmsnorm._BWD_STATIC_SMEM) // 4
    T = 3
    with poisoned_allocations():
        for C in (limit - 1, limit):  # odd and even: the scalar and the vector paths
            x, g = rounded(rng, (T, C), "bfloat16"), rounded(rng, (T, C), "bfloat16")
            w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
            dx, dw = m.rmsnorm_bwd(to_gpu(g), to_gpu(x), 1e-5, to_gpu(w))
            rdx, rdw = R.rmsnorm_bwd(g, x, 1e-5, w)
            # dx = r g' - x r^3 mean(g' x) cancels terms of size r |g'|
            r = 1 / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + 1e-5)
            term = float(np.sqrt(np.mean((r * f64(g) * w) ** 2)))
            assert_close(dx, rdx, ACT_TOL["bfloat16"] * 2, f"dx C={C}", scale=term)
            assert_close(dw, rdw, 1e-4, f"dw C={C}")
    x = to_gpu(rounded(rng, (T, limit + 1), "bfloat16"))
    with pytest.raises(ValueError, match=rf"supports C <= {limit}; x has C = {limit + 1}"):
        m.rmsnorm_bwd(x, x, 1e-5, cp.ones(limit + 1, cp.float32))
    cp.cuda.Device().synchronize()  # no sticky CUDA error


@pytest.mark.slow
def test_rmsnorm_fwd_row_of_2_31_minus_1():
    """One row of C = 2^31 - 1 bf16 values (4 GiB in, 4 GiB out; the 32-bit column
    counter wrapped and stored out of bounds).  x repeats 8 values of magnitude
    1 or 2: each of the 1024 threads (a multiple of 8 columns apart) sums about
    2^21 squares of one value, exactly in float32, so the kernel's statistics carry
    only the rounding of the final block sum; every output of one residue class
    mod 8 must be the same."""
    import cupy as cp

    C = 2**31 - 1
    free = cp.cuda.runtime.memGetInfo()[0]
    if free < 10 * 2**30:
        pytest.skip(f"needs ~10 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    vals = np.array([1.0, 2.0, -1.0, 1.0, -2.0, 2.0, 1.0, -1.0])
    bits = vals.astype(NP_DTYPES["bfloat16"]).view(np.uint16)
    with poisoned_allocations():
        xb = cp.tile(cp.asarray(bits), 2**28)[:C]
        x = xb.view(NP_DTYPES["bfloat16"]).reshape(1, C)
        y = m.rmsnorm_fwd(x, 1e-5)
        cp.cuda.Device().synchronize()
    counts = np.full(8, C // 8) + (np.arange(8) < C % 8)
    r = 1 / np.sqrt(float(np.sum(counts * vals**2)) / C + 1e-5)
    yb = y.reshape(C).view(cp.uint16)
    for k in range(8):
        assert bool((xb[k::8] == int(bits[k])).all()), f"x was overwritten (residue {k})"
        col = yb[k::8]
        first = int(col[0])
        assert bool((col == first).all()), f"residue {k}: outputs differ along the row (unwritten or wrong)"
        got = float(np.array([first], np.uint16).view(NP_DTYPES["bfloat16"])[0])
        assert abs(got - vals[k] * r) <= ACT_TOL["bfloat16"] * (abs(vals[k] * r) + 1), (k, got, vals[k] * r)
    del x, xb, y, yb


@pytest.mark.parametrize("n", [9, 17, 31, 32])
@pytest.mark.parametrize("T", [1, 3, 127, 1000])
def test_sinkhorn_implicit_large_n(rng, n, T):
    """n > 8: one warp per matrix in shared memory (4 per block: T = 1, 3, 127
    leave a block partly empty) against the float64 reference."""
    L = _coef(rng, (T, n, n))
    G = _coef(rng, (T, n, n))
    with poisoned_allocations():
        got = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), 20, 1e-8, "implicit"))
        h = _coef(rng, (T, n))
        dpre = m.mhc_pre_op_bwd(None, None, to_gpu(h), to_gpu(G), to_gpu(rounded(rng, (T, n, 8), "float32")),
                                to_gpu(h), to_gpu(h), to_gpu(L), grad_mode="implicit")
    ref = R.sinkhorn_knopp_bwd(G, L, 20, 1e-8, "implicit")
    assert_close(got, ref, 1e-3, "implicit dL")
    assert np.abs(f64(got).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(got).max())
    assert_close(dpre[-1], ref, 1e-3, "pre op dh_res_raw")


@pytest.mark.parametrize("ds", ["false", "true"])
def test_sinkhorn_implicit_n32_uses_no_local_memory(ds):
    from cupy_backends.cuda.api import driver

    from mhc_cupy import _jit

    fn = _jit.get_function("sinkhorn.cu", f"mhc_sinkhorn_knopp_implicit_bwd_warp_kernel<32,{ds}>")
    assert driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn.ptr) == 0


# ------------------------------------------------- RMS statistics of huge rows
# |x| ~ 1e20 overflows a float32 sum of squares (the GPU gave 0 where the CPU is
# right); 1e36 is near the top of bf16 / f32; 1e15 does not overflow but r^3
# (2e-45) underflowed in the old backward.  C = 7: two-pass scalar kernels;
# 1000 / 4096: register-cached (4096 float32: two-pass); 49152: two-pass, 1024-thread blocks.
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("C", [7, 1000, 4096, 49152])
@pytest.mark.parametrize("scale", [1e15, 1e20, 1e36])
@pytest.mark.parametrize("weighted", [False, True])
def test_rmsnorm_huge_rows(rng, dt, C, scale, weighted):
    import cupy as cp

    from mhc_cupy.ops import rmsnorm

    if weighted and C * 4 + 256 > rmsnorm._smem_optin(cp.cuda.runtime.getDevice()):
        pytest.skip("the weighted backward's row does not fit this GPU's shared memory")
    T = 3
    x = rounded(rng, (T, C), dt, scale=scale)
    x[1] = rounded(rng, (C,), dt)  # an ordinary row in between
    g = rounded(rng, (T, C), dt)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32) if weighted else None
    wg = None if w is None else to_gpu(w)
    with poisoned_allocations():
        y = m.rmsnorm_fwd(to_gpu(x), 1e-5, wg)
        got = m.rmsnorm_bwd(to_gpu(g), to_gpu(x), 1e-5, wg)
    assert_close(y, R.rmsnorm_fwd(x, 1e-5, w), ACT_TOL[dt], "y")
    ref = R.rmsnorm_bwd(g, x, 1e-5, w)
    r = 1 / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + 1e-5)
    term = r * f64(g) * (1 if w is None else w)  # per-row scale of dx (rows differ by 1e36)
    dx, rdx = (got[0], ref[0]) if weighted else (got, ref)
    dx = f64(to_host(dx))
    for t in range(T):
        assert_close(dx[t], rdx[t], ACT_TOL[dt] * 2, f"dx row {t}", scale=float(np.sqrt(np.mean(term[t] ** 2))))
    if weighted:
        assert_close(got[1], ref[1], 1e-4, "dw")


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("T,C", [(1, 4096), (3, 4096), (1000, 64)])
@pytest.mark.parametrize("scale", [5e17, 1e19, 1e20, 1e36])
def test_coeffs_huge_tokens(rng, dt, T, C, scale):
    """n = 4; the forward sums squares per D range (64 ranges of 256 at C = 4096,
    2 of 128 at C = 64).  5e17 at C = 4096: every range finite, the total
    overflows; 1e19 and up: the ranges themselves overflow (summed again,
    scaled, in the forward kernel).  The backward is checked where its c term
    (~ sqrt(K) / (n C |x|^2), a float32 of its own) stays above 1e-40: beyond
    that it is a float32 denormal."""
    from test_coeffs import _case, _check_bwd, _run

    n = 4
    D, K = n * C, n * n + 2 * n
    x, phi, alpha, bias, g = _case(rng, T, n, C, dt)
    x = (f64(x) * scale).astype(x.dtype)
    if T > 1:
        x[1] = rounded(rng, (n, C), dt)  # an ordinary token in between
    with poisoned_allocations():
        h, got = _run(x, phi, alpha, bias, g)
    for a, b, name in zip(h, R.mhc_coeffs_fwd(x, phi, alpha, bias), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert_close(a, b, 1e-4, name)
    if np.sqrt(K) / (D * scale**2) > 1e-40:
        _check_bwd(got, R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt)


@pytest.mark.parametrize("scale", [5e17, 1e20])
def test_layer_pre_huge_tokens(rng, scale):
    """The fused layer's saved sums (stats) carry an overflowed sum of squares to
    its backward (negative: minus the scaled sum); forward and the coefficient
    gradients dphi, dalpha against the float64 reference."""
    from test_coeffs import _case

    if not hasattr(m, "mhc_layer_pre_fwd"):
        pytest.skip("no fused layer op")
    n, T, C = 4, 3, 4096
    x, phi, alpha, bias, _ = _case(rng, T, n, C, "bfloat16")
    x = (f64(x) * scale).astype(x.dtype)
    with poisoned_allocations():
        got = m.mhc_layer_pre_fwd(to_gpu(x), to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    ref = R.mhc_layer_pre_fwd(x, phi, alpha, bias)
    assert_close(got[0], ref[0], ACT_TOL["bfloat16"], "layer_in")
    for a, b, name in zip(got[1:4], ref[1:4], ("H_pre", "H_post", "H_res")):
        assert_close(a, b, 1e-3, name)
    q = f64(to_host(got[4]))[..., -1]
    assert np.all(np.isfinite(q) & (q < 0)), f"an overflowed sum of squares is saved as minus the scaled sum: {q}"
    gli = rounded(rng, (T, C), "bfloat16")
    gH_res = _coef(rng, (T, n, n))
    with poisoned_allocations():
        bwd = m.mhc_layer_pre_bwd(to_gpu(gli), None, None, to_gpu(gH_res), to_gpu(x), to_gpu(phi), to_gpu(alpha),
                                  to_gpu(bias), got[4], got[1], got[3])
    rbwd = R.mhc_layer_pre_bwd(gli, None, None, gH_res, x, phi, alpha, bias, ref[4], ref[1], ref[3])
    # dphi = sum_t x~^T dH and dalpha ~ g H~ / r: O(1) although x is huge (r is right)
    assert_close(bwd[1], rbwd[1], 1e-3, "dphi")
    assert_close(bwd[2], rbwd[2], 1e-3, "dalpha")
