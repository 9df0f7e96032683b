"""The mHC head, ``mhc_head_fwd`` / ``mhc_head_bwd`` (OPS.md section 11, DeepSeek-V4's ``hc_head``:
n streams to one hidden state), at every level: CPU and GPU cases.

CPU: the NumPy reference, the functional API, torch ``mhc_head`` / ``MHCHead`` (eager and
torch.compile, ``from_deepseek`` / ``to_deepseek``) and JAX ``mhc_head`` against
``deepseek_oracle.head`` (plain float64 torch written from the convention's statement,
independently of ``mhc_cupy.reference``), gradients by torch autograd.

GPU (``gpu_test``: skipped without a GPU, CuPy allocations NaN-poisoned): the kernels against
the float64 reference on inputs rounded to the activation dtype, so what is left is the
kernels' float32 arithmetic:

* out: sum_i w_i x_i with w from a float32 dot product over D = n*C terms (the coefficient
  path's tensor-core GEMM, float32-accurate): ACT_TOL (one rounding) plus the w error, which is
  ~1e-6 relative (see tests/test_coeffs.py), far below bfloat16 / float16 rounding and
  covered for float32 by ACT_TOL's 1e-5.
* dx: w_i g + dH hc_fn - c x, float32, rounded once: 2 ACT_TOL on the scale of its terms.
* dhc_fn, dhc_scale, dhc_base: float32 sums over tokens in a fixed order: COEF_TOL of the root
  sum of squares of their per-token terms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy.torch import MHCHead, mhc_head

import deepseek_oracle as O
from deepseek_oracle import LEADS, NS, head_params, oracle
from gpu.helpers import ACT_TOL, COEF_TOL, needs_torch, rounded, to_gpu, to_host
from harness import TOL, assert_close, assert_close_uniform, f64, gpu_test

GPU = gpu_test()


# ============================================================ CPU
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
    out = m.mhc_head_fwd(x, *p)
    assert out.dtype == x.dtype
    assert_close(out, want, TOL["rounding"][dtype], "out")
    dx, dfn, dscale, dbase = m.mhc_head_bwd(g, x, *p)
    assert dx.dtype == x.dtype and dfn.dtype == dscale.dtype == dbase.dtype == np.float32
    assert_close(dx, dwant[0], TOL["rounding"][dtype], "dx")
    for got, w, name in zip((dfn, dscale, dbase), dwant[1:], ("dhc_fn", "dhc_scale", "dhc_base")):
        assert_close(got, w, TOL["float32_unit"].value * 4, name)


@pytest.mark.parametrize("tokens", [0, 1, 63, 65, 5000, 10**6])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (4, 4096), (8, 4096), (25, 100), (32, 4096)])
def test_dphi_layout(tokens, n, C):
    """dhc_fn's CUDA-core reduction: every column in one chunk of at most 24, every token in one
    split, the float32 partials [splits, n*C, n] bounded (64 MiB)."""
    from mhc_cupy.ops import head

    D = n * C
    kc, ncc, splits, per = head._dphi_layout(tokens, D, n)
    assert 1 <= kc <= 24 and kc * ncc >= n > kc * (ncc - 1)
    assert splits >= 1 and per >= 1
    assert splits * per >= tokens > (splits - 1) * per or tokens == 0
    assert splits == 1 or splits * D * n <= 16 * 2**20


def test_head_zero_tokens_and_bad_input(rng):
    n, C = 3, 5
    p = f32(*head_params(rng, n, C))
    x = np.zeros((0, n, C), np.float32)
    assert m.mhc_head_fwd(x, *p).shape == (0, C)
    dx, dfn, dscale, dbase = m.mhc_head_bwd(np.zeros((0, C), np.float32), x, *p)
    assert dx.shape == (0, n, C) and not dfn.any() and not dscale.any() and not dbase.any()
    x = rng.normal(size=(2, n, C)).astype(np.float32)
    with pytest.raises(ValueError, match="hc_fn"):
        m.mhc_head_fwd(x, p[0].T.copy(), p[1], p[2])  # our phi layout, not DeepSeek's
    with pytest.raises(ValueError, match="hc_scale"):
        m.mhc_head_fwd(x, p[0], np.ones(3, np.float32), p[2])
    with pytest.raises(TypeError, match="hc_base"):
        m.mhc_head_fwd(x, p[0], p[1], p[2].astype(np.float64))
    with pytest.raises(ValueError, match="grad"):
        m.mhc_head_bwd(np.zeros((2, C + 1), np.float32), x, *p)
    with pytest.raises(ValueError, match="hc_eps"):
        m.mhc_head_fwd(x, *p, hc_eps=-1.0)


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


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; the GPU cases run the CUDA one
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

# ============================================================ GPU
DTYPES = ["bfloat16", "float16", "float32"]
# (tokens, C): C = 1 (with n = 32: 32-thread blocks), 7, 33 odd (scalar paths); 64 / 1000 / 4096
# vectorised; T = 1000 with C = 1000 splits D in the forward GEMM and the dhc_fn sum over tokens.
HEAD_SIZES = [(1, 1), (3, 7), (127, 33), (127, 64), (1000, 1000), (3, 4096)]
HEAD_NS = [1, 2, 3, 4, 5, 8, 16, 32]


def _case(rng, lead, n, C, dt):
    D = n * C
    x = rounded(rng, lead + (n, C), dt)
    hc_fn = (rng.standard_normal((n, D)) / np.sqrt(D)).astype(np.float32)
    hc_scale = np.array([0.8], np.float32)
    hc_base = (0.5 * rng.standard_normal(n)).astype(np.float32)
    g = rounded(rng, lead + (C,), dt)
    return x, hc_fn, hc_scale, hc_base, g


def _scales(g, x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """Sizes of the terms behind out, dx, dhc_scale, dhc_base (for the tolerance scales); for out
    (rms(out), sum_i w_i |x_i| elementwise): out = sum_i w_i x_i cancels (a single token at
    C = 1, n = 8 gave |out| ~ 6e-4 from terms ~ 0.5), and each float32 w_i carries its rounding."""
    n, C = x.shape[-2], x.shape[-1]
    xt = f64(x).reshape(-1, n * C)
    g = f64(g).reshape(-1, C)
    H = xt @ f64(hc_fn).T
    rinv = 1 / np.sqrt(np.mean(xt**2, -1, keepdims=True) + rms_eps)
    s = 1 / (1 + np.exp(-(H * rinv * hc_scale[0] + hc_base)))
    gz = np.einsum("tc,tkc->tk", g, xt.reshape(-1, n, C)) * s * (1 - s)
    dH = gz * hc_scale[0] * rinv
    dx_scale = max(float(np.sqrt(np.mean(g**2))), float(np.sqrt(np.mean((dH @ f64(hc_fn)) ** 2))))
    w, xs = s + hc_eps, xt.reshape(-1, n, C)
    out_rms = np.sqrt(np.mean(np.einsum("tk,tkc->tc", w, xs) ** 2))
    out_terms = np.einsum("tk,tkc->tc", w, np.abs(xs)).reshape(x.shape[:-2] + (C,))
    return (out_rms, out_terms), dx_scale, float(np.sqrt(np.sum((gz * H * rinv) ** 2))), float(np.sqrt(np.sum(gz**2) / n))


def _check(rng, lead, n, C, dt, g_dtype=None, x_scale=1.0):
    x, hc_fn, hc_scale, hc_base, g = _case(rng, lead, n, C, dt)
    if x_scale != 1.0:
        x = (f64(x) * x_scale).astype(x.dtype)
    if g_dtype is not None:
        g = g.astype(g_dtype)
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    (out_rms, out_terms), dx_scale, scale_scale, base_scale = _scales(g, x, hc_fn, hc_scale, hc_base)
    # out: the dtype's tolerance of rms(out), plus w to 16 float32 ulps (|err| <= 2^-20 sum_i w_i |x_i|)
    out_scale = out_rms + 2.0**-20 / ACT_TOL[dt] * out_terms
    out = m.mhc_head_fwd(*gpu)
    assert out.dtype == x.dtype
    assert_close(to_host(out), R.mhc_head_fwd(x, hc_fn, hc_scale, hc_base), ACT_TOL[dt], "out", scale=out_scale)
    got = m.mhc_head_bwd(to_gpu(g), *gpu)
    ref = R.mhc_head_bwd(g, x, hc_fn, hc_scale, hc_base)
    assert got[0].dtype == x.dtype
    assert_close(to_host(got[0]), ref[0], 2 * ACT_TOL[dt], "dx", scale=dx_scale)
    assert_close(to_host(got[1]), ref[1], COEF_TOL, "dhc_fn")
    assert_close(to_host(got[2]), ref[2], COEF_TOL, "dhc_scale", scale=scale_scale)
    assert_close(to_host(got[3]), ref[3], COEF_TOL, "dhc_base", scale=base_scale)
    return gpu, g


@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", HEAD_NS)
@pytest.mark.parametrize("T,C", HEAD_SIZES)
def test_head(rng, dt, n, T, C):
    _check(rng, (T,), n, C, dt)


@GPU
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_head_float32_grad(rng, dt):
    """The incoming gradient in float32 with bfloat16 / float16 activations."""
    _check(rng, (127,), 4, 64, dt, g_dtype=np.float32)


@GPU
def test_head_leading_dims_and_misaligned(rng):
    _check(rng, (2, 3, 5), 4, 64, "bfloat16")
    # a view at an odd element offset: no vector path (C % 8 == 0 but the pointer is misaligned)
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (7,), 4, 64, "bfloat16")
    xg = to_gpu(np.concatenate([np.zeros(1, x.dtype), x.reshape(-1)]))[1:].reshape(x.shape)
    out = m.mhc_head_fwd(xg, *(to_gpu(v) for v in (hc_fn, hc_scale, hc_base)))
    assert_close(to_host(out), R.mhc_head_fwd(x, hc_fn, hc_scale, hc_base), ACT_TOL["bfloat16"], "out")


@GPU
def test_head_zero_tokens(rng):
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (0,), 4, 64, "bfloat16")
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    assert m.mhc_head_fwd(*gpu).shape == (0, 64)
    dx, dfn, dscale, dbase = m.mhc_head_bwd(to_gpu(g), *gpu)
    assert dx.shape == (0, 4, 64)
    for a in (dfn, dscale, dbase):
        assert (f64(to_host(a)) == 0).all()


@GPU
@pytest.mark.parametrize("n,T,C", [(4, 1000, 1000), (8, 3000, 64)])
def test_head_deterministic(rng, n, T, C):
    """Two identical calls give the same bits (no atomics; the dhc_fn sum over tokens is split)."""
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (T,), n, C, "bfloat16")
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    first = [to_host(a) for a in (m.mhc_head_fwd(*gpu), *m.mhc_head_bwd(to_gpu(g), *gpu))]
    for _ in range(3):
        again = [to_host(a) for a in (m.mhc_head_fwd(*gpu), *m.mhc_head_bwd(to_gpu(g), *gpu))]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@GPU
@needs_torch
@pytest.mark.parametrize("n", [1, 4, 8])
def test_torch_head_module_cuda(rng, n):
    """MHCHead on CUDA (the kernels) equals MHCHead on the CPU (the reference) to float32 tolerance,
    values and gradients, eagerly and under torch.compile."""
    import torch

    from mhc_cupy.torch import MHCHead

    C = 64
    cpu = MHCHead(C, n, scale_init=0.8)
    with torch.no_grad():
        cpu.hc_base.normal_()
    gpu = MHCHead.from_deepseek(*(t.cuda() for t in cpu.to_deepseek()))
    x = torch.tensor(rng.standard_normal((127, n, C)), dtype=torch.float32)
    g = torch.tensor(rng.standard_normal((127, C)), dtype=torch.float32)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    cpu(xc).backward(g)
    for fn in (gpu, torch.compile(gpu, fullgraph=True)):
        xg.grad = None
        for p in gpu.parameters():
            p.grad = None
        out = fn(xg)
        out.backward(g.cuda())
        assert_close(out.detach().cpu(), cpu(x).detach(), ACT_TOL["float32"], "out")
        assert_close(xg.grad.cpu(), xc.grad, 2 * ACT_TOL["float32"], "dx")
        for a, b in zip(gpu.parameters(), cpu.parameters()):
            assert_close(a.grad.cpu(), b.grad, COEF_TOL, "parameter gradient")


@GPU
@pytest.mark.parametrize("x_scale", [1e10, 1e20])
def test_head_huge_tokens(rng, x_scale):
    """|x| ~ 1e20 (its float32 sum of squares overflows, and g x and the raw mix H both grow with
    |x|): the forward's scaled sum and the backward's products with H / r keep out, dx, dhc_fn,
    dhc_scale and dhc_base finite and right."""
    _check(rng, (3,), 4, 4096, "bfloat16", x_scale=x_scale)
