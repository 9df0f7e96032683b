"""The fused layer pieces (OPS.md section 9): ``mhc_layer_pre_fwd`` / ``mhc_layer_post_bwd`` /
``mhc_layer_pre_bwd`` and their torch wrappers ``mhc_layer_pre`` / ``mhc_layer_post``.

* CPU: the functional pieces (NumPy reference) against float64 torch autograd of the plain
  torch layer ``mhc_reference`` with a tanh sublayer, on random data of realistic scale
  (logits of scale ~1), odd token counts and C, n = 1..5, the post op's dx given to
  ``mhc_layer_pre_bwd`` as g (grad_out) or as ``mhc_post_op_bwd``'s dx (grad_x); the torch
  wrappers give the same gradients when x is also used outside the layer and when only part
  of the output is used; double backward raises.
* GPU (marked ``gpu``): the kernels (tensor-core GEMM and backward, pre / post kernels)
  against the float64 reference, every activation dtype, n = 1..32, NaN-poisoned outputs,
  bitwise-repeatable results; tolerances from tests/harness.py (TOL["activation"]: one rounding
  of an activation output; TOL["coefficient"]: float32 sums) on the scale of the terms summed.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mhc_cupy as m
import mhc_cupy.torch as mt
from mhc_cupy import reference as R
from mhc_cupy.ops import coeffs
from mhc_cupy.torch.reference import mhc_reference

CASES = [((1,), 1, 7), ((3,), 2, 33), ((127,), 4, 64), ((2, 5), 3, 16), ((9,), 5, 12)]


def _params(rng, n, C, dtype=np.float32):
    K = n * n + 2 * n
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(dtype)
    alpha = np.array([0.7, 1.3, 1.1], dtype)
    bias = (0.5 * rng.standard_normal(K)).astype(dtype)
    return phi, alpha, bias


def _torch_reference(x, phi, alpha, bias, g, num_iters=20, eps=1e-8, rms_eps=1e-5):
    """out and (dx, dphi, dalpha, dbias) of the tanh layer by float64 torch autograd."""
    ts = [torch.tensor(np.asarray(v, np.float64), requires_grad=True) for v in (x, phi, alpha, bias)]
    out = mhc_reference(*ts, torch.tanh, num_iters, eps, rms_eps)
    out.backward(torch.tensor(np.asarray(g, np.float64)))
    return out.detach().numpy(), [t.grad.numpy() for t in ts]


def _functional_layer(x, phi, alpha, bias, g, post_dx="grad_out"):
    """The tanh layer from the pieces; post_dx: how the post op's dx reaches mhc_layer_pre_bwd
    (grad_out: g, folded there; grad_x: mhc_post_op_bwd's dx, added there)."""
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
    y = np.tanh(np.asarray(layer_in, np.float64)).astype(x.dtype)
    out = m.mhc_post_op_fwd(y, x, H_post, H_res)
    if post_dx == "grad_out":
        dy, dH_post, dH_res = m.mhc_layer_post_bwd(g, y, x, H_post, H_res)
        kw = {}
    else:
        dy, dx_post, dH_post, dH_res = m.mhc_post_op_bwd(g, y, x, H_post, H_res)
        g, kw = None, {"grad_x": dx_post}
    g_li = (np.asarray(dy, np.float64) * (1 - np.asarray(y, np.float64) ** 2)).astype(x.dtype)
    grads = m.mhc_layer_pre_bwd(g_li, g, dH_post, dH_res, x, phi, alpha, bias, stats, H_pre, H_res, **kw)
    return out, grads, stats


@pytest.mark.parametrize("post_dx", ["grad_out", "grad_x"])
@pytest.mark.parametrize("lead,n,C", CASES)
def test_functional_pieces_match_autograd(rng, lead, n, C, post_dx):
    x = rng.standard_normal(lead + (n, C)).astype(np.float32)
    phi, alpha, bias = _params(rng, n, C)
    g = rng.standard_normal(lead + (n, C)).astype(np.float32)
    out, grads, stats = _functional_layer(x, phi, alpha, bias, g, post_dx)
    out_ref, grads_ref = _torch_reference(x, phi, alpha, bias, g)
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    for got, ref, name in zip(grads, grads_ref, ("dx", "dphi", "dalpha", "dbias")):
        assert got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * (np.abs(ref).max() + 1), err_msg=name)
    xt = x.reshape(lead + (n * C,)).astype(np.float64)
    np.testing.assert_allclose(stats[..., :-1], xt @ phi.astype(np.float64), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[..., -1], (xt**2).sum(-1), rtol=1e-5)


