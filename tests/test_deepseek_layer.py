"""The DeepSeek-V4 head and layer on the CPU: ``mhc_head`` (OPS.md section 11) at every level
(NumPy reference, functional API, torch ``mhc_head`` / ``MHCHead``, JAX ``mhc_head``), the
``convention="deepseek"`` layer (torch ``MHC``, JAX ``mhc_layer``) and the DeepSeek parameter
layout (``from_deepseek`` / ``to_deepseek``, docs/DEEPSEEK.md).

The oracle is ``deepseek_oracle`` (plain float64 torch written from the convention's statement,
independently of ``mhc_cupy.reference``): ``head`` and ``layer``, gradients by torch autograd.
"""

import numpy as np
import pytest
import torch

import deepseek_oracle as O
import mhc_cupy
from mhc_cupy import reference as R
from mhc_cupy.torch import MHC, MHCHead, mhc_head

from harness import TOL, assert_close, assert_close_uniform, f64
from test_deepseek import oracle_vjp, t64

LEADS = [(1,), (3,), (127,)]
NS = [1, 2, 3, 4, 5, 8]


def oracle(fn, inputs, g):
    """(output, input gradients) of ``fn`` in float64 torch for the incoming gradient ``g``."""
    (out,), grads = oracle_vjp(fn, inputs, [g])
    return out, grads


def head_params(rng, n, C):
    """hc_fn [n, nC], hc_scale [1], hc_base [n] at a realistic scale (logits of order 1)."""
    return rng.normal(size=(n, n * C)) / np.sqrt(n * C), rng.uniform(0.5, 2.0, size=1), rng.normal(size=n) * 0.5


def layer_params(rng, n, C):
    m = n * n + 2 * n
    return rng.normal(size=(m, n * C)) / np.sqrt(n * C), rng.uniform(0.5, 2.0, size=3), rng.normal(size=m) * 0.5


def f32(*arrays):
    return [np.asarray(a, dtype=np.float32) for a in arrays]


# ------------------------------------------------------------------ head: reference and functional API
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("C", [7, 33])
def test_reference_head(rng, lead, n, C):
    x = rng.normal(size=lead + (n, C))
    p = head_params(rng, n, C)
    g = rng.normal(size=lead + (C,))
    want, dwant = oracle(O.head, [x, *p], g)
    assert_close_uniform(R.mhc_head_fwd(x, *p), want, 1e-12)
    for got, w, name in zip(R.mhc_head_bwd(g, x, *p), dwant, ("dx", "dhc_fn", "dhc_scale", "dhc_base")):
        assert_close_uniform(got, w, 1e-10, name)
    # other eps settings reach the maths
    want, dwant = oracle(lambda *a: O.head(*a, rms_eps=0.5, hc_eps=0.25), [x, *p], g)
    assert_close_uniform(R.mhc_head_fwd(x, *p, 0.5, 0.25), want, 1e-12)
    for got, w in zip(R.mhc_head_bwd(g, x, *p, 0.5, 0.25), dwant):
        assert_close_uniform(got, w, 1e-10)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 4, 5])
def test_functional_head_cpu(rng, dtype, n):
    """The functional API on CPU inputs: the float64 reference rounded once to the activation dtype."""
    import ml_dtypes

    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    C = 33
    x = rng.normal(size=(3, n, C)).astype(np_dt)
    p = f32(*head_params(rng, n, C))
    g = rng.normal(size=(3, C)).astype(np_dt)
    want, dwant = oracle(O.head, [f64(x), *p], f64(g))
    out = mhc_cupy.mhc_head_fwd(x, *p)
    assert out.dtype == x.dtype
    assert_close(out, want, TOL["rounding"][dtype], "out")
    dx, dfn, dscale, dbase = mhc_cupy.mhc_head_bwd(g, x, *p)
    assert dx.dtype == x.dtype and dfn.dtype == dscale.dtype == dbase.dtype == np.float32
    assert_close(dx, dwant[0], TOL["rounding"][dtype], "dx")
    for got, w, name in zip((dfn, dscale, dbase), dwant[1:], ("dhc_fn", "dhc_scale", "dhc_base")):
        assert_close(got, w, TOL["float32_unit"].value * 4, name)


def test_head_zero_tokens_and_bad_input(rng):
    n, C = 3, 5
    p = f32(*head_params(rng, n, C))
    x = np.zeros((0, n, C), np.float32)
    assert mhc_cupy.mhc_head_fwd(x, *p).shape == (0, C)
    dx, dfn, dscale, dbase = mhc_cupy.mhc_head_bwd(np.zeros((0, C), np.float32), x, *p)
    assert dx.shape == (0, n, C) and not dfn.any() and not dscale.any() and not dbase.any()
    x = rng.normal(size=(2, n, C)).astype(np.float32)
    with pytest.raises(ValueError, match="hc_fn"):
        mhc_cupy.mhc_head_fwd(x, p[0].T.copy(), p[1], p[2])  # our phi layout, not DeepSeek's
    with pytest.raises(ValueError, match="hc_scale"):
        mhc_cupy.mhc_head_fwd(x, p[0], np.ones(3, np.float32), p[2])
    with pytest.raises(TypeError, match="hc_base"):
        mhc_cupy.mhc_head_fwd(x, p[0], p[1], p[2].astype(np.float64))
    with pytest.raises(ValueError, match="grad"):
        mhc_cupy.mhc_head_bwd(np.zeros((2, C + 1), np.float32), x, *p)
    with pytest.raises(ValueError, match="hc_eps"):
        mhc_cupy.mhc_head_fwd(x, *p, hc_eps=-1.0)


