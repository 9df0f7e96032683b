"""Tests of the float64 NumPy reference (mhc_cupy/reference.py) against torch autograd.

Every backward is checked against float64 torch autograd of a straightforward torch
re-implementation of the forward (written below, independently of the reference), on fresh
random data seeded per test. Runs on CPU only and is meant to stay well under a minute.
"""

import functools
import zlib

import numpy as np
import pytest
import torch

from mhc_cupy import reference as R
from mhc_cupy.torch.reference import sinkhorn_reference

from harness import assert_close_uniform, default_dtype


@pytest.fixture(autouse=True)
def _float64_default():
    """This module's torch oracles run in float64; restore the default afterwards."""
    with default_dtype(torch.float64):
        yield


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh data per test, reproducible across runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


#: The reference's outputs are float64 and within rtol * max|desired| of float64 torch.
assert_reference = functools.partial(assert_close_uniform, dtype=np.float64)


def _t(a):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def torch_vjp(fn, inputs, grads):
    """Run ``fn`` on float64 tensor copies of ``inputs``; return (outputs, input gradients).

    ``grads`` has one entry per output (``None`` = that output's gradient is zero).
    """
    ts = [_t(a) for a in inputs]
    outs = fn(*ts)
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    loss = sum(
        (o * torch.as_tensor(np.asarray(g, dtype=np.float64))).sum()
        for o, g in zip(outs, grads)
        if g is not None
    )
    if not torch.is_tensor(loss):  # all grads None
        return [o.detach().numpy() for o in outs], [np.zeros(a.shape) for a in inputs]
    gs = torch.autograd.grad(loss, ts, allow_unused=True)
    gs = [np.zeros(t.shape) if g is None else g.numpy() for g, t in zip(gs, ts)]
    return [o.detach().numpy() for o in outs], gs


# ---- straightforward torch forwards (independent of the reference) ---------------------------
# Sinkhorn-Knopp: the plain-torch oracle mhc_cupy.torch.reference.sinkhorn_reference.

def t_rmsnorm(x, eps, w=None):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def t_mix(x, M):
    return torch.einsum("...ij,...jc->...ic", M, x)


def t_aggregate(x, h):
    if h.dim() == 1:
        return torch.einsum("i,...ic->...c", h, x)
    return torch.einsum("...i,...ic->...c", h, x)


def t_distribute(y, h):
    if h.dim() == 1:
        return torch.einsum("i,...c->...ic", h, y)
    return torch.einsum("...i,...c->...ic", h, y)


def t_post(y, x, H_post, H_res):
    return torch.einsum("...ij,...jc->...ic", H_res, x) + H_post[..., :, None] * y[..., None, :]


def t_pre(x, hp, hq, hr, num_iters, eps):
    H_pre = torch.sigmoid(hp)
    H_post = 2 * torch.sigmoid(hq)
    H_res = sinkhorn_reference(hr, num_iters, eps)
    return torch.einsum("...i,...ic->...c", H_pre, x), H_pre, H_post, H_res


def t_coeffs(x, phi, alpha, bias, eps):
    n, C = x.shape[-2], x.shape[-1]
    xt = x.reshape(*x.shape[:-2], n * C)
    r = torch.sqrt((xt ** 2).mean(-1, keepdim=True) + eps)
    H = xt @ phi
    pre = alpha[0] * H[..., :n] / r + bias[:n]
    post = alpha[1] * H[..., n:2 * n] / r + bias[n:2 * n]
    res = alpha[2] * H[..., 2 * n:] / r + bias[2 * n:]
    return pre, post, res.reshape(*x.shape[:-2], n, n)


LEADS = [(0,), (1,), (3,), (127,), (2, 3)]


# ----------------------------------------------------------------------------------------------
# 1. Sinkhorn-Knopp
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead", LEADS + [()])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_fwd_columns_and_torch(rng, lead, n):
    L = rng.normal(size=lead + (n, n)) * 3
    P = R.sinkhorn_knopp_fwd(L)
    assert P.shape == L.shape and P.dtype == np.float64
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-6)
    ref = sinkhorn_reference(torch.tensor(L), 20, 1e-8).numpy()
    assert_reference(P, ref, 1e-12)


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_sinkhorn_fwd_converged_rows_and_cols(rng, n):
    L = rng.normal(size=(5, n, n))
    P = R.sinkhorn_knopp_fwd(L, num_iters=300, eps=1e-12)
    np.testing.assert_allclose(P.sum(-1), 1.0, atol=1e-8)
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-8)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_sinkhorn_large_logits_finite(rng, n):
    L = rng.normal(size=(7, n, n)) * 100
    assert L.max() > 88
    P = R.sinkhorn_knopp_fwd(L)
    assert np.all(np.isfinite(P))
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-6)
    # torch of the same (shifted) forward agrees, and the gradient is finite
    G = rng.normal(size=L.shape)
    for mode in ("unrolled", "implicit"):
        assert np.all(np.isfinite(R.sinkhorn_knopp_bwd(G, L, grad_mode=mode)))
    L32 = L.astype(np.float32)
    assert np.all(np.isfinite(R.sinkhorn_knopp_fwd(L32)))