def test_cpu_stats_keep_an_overflowing_sum_of_squares_scaled(rng):
    """OPS.md section 8: a token whose float32 sum of squares overflows is saved in stats[..., -1]
    as -sum((2^-100 x~)^2), on the CPU as on the GPU (it was inf there); the other token's stats
    stay plain sums and the outputs are those of the separate ops."""
    x = rng.standard_normal((2, 2, 3)).astype(np.float32)
    x[0] *= np.float32(1e20)  # sum of squares ~ 1e40 > float32 max
    phi, alpha, bias = _params(rng, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from a cast
        layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
    x64 = x.astype(np.float64).reshape(2, 6)
    np.testing.assert_allclose(stats[0, -1], -((2.0**-100 * x64[0]) ** 2).sum(), rtol=1e-6)
    np.testing.assert_allclose(stats[1, -1], (x64[1] ** 2).sum(), rtol=1e-6)
    assert np.isfinite(stats).all() and stats[0, -1] < 0 < stats[1, -1]
    for got, want in zip((layer_in, H_pre, H_post, H_res), m.mhc_pre_op_fwd(x, *m.mhc_coeffs_fwd(x, phi, alpha, bias))):
        np.testing.assert_allclose(got, want, rtol=1e-6)  # (the coefficients rounded to float32 here)


def _layer_torch(n, C, seed=0):
    torch.manual_seed(seed)
    layer = mt.MHC(C, n, torch.nn.Tanh(), alpha_init=1.0)
    with torch.no_grad():
        layer.bias.add_(torch.randn_like(layer.bias))
    return layer


def _ref(layer, v):
    """The layer in float64 plain torch (parameters as float64 leaves of their own)."""
    p64 = [q.detach().double().requires_grad_() for q in (layer.phi, layer.alpha, layer.bias)]
    return mhc_reference(v, *p64, torch.tanh, layer.num_iters, layer.eps, layer.rms_eps), p64


def _close(a, b, name):
    b = b.to(a.dtype)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max() + 1), msg=name)


@pytest.mark.parametrize("n", [3, 5])  # x_link carries g (n <= 4) or the post op's dx (n > 4)
def test_torch_fused_layer_x_used_elsewhere_and_partial_output(n):
    """What the post piece hands along x_link must not disturb x's other gradients."""
    C = 10
    layer = _layer_torch(n, C)
    x = torch.randn(4, 5, n, C, requires_grad=True)
    xr = x.detach().double().requires_grad_()

    def loss(out, x):
        return (out[..., 1:, :] ** 2).sum() + (x**3).sum() + out[..., 0, :].sin().sum()

    loss(layer(x), x).backward()
    out_ref, p64 = _ref(layer, xr)
    grads_ref = torch.autograd.grad(loss(out_ref, xr), (xr, *p64))
    got = (x.grad, layer.phi.grad, layer.alpha.grad, layer.bias.grad)
    for a, b, name in zip(got, grads_ref, ("dx", "dphi", "dalpha", "dbias")):
        _close(a, b, name)


@pytest.mark.parametrize("n,C", [(3, 10), (5, 7)])
def test_torch_layer_separate_ops(n, C):
    """MHC built under kernel_choice(fused=False) (what the benchmark times beside the pieces):
    coefficients -> pre op -> F -> post op, the same values and gradients."""
    from mhc_cupy._kernel_choice import kernel_choice

    with kernel_choice(fused=False):
        layer = _layer_torch(n, C)
    x = torch.randn(4, 3, n, C, requires_grad=True)
    xr = x.detach().double().requires_grad_()

    def loss(out, x):
        return (out[..., 1:, :] ** 2).sum() + (x**3).sum() + out[..., 0, :].sin().sum()

    out = layer(x)
    loss(out, x).backward()
    out_ref, p64 = _ref(layer, xr)
    _close(out, out_ref.detach(), "out")
    grads_ref = torch.autograd.grad(loss(out_ref, xr), (xr, *p64))
    got = (x.grad, layer.phi.grad, layer.alpha.grad, layer.bias.grad)
    for a, b, name in zip(got, grads_ref, ("dx", "dphi", "dalpha", "dbias")):
        _close(a, b, name)


