"""convention="deepseek" (OPS.md "DeepSeek-V4 convention") for every op: the GPU cases.

``gpu_test``: skipped without a GPU, every CuPy allocation NaN-poisoned so an unwritten element
fails.  The kernels against the oracle ``deepseek_oracle`` (float64 torch, see tests/test_deepseek.py
for the CPU cases) evaluated on exactly the rounded inputs the kernels get.  The implicit Sinkhorn
gradient has no autograd oracle (it is the gradient of the converged projection): it is checked
against the deepseek NumPy reference, which the CPU cases check against the oracle's gradient of a
long converged run.  H_res / logits are not symmetric, so a missing or doubled transpose fails.
Tolerances are the rows of ``harness.TOL`` the paper convention's GPU cases use for the same quantities.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mhc_cupy as m
from mhc_cupy import reference as R

import deepseek_oracle as O
from gpu.helpers import ACT_TOL, COEF_TOL, SINKHORN_TOL, coef, rounded, to_gpu, to_host
from gpu.helpers import DTYPES as GPU_DTYPES, NS as GPU_NS, SIZES as GPU_SIZES
from harness import TOL, assert_close, f64, gpu_test
from paper_oracle import torch_vjp

GPU = gpu_test()


# ============================================================ GPU
DS = {"convention": "deepseek"}
CHAIN_TOL = TOL["sinkhorn_chain_grad"].value


# ------------------------------------------------------------------ Sinkhorn
@GPU
@pytest.mark.parametrize("n", GPU_NS + [17, 32])
@pytest.mark.parametrize("T", [1, 3, 127, 1000])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_sinkhorn(rng, n, T, scale):
    L, G = coef(rng, (T, n, n), scale), coef(rng, (T, n, n))
    (P_ref,), (dL_ref,) = torch_vjp(O.sinkhorn, [L], [G])
    assert_close(m.sinkhorn_knopp_fwd(to_gpu(L), **DS), P_ref, SINKHORN_TOL, "P")
    dL = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), **DS))
    assert_close(dL, dL_ref, 20 * SINKHORN_TOL if scale > 1 else SINKHORN_TOL, "dL")
    assert np.abs(f64(dL).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(dL).max()), "rows of dL must sum to 0"


@GPU
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("num_iters", [1, 2, 5, 20, 200])
@pytest.mark.parametrize("eps", [1e-6, 1e-3, 0.0])
def test_sinkhorn_iters_eps_and_history(rng, n, num_iters, eps):
    """The softmax start alone (1 iteration), eps in and out of the first step, and num_iters = 200
    (the step history in global scratch instead of shared memory)."""
    L, G = coef(rng, (33, n, n)), coef(rng, (33, n, n))
    (P_ref,), (dL_ref,) = torch_vjp(lambda l: O.sinkhorn(l, num_iters, eps), [L], [G])
    assert_close(m.sinkhorn_knopp_fwd(to_gpu(L), num_iters, eps, **DS), P_ref, SINKHORN_TOL, "P")
    assert_close(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), num_iters, eps, **DS), dL_ref, 5 * SINKHORN_TOL, "dL")


@GPU
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("eps", [0.0, 1e-40])
def test_sinkhorn_subnormal_start(rng, n, eps):
    """eps 0 or subnormal with a subnormal softmax entry (exp(-95)): the softmax start's backward
    divides by y = q + eps, whose reciprocal overflows for a subnormal y; dL stays finite and right."""
    L, G = coef(rng, (33, n, n)), coef(rng, (33, n, n))
    L[:, 0, 0] = L[:, 0, 1:].max(-1) - 95.0
    (P_ref,), (dL_ref,) = torch_vjp(lambda l: O.sinkhorn(l, 20, eps), [L], [G])
    assert_close(m.sinkhorn_knopp_fwd(to_gpu(L), 20, eps, **DS), P_ref, SINKHORN_TOL, "P")
    assert_close(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), 20, eps, **DS), dL_ref, 5 * SINKHORN_TOL, "dL")


@GPU
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 9, 16, 32])
def test_sinkhorn_implicit(rng, n):
    """The implicit gradient (one thread per matrix for n <= 8, one warp above) at the deepseek P."""
    L, G = coef(rng, (200, n, n)), coef(rng, (200, n, n))
    got = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), grad_mode="implicit", **DS))
    assert_close(got, R.sinkhorn_knopp_bwd(G, L, grad_mode="implicit", **DS), 1e-3, "implicit dL")
    assert np.abs(f64(got).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(got).max())


@GPU
def test_sinkhorn_num_iters_0_raises(rng):
    with pytest.raises(ValueError, match="num_iters"):
        m.sinkhorn_knopp_fwd(to_gpu(coef(rng, (3, 4, 4))), 0, **DS)


# ------------------------------------------------------------------ pre op
#: (dtype, n, tokens, C, grad_mode): the implicit mode at one dtype and small C (its Sinkhorn part is dtype-free).
PRE_CASES = [(dt, n, T, C, "unrolled") for dt in GPU_DTYPES for n in GPU_NS + [32] for T, C in GPU_SIZES] + \
    [("bfloat16", n, T, C, "implicit") for n in GPU_NS + [32] for T, C in GPU_SIZES if C <= 64]


def _check_pre(rng, dt, n, T, C, grad_mode="unrolled", absent=(), **settings):
    """Pre op forward and backward on the GPU vs the oracle (implicit gradient: the deepseek reference);
    ``absent``: incoming gradients given as None; ``settings``: hc_eps / post_mult."""
    x = rounded(rng, (T, n, C), dt)
    raw = [coef(rng, (T, n), 2.0), coef(rng, (T, n), 2.0), coef(rng, (T, n, n), 2.0)]
    grads = [rounded(rng, (T, C), dt), coef(rng, (T, n)), coef(rng, (T, n)), coef(rng, (T, n, n))]
    grads = [None if i in absent else v for i, v in enumerate(grads)]
    ref, dref = torch_vjp(lambda *a: O.pre_op(*a, **settings), [x, *raw], grads)
    kw = dict(settings, **DS)
    if grad_mode == "implicit":
        dref = R.mhc_pre_op_bwd(*grads, x, *raw, grad_mode="implicit", **kw)
    got = m.mhc_pre_op_fwd(*(to_gpu(v) for v in (x, *raw)), **kw)
    for name, a, b, tol in zip(("layer_in", "H_pre", "H_post", "H_res"), got, ref,
                               (ACT_TOL[dt], 1e-6, 1e-6, SINKHORN_TOL)):
        assert_close(a, b, tol, name)
    got = m.mhc_pre_op_bwd(*(None if v is None else to_gpu(v) for v in (*grads, x, *raw)), grad_mode=grad_mode, **kw)
    for name, a, b, tol in zip(("dx", "dh_pre_raw", "dh_post_raw", "dh_res_raw"), got, dref,
                               (ACT_TOL[dt], COEF_TOL, 1e-5, 5e-3)):
        assert_close(a, b, tol, name)


@GPU
@pytest.mark.parametrize("dt,n,T,C,grad_mode", PRE_CASES)
def test_pre_op(rng, dt, n, T, C, grad_mode):
    _check_pre(rng, dt, n, T, C, grad_mode)


@GPU
def test_pre_op_activation_settings(rng):
    """hc_eps and post_mult given explicitly, and absent incoming gradients (grad_H_pre, grad_H_res)."""
    _check_pre(rng, "bfloat16", 4, 127, 64, absent=(1, 3), hc_eps=0.01, post_mult=1.5)


# ------------------------------------------------------------------ post op
@GPU
@pytest.mark.parametrize("dt", GPU_DTYPES)
@pytest.mark.parametrize("n", GPU_NS + [17, 32])
@pytest.mark.parametrize("T,C", GPU_SIZES)
def test_post_op(rng, dt, n, T, C):
    y, x = rounded(rng, (T, C), dt), rounded(rng, (T, n, C), dt)
    Hp, Hr = coef(rng, (T, n)), coef(rng, (T, n, n))
    g = rounded(rng, (T, n, C), dt)
    (ref,), dref = torch_vjp(O.post_op, [y, x, Hp, Hr], [g])
    assert_close(m.mhc_post_op_fwd(to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr), **DS), ref, ACT_TOL[dt], "out")
    got = m.mhc_post_op_bwd(to_gpu(g), to_gpu(y), to_gpu(x), to_gpu(Hp), to_gpu(Hr), **DS)
    for name, a, b, tol in zip(("dy", "dx", "dH_post", "dH_res"), got, dref,
                               (ACT_TOL[dt], ACT_TOL[dt], COEF_TOL, COEF_TOL)):
        assert_close(a, b, tol, name)


# ------------------------------------------------------------------ coefficients
@GPU
@pytest.mark.parametrize("dt", GPU_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("T,C", [(1, 7), (3, 33), (127, 64), (1000, 256)])
def test_coeffs(rng, dt, n, T, C):
    """DeepSeek-layout parameters (hc_fn = phi^T) and the deepseek default rms_eps (1e-6)."""
    m_ = n * n + 2 * n
    x = rounded(rng, (T, n, C), dt)
    hc_fn = coef(rng, (m_, n * C), 1 / np.sqrt(n * C))
    hc_scale, hc_base = np.array([0.7, 1.3, 2.0], np.float32), coef(rng, (m_,), 0.5)
    gs = [coef(rng, (T, n)), coef(rng, (T, n)), coef(rng, (T, n, n))]
    ref, (dx, dfn, dscale, dbase) = torch_vjp(O.coeffs, [x, hc_fn, hc_scale, hc_base], gs)
    phi = np.ascontiguousarray(hc_fn.T)
    got = m.mhc_coeffs_fwd(to_gpu(x), to_gpu(phi), to_gpu(hc_scale), to_gpu(hc_base), **DS)
    for name, a, b in zip(("pre", "post", "res"), got, ref):
        assert_close(a, b, COEF_TOL, name)
    got = m.mhc_coeffs_bwd(*(to_gpu(v) for v in gs), to_gpu(x), to_gpu(phi), to_gpu(hc_scale), to_gpu(hc_base), **DS)
    assert_close(got[0], dx, ACT_TOL[dt], "dx")
    assert_close(got[1], dfn.T, COEF_TOL, "dphi")
    assert_close(got[2], dscale, COEF_TOL, "dalpha", scale=float(np.abs(dscale).max()) + 1.0)
    assert_close(got[3], dbase, COEF_TOL, "dbias", scale=float(np.abs(dbase).max()) + 1.0)


# ------------------------------------------------------------------ the fused layer pieces
def _layer_inputs(rng, dt, T, n, C):
    m_ = n * n + 2 * n
    x = rounded(rng, (T, n, C), dt)
    hc_fn = coef(rng, (m_, n * C), 1 / np.sqrt(n * C))
    return x, hc_fn, np.array([0.7, 1.3, 2.0], np.float32), coef(rng, (m_,), 0.5)


def _layer_pieces(x, phi, alpha, bias, g, iters=20, eps=O.EPS, grad_mode="unrolled"):
    """Forward and backward of one layer with the identity sublayer, through the fused pieces."""
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias, iters, eps, **DS)
    out = m.mhc_post_op_fwd(layer_in, x, H_post, H_res, **DS)
    dy, dH_post, dH_res = m.mhc_layer_post_bwd(g, layer_in, x, H_post, H_res, **DS)
    grads = m.mhc_layer_pre_bwd(dy, g, dH_post, dH_res, x, phi, alpha, bias, stats, H_pre, H_res, iters, eps,
                                grad_mode=grad_mode, **DS)
    return (out, layer_in, stats, dy, *grads)


#: n <= 4: the fused tensor-core dx / dphi kernel; 5 and 8: the dx with phi resident (both read H_res transposed here).
LAYER_NS = [1, 2, 3, 4, 5, 8]


@GPU
@pytest.mark.parametrize("n", LAYER_NS)
@pytest.mark.parametrize("T,C", [(1, 7), (3, 33), (127, 64), (1000, 256)])
@pytest.mark.parametrize("grad_mode", ["unrolled", "implicit"])
def test_layer_pieces_float32(rng, n, T, C, grad_mode):
    """The whole layer (identity sublayer) through the fused pieces, float32, against the oracle layer
    (implicit mode: its gradients against the deepseek reference of the same pieces)."""
    x, hc_fn, hc_scale, hc_base = _layer_inputs(rng, "float32", T, n, C)
    phi = np.ascontiguousarray(hc_fn.T)
    g = rounded(rng, (T, n, C), "float32")
    (ref,), (dx, dfn, dscale, dbase) = torch_vjp(O.layer, [x, hc_fn, hc_scale, hc_base], [g])
    if grad_mode == "implicit":
        layer_in, H_pre, H_post, H_res, stats = R.mhc_layer_pre_fwd(x, phi, hc_scale, hc_base, **DS)
        dy, _, dH_post, dH_res = R.mhc_post_op_bwd(g, layer_in, x, H_post, H_res, **DS)
        dx, dphi, dscale, dbase = R.mhc_layer_pre_bwd(dy, g, dH_post, dH_res, x, phi, hc_scale, hc_base, stats, H_pre,
                                                      H_res, grad_mode="implicit", **DS)
        dfn = dphi.T
    out, _, _, _, *got = _layer_pieces(*(to_gpu(v) for v in (x, phi, hc_scale, hc_base, g)), grad_mode=grad_mode)
    assert_close(out, ref, 2 * ACT_TOL["float32"], "out")  # layer_in rounded to float32 before the post op
    assert_close(got[0], dx, CHAIN_TOL, "dx")
    assert_close(got[1], dfn.T, CHAIN_TOL, "dphi")
    assert_close(got[2], dscale, CHAIN_TOL, "dalpha", scale=float(np.abs(dscale).max()) + 1.0)
    assert_close(got[3], dbase, CHAIN_TOL, "dbias", scale=float(np.abs(dbase).max()) + 1.0)


@GPU
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("n", LAYER_NS)
@pytest.mark.parametrize("grad_mode", ["unrolled", "implicit"])
def test_layer_pieces_each(rng, dt, n, grad_mode):
    """Each fused piece under deepseek against the deepseek reference (checked against the oracle on
    the CPU, tests/test_deepseek.py) on the GPU's own intermediates, as the paper convention's
    tests/test_layer_fused.py does: 16-bit rounding between the pieces does not enter."""
    from mhc_cupy import reference as R

    T, C = 300, 96
    x, hc_fn, hc_scale, hc_base = _layer_inputs(rng, dt, T, n, C)
    phi = np.ascontiguousarray(hc_fn.T)
    g, y, g_li = rounded(rng, (T, n, C), dt), rounded(rng, (T, C), dt), rounded(rng, (T, C), dt)
    dev = [to_gpu(v) for v in (x, phi, hc_scale, hc_base)]
    kw = dict(grad_mode=grad_mode, **DS)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*dev, **DS)
    dy, dH_post, dH_res = m.mhc_layer_post_bwd(to_gpu(g), to_gpu(y), dev[0], H_post, H_res, **DS)
    got = m.mhc_layer_pre_bwd(to_gpu(g_li), to_gpu(g), dH_post, dH_res, *dev, stats, H_pre, H_res, **kw)
    ref_fwd = R.mhc_layer_pre_fwd(x, phi, hc_scale, hc_base, convention="deepseek")
    for a, b, name in zip((layer_in, H_pre, H_post, H_res, stats), ref_fwd,
                          ("layer_in", "H_pre", "H_post", "H_res", "stats")):
        assert_close(a, b, ACT_TOL[dt] if name == "layer_in" else COEF_TOL, name)
    ref_post = R.mhc_post_op_bwd(g, y, x, to_host(H_post), to_host(H_res), convention="deepseek")
    scale = float(np.abs(f64(g)).sum(-1).mean())
    assert_close(dy, ref_post[0], ACT_TOL[dt], "dy")
    assert_close(dH_post, ref_post[2], COEF_TOL, "dH_post", scale=scale)
    assert_close(dH_res, ref_post[3], COEF_TOL, "dH_res", scale=scale)
    ref = R.mhc_layer_pre_bwd(g_li, g, to_host(dH_post), to_host(dH_res), x, phi, hc_scale, hc_base, None,
                              to_host(H_pre), to_host(H_res), **kw)
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], "dx", scale=float(np.sqrt(np.mean(ref[0] ** 2))) + 1e-30)
    assert_close(got[1], ref[1], COEF_TOL if grad_mode == "unrolled" else CHAIN_TOL, "dphi")
    assert_close(got[2], ref[2], COEF_TOL if grad_mode == "unrolled" else CHAIN_TOL, "dalpha",
                 scale=float(np.abs(ref[2]).max()) + 1.0)
    assert_close(got[3], ref[3], COEF_TOL if grad_mode == "unrolled" else CHAIN_TOL, "dbias",
                 scale=float(np.abs(ref[3]).max()) + 1.0)


# ------------------------------------------------------------------ determinism
@GPU
def test_bitwise_deterministic(rng):
    """Two runs of every deepseek kernel give the same bits (no atomics)."""
    import cupy as cp

    dt, T, n, C = "bfloat16", 1000, 4, 256
    x, hc_fn, hc_scale, hc_base = _layer_inputs(rng, dt, T, n, C)
    phi = np.ascontiguousarray(hc_fn.T)
    g = rounded(rng, (T, n, C), dt)
    dev = [to_gpu(v) for v in (x, phi, hc_scale, hc_base, g)]
    L, G = to_gpu(coef(rng, (T, n, n), 2.0)), to_gpu(coef(rng, (T, n, n)))

    def once():
        outs = list(_layer_pieces(*dev))
        outs += list(_layer_pieces(*dev, 300, 0.0, "implicit"))
        outs += [m.sinkhorn_knopp_fwd(L, **DS), m.sinkhorn_knopp_bwd(G, L, **DS),
                 m.sinkhorn_knopp_bwd(G, L, grad_mode="implicit", **DS)]
        outs += list(m.mhc_post_op_bwd(dev[4], dev[0][:, 0], dev[0], L[:, 0], L, **DS))
        return outs

    for u, v in zip(once(), once()):
        assert cp.array_equal(u.view(cp.uint16) if u.dtype.itemsize == 2 else u.view(cp.uint32),
                              v.view(cp.uint16) if v.dtype.itemsize == 2 else v.view(cp.uint32))


@GPU
def test_paper_convention_unchanged(rng):
    """The default convention gives the bits of convention="paper" (the same kernels, DS = false)."""
    import cupy as cp

    L, G = to_gpu(coef(rng, (127, 4, 4), 2.0)), to_gpu(coef(rng, (127, 4, 4)))
    a = m.sinkhorn_knopp_bwd(G, L)
    b = m.sinkhorn_knopp_bwd(G, L, 20, 1e-8, convention="paper")
    assert cp.array_equal(a.view(cp.uint32), b.view(cp.uint32))
    assert not cp.allclose(m.sinkhorn_knopp_fwd(L, 2), m.sinkhorn_knopp_fwd(L, 2, **DS))


# ------------------------------------------------------------------ the adapters on CUDA
@GPU
def test_torch_adapter_cuda(rng):
    """mhc_cupy.torch pre op -> post op chain on CUDA under deepseek, autograd vs the oracle."""
    import mhc_cupy.torch as mt

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    T, n, C = 127, 4, 64
    arrays = [coef(rng, (T, n, C)), coef(rng, (T, n), 2.0), coef(rng, (T, n), 2.0), coef(rng, (T, n, n), 2.0)]
    ts = [torch.tensor(a, device="cuda", requires_grad=True) for a in arrays]

    def chain(x, hp, hq, hr, ops):
        layer_in, H_pre, H_post, H_res = ops[0](x, hp, hq, hr)
        return ops[1](torch.tanh(layer_in), x, H_post, H_res)

    kernels = (lambda *a: mt.mhc_pre_op(*a, convention="deepseek"),
               lambda *a: mt.mhc_post_op(*a, convention="deepseek"))
    out = chain(*ts, kernels)
    g = coef(rng, (T, n, C))
    (ref,), dref = torch_vjp(lambda *a: chain(*a, (O.pre_op, O.post_op)), arrays, [g])
    assert_close(out, ref, 1e-5, "out")
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, ts, torch.tensor(g, device="cuda")), dref)):
        assert_close(a, b, CHAIN_TOL, f"gradient {i}")


@GPU
def test_jax_adapter_cuda(rng):
    """mhc_cupy.jax pre op -> post op chain on the GPU under deepseek, jax.vjp vs the oracle."""
    jax = pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    T, n, C = 127, 4, 64
    arrays = [coef(rng, (T, n, C)), coef(rng, (T, n), 2.0), coef(rng, (T, n), 2.0), coef(rng, (T, n, n), 2.0)]

    def chain(x, hp, hq, hr):
        layer_in, H_pre, H_post, H_res = mj.mhc_pre_op(x, hp, hq, hr, convention="deepseek")
        return mj.mhc_post_op(jax.numpy.tanh(layer_in), x, H_post, H_res, convention="deepseek")

    dev = [jax.device_put(a, jax.devices("gpu")[0]) for a in arrays]
    out, vjp = jax.vjp(jax.jit(chain), *dev)
    g = coef(rng, (T, n, C))

    def ochain(x, hp, hq, hr):
        layer_in, _, H_post, H_res = O.pre_op(x, hp, hq, hr)
        return O.post_op(torch.tanh(layer_in), x, H_post, H_res)

    (ref,), dref = torch_vjp(ochain, arrays, [g])
    assert_close(np.asarray(out), ref, 1e-5, "out")
    for i, (a, b) in enumerate(zip(vjp(jax.numpy.asarray(g)), dref)):
        assert_close(np.asarray(a), b, CHAIN_TOL, f"gradient {i}")