# ------------------------------------------------------------------ head: torch and JAX
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_torch_head_module(rng, lead, n):
    C = 33
    head = MHCHead.from_deepseek(*(torch.tensor(a, dtype=torch.float32) for a in head_params(rng, n, C)))
    assert (head.dim, head.n_streams, head.rms_eps, head.hc_eps) == (C, n, 1e-6, 1e-6)
    x = torch.tensor(rng.normal(size=lead + (n, C)), dtype=torch.float32, requires_grad=True)
    g = rng.normal(size=lead + (C,))
    out = head(x)
    out.backward(torch.tensor(g, dtype=torch.float32))
    want, dwant = oracle(O.head, [x.detach(), *(p.detach() for p in head.to_deepseek())], g)
    tol = TOL["float32_layer"].value
    assert_close(out, want, tol, "out")
    for got, w, name in zip((x.grad, head.hc_fn.grad, head.hc_scale.grad, head.hc_base.grad), dwant,
                            ("dx", "dhc_fn", "dhc_scale", "dhc_base")):
        assert_close(got, w, tol, name)


def test_torch_head_compiled_matches_eager(rng):
    """torch.compile (the custom ops torch.ops.mhc_cupy.mhc_head_fwd / _bwd) gives the eager values."""
    n, C = 4, 33
    p = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in head_params(rng, n, C)]
    x = torch.tensor(rng.normal(size=(3, n, C)), dtype=torch.float32, requires_grad=True)
    eager = mhc_head(x, *p)
    eager.sum().backward()
    grads = [t.grad.clone() for t in (x, *p)]
    for t in (x, *p):
        t.grad = None
    compiled = torch.compile(lambda *a: mhc_head(*a), backend="eager", fullgraph=True)(x, *p)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip((t.grad for t in (x, *p)), grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_head_conventions_and_round_trip(rng):
    head = MHCHead(33, 4)
    again = MHCHead.from_deepseek(*head.to_deepseek())
    for a, b in zip(head.to_deepseek(), again.to_deepseek()):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    paper = MHCHead(33, 4, convention="paper")
    assert (paper.rms_eps, paper.hc_eps) == (1e-5, 0.0)
    x = torch.randn(2, 4, 33)
    # at initialisation the head is the stream mean (up to the small dynamic term and hc_eps)
    torch.testing.assert_close(MHCHead(33, 4, scale_init=0.0)(x), x.mean(-2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hc_fn"):
        MHCHead.from_deepseek(torch.zeros(4, 130), torch.zeros(1), torch.zeros(4))
    with pytest.raises(ValueError, match="hc_scale"):
        MHCHead.from_deepseek(torch.zeros(4, 132), torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="convention"):
        MHCHead(33, 4, convention="v4")
    with pytest.raises(ValueError, match="MHCHead"):
        head(torch.randn(2, 3, 33))


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; tests/gpu has the CUDA one
@pytest.mark.parametrize("n", [1, 4, 5])
def test_jax_head(rng, n):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import mhc_cupy.jax as mj

    C = 33
    params = {k: jnp.asarray(a, jnp.float32) for k, a in zip(("hc_fn", "hc_scale", "hc_base"), head_params(rng, n, C))}
    x = jnp.asarray(rng.normal(size=(3, n, C)), jnp.float32)
    g = rng.normal(size=(3, C))
    out, vjp = jax.vjp(lambda p, x: mj.mhc_head(p, x), params, x)
    dp, dx = vjp(jnp.asarray(g, jnp.float32))
    want, dwant = oracle(O.head, [x, params["hc_fn"], params["hc_scale"], params["hc_base"]], g)
    tol = TOL["float32_layer"].value
    assert_close(out, want, tol, "out")
    for got, w, name in zip((dx, dp["hc_fn"], dp["hc_scale"], dp["hc_base"]), dwant, ("dx", "fn", "scale", "base")):
        assert_close(got, w, tol, name)
    init = mj.mhc_head_init(jax.random.PRNGKey(0), C, n)
    assert {k: v.shape for k, v in init.items()} == {"hc_fn": (n, n * C), "hc_scale": (1,), "hc_base": (n,)}


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
    with pytest.raises(ValueError, match="num_iters"):
        MHC(33, 4, num_iters=0, convention="deepseek")


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; tests/gpu has the CUDA one
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


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; tests/gpu has the CUDA one
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