@pytest.mark.parametrize("n", [3, 5])
def test_torch_fused_layer_frozen_mhc_trainable_sublayer(n, monkeypatch):
    """Frozen mHC parameters and an x without grad: x_link needs no gradient, so the post piece's
    backward skips the post op's dx (mhc_post_op_bwd not called); the sublayer's weight gets its
    gradient."""
    from mhc_cupy.torch import functions

    real = functions._call  # the layer pieces' kernel calls

    def no_dx(name, *args):
        if name == "mhc_post_op_bwd":
            raise AssertionError("the post op's dx was computed though nothing needs it")
        return real(name, *args)

    monkeypatch.setattr(functions, "_call", no_dx)
    C = 6
    torch.manual_seed(0)
    lin = torch.nn.Linear(C, C)
    layer = mt.MHC(C, n, lin, alpha_init=1.0).requires_grad_(False)
    lin.requires_grad_(True)
    x = torch.randn(5, n, C)
    out = layer(x)
    (gw,) = torch.autograd.grad((out**2).sum(), [lin.weight])
    lin64 = torch.nn.Linear(C, C).double()
    lin64.load_state_dict(lin.state_dict())
    p64 = [q.detach().double() for q in (layer.phi, layer.alpha, layer.bias)]
    ref = mhc_reference(x.double(), *p64, lin64, layer.num_iters, layer.eps, layer.rms_eps)
    (gw_ref,) = torch.autograd.grad((ref**2).sum(), [lin64.weight])
    _close(gw, gw_ref, "dW")


