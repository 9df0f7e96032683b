"""The float64 NumPy reference (mhc_cupy/reference.py) and the functional API on CPU inputs, across ops:
low-precision inputs computed in float64, zero tokens, and bad input getting a clear error.

Each op's own checks against float64 torch autograd are in its family's file (tests/test_sinkhorn.py,
test_rmsnorm.py, test_stream.py, test_pre_op.py, test_coeffs.py).  Runs on CPU only.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from mhc_cupy import reference as R


# ----------------------------------------------------------------------------------------------
# dtypes and zero tokens
# ----------------------------------------------------------------------------------------------

def _low_precision_dtypes():
    dts = [np.float16, np.float32]
    try:
        import ml_dtypes
        dts.append(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover
        pass
    return dts


@pytest.mark.parametrize("dt", _low_precision_dtypes(), ids=lambda d: np.dtype(d).name)
def test_low_precision_inputs_compute_in_f64(rng, dt):
    n, C = 4, 64
    x = rng.normal(size=(3, n, C)).astype(dt)
    M = rng.normal(size=(3, n, n)).astype(dt)
    g = rng.normal(size=(3, n, C)).astype(dt)
    x64, M64, g64 = (np.asarray(a, dtype=np.float64) for a in (x, M, g))
    out = R.stream_mix_fwd(x, M)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, R.stream_mix_fwd(x64, M64))
    for a, b in zip(R.stream_mix_bwd(g, x, M), R.stream_mix_bwd(g64, x64, M64)):
        assert a.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    y = R.rmsnorm_fwd(x, eps=1e-6)
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, R.rmsnorm_fwd(x64, eps=1e-6))
    L = rng.normal(size=(3, n, n)).astype(dt)
    assert R.sinkhorn_knopp_fwd(L).dtype == np.float64
    assert R.sinkhorn_knopp_bwd(L, L, grad_mode="implicit").dtype == np.float64


def test_zero_tokens_all_ops():
    n, C = 4, 7
    x = np.zeros((2, 0, n, C), np.float32)
    y = np.zeros((2, 0, C), np.float32)
    h = np.zeros((2, 0, n), np.float32)
    hs = np.ones(n, np.float32)
    M = np.zeros((2, 0, n, n), np.float32)
    assert R.sinkhorn_knopp_fwd(M).shape == M.shape
    for mode in ("unrolled", "implicit"):
        assert R.sinkhorn_knopp_bwd(M, M, grad_mode=mode).shape == M.shape
    assert R.rmsnorm_fwd(y).shape == y.shape
    dx, dw = R.rmsnorm_bwd(y, y, weight=np.ones(C))
    assert dx.shape == y.shape and dw.shape == (C,)
    assert R.stream_mix_fwd(x, M).shape == x.shape
    assert [a.shape for a in R.stream_mix_bwd(x, x, M)] == [x.shape, M.shape]
    assert R.stream_aggregate_fwd(x, hs).shape == y.shape
    dx, dh = R.stream_aggregate_bwd(y, x, hs)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dh, np.zeros(n))
    assert R.stream_distribute_fwd(y, hs).shape == x.shape
    dy, dh = R.stream_distribute_bwd(x, y, hs)
    assert dy.shape == y.shape
    np.testing.assert_array_equal(dh, np.zeros(n))
    assert R.mhc_post_op_fwd(y, x, h, M).shape == x.shape
    assert [a.shape for a in R.mhc_post_op_bwd(x, y, x, h, M)] == [
        y.shape, x.shape, h.shape, M.shape]
    outs = R.mhc_pre_op_fwd(x, h, h, M)
    assert [a.shape for a in outs] == [y.shape, h.shape, h.shape, M.shape]
    outs = R.mhc_pre_op_bwd(y, h, h, M, x, h, h, M)
    assert [a.shape for a in outs] == [x.shape, h.shape, h.shape, M.shape]
    m = n * n + 2 * n
    phi, alpha, bias = np.ones((n * C, m)), np.ones(3), np.ones(m)
    outs = R.mhc_coeffs_fwd(x, phi, alpha, bias)
    assert [a.shape for a in outs] == [h.shape, h.shape, M.shape]
    dx, dphi, dalpha, dbias = R.mhc_coeffs_bwd(h, h, M, x, phi, alpha, bias)
    assert dx.shape == x.shape
    for a, s in ((dphi, phi.shape), (dalpha, (3,)), (dbias, (m,))):
        np.testing.assert_array_equal(a, np.zeros(s))


def test_cpu_path_quiet_on_non_finite_and_underflow():
    """The CPU path gives the kernels' values without NumPy floating-point warnings: NaN / inf
    propagate, exp underflows (Sinkhorn at scale 1000, OPS.md section 1).  It warned before (an
    error under warnings-as-errors) and raised FloatingPointError under np.seterr(all="raise")."""
    import warnings

    import mhc_cupy as m

    L = (np.random.default_rng(0).standard_normal((2, 4, 4)) * 1000).astype(np.float32)
    x = np.ones((2, 4, 8), np.float32)
    x[0, 0, 0] = np.inf
    big = np.full((2, 4, 8), 6e4, np.float16)  # the mix overflows float16: inf, as on the GPU
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        P = m.sinkhorn_knopp_fwd(L)
        y = m.rmsnorm_fwd(x)
        out = m.stream_mix_fwd(big, np.ones((2, 4, 4), np.float32))
    cols = P.sum(-2)  # 1, or 0 for a column no row has its maximum in (OPS.md section 1)
    assert np.isfinite(P).all() and np.allclose(cols * (1 - cols), 0, atol=1e-6)
    assert np.isnan(y[0]).any() and np.isfinite(y[1]).all()
    assert np.isinf(out).all()


# ----------------------------------------------------------------------------------------------
# the functional API on CPU inputs: bad input gets a clear error, never a hang or a silent answer
# ----------------------------------------------------------------------------------------------

def _functional_calls(lead, n=4, C=8):
    """(op name, function, positional array arguments by name, params) of all 16 functional ops."""
    f = np.float32
    z = lambda *s: np.zeros(lead + s, f)  # noqa: E731
    x, y, h, M, K = z(n, C), z(C), z(n), z(n, n), n * n + 2 * n
    phi, alpha, bias = np.zeros((n * C, K), f), np.ones(3, f), np.zeros(K, f)
    hs = np.ones(n, f)
    sk = dict(num_iters=3, eps=1e-8)
    return [
        ("sinkhorn_knopp_fwd", dict(logits=M), sk),
        ("sinkhorn_knopp_bwd", dict(grad_P=M, logits=M), sk),
        ("rmsnorm_fwd", dict(x=y), dict(eps=1e-5)),
        ("rmsnorm_bwd", dict(grad=y, x=y), dict(eps=1e-5)),
        ("stream_mix_fwd", dict(x=x, M=M), {}),
        ("stream_mix_bwd", dict(grad=x, x=x, M=M), {}),
        ("stream_aggregate_fwd", dict(x=x, h=hs), {}),
        ("stream_aggregate_bwd", dict(grad=y, x=x, h=hs), {}),
        ("stream_distribute_fwd", dict(y=y, h=hs), {}),
        ("stream_distribute_bwd", dict(grad=x, y=y, h=hs), {}),
        ("mhc_post_op_fwd", dict(layer_out=y, x=x, H_post=h, H_res=M), {}),
        ("mhc_post_op_bwd", dict(grad=x, layer_out=y, x=x, H_post=h, H_res=M), {}),
        ("mhc_pre_op_fwd", dict(x=x, h_pre_raw=h, h_post_raw=h, h_res_raw=M), sk),
        ("mhc_pre_op_bwd", dict(grad_layer_in=y, grad_H_pre=h, grad_H_post=h, grad_H_res=M, x=x, h_pre_raw=h,
                                h_post_raw=h, h_res_raw=M), sk),
        ("mhc_coeffs_fwd", dict(x=x, phi=phi, alpha=alpha, bias=bias), dict(eps=1e-5)),
        ("mhc_coeffs_bwd", dict(grad_h_pre_raw=h, grad_h_post_raw=h, grad_h_res_raw=M, x=x, phi=phi, alpha=alpha,
                                bias=bias), dict(eps=1e-5)),
    ]


def _functional(name):
    import mhc_cupy

    return getattr(mhc_cupy, name)


@pytest.mark.parametrize("name", [c[0] for c in _functional_calls((2,))])
def test_functional_zero_tokens_huge_leading_dim(name):
    """(2**40, 0, ...) has no tokens: empty outputs at once (it hung, or asked for 8 TiB)."""
    ((_, arrays, params),) = [c for c in _functional_calls((2**40, 0)) if c[0] == name]
    outs = _functional(name)(*arrays.values(), **params)
    for o in (outs if isinstance(outs, tuple) else (outs,)):
        if o.ndim > 2 and o.shape[:2] == (2**40, 0):
            continue
        assert not o.any(), (name, o.shape)  # parameter gradients over no tokens: zero


@pytest.mark.parametrize("name", [c[0] for c in _functional_calls((2,))])
def test_functional_none_list_or_masked_array_names_the_argument(name):
    """None, a list and a NumPy masked array (its mask would be ignored) are refused naming the argument."""
    ((_, arrays, params),) = [c for c in _functional_calls((3,)) if c[0] == name]
    fn = _functional(name)
    for arg in arrays:
        masked = None if arrays[arg] is None else np.ma.masked_less(arrays[arg], 0)
        for bad, what in ((None, "is None"), ([[1.0, 2.0]], "list"), (masked, "masked array")):
            if bad is None and what != "is None":
                continue
            if bad is None and arg.startswith("grad_") and name in ("mhc_pre_op_bwd", "mhc_coeffs_bwd"):
                continue  # a None gradient counts as zero there
            args = dict(arrays, **{arg: bad})
            with pytest.raises(TypeError, match=rf"^{arg}\b.*{what}"):
                fn(*args.values(), **params)


class _UserMasked(np.ma.MaskedArray):
    """A masked-array subclass defined outside NumPy."""


class _UserArray(np.ndarray):
    """An ndarray subclass defined outside NumPy."""


def test_functional_array_subclass_outside_numpy():
    """Arrays were told apart by their type's module: a MaskedArray subclass from another module went
    through DLPack, its mask silently ignored; it is refused like a MaskedArray. A plain ndarray subclass
    is a NumPy array."""
    import mhc_cupy

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 7)).astype(np.float32)
    M = rng.standard_normal((3, 4, 4)).astype(np.float32)
    masked = np.ma.masked_less(x, 0).view(_UserMasked)
    with pytest.raises(TypeError, match=r"^x\b.*masked array"):
        mhc_cupy.stream_mix_fwd(masked, M)
    out = mhc_cupy.stream_mix_fwd(x.view(_UserArray), M)
    np.testing.assert_array_equal(out, mhc_cupy.stream_mix_fwd(x, M))


@pytest.mark.parametrize("name", ["sinkhorn_knopp_fwd", "sinkhorn_knopp_bwd", "mhc_pre_op_fwd", "mhc_pre_op_bwd"])
def test_functional_num_iters_type_strict_and_bounded(name):
    """True / 1.0 are rejected whether or not num_iters=1 ran before (the plan cache
    once treated them as 1); num_iters is bounded by MAX_NUM_ITERS."""
    import mhc_cupy

    ((_, arrays, params),) = [c for c in _functional_calls((3,)) if c[0] == name]
    fn = _functional(name)
    for bad in (True, 1.0, np.bool_(True), "1"):
        with pytest.raises(TypeError, match="num_iters must be an int"):
            fn(*arrays.values(), **dict(params, num_iters=bad))
    fn(*arrays.values(), **dict(params, num_iters=1))
    for bad in (True, 1.0, np.bool_(True)):
        with pytest.raises(TypeError, match="num_iters must be an int"):
            fn(*arrays.values(), **dict(params, num_iters=bad))
    assert mhc_cupy.MAX_NUM_ITERS == 10_000
    for bad in (-1, mhc_cupy.MAX_NUM_ITERS + 1, 2**31):
        with pytest.raises(ValueError, match="num_iters must be in 0..10000"):
            fn(*arrays.values(), **dict(params, num_iters=bad))


@pytest.mark.parametrize("name", ["sinkhorn_knopp_fwd", "rmsnorm_fwd", "rmsnorm_bwd", "mhc_pre_op_fwd",
                                  "mhc_coeffs_fwd", "mhc_coeffs_bwd"])
def test_functional_eps_type_strict(name):
    ((_, arrays, params),) = [c for c in _functional_calls((3,)) if c[0] == name]
    fn = _functional(name)
    fn(*arrays.values(), **dict(params, eps=1.0))
    fn(*arrays.values(), **dict(params, eps=np.float32(1e-5)))
    for bad in (True, False, "1e-5", None):
        with pytest.raises(TypeError, match="eps must be a float"):
            fn(*arrays.values(), **dict(params, eps=bad))
    for bad in (10**400, -10**400, float("nan"), -1e-5):  # an int past the float range too
        with pytest.raises(ValueError, match="eps must be finite and >= 0"):
            fn(*arrays.values(), **dict(params, eps=bad))
    # values a float32 (the kernels' eps) rounds to 0 or inf: the GPU would run another eps than the CPU
    for bad in (1e-50, 7e-46, 1e300, 10**39):
        with pytest.raises(ValueError, match=r"eps must be 0 or between 1.4e-45 and 3.403e\+38 \(the kernels take "
                                             r"it as a float32\), got"):
            fn(*arrays.values(), **dict(params, eps=bad))
    for ok in (0.0, 8e-46, 3.4e38):  # 0, the smallest subnormal (rounded up to), the largest float32 about
        fn(*arrays.values(), **dict(params, eps=ok))


def test_gradient_dtype_message_names_each_allowed_dtype_once():
    import mhc_cupy

    x = np.ones((3, 4), np.float32)
    with pytest.raises(TypeError, match=r"^grad has dtype float16; it needs float32 \(the activation dtype\)$"):
        mhc_cupy.rmsnorm_bwd(x.astype(np.float16), x)
    with pytest.raises(TypeError, match=r"^grad has dtype float16; it needs bfloat16 \(the activation dtype\) "
                                        r"or float32$"):
        mhc_cupy.rmsnorm_bwd(x.astype(np.float16), x.astype(ml_dtypes.bfloat16))


def test_functional_shape_error_names_x():
    """x lacking its stream dim: the message names x and M, not M alone."""
    import mhc_cupy

    x, M = np.zeros((3, 4), np.float32), np.zeros((3, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"x has shape \(3, 4\) .* but M has shape \(3, 4, 4\).* x needs "
                                         r"\(3, 4, C\)"):
        mhc_cupy.stream_mix_fwd(x, M)
    with pytest.raises(ValueError, match=r"x has shape \(3, 4\) .* but h_pre_raw has shape"):
        mhc_cupy.mhc_pre_op_fwd(x, np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32), M)


class Producer:
    """Not a torch tensor or NumPy array: only the DLPack protocol, of the array it wraps."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_functional_bf16_dlpack_producer_on_cpu(rng):
    """A generic DLPack producer of CPU bfloat16 (NumPy cannot import it) works: NumPy bf16 out."""
    import ml_dtypes

    import mhc_cupy

    x = torch.from_numpy(rng.standard_normal((3, 8))).to(torch.bfloat16)
    out = mhc_cupy.rmsnorm_fwd(Producer(x))
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    want = mhc_cupy.rmsnorm_fwd(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(out.view(np.int16), want.view(np.int16))


def test_functional_dlpack_producer_that_cannot_export_names_the_argument(rng):
    """A DLPack producer whose __dlpack__ refuses (float8, a tensor requiring grad, a conjugate view,
    a big-endian array) raised the producer's raw BufferError / RuntimeError, and one without
    __dlpack_device__ CuPy's "cannot be consumed multiple times": now TypeErrors naming the argument."""
    import mhc_cupy

    class NoDevice:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

    x = rng.standard_normal((3, 4, 7)).astype(np.float32)
    M = rng.standard_normal((3, 4, 4)).astype(np.float32)
    t = torch.from_numpy(x)
    for bad, why in ((t.to(torch.float8_e4m3fn), "dtype"), (t.clone().requires_grad_(), "require gradient"),
                     (t.to(torch.complex64).conj(), "conjugate"), (x.astype(">f4"), "byte order")):
        with pytest.raises(TypeError, match=rf"^x: this CPU DLPack array \(Producer\) could not be imported .*{why}"):
            mhc_cupy.stream_mix_fwd(Producer(bad), M)
    with pytest.raises(TypeError, match=r"^M: got a NoDevice with __dlpack__ but no __dlpack_device__"):
        mhc_cupy.stream_mix_fwd(x, NoDevice(M))
    np.testing.assert_array_equal(mhc_cupy.stream_mix_fwd(Producer(x), Producer(M)), mhc_cupy.stream_mix_fwd(x, M))