@pytest.mark.parametrize("mode", ["unrolled", "implicit"])
def test_sinkhorn_n1(rng, mode):
    L = rng.normal(size=(4, 1, 1)) * 50
    P = R.sinkhorn_knopp_fwd(L)
    np.testing.assert_allclose(P, 1.0, atol=1e-7)
    d = R.sinkhorn_knopp_bwd(rng.normal(size=L.shape), L, grad_mode=mode)
    assert d.shape == L.shape
    np.testing.assert_allclose(d, 0.0, atol=1e-14)


def test_sinkhorn_num_iters_0(rng):
    L = rng.normal(size=(3, 4, 4)) * 5
    P = R.sinkhorn_knopp_fwd(L, num_iters=0)
    np.testing.assert_array_equal(P, np.exp(L - L.max(-1, keepdims=True)))


@pytest.mark.parametrize("scale", [1.0, 6.0])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("num_iters", [0, 1, 5, 20])
def test_sinkhorn_unrolled_bwd_vs_torch(rng, scale, n, num_iters):
    lead = {1: (3,), 2: (127,), 3: (2, 3), 4: (1,), 8: (3,), 16: (2, 3)}[n]
    L = rng.normal(size=lead + (n, n)) * scale
    G = rng.normal(size=L.shape)
    ours = R.sinkhorn_knopp_bwd(G, L, num_iters=num_iters)
    _, (ref,) = torch_vjp(lambda l: sinkhorn_reference(l, num_iters, 1e-8), [L], [G])
    assert_reference(ours, ref, 1e-9)
    # default grad_mode is "unrolled"
    np.testing.assert_array_equal(
        ours, R.sinkhorn_knopp_bwd(G, L, num_iters, 1e-8, grad_mode="unrolled"))
    # every row sums to 0
    np.testing.assert_allclose(ours.sum(-1), 0.0, atol=1e-12 * max(np.abs(ours).max(), 1))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_implicit_bwd_converged(rng, n):
    L = rng.normal(size=(3, n, n))
    G = rng.normal(size=L.shape)
    ours = R.sinkhorn_knopp_bwd(G, L, num_iters=300, eps=0.0, grad_mode="implicit")
    _, (ref,) = torch_vjp(lambda l: sinkhorn_reference(l, 300, 0.0), [L], [G])
    assert_reference(ours, ref, 1e-7)
    np.testing.assert_allclose(ours.sum(-1), 0.0, atol=1e-12 * max(np.abs(ours).max(), 1))


@pytest.mark.parametrize("n", [3, 4, 8])
def test_sinkhorn_implicit_differs_when_unconverged(rng, n):
    L = rng.normal(size=(4, n, n)) * 6
    G = rng.normal(size=L.shape)
    imp = R.sinkhorn_knopp_bwd(G, L, num_iters=3, grad_mode="implicit")
    unr = R.sinkhorn_knopp_bwd(G, L, num_iters=3, grad_mode="unrolled")
    assert np.abs(imp - unr).max() > 1e-3 * np.abs(unr).max()
    # still a valid gradient direction: rows sum to 0
    np.testing.assert_allclose(imp.sum(-1), 0.0, atol=1e-12 * max(np.abs(imp).max(), 1))


def test_sinkhorn_bad_grad_mode(rng):
    L = rng.normal(size=(2, 3, 3))
    with pytest.raises(ValueError, match="grad_mode"):
        R.sinkhorn_knopp_bwd(L, L, grad_mode="gauss-seidel")
    with pytest.raises(ValueError, match="grad_mode"):
        R.mhc_pre_op_bwd(None, None, None, None, np.zeros((2, 3, 4)), np.zeros((2, 3)),
                         np.zeros((2, 3)), L, grad_mode="exact")


# ----------------------------------------------------------------------------------------------
# 2. RMSNorm
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


# ----------------------------------------------------------------------------------------------
# 3-6. Stream ops and post op
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


# ----------------------------------------------------------------------------------------------
# 7. Pre op
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


# ----------------------------------------------------------------------------------------------
# 8. Coefficient path
# ----------------------------------------------------------------------------------------------

COEFF_SHAPES = [((0,), 4, 7), ((1,), 1, 1), ((3,), 2, 1000), ((127,), 4, 64),
                ((2, 3), 3, 7), ((3,), 16, 64)]