def test_torch_fused_layer_two_layers_in_sequence():
    n, C = 2, 6
    l1, l2 = _layer_torch(n, C, 1), _layer_torch(n, C, 2)
    x = torch.randn(7, n, C, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    l2(l1(x)).square().sum().backward()
    (dx,) = torch.autograd.grad(_ref(l2, _ref(l1, xr)[0])[0].square().sum(), (xr,))
    _close(x.grad, dx, "dx")


def test_torch_fused_layer_double_backward_raises():
    layer = _layer_torch(2, 4)
    x = torch.randn(3, 2, 4, requires_grad=True)
    (dx,) = torch.autograd.grad(layer(x).square().sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        dx.sum().backward()


def test_mismatched_gradient_dtypes_raise(rng):
    n, C = 2, 8
    x = rng.standard_normal((3, n, C)).astype(np.float32)
    phi, alpha, bias = _params(rng, n, C)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
    with pytest.raises(TypeError, match="grad_layer_in"):
        m.mhc_layer_pre_bwd(layer_in.astype(np.float16), x, None, None, x, phi, alpha, bias, stats, H_pre, H_res)
    with pytest.raises(TypeError, match="grad_x has dtype float16"):
        m.mhc_layer_pre_bwd(layer_in, None, None, None, x, phi, alpha, bias, stats, H_pre, H_res,
                            grad_x=x.astype(np.float16))
    with pytest.raises(ValueError, match="grad_x"):
        m.mhc_layer_pre_bwd(layer_in, None, None, None, x, phi, alpha, bias, stats, H_pre, H_res, grad_x=x[:, :1])
    with pytest.raises(ValueError, match="stats"):
        m.mhc_layer_pre_bwd(None, None, None, None, x, phi, alpha, bias, stats[:, :-1], H_pre, H_res)


# --------------------------------------------------------------------- GPU
GPU_CASES = [((1,), 1, 7), ((1,), 2, 64), ((3,), 2, 33), ((127,), 4, 64), ((2, 5), 3, 16), ((300,), 4, 1000), ((70,), 4, 4096),
             ((9,), 5, 12), ((127,), 8, 33), ((3, 50), 8, 256), ((40,), 16, 64), ((33,), 13, 1000),
             ((5,), 32, 48)]  # n > 4: split backward (dx with phi streamed: 13, 16, 32), tensor-core post backward


def _gpu_layer(dt, lead, n, C, rng):
    from gpu.helpers import rounded, to_gpu

    x = rounded(rng, lead + (n, C), dt)
    g = rounded(rng, lead + (n, C), dt)
    y = rounded(rng, lead + (C,), dt)
    phi, alpha, bias = _params(rng, n, C)
    g_li = rounded(rng, lead + (C,), dt)
    host = (x, phi, alpha, bias)
    dev = [to_gpu(v) for v in host]
    return host, dev, (to_gpu(g), to_gpu(y), to_gpu(g_li)), (g, y, g_li)


@pytest.mark.gpu
@pytest.mark.parametrize("post_dx", ["grad_out", "grad_x"])
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("lead,n,C", GPU_CASES)
def test_gpu_pieces_match_reference(rng, dt, lead, n, C, post_dx):
    """post_dx: the post op's dx reaches mhc_layer_pre_bwd as g (grad_out, summed there) or as
    mhc_post_op_bwd's dx (grad_x, added there; the reference gets that same rounded dx)."""
    from gpu.helpers import ACT_TOL, COEF_TOL, assert_close, f64, poisoned_allocations, to_host

    (x, phi, alpha, bias), dev, (g_d, y_d, gli_d), (g, y, g_li) = _gpu_layer(dt, lead, n, C, rng)
    with poisoned_allocations():
        layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*dev)
        if post_dx == "grad_out":
            dy, dH_post, dH_res = m.mhc_layer_post_bwd(g_d, y_d, dev[0], H_post, H_res)
            got = m.mhc_layer_pre_bwd(gli_d, g_d, dH_post, dH_res, *dev, stats, H_pre, H_res)
        else:
            dy, dx_post, dH_post, dH_res = m.mhc_post_op_bwd(g_d, y_d, dev[0], H_post, H_res)
            got = m.mhc_layer_pre_bwd(gli_d, None, dH_post, dH_res, *dev, stats, H_pre, H_res, grad_x=dx_post)
    ref_fwd = R.mhc_layer_pre_fwd(x, phi, alpha, bias)
    for a, b, name in zip((layer_in, H_pre, H_post, H_res, stats), ref_fwd,
                          ("layer_in", "H_pre", "H_post", "H_res", "stats")):
        assert_close(a, b, ACT_TOL[dt] if name == "layer_in" else COEF_TOL, name)
    ref_post = R.mhc_post_op_bwd(g, y, x, to_host(H_post), to_host(H_res))
    assert_close(dy, ref_post[0], ACT_TOL[dt], "dy")
    assert_close(dH_post, ref_post[2], COEF_TOL, "dH_post", scale=float(np.abs(f64(g)).sum(-1).mean()))
    assert_close(dH_res, ref_post[3], COEF_TOL, "dH_res", scale=float(np.abs(f64(g)).sum(-1).mean()))
    gx = {} if post_dx == "grad_out" else {"grad_x": to_host(dx_post)}
    ref = R.mhc_layer_pre_bwd(g_li, g if post_dx == "grad_out" else None, to_host(dH_post), to_host(dH_res), x, phi,
                              alpha, bias, None, to_host(H_pre), to_host(H_res), **gx)
    # dx: three terms of similar size summed in float32, rounded once
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], "dx", scale=float(np.sqrt(np.mean(ref[0] ** 2))) + 1e-30)
    assert_close(got[1], ref[1], COEF_TOL, "dphi")
    assert_close(got[2], ref[2], COEF_TOL, "dalpha", scale=float(np.abs(ref[2]).max()) + 1.0)
    assert_close(got[3], ref[3], COEF_TOL, "dbias", scale=float(np.abs(ref[3]).max()) + 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
def test_gpu_pieces_bitwise_repeatable(rng, n):
    import cupy as cp

    _, dev, (g_d, y_d, gli_d), _ = _gpu_layer("bfloat16", (1000,), n, 256, rng)

    def once():
        layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*dev)
        dy, dH_post, dH_res = m.mhc_layer_post_bwd(g_d, y_d, dev[0], H_post, H_res)
        return (layer_in, stats, dy, *m.mhc_layer_pre_bwd(gli_d, g_d, dH_post, dH_res, *dev, stats, H_pre, H_res))

    a, b = once(), once()
    for u, v in zip(a, b):
        assert cp.array_equal(u.view(cp.uint8) if u.dtype.itemsize == 2 else u, v.view(cp.uint8) if
                              v.dtype.itemsize == 2 else v, equal_nan=False)


