"""GPU cases across the ops (each op's own are in its family's file, tests/test_<family>.py): layouts
and dtypes, determinism, errors, zero copy; against the float64 NumPy reference.

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

from .helpers import ACT_TOL, COEF_TOL, assert_close, coef, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_allocations():
        yield


# ------------------------------------------------------ layouts and dtypes
def test_f32_incoming_gradients(rng):
    n, T, C = 4, 50, 4096
    x = rounded(rng, (T, n, C), "bfloat16")
    M = coef(rng, (T, n, n))
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
    M = coef(rng, (T, n, n))
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
    wbuf = to_gpu(coef(rng, (C + 1,)))
    y = rounded(rng, (T, C), dt)
    assert_close(m.rmsnorm_fwd(to_gpu(y), 1e-5, wbuf[1:]), R.rmsnorm_fwd(y, 1e-5, to_host(wbuf[1:])),
                 ACT_TOL[dt], "rmsnorm weight offset")


def test_leading_dims_and_zero_tokens(rng):
    x = rounded(rng, (2, 3, 4, 64), "bfloat16")
    M = coef(rng, (2, 3, 4, 4))
    assert_close(m.stream_mix_fwd(to_gpu(x), to_gpu(M)), R.stream_mix_fwd(x, M), ACT_TOL["bfloat16"], "lead")
    x0 = to_gpu(rounded(rng, (0, 5, 4, 64), "bfloat16"))
    M0 = to_gpu(coef(rng, (0, 5, 4, 4)))
    assert m.stream_mix_fwd(x0, M0).shape == (0, 5, 4, 64)
    dx, dM = m.stream_mix_bwd(x0, x0, M0)
    assert dx.shape == x0.shape and dM.shape == M0.shape
    h = to_gpu(coef(rng, (4,)))
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
    Hp, Hr = to_gpu(coef(rng, (T, n))), to_gpu(coef(rng, (T, n, n)))
    h = to_gpu(coef(rng, (n,)))
    w = to_gpu(coef(rng, (n * C,)))
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
    M = to_gpu(coef(rng, (3, 4, 4)))
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
    Mh = coef(rng, (T, n, n))
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
    M = coef(rng, (5, 3, 3))
    out = m.stream_mix_fwd(Foreign(to_gpu(x)), Foreign(to_gpu(M)))
    assert isinstance(out, cp.ndarray)
    assert_close(out, R.stream_mix_fwd(x, M), ACT_TOL["float32"], "foreign")
