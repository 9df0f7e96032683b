"""convention="deepseek" (OPS.md "DeepSeek-V4 convention") on the CPU.

The oracle is ``deepseek_oracle``: the DeepSeek-V4 maths in plain float64 torch, written from
the convention's statement independently of ``mhc_cupy.reference``; its gradients are torch
autograd.  Checked against it: the NumPy reference (float64, values and every backward), the
functional API on CPU inputs (bfloat16 / float16 / float32, one rounding), the torch adapter
(autograd) and the JAX adapter (``jax.grad``).  Also: the defaults each convention resolves,
bad conventions, and that "paper" stays what it was.
"""

import numpy as np
import pytest
import torch

import deepseek_oracle as O
import mhc_cupy
from mhc_cupy import _convention
from mhc_cupy import reference as R

from harness import TOL, assert_close, assert_close_uniform, f64

LEADS = [(1,), (3,), (127,)]
NS = [1, 2, 3, 4, 5, 8]


def t64(a, grad=True):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def oracle_vjp(fn, inputs, grads):
    """(outputs, input gradients) of ``fn`` in float64 torch; ``grads`` one per output (None: zero)."""
    ts = [t64(a) for a in inputs]
    outs = fn(*ts)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    loss = sum((o * t64(g, False)).sum() for o, g in zip(outs, grads) if g is not None)
    gs = torch.autograd.grad(loss, ts, allow_unused=True)
    return [o.detach().numpy() for o in outs], [np.zeros(t.shape) if g is None else g.numpy() for g, t in zip(gs, ts)]


def data(rng, lead, n, C, scale):
    """x [..., n, C], raw pre / post [..., n], raw res [..., n, n] (logits of ``scale``), y [..., C]."""
    return dict(x=rng.normal(size=lead + (n, C)), h_pre_raw=rng.normal(size=lead + (n,)) * scale,
                h_post_raw=rng.normal(size=lead + (n,)) * scale, h_res_raw=rng.normal(size=lead + (n, n)) * scale,
                y=rng.normal(size=lead + (C,)))


def params(rng, n, C):
    """DeepSeek-layout parameters hc_fn [m, nC], hc_scale [3], hc_base [m] and ours (phi = hc_fn^T)."""
    m = n * n + 2 * n
    hc_fn = rng.normal(size=(m, n * C)) / np.sqrt(n * C)
    return hc_fn, rng.uniform(0.5, 2.0, size=3), rng.normal(size=m) * 0.5


uniform = assert_close_uniform


# ------------------------------------------------------------------ defaults, arguments
def test_defaults_resolved_in_one_place():
    assert _convention.resolve("paper", num_iters=None, eps=None, rms_eps=None) == (20, 1e-8, 1e-5)
    assert _convention.resolve("deepseek", num_iters=None, eps=None, rms_eps=None) == (20, 1e-6, 1e-6)
    assert _convention.resolve("deepseek", hc_eps=None, post_mult=None) == (1e-6, 2.0)
    assert _convention.resolve("paper", hc_eps=None, post_mult=None) == (0.0, 2.0)
    assert _convention.resolve("deepseek", eps=1e-3) == 1e-3  # a given value wins


@pytest.mark.parametrize("bad", ["DeepSeek", "", None, 1, "v4"])
def test_bad_convention_names_the_argument(rng, bad):
    L = rng.normal(size=(2, 3, 3)).astype(np.float32)
    for call in (lambda: R.sinkhorn_knopp_fwd(L, convention=bad),
                 lambda: mhc_cupy.sinkhorn_knopp_fwd(L, convention=bad),
                 lambda: mhc_cupy.sinkhorn_knopp_bwd(L, L, convention=bad)):
        with pytest.raises(ValueError, match="convention"):
            call()


def test_deepseek_needs_an_iteration(rng):
    L = rng.normal(size=(2, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="num_iters"):
        mhc_cupy.sinkhorn_knopp_fwd(L, num_iters=0, convention="deepseek")
    mhc_cupy.sinkhorn_knopp_fwd(L, num_iters=0)  # paper: the shifted exponential


# ------------------------------------------------------------------ NumPy reference vs the oracle
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_reference_sinkhorn(rng, lead, n, scale):
    L = rng.normal(size=lead + (n, n)) * scale
    G = rng.normal(size=L.shape)
    (want,), (dwant,) = oracle_vjp(O.sinkhorn, [L], [G])
    uniform(R.sinkhorn_knopp_fwd(L, convention="deepseek"), want, 1e-12)
    uniform(R.sinkhorn_knopp_bwd(G, L, convention="deepseek"), dwant, 1e-9)
    for iters in (1, 2):
        (want,), (dwant,) = oracle_vjp(lambda l: O.sinkhorn(l, iters, 1e-3), [L], [G])
        uniform(R.sinkhorn_knopp_fwd(L, iters, 1e-3, convention="deepseek"), want, 1e-12)
        uniform(R.sinkhorn_knopp_bwd(G, L, iters, 1e-3, convention="deepseek"), dwant, 1e-9)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_reference_sinkhorn_implicit_converged(rng, n):
    """"implicit" is the gradient of the converged projection: the unrolled one of a long deepseek run."""
    L = rng.normal(size=(3, n, n))
    G = rng.normal(size=L.shape)
    _, (dwant,) = oracle_vjp(lambda l: O.sinkhorn(l, 300, 0.0), [L], [G])
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
    want, dwant = oracle_vjp(O.pre_op, ins, gs)
    for got, w in zip(R.mhc_pre_op_fwd(*ins, convention="deepseek"), want):
        uniform(got, w, 1e-12)
    for got, w in zip(R.mhc_pre_op_bwd(*gs, *ins, convention="deepseek"), dwant):
        uniform(got, w, 1e-9)
    # other activation settings (hc_eps, post_mult) and absent gradients
    want, dwant = oracle_vjp(lambda *a: O.pre_op(*a, 3, 1e-4, 0.01, 1.5), ins, [gs[0], None, gs[2], None])
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
    (want,), dwant = oracle_vjp(O.post_op, ins, [g])
    uniform(R.mhc_post_op_fwd(*ins, convention="deepseek"), want, 1e-12)
    for got, w in zip(R.mhc_post_op_bwd(g, *ins, convention="deepseek"), dwant):
        uniform(got, w, 1e-12)


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("C", [7, 33])
def test_reference_coeffs(rng, lead, n, C):
    x = rng.normal(size=lead + (n, C))
    hc_fn, hc_scale, hc_base = params(rng, n, C)
    gs = [rng.normal(size=lead + (n,)), rng.normal(size=lead + (n,)), rng.normal(size=lead + (n, n))]
    want, (dx, dfn, dscale, dbase) = oracle_vjp(O.coeffs, [x, hc_fn, hc_scale, hc_base], gs)
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
    hc_fn, hc_scale, hc_base = params(rng, n, C)
    g = rng.normal(size=x.shape)
    iters, eps = (20, 1e-6) if mode == "unrolled" else (300, 0.0)  # implicit: the exact converged projection
    (want,), (dx, dfn, dscale, dbase) = oracle_vjp(lambda *a: O.layer(*a, iters=iters, eps=eps),
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