@pytest.mark.parametrize("lead,n,C", COEFF_SHAPES)
@pytest.mark.parametrize("present", [(1, 1, 1), (0, 1, 0)])
def test_mhc_coeffs(rng, lead, n, C, present):
    eps = 1e-5
    m = n * n + 2 * n
    x = rng.normal(size=lead + (n, C)) * 1.5
    if x.size:
        x.reshape(-1, n, C)[0] = 0.0            # an all-zero token stays finite
    phi = rng.normal(size=(n * C, m)) / np.sqrt(n * C)
    alpha = rng.normal(size=3)
    bias = rng.normal(size=m)
    out_shapes = [lead + (n,), lead + (n,), lead + (n, n)]
    grads = [rng.normal(size=s) if p else None for s, p in zip(out_shapes, present)]

    outs_ref, grads_ref = torch_vjp(
        lambda *a: t_coeffs(*a, eps), [x, phi, alpha, bias], grads)
    outs = R.mhc_coeffs_fwd(x, phi, alpha, bias, eps=eps)
    for name, a, b in zip(("h_pre_raw", "h_post_raw", "h_res_raw"), outs, outs_ref):
        assert_reference(a, b, 1e-12, name)
    ours = R.mhc_coeffs_bwd(*grads, x, phi, alpha, bias, eps=eps)
    assert len(ours) == 4
    for name, a, b in zip(("dx", "dphi", "dalpha", "dbias"), ours, grads_ref):
        assert_reference(a, b, 1e-10, name)
        assert np.all(np.isfinite(a))


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
def test_functional_none_or_list_names_the_argument(name):
    ((_, arrays, params),) = [c for c in _functional_calls((3,)) if c[0] == name]
    fn = _functional(name)
    for arg in arrays:
        for bad, what in ((None, "is None"), ([[1.0, 2.0]], "list")):
            if bad is None and arg.startswith("grad_") and name in ("mhc_pre_op_bwd", "mhc_coeffs_bwd"):
                continue  # a None gradient counts as zero there
            args = dict(arrays, **{arg: bad})
            with pytest.raises(TypeError, match=rf"^{arg}\b.*{what}"):
                fn(*args.values(), **params)


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


def test_functional_shape_error_names_x():
    """x lacking its stream dim: the message names x and M, not M alone."""
    import mhc_cupy

    x, M = np.zeros((3, 4), np.float32), np.zeros((3, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"x has shape \(3, 4\) .* but M has shape \(3, 4, 4\).* x needs "
                                         r"\(3, 4, C\)"):
        mhc_cupy.stream_mix_fwd(x, M)
    with pytest.raises(ValueError, match=r"x has shape \(3, 4\) .* but h_pre_raw has shape"):
        mhc_cupy.mhc_pre_op_fwd(x, np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32), M)


def test_functional_rmsnorm_bwd_weight_c0():
    import mhc_cupy

    x = np.zeros((3, 0), np.float32)
    dx, dw = mhc_cupy.rmsnorm_bwd(x, x, weight=np.zeros(0, np.float32))
    assert dx.shape == (3, 0) and dw.shape == (0,) and dw.dtype == np.float32


def test_functional_bf16_dlpack_producer_on_cpu(rng):
    """A generic DLPack producer of CPU bfloat16 (NumPy cannot import it) works: NumPy bf16 out."""
    import ml_dtypes

    import mhc_cupy

    class Producer:  # not a torch tensor: only the DLPack protocol
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    x = torch.from_numpy(rng.standard_normal((3, 8))).to(torch.bfloat16)
    out = mhc_cupy.rmsnorm_fwd(Producer(x))
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    want = mhc_cupy.rmsnorm_fwd(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(out.view(np.int16), want.view(np.int16))


def test_sinkhorn_logit_scale_1000_and_eps_0_as_documented(rng):
    """OPS.md section 1, edge cases: at logit scale ~1000 a column that is no row's maximum
    stays 0 (finite, not doubly stochastic, ~zero gradient); eps = 0 then gives NaN."""
    L = np.array([[0.0, 1000.0, -500.0], [900.0, 0.0, -1000.0], [0.0, 950.0, 10.0]])[None]  # maxima: 1, 0, 1
    P = R.sinkhorn_knopp_fwd(L)
    assert np.isfinite(P).all()
    np.testing.assert_array_equal(P[0, :, 2], 0.0)  # column 2 holds no row maximum
    np.testing.assert_allclose(P.sum(-2)[0], [1.0, 1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(P[0, [0, 2], 1], [0.5, 0.5], atol=1e-7)  # two rows share column 1: 1/2 each
    G = rng.standard_normal(L.shape)
    for mode in ("unrolled", "implicit"):
        np.testing.assert_allclose(R.sinkhorn_knopp_bwd(G, L, grad_mode=mode), 0.0, atol=1e-6)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.isnan(R.sinkhorn_knopp_fwd(L, eps=0.0)).all()
        L0 = rng.standard_normal((2, 4, 4))
        np.testing.assert_allclose(R.sinkhorn_knopp_fwd(L0, eps=0.0).sum(-2), 1.0, atol=1e-12)
        assert np.isnan(R.rmsnorm_fwd(np.zeros((1, 4)), eps=0.0)).all()