@pytest.mark.gpu
# the fused tensor-core backward (n <= 4; with 16-bit gradients and C % 8 == 0 it stages them in shared memory,
# zeros where absent), the split one with phi resident (n = 8) and streamed (n = 16, 32) in dx
@pytest.mark.parametrize("n,C", [(4, 64), (8, 40), (16, 40), (32, 24)])
@pytest.mark.parametrize("missing", ["none", "grad_layer_in", "grad_out", "both"])
@pytest.mark.parametrize("with_gx", [False, True])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_gpu_pre_bwd_missing_layer_gradients(rng, dt, n, C, missing, with_gx):
    """A None layer gradient counts as zero in dx (each alone adds its term); grad_x alone too."""
    from gpu.helpers import ACT_TOL, COEF_TOL, assert_close, poisoned_allocations, rounded, to_gpu, to_host

    (x, phi, alpha, bias), dev, (g_d, y_d, gli_d), (g, y, g_li) = _gpu_layer(dt, (37,), n, C, rng)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*dev)
    dH_post, dH_res = (to_gpu_like(rng, H_post), to_gpu_like(rng, H_res))
    use_li = gli_d if missing not in ("grad_layer_in", "both") else None
    use_g = g_d if missing not in ("grad_out", "both") else None
    gx_h = rounded(rng, x.shape, dt) if with_gx else None
    with poisoned_allocations():
        got = m.mhc_layer_pre_bwd(use_li, use_g, dH_post, dH_res, *dev, stats, H_pre, H_res,
                                  grad_x=None if gx_h is None else to_gpu(gx_h))
    ref = R.mhc_layer_pre_bwd(None if use_li is None else g_li, None if use_g is None else g, to_host(dH_post),
                              to_host(dH_res), x, phi, alpha, bias, None, to_host(H_pre), to_host(H_res),
                              grad_x=gx_h)
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], "dx", scale=float(np.sqrt(np.mean(ref[0] ** 2))) + 1e-30)
    assert_close(got[1], ref[1], COEF_TOL, "dphi")


def to_gpu_like(rng, a):
    """A fresh float32 random array of a's shape on the GPU (an incoming coefficient gradient)."""
    from gpu.helpers import to_gpu

    return to_gpu(rng.standard_normal(a.shape).astype(np.float32))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("n", [4, 5])  # the post op's dx folded (n <= 4) or sent as grad_x
