"""convention="deepseek" (OPS.md "DeepSeek-V4 convention") for every op: the CPU cases.

The oracle is ``deepseek_oracle``: the DeepSeek-V4 maths in plain float64 torch, written from
the convention's statement independently of ``mhc_cupy.reference``; its gradients are torch
autograd.  Checked against it on the CPU: the NumPy reference (float64, values and every
backward), the functional API on CPU inputs (bfloat16 / float16 / float32, one rounding), the
torch adapter (autograd) and the JAX adapter (``jax.grad``).  Also: the defaults each convention
resolves, bad conventions, and that "paper" stays what it was.  The GPU cases (the kernels
against the same oracle) are in tests/test_deepseek_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mhc_cupy as m
from mhc_cupy import _convention, reference as R
from mhc_cupy._settings import LayerSettings

import deepseek_oracle as O
from deepseek_oracle import LEADS, NS, layer_params
from harness import NP_DTYPES, TOL, assert_close, assert_close_uniform, f64, spec_inputs
from paper_oracle import torch_vjp


def data(rng, lead, n, C, scale):
    """x [..., n, C], raw pre / post [..., n], raw res [..., n, n] (logits of ``scale``), y [..., C]."""
    return dict(x=rng.normal(size=lead + (n, C)), h_pre_raw=rng.normal(size=lead + (n,)) * scale,
                h_post_raw=rng.normal(size=lead + (n,)) * scale, h_res_raw=rng.normal(size=lead + (n, n)) * scale,
                y=rng.normal(size=lead + (C,)))


uniform = assert_close_uniform


# ------------------------------------------------------------------ defaults, arguments
def test_defaults_resolved_in_one_place():
    D = _convention.DEFAULT
    assert _convention.resolve("paper", num_iters=D, eps=D, rms_eps=D) == (20, 1e-8, 1e-5)
    assert _convention.resolve("deepseek", num_iters=D, eps=D, rms_eps=D) == (20, 1e-6, 1e-6)
    assert _convention.resolve("deepseek", hc_eps=D, post_mult=D) == (1e-6, 2.0)
    assert _convention.resolve("paper", hc_eps=D, post_mult=D) == (0.0, 2.0)
    assert _convention.resolve("deepseek", eps=1e-3) == 1e-3  # a given value wins
    import copy
    import pickle

    assert copy.deepcopy(D) is D and pickle.loads(pickle.dumps(D)) is D


def test_defaults_by_convention(rng):
    """An omitted setting takes the convention's default; an explicit None stays a TypeError."""
    L = rng.normal(size=(3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(m.sinkhorn_knopp_fwd(L, convention="deepseek"),
                                  m.sinkhorn_knopp_fwd(L, 20, 1e-6, convention="deepseek"))
    np.testing.assert_array_equal(m.sinkhorn_knopp_fwd(L), m.sinkhorn_knopp_fwd(L, 20, 1e-8))
    with pytest.raises(TypeError, match="eps must be a float"):
        m.sinkhorn_knopp_fwd(L, eps=None, convention="deepseek")


@pytest.mark.parametrize("bad", ["DeepSeek", "", None, 1, "v4"])
def test_bad_convention_names_the_argument(rng, bad):
    L = rng.normal(size=(2, 3, 3)).astype(np.float32)
    for call in (lambda: R.sinkhorn_knopp_fwd(L, convention=bad),
                 lambda: m.sinkhorn_knopp_fwd(L, convention=bad),
                 lambda: m.sinkhorn_knopp_bwd(L, L, convention=bad)):
        with pytest.raises(ValueError, match="convention"):
            call()


def test_deepseek_needs_an_iteration(rng):
    L = rng.normal(size=(2, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="num_iters"):
        m.sinkhorn_knopp_fwd(L, num_iters=0, convention="deepseek")
    m.sinkhorn_knopp_fwd(L, num_iters=0)  # paper: the shifted exponential


# ------------------------------------------------------------------ NumPy reference vs the oracle
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_reference_sinkhorn(rng, lead, n, scale):
    L = rng.normal(size=lead + (n, n)) * scale
    G = rng.normal(size=L.shape)
    (want,), (dwant,) = torch_vjp(O.sinkhorn, [L], [G])
    uniform(R.sinkhorn_knopp_fwd(L, convention="deepseek"), want, 1e-12)
    uniform(R.sinkhorn_knopp_bwd(G, L, convention="deepseek"), dwant, 1e-9)
    for iters in (1, 2):
        (want,), (dwant,) = torch_vjp(lambda l: O.sinkhorn(l, iters, 1e-3), [L], [G])
        uniform(R.sinkhorn_knopp_fwd(L, iters, 1e-3, convention="deepseek"), want, 1e-12)
        uniform(R.sinkhorn_knopp_bwd(G, L, iters, 1e-3, convention="deepseek"), dwant, 1e-9)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_reference_sinkhorn_implicit_converged(rng, n):
    """"implicit" is the gradient of the converged projection: the unrolled one of a long deepseek run."""
    L = rng.normal(size=(3, n, n))
    G = rng.normal(size=L.shape)
    _, (dwant,) = torch_vjp(lambda l: O.sinkhorn(l, 300, 0.0), [L], [G])
    got = R.sinkhorn_knopp_bwd(G, L, 300, 0.0, grad_mode="implicit", convention="deepseek")
    uniform(got, dwant, 1e-7)


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("C", [7, 33])
def test_reference_pre_op(rng, lead, n, C):
    d = data(rng, lead, n, C, 2.0)
    ins = [d["x"], d["h_pre_raw"], d["h_post_raw"], d["h_res_raw"]]
    gs = [rng.normal(size=lead + (C,)), rng.normal(size=lead + (n,)), rng.normal(size=lead + (n,)),
          rng.normal(size=lead + (n, n))]
    want, dwant = torch_vjp(O.pre_op, ins, gs)
    for got, w in zip(R.mhc_pre_op_fwd(*ins, convention="deepseek"), want):
        uniform(got, w, 1e-12)
    for got, w in zip(R.mhc_pre_op_bwd(*gs, *ins, convention="deepseek"), dwant):
        uniform(got, w, 1e-9)
    # other activation settings (hc_eps, post_mult) and absent gradients
    want, dwant = torch_vjp(lambda *a: O.pre_op(*a, 3, 1e-4, 0.01, 1.5), ins, [gs[0], None, gs[2], None])
    for got, w in zip(R.mhc_pre_op_fwd(*ins, 3, 1e-4, "deepseek", 0.01, 1.5), want):
        uniform(got, w, 1e-12)
    got = R.mhc_pre_op_bwd(gs[0], None, gs[2], None, *ins, 3, 1e-4, "unrolled", "deepseek", 0.01, 1.5)
    for g, w in zip(got, dwant):
        uniform(g, w, 1e-9)


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
def test_reference_post_op(rng, lead, n):
    d = data(rng, lead, n, 33, 1.0)
    H_post, H_res = rng.uniform(0, 2, size=lead + (n,)), rng.uniform(0, 1, size=lead + (n, n))
    ins = [d["y"], d["x"], H_post, H_res]
    g = rng.normal(size=d["x"].shape)
    (want,), dwant = torch_vjp(O.post_op, ins, [g])
    uniform(R.mhc_post_op_fwd(*ins, convention="deepseek"), want, 1e-12)
    for got, w in zip(R.mhc_post_op_bwd(g, *ins, convention="deepseek"), dwant):
        uniform(got, w, 1e-12)


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("C", [7, 33])
def test_reference_coeffs(rng, lead, n, C):
    x = rng.normal(size=lead + (n, C))
    hc_fn, hc_scale, hc_base = layer_params(rng, n, C)
    gs = [rng.normal(size=lead + (n,)), rng.normal(size=lead + (n,)), rng.normal(size=lead + (n, n))]
    want, (dx, dfn, dscale, dbase) = torch_vjp(O.coeffs, [x, hc_fn, hc_scale, hc_base], gs)
    for got, w in zip(R.mhc_coeffs_fwd(x, hc_fn.T, hc_scale, hc_base, convention="deepseek"), want):
        uniform(got, w, 1e-12)
    got = R.mhc_coeffs_bwd(*gs, x, hc_fn.T, hc_scale, hc_base, convention="deepseek")
    for g, w in zip(got, (dx, dfn.T, dscale, dbase)):
        uniform(g, w, 1e-9)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["unrolled", "implicit"])
def test_reference_layer_pieces(rng, n, mode):
    """The fused layer's reference pieces under deepseek give the oracle layer's gradients."""
    lead, C = (3,), 7
    x = rng.normal(size=lead + (n, C))
    hc_fn, hc_scale, hc_base = layer_params(rng, n, C)
    g = rng.normal(size=x.shape)
    iters, eps = (20, 1e-6) if mode == "unrolled" else (300, 0.0)  # implicit: the exact converged projection
    (want,), (dx, dfn, dscale, dbase) = torch_vjp(lambda *a: O.layer(*a, iters=iters, eps=eps),
                                                   [x, hc_fn, hc_scale, hc_base], [g])
    kw = dict(num_iters=iters, eps=eps, convention="deepseek")
    layer_in, H_pre, H_post, H_res, stats = R.mhc_layer_pre_fwd(x, hc_fn.T, hc_scale, hc_base, **kw)
    uniform(R.mhc_post_op_fwd(layer_in, x, H_post, H_res, convention="deepseek"), want, 1e-12)
    dy, _, dH_post, dH_res = R.mhc_post_op_bwd(g, layer_in, x, H_post, H_res, convention="deepseek")
    got = R.mhc_layer_pre_bwd(dy, g, dH_post, dH_res, x, hc_fn.T, hc_scale, hc_base, stats, H_pre, H_res,
                              grad_mode=mode, **kw)
    tol = 1e-9 if mode == "unrolled" else 1e-6
    for a, w in zip(got, (dx, dfn.T, dscale, dbase)):
        uniform(a, w, tol)


def test_paper_reference_unchanged(rng):
    """The paper convention's reference is what it was: the explicit paper defaults, bit for bit."""
    L = rng.normal(size=(3, 4, 4)) * 2
    G = rng.normal(size=L.shape)
    np.testing.assert_array_equal(R.sinkhorn_knopp_fwd(L), R.sinkhorn_knopp_fwd(L, 20, 1e-8, "paper"))
    np.testing.assert_array_equal(R.sinkhorn_knopp_bwd(G, L), R.sinkhorn_knopp_bwd(G, L, 20, 1e-8))
    assert not np.allclose(R.sinkhorn_knopp_fwd(L, 2), R.sinkhorn_knopp_fwd(L, 2, convention="deepseek"))


# ------------------------------------------------------------------ the ops through every route
#: name -> (inputs (name, trailing shape, kind, scale), the oracle).  kind: "act" (x's dtype),
#: "coef" (float32).  Logits of scale 2; DeepSeek-layout parameters for the coefficient path.
#: op -> (input scales, float64 oracle); the inputs themselves (names, shapes, dtypes) come from the
#: op's spec (harness.spec_inputs); H_post and H_res are taken non-negative, as the pre op makes them.
OPS = {
    "sinkhorn_knopp": ({"logits": 2.0}, O.sinkhorn),
    "mhc_pre_op": ({"h_pre_raw": 2.0, "h_post_raw": 2.0, "h_res_raw": 2.0}, O.pre_op),
    "mhc_post_op": ({"H_res": 0.5}, O.post_op),
    "mhc_coeffs": ({"bias": 0.5}, lambda x, phi, a, b: O.coeffs(x, phi.T, a, b)),
}


def make_inputs(rng, op, lead, n, C, dt):
    """The op's inputs as NumPy arrays of their dtypes (activations ``dt``, coefficients float32)."""
    arrays = spec_inputs(op, rng, lead, n, C, dt, OPS[op][0])
    return [np.abs(a) if k in ("H_post", "H_res") else a for k, a in arrays.items()]


def oracle(op, inputs, cots):
    """(outputs, input gradients) of the float64 oracle at the given (rounded) inputs."""
    return torch_vjp(OPS[op][1], [f64(a) for a in inputs], [None if g is None else f64(g) for g in cots])


def cotangents(rng, outs, dt, op):
    """One cotangent per output (activation outputs in ``dt``, the rest float32)."""
    cts = []
    for o in outs:
        a = rng.normal(size=np.shape(o))
        act = op in ("mhc_post_op",) or (op == "mhc_pre_op" and len(cts) == 0)
        cts.append(a.astype(NP_DTYPES[dt] if act else np.float32))
    return cts


def tol(dt):
    """The CPU routes compute in float64 and round each output once (TOL["rounding"]); 4x for
    float64 -> float32 -> bfloat16 and the rms scale of near-zero elements."""
    return TOL["rounding"][dt] * 4


def assert_all(got, want, what):
    """Each output within the rounding of its own dtype (activations: x's; coefficients: float32)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, tol(str(g.dtype).replace("torch.", "")), f"{what}[{i}]")


FUNCTIONAL = {
    "sinkhorn_knopp": (m.sinkhorn_knopp_fwd, m.sinkhorn_knopp_bwd),
    "mhc_pre_op": (m.mhc_pre_op_fwd, m.mhc_pre_op_bwd),
    "mhc_post_op": (m.mhc_post_op_fwd, m.mhc_post_op_bwd),
    "mhc_coeffs": (m.mhc_coeffs_fwd, m.mhc_coeffs_bwd),
}


def _tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


#: (op, activation dtype, C): Sinkhorn has neither (float32 logits only).
OP_DTYPES = [("sinkhorn_knopp", "float32", 1)] + [(op, dt, C) for op in ("mhc_coeffs", "mhc_post_op", "mhc_pre_op")
                                                  for dt in ("bfloat16", "float16", "float32") for C in (7, 33)]


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("op,dt,C", OP_DTYPES)
def test_functional_cpu(rng, op, dt, C, lead, n):
    """The functional API on CPU inputs (the NumPy reference, rounded once) vs the oracle."""
    fwd, bwd = FUNCTIONAL[op]
    ins = make_inputs(rng, op, lead, n, C, dt)
    outs = _tuple(fwd(*ins, convention="deepseek"))
    cts = cotangents(rng, outs, dt, op)
    want, dwant = oracle(op, ins, cts)
    assert_all(outs, want, f"{op} forward")
    assert_all(_tuple(bwd(*cts, *ins, convention="deepseek")), dwant, f"{op} backward")


@pytest.mark.parametrize("n", [1, 4, 5])
@pytest.mark.parametrize("op,dt", sorted({(op, dt) for op, dt, _ in OP_DTYPES}))
def test_torch_adapter(rng, op, dt, n):
    """mhc_cupy.torch under convention="deepseek": values and autograd gradients vs the oracle."""
    import mhc_cupy.torch as mt

    ins = make_inputs(rng, op, (3,), n, 33, dt)
    ts = [torch.tensor(np.asarray(a, np.float32)).to(getattr(torch, dt) if a.dtype.itemsize == 2 else torch.float32)
          .requires_grad_() for a in ins]
    outs = _tuple(getattr(mt, op)(*ts, convention="deepseek"))
    cts = cotangents(rng, outs, dt, op)
    want, dwant = oracle(op, ins, cts)
    assert_all(outs, want, f"{op} forward")
    tcts = [torch.tensor(np.asarray(c, np.float32)).to(o.dtype) for c, o in zip(cts, outs)]
    assert_all(torch.autograd.grad(outs, ts, tcts), dwant, f"{op} gradients")


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; the GPU cases run the CUDA one
@pytest.mark.parametrize("op,dt", sorted({(op, dt) for op, dt, _ in OP_DTYPES if dt != "float16"}))
def test_jax_adapter(rng, op, dt):
    """mhc_cupy.jax under convention="deepseek": values and jax.vjp gradients vs the oracle."""
    jax = pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    ins = make_inputs(rng, op, (3,), 4, 33, dt)
    outs, vjp = jax.vjp(lambda *a: _tuple(getattr(mj, op)(*a, convention="deepseek")), *ins)
    cts = cotangents(rng, outs, dt, op)
    want, dwant = oracle(op, ins, cts)
    assert_all(outs, want, f"{op} forward")
    assert_all(vjp(tuple(cts)), dwant, f"{op} gradients")


def test_torch_compile_deepseek(rng):
    """The custom-op route (torch.compile) takes the convention: equal to the eager route."""
    import mhc_cupy.torch as mt

    ins = [torch.tensor(np.asarray(a, np.float32)).requires_grad_() for a in make_inputs(rng, "mhc_pre_op", (3,), 4,
                                                                                        33, "float32")]

    def f(*a):
        layer_in, H_pre, H_post, H_res = mt.mhc_pre_op(*a, convention="deepseek")
        return mt.mhc_post_op(layer_in, a[0], H_post, H_res, convention="deepseek").square().sum() + H_pre.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(*ins), f(*ins)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, ins), torch.autograd.grad(want, ins)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["unrolled", "implicit"])
def test_fused_layer_pieces_functional(rng, mode):
    """mhc_layer_pre_fwd -> post op -> mhc_layer_post_bwd -> mhc_layer_pre_bwd under deepseek (CPU)
    against the oracle layer (identity sublayer)."""
    x, phi, alpha, bias = make_inputs(rng, "mhc_coeffs", (3,), 4, 33, "float32")
    iters, eps = (20, _convention.DEFAULT) if mode == "unrolled" else (300, 0.0)
    kw = dict(convention="deepseek")
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias, iters, eps, **kw)
    out = m.mhc_post_op_fwd(layer_in, x, H_post, H_res, **kw)
    g = rng.normal(size=x.shape).astype(np.float32)
    (want,), dwant = torch_vjp(lambda *a: O.layer(a[0], a[1].T, a[2], a[3], iters=iters,
                                                   eps=O.EPS if mode == "unrolled" else eps),
                                [f64(a) for a in (x, phi, alpha, bias)], [f64(g)])
    assert_close(out, want, tol("float32") * 10, "layer output")
    dy, dH_post, dH_res = m.mhc_layer_post_bwd(g, layer_in, x, H_post, H_res, **kw)
    got = m.mhc_layer_pre_bwd(dy, g, dH_post, dH_res, x, phi, alpha, bias, stats, H_pre, H_res, iters, eps,
                                     grad_mode=mode, **kw)
    for i, (a, w) in enumerate(zip(got, dwant)):
        assert_close(a, w, 1e-4 if mode == "unrolled" else 1e-3, f"layer gradient {i}")


@pytest.mark.parametrize("mode", ["unrolled", "implicit"])
def test_torch_layer_pieces(rng, mode):
    """mhc_cupy.torch.mhc_layer_pre / mhc_layer_post under deepseek: autograd vs the oracle layer."""
    import mhc_cupy.torch as mt

    arrays = make_inputs(rng, "mhc_coeffs", (3,), 2, 33, "float32")
    ts = [torch.tensor(a).requires_grad_() for a in arrays]
    iters = 20 if mode == "unrolled" else 300
    eps = _convention.DEFAULT if mode == "unrolled" else 0.0
    layer_in, x_link, H_post, H_res = mt.mhc_layer_pre(*ts, iters, eps, grad_mode=mode, convention="deepseek")
    out = mt.mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res, convention="deepseek")
    g = rng.normal(size=arrays[0].shape)
    (want,), dwant = torch_vjp(lambda x, p, a, b: O.layer(x, p.T, a, b, torch.tanh, iters=iters,
                                                           eps=O.EPS if mode == "unrolled" else eps),
                                [f64(a) for a in arrays], [g])
    assert_close(out, want, 1e-5, "output")
    got = torch.autograd.grad(out, ts, torch.tensor(g, dtype=torch.float32))
    for i, (a, w) in enumerate(zip(got, dwant)):
        assert_close(a, w, 1e-4 if mode == "unrolled" else 1e-3, f"gradient {i}")


@pytest.mark.usefixtures("jax_on_cpu")  # the CPU path; the GPU cases run the CUDA one
@pytest.mark.parametrize("fold", [True, False])
def test_jax_fused_layer_settings(rng, fold):
    """The JAX fused layer's custom_vjp carries the convention (mhc_cupy.jax._fused_layer under deepseek),
    with the post op's dx folded into the pre piece's backward or added after its own (fold False)."""
    jax = pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    x, phi, alpha, bias = make_inputs(rng, "mhc_coeffs", (3,), 4, 33, "float32")
    D = _convention.DEFAULT
    settings = mj._layer_settings(D, D, D, "unrolled", "deepseek")
    assert settings == LayerSettings(20, 1e-6, 1e-6, "unrolled", "deepseek", 1e-6, 2.0)  # one resolved value
    out, vjp = jax.vjp(lambda *a: mj._fused_layer(jax.numpy.tanh, settings, fold, *a), phi, alpha, bias, x)
    g = rng.normal(size=x.shape).astype(np.float32)
    (want,), dwant = torch_vjp(lambda p, a, b, xx: O.layer(xx, p.T, a, b, torch.tanh),
                                [f64(a) for a in (phi, alpha, bias, x)], [f64(g)])
    assert_close(out, want, 1e-5, "output")
    for i, (a, w) in enumerate(zip(vjp(g), dwant)):
        assert_close(a, w, 1e-4, f"gradient {i}")
