"""The ``convention="deepseek"`` layer (OPS.md section 10): torch ``MHC`` and JAX ``mhc_layer`` against
``deepseek_oracle.layer`` (plain float64 torch written from the convention's statement,
independently of ``mhc_cupy.reference``; gradients by torch autograd), and the DeepSeek parameter
layout (``from_deepseek`` / ``to_deepseek``, docs/DEEPSEEK.md): CPU and GPU cases.  The head is
in tests/test_head.py, the deepseek convention of each op in tests/test_deepseek.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhc_cupy.torch import MHC, MHCHead

import deepseek_oracle as O
from deepseek_oracle import LEADS, NS, layer_params, t64
from gpu.helpers import needs_torch
from harness import TOL, assert_close, gpu_test

GPU = gpu_test()


# ============================================================ CPU
# ------------------------------------------------------------------ the layer in DeepSeek's layout
def test_mhc_round_trip_bitwise(rng):
    hc_fn, hc_scale, hc_base = (torch.tensor(a, dtype=torch.float32) for a in layer_params(rng, 4, 33))
    layer = MHC.from_deepseek(hc_fn, hc_scale, hc_base)
    assert (layer.dim, layer.n_streams, layer.convention) == (33, 4, "deepseek")
    assert (layer.num_iters, layer.eps, layer.rms_eps, layer.hc_eps, layer.post_mult) == (20, 1e-6, 1e-6, 1e-6, 2.0)
    assert torch.equal(layer.phi, hc_fn.t()) and torch.equal(layer.alpha, hc_scale) and torch.equal(layer.bias, hc_base)
    for a, b in zip(layer.to_deepseek(), (hc_fn, hc_scale, hc_base)):
        assert a.dtype == torch.float32 and a.is_contiguous() and torch.equal(a, b)
    assert MHC.from_deepseek(hc_fn, hc_scale, hc_base, convention="paper").convention == "paper"
    with pytest.raises(ValueError, match="hc_fn"):
        MHC.from_deepseek(hc_fn[:-1], hc_scale, hc_base)
    with pytest.raises(ValueError, match="hc_base"):
        MHC.from_deepseek(hc_fn, hc_scale, hc_base[:-1])
    with pytest.raises(TypeError, match="hc_scale"):
        MHC.from_deepseek(hc_fn, [1.0, 1.0, 1.0], hc_base)
    with pytest.raises(ValueError, match=r"hc_fn has shape \(24, 0\); it needs .* C >= 1"):  # issue 41 item 11
        MHC.from_deepseek(hc_fn[:, :0], hc_scale, hc_base)
    with pytest.raises(ValueError, match=r"hc_fn has shape \(4, 0\); it needs \[n, n\*C\] with n >= 1 and C >= 1"):
        MHCHead.from_deepseek(torch.zeros(4, 0), torch.zeros(1), torch.zeros(4))
    with pytest.raises(ValueError, match="num_iters"):
        MHC(33, 4, num_iters=0, convention="deepseek")


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("at", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int32])
def test_torch_from_deepseek_refuses_complex_bool_and_integer(rng, head, at, dtype):
    """A complex hc_fn, hc_scale or hc_base: TypeError naming it (copy_ dropped the imaginary part); a bool or
    integer one too (its values were taken for weights)."""
    n, C = 2, 3
    ds = ([torch.zeros(n, n * C), torch.ones(1), torch.zeros(n)] if head else
          [torch.tensor(a, dtype=torch.float32) for a in layer_params(rng, n, C)])
    ds[at] = ds[at].to(dtype) + 1j if dtype.is_complex else ds[at].to(dtype)
    name = ("hc_fn", "hc_scale", "hc_base")[at]
    with pytest.raises(TypeError, match=rf"^{name} has dtype {dtype}; it needs a real floating-point dtype"):
        (MHCHead if head else MHC).from_deepseek(*ds)


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; the GPU cases run the CUDA one
def test_jax_round_trip_bitwise(rng):
    pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    ds = [np.asarray(a, np.float32) for a in layer_params(rng, 3, 7)]
    params = mj.mhc_from_deepseek(*ds)
    assert params["phi"].shape == (21, 15)
    for a, b in zip(mj.mhc_to_deepseek(params), ds):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(ValueError, match="hc_fn"):
        mj.mhc_from_deepseek(ds[0][:-1], ds[1], ds[2])


class _Sublayer(torch.nn.Module):
    """A small differentiable sublayer [..., C] -> [..., C] (tanh of a fixed linear map)."""

    def __init__(self, C, seed=0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(C, C, generator=torch.Generator().manual_seed(seed)) / C**0.5)

    def forward(self, h):
        return torch.tanh(h @ self.w.to(h.dtype))


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
def test_torch_mhc_deepseek_matches_oracle(rng, lead, n):
    """MHC(convention="deepseek") loaded from DeepSeek-layout parameters: the oracle layer's values and
    gradients (x, hc_fn, hc_scale, hc_base, the sublayer's weight), float32 on the CPU."""
    C = 33
    ds = [torch.tensor(a, dtype=torch.float32) for a in layer_params(rng, n, C)]
    sub = _Sublayer(C)
    layer = MHC.from_deepseek(*ds, sublayer=sub)
    x = torch.tensor(rng.normal(size=lead + (n, C)), dtype=torch.float32, requires_grad=True)
    g = rng.normal(size=x.shape)
    out = layer(x)
    out.backward(torch.tensor(g, dtype=torch.float32))

    ts = [t64(a) for a in (x.detach(), *ds)]
    sub64 = _Sublayer(C).double()
    want = O.layer(*ts, sublayer=sub64)
    want.backward(t64(g, False))
    tol = TOL["float32_layer"].value * 10  # 20 float32 Sinkhorn steps between the layer's float32 ops
    assert_close(out, want, tol, "out")
    got = (x.grad, layer.phi.grad.t(), layer.alpha.grad, layer.bias.grad, sub.w.grad)
    for a, w, name in zip(got, [t.grad for t in ts] + [sub64.w.grad], ("dx", "dhc_fn", "dhc_scale", "dhc_base", "dw")):
        assert_close(a, w, tol, name)


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; the GPU cases run the CUDA one
@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_jax_mhc_layer_deepseek_matches_oracle(rng, n):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import mhc_cupy.jax as mj

    C, lead = 33, (3,)
    ds = [np.asarray(a, np.float32) for a in layer_params(rng, n, C)]
    w = rng.normal(size=(C, C)).astype(np.float32) / np.sqrt(C)
    x = jnp.asarray(rng.normal(size=lead + (n, C)), jnp.float32)
    g = rng.normal(size=x.shape)

    def f(params, x, w):
        return mj.mhc_layer(params, x, lambda h: jnp.tanh(h @ w), convention="deepseek")

    out, vjp = jax.vjp(f, mj.mhc_from_deepseek(*ds), x, jnp.asarray(w))
    dp, dx, dw = vjp(jnp.asarray(g, jnp.float32))
    ts = [t64(a) for a in (x, *ds)]
    w64 = t64(w)
    want = O.layer(*ts, sublayer=lambda h: torch.tanh(h @ w64))
    want.backward(t64(g, False))
    tol = TOL["float32_layer"].value * 10
    assert_close(out, want, tol, "out")
    got = (dx, dp["phi"].T, dp["alpha"], dp["bias"], dw)
    for a, want_g, name in zip(got, [t.grad for t in ts] + [w64.grad], ("dx", "dhc_fn", "dhc_scale", "dhc_base", "dw")):
        assert_close(a, want_g, tol, name)


def test_post_mult_below_one_and_post_init_range():
    """post_mult <= 1 is a valid setting (H_post at init defaults to post_mult / 2); an explicit
    post_init outside (0, post_mult) is refused naming both."""
    import mhc_cupy.torch as mt

    for post_mult in (1.0, 0.5):
        layer = mt.MHC(8, 4, post_mult=post_mult)
        H_post = post_mult * torch.sigmoid(layer.bias[4:8].detach())
        torch.testing.assert_close(H_post, torch.full((4,), post_mult / 2))
    torch.testing.assert_close(mt.MHC(8, 4).bias[4:8], torch.zeros(4))  # default: b_post = 0 as before
    with pytest.raises(ValueError, match=r"post_init .* post_mult = 1.0"):
        mt.MHC(8, 4, post_init=1.5, post_mult=1.0)
    hc_fn, hc_scale, hc_base = mt.MHC(8, 4, convention="deepseek").to_deepseek()
    layer = mt.MHC.from_deepseek(hc_fn, hc_scale, hc_base, post_mult=1.0)
    assert torch.equal(layer.bias, hc_base)


def test_pre_init_is_h_pre_with_hc_eps():
    """pre_init is H_pre at init, hc_eps included (H_pre = sigmoid(b_pre) + hc_eps): with phi zero,
    the pre op gives exactly pre_init (it gave pre_init + hc_eps); pre_init outside (hc_eps, 1 + hc_eps)
    and post_init with post_mult 0 (H_post is 0) are refused, naming them.  Default unchanged."""
    import mhc_cupy as m
    import mhc_cupy.torch as mt

    for hc_eps, pre in ((0.5, 0.8), (0.1, 0.3), (0.0, 0.3)):
        layer = mt.MHC(8, 4, pre_init=pre, convention="deepseek", hc_eps=hc_eps)
        with torch.no_grad():
            layer.phi.zero_()
        x = torch.randn(2, 4, 8)
        with torch.no_grad():  # (the functional op records no graph: detached coefficients, no warning)
            H_pre = m.mhc_pre_op_fwd(x, *layer.coefficients(x), convention="deepseek", hc_eps=hc_eps)[1]
        torch.testing.assert_close(H_pre, torch.full((2, 4), pre), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.sigmoid(mt.MHC(8, 4, convention="deepseek", hc_eps=0.1).bias[:4]),
                               torch.full((4,), 0.25))  # default: sigmoid(b_pre) = 1/n, as before
    for bad in (0.3, 1.6):
        with pytest.raises(ValueError, match=r"pre_init .* \(hc_eps, 1 \+ hc_eps\)"):
            mt.MHC(8, 4, pre_init=bad, convention="deepseek", hc_eps=0.5)
    with pytest.raises(ValueError, match=r"pre_init must be finite, got nan"):
        mt.MHC(8, 4, pre_init=float("nan"), convention="deepseek", hc_eps=0.5)
    with pytest.raises(ValueError, match=r"post_init .*post_mult 0"):
        mt.MHC(8, 4, post_init=1.5, post_mult=0.0)
    mt.MHC(8, 4, post_mult=0.0)  # without post_init: fine


def test_layer_halves_must_share_the_convention():
    """mhc_layer_post under another convention than mhc_layer_pre raises (its dx would be folded
    in the pre half's convention)."""
    import mhc_cupy.torch as mt

    layer = mt.MHC(8, 3)
    x = torch.randn(2, 3, 8, requires_grad=True)
    layer_in, x_link, H_post, H_res = mt.mhc_layer_pre(x, layer.phi, layer.alpha, layer.bias, convention="deepseek")
    with pytest.raises(ValueError, match="convention='paper' but mhc_layer_pre ran with convention='deepseek'"):
        mt.mhc_layer_post(layer_in, x_link, H_post, H_res, convention="paper")
    out = mt.mhc_layer_post(layer_in, x_link, H_post, H_res, convention="deepseek")
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mode", ["no_grad", "frozen", "autograd", "compiled", "compiled_no_grad"])
def test_layer_halves_convention_checked_in_every_mode(mode):
    """The convention mismatch raises whether or not autograd records (issue 41 item 2: under no_grad or
    with frozen parameters the post half silently ran the paper post op), also under torch.compile
    (checked while tracing: a ValueError, or under fullgraph=True Dynamo's error carrying it)."""
    import contextlib

    import mhc_cupy.torch as mt

    layer = mt.MHC(8, 3)
    params = [p.detach() for p in (layer.phi, layer.alpha, layer.bias)] if mode == "frozen" else \
        [layer.phi, layer.alpha, layer.bias]
    x = torch.randn(2, 3, 8)

    def run(x, phi, alpha, bias, convention):
        layer_in, x_link, H_post, H_res = mt.mhc_layer_pre(x, phi, alpha, bias, convention="deepseek")
        return mt.mhc_layer_post(layer_in, x_link, H_post, H_res, convention=convention)

    compiled = mode.startswith("compiled")
    good = torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run  # no graph break
    bad = torch.compile(run, backend="aot_eager") if compiled else run
    match = "convention='paper' but mhc_layer_pre ran with convention='deepseek'"
    with torch.no_grad() if mode.endswith("no_grad") else contextlib.nullcontext():
        layer_in, _, H_post, H_res = mt.mhc_layer_pre(x, *params, convention="deepseek")
        want = mt.mhc_post_op(layer_in, x, H_post, H_res, convention="deepseek")
        torch.testing.assert_close(good(x, *params, "deepseek"), want)
        with pytest.raises(ValueError, match=match):
            bad(x, *params, "paper")
        if compiled:
            with pytest.raises(Exception, match=match):
                good(x, *params, "paper")


# ============================================================ GPU
# ------------------------------------------------------------------ torch: MHCHead and MHC(convention="deepseek")


@GPU
@needs_torch
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_torch_mhc_deepseek_cuda(rng, n, dt):
    """MHC(convention="deepseek") from DeepSeek-layout parameters on CUDA (fused pieces; the post op's dx
    as g for n <= 4, as grad_x for n = 8) against the plain-torch float64 oracle layer: values and gradients."""
    import torch

    import deepseek_oracle as O
    from mhc_cupy.torch import MHC, MHCHead

    from harness import TOL

    C, T = 64, 127
    m_ = n * n + 2 * n
    ds = [torch.tensor(rng.standard_normal((m_, n * C)) / np.sqrt(n * C), dtype=torch.float32),
          torch.tensor(rng.uniform(0.5, 2.0, 3), dtype=torch.float32),
          torch.tensor(rng.standard_normal(m_) * 0.5, dtype=torch.float32)]
    layer = MHC.from_deepseek(*(t.cuda() for t in ds))
    tdt = getattr(torch, dt)
    x = torch.tensor(rng.standard_normal((T, n, C)), dtype=tdt, device="cuda", requires_grad=True)
    g = torch.tensor(rng.standard_normal((T, n, C)), dtype=tdt, device="cuda")
    out = layer(x)
    out.backward(g)
    ts = [t.double().requires_grad_() for t in (x.detach().cpu(), *ds)]
    want = O.layer(*ts)
    want.backward(g.double().cpu())
    tol_out, tol_grad = TOL["layer_gpu"][dt]
    assert out.dtype == tdt
    assert_close(out.detach().cpu(), want.detach(), tol_out, "out")
    got = (x.grad, layer.phi.grad.t(), layer.alpha.grad, layer.bias.grad)
    for a, t, name in zip(got, ts, ("dx", "dhc_fn", "dhc_scale", "dhc_base")):
        assert_close(a.cpu(), t.grad, tol_grad, name)


@GPU
@needs_torch
def test_torch_mhc_deepseek_deterministic(rng):
    """MHC(convention="deepseek") on CUDA: a repeated forward and backward gives the same bits."""
    import torch

    from mhc_cupy.torch import MHC, MHCHead

    layer = MHC(256, 4, convention="deepseek", device="cuda")
    x = torch.tensor(rng.standard_normal((2000, 4, 256)), dtype=torch.bfloat16, device="cuda")
    g = torch.randn(x.shape, dtype=torch.bfloat16, device="cuda")

    def run():
        xi = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        out = layer(xi)
        out.backward(g)
        return [out.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    first = run()
    for a, b in zip(first, run()):
        assert torch.equal(a, b)  # finite values: equal means the same bits