def test_torch_fused_layer_compiles_fullgraph(backend, n):
    """MHC (fused pieces) under torch.compile(fullgraph=True): one graph, eager results and gradients."""
    torch._dynamo.reset()
    C = 8
    layer = _layer_torch(n, C)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    for T in (3, 5):
        x = torch.randn(T, n, C, requires_grad=True)
        got, want = compiled(x), layer(x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        g = torch.randn_like(got)
        params = (x, layer.phi, layer.alpha, layer.bias)
        for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def _cuda_layer(n=4):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    C, T = 256, 300
    layer = _layer_torch(n, C).cuda()
    x = torch.randn(T, n, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return layer, x, torch.randn_like(x)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
def test_gpu_fused_layer_compiles(n):
    """On CUDA, inductor fullgraph: eager results (bf16 tolerance: inductor computes the bf16
    sublayer in float32 and rounds once)."""
    torch._dynamo.reset()
    layer, x, g = _cuda_layer(n)
    params = (x, layer.phi, layer.alpha, layer.bias)
    want = layer(x)
    grads = torch.autograd.grad(want, params, g)
    got = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, params, g), grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
def test_gpu_layer_cuda_graph(n):
    """A captured forward + backward of MHC replays bitwise to eager on new inputs."""
    layer, x, g = _cuda_layer(n)
    static_x = x.detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: every kernel compiled / loaded before capture
            torch.autograd.grad(layer(static_x), (static_x, layer.phi), g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static_x)
        dx, dphi = torch.autograd.grad(out, (static_x, layer.phi), g)
    new_x = torch.randn_like(x)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    xe = new_x.detach().requires_grad_()
    dxe, dphie = torch.autograd.grad(layer(xe), (xe, layer.phi), g)
    torch.testing.assert_close(dx, dxe, rtol=0, atol=0)
    torch.testing.assert_close(dphi, dphie, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_jax_layer_matches_plain_jnp(rng, n):
    """mhc_cupy.jax.mhc_layer (one custom_vjp; the post op's dx folded for n <= 4, added for n = 5) against the plain
    jax.numpy layer: values and gradients in x, phi, alpha, bias and the sublayer's own weight
    (closed over by f), under jit(grad) and vmap."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import mhc_cupy.jax as mj
    from mhc_cupy.bench.baselines import jnp_mhc_layer

    C = 12
    phi, alpha, bias = _params(rng, n, C)
    params = {"phi": jnp.asarray(phi), "alpha": jnp.asarray(alpha), "bias": jnp.asarray(bias)}
    x = jnp.asarray(rng.standard_normal((2, 5, n, C)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(C).astype(np.float32))
    g = jnp.asarray(rng.standard_normal((2, 5, n, C)).astype(np.float32))

    def loss(layer, params, x, w):
        return (layer(params, x, lambda li: jnp.tanh(li * w)) * g).sum()

    got = jax.jit(jax.grad(lambda *a: loss(mj.mhc_layer, *a), argnums=(0, 1, 2)))(params, x, w)
    want = jax.grad(lambda *a: loss(jnp_mhc_layer, *a), argnums=(0, 1, 2))(params, x, w)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5 * (float(np.abs(b).max()) + 1))
    out = jax.vmap(lambda xi: mj.mhc_layer(params, xi, jnp.tanh))(x)
    ref = jnp_mhc_layer(params, x, jnp.tanh)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [True, "1e-5", None])
def test_rms_eps_errors_name_rms_eps(rng, bad):
    """A bad rms_eps of the fused pieces is reported under its own name (not the coefficient op's eps)."""
    n, C = 3, 7
    x = rng.standard_normal((2, n, C)).astype(np.float32)
    phi, alpha, bias = _params(rng, n, C)
    with pytest.raises(TypeError, match="rms_eps must be a float"):
        m.mhc_layer_pre_fwd(x, phi, alpha, bias, rms_eps=bad)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
    with pytest.raises(TypeError, match="rms_eps must be a float"):
        m.mhc_layer_pre_bwd(layer_in, None, None, None, x, phi, alpha, bias, stats, H_pre, H_res, rms_eps=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n,C,dt", [((300,), 8, 72, "bfloat16"), ((77,), 6, 40, "float16"), ((50,), 8, 36, "float32"),
                                         ((33,), 5, 24, "bfloat16"), ((130,), 14, 40, "bfloat16"),
                                         ((3, 43), 7, 33, "float16")])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_gpu_dx_tile_kernel_bitwise(rng, monkeypatch, lead, n, C, dt, convention):
    """mhc_coeffs_mma_dx_tile_kernel (phi streamed in K chunks; coeffs._DX_MIN_WARPS above any block
    count) gives the dx of mhc_coeffs_mma_dx_kernel (phi resident; _DX_MIN_WARPS 0) bit for bit, with every layer term
    (g_layer_in, g, grad_x; deepseek: H_res transposed), and the same dphi / dalpha / dbias; C not
    a multiple of 32 and token counts that are not a multiple of a step."""
    from gpu.helpers import to_host

    from mhc_cupy import _dispatch
    from mhc_cupy._kernel_choice import kernel_choice

    (x, phi, alpha, bias), dev, (g_d, y_d, gli_d), _ = _gpu_layer(dt, lead, n, C, rng)
    got = {}
    for mode, min_warps in (("resident", 0), ("tile", 1 << 30)):
        monkeypatch.setattr(coeffs.split_bwd, "_DX_MIN_WARPS", min_warps)
        monkeypatch.setattr(_dispatch, "_plans", {})
        monkeypatch.setattr(_dispatch, "_fast", {})
        with kernel_choice(wg_dx=False):  # the mma.sync dx kernels (bf16 on sm_90a: the wgmma dx)
            layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*dev, convention=convention)
            dy, dx_post, dH_post, dH_res = m.mhc_post_op_bwd(g_d, y_d, dev[0], H_post, H_res, convention=convention)
            got[mode] = [to_host(a) for a in m.mhc_layer_pre_bwd(gli_d, g_d, dH_post, dH_res, *dev, stats, H_pre,
                                                                 H_res, convention=convention, grad_x=dx_post)]
            assert coeffs.backward_layout(int(np.prod(lead)), n, C, n * n + 2 * n, dt).dx_kind == mode
    for a, b, what in zip(got["resident"], got["tile"], ("dx", "dphi", "dalpha", "dbias")):
        assert np.isfinite(a.astype(np.float32)).all(), what
        assert a.tobytes() == b.tobytes(), what
