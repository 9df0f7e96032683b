"""mhc_cupy.jax on the CPU (CI): the adapter plumbing under eager, jit, grad / vjp and vmap.

On the CPU every kernel call of the adapter is a ``buffer_callback`` that runs
the float64 NumPy reference and rounds once to the output dtype, so:

* forward vs ``mhc_cupy.reference``: one rounding of the float64 value, i.e.
  at most 2^-p relative (p = 8 bf16, 11 f16, 24 f32);
* vjp vs the functional ``*_bwd`` (same reference, same rounding): bitwise;
* grad vs JAX autodiff of a pure-jnp float32 forward: the jnp side carries
  float32 accumulation error (sums over C <= 33 terms, 20 Sinkhorn
  iterations): 1e-4 relative to the largest gradient;
* vmap vs a per-example Python loop: bitwise where vmap runs the same call
  with one more token dim; 1e-6 relative where it sums a shared gradient in
  float32 (shared ``h``).

Retracing: jit at tokens 21, n 4, C 1000, then re-traced at
other shapes; grad and vmap; zero gradient for unused outputs; no host
callback other than buffer_callback in the lowered program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc_cupy
import mhc_cupy.jax as mj
from mhc_cupy import reference as R
from mhc_cupy.ops import SPECS
from mhc_cupy.bench.baselines import jnp_sinkhorn

from harness import assert_close, assert_rounded, f64, spec_inputs, spec_parameters

pytestmark = pytest.mark.usefixtures("jax_on_cpu")

NI, SK_EPS, RMS_EPS = 20, 1e-8, 1e-5
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


# --------------------------------------------------------------- helpers
def assert_same(actual, expected):
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    np.testing.assert_array_equal(f64(a), f64(e))


# ------------------------------------------------ pure-jnp float32 forwards
def sinkhorn_jnp(L, num_iters=NI, eps=SK_EPS):
    """OPS.md section 1 exactly: the bench's plain-jnp Sinkhorn-Knopp (one definition)."""
    return jnp_sinkhorn(L, num_iters, eps)


def rmsnorm_jnp(x, eps=RMS_EPS, weight=None):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight
    return y.astype(x.dtype)


def mix_jnp(x, M):
    return (M @ x.astype(jnp.float32)).astype(x.dtype)


def aggregate_jnp(x, h):
    return (h[..., :, None] * x.astype(jnp.float32)).sum(-2).astype(x.dtype)


def distribute_jnp(y, h):
    return (h[..., :, None] * y.astype(jnp.float32)[..., None, :]).astype(y.dtype)


def post_jnp(y, x, H_post, H_res):
    return (H_res @ x.astype(jnp.float32) + H_post[..., :, None] * y.astype(jnp.float32)[..., None, :]).astype(x.dtype)


def coeffs_jnp(x, phi, alpha, bias, eps=RMS_EPS):
    n, C = x.shape[-2], x.shape[-1]
    xt = x.astype(jnp.float32).reshape(x.shape[:-2] + (n * C,))
    rinv = jax.lax.rsqrt(jnp.mean(xt * xt, -1, keepdims=True) + eps)
    h = (xt @ phi) * rinv
    return (alpha[0] * h[..., :n] + bias[:n], alpha[1] * h[..., n:2 * n] + bias[n:2 * n],
            (alpha[2] * h[..., 2 * n:] + bias[2 * n:]).reshape(x.shape[:-2] + (n, n)))


def pre_jnp(x, a, b, c):
    H_pre = jax.nn.sigmoid(a)
    return aggregate_jnp(x, H_pre), H_pre, 2 * jax.nn.sigmoid(b), sinkhorn_jnp(c)


# ------------------------------------------------------------ op table
@dataclass
class Op:
    """One adapter op: its inputs (from the op's spec, ``harness.spec_inputs``) and every oracle
    it is checked against."""

    args: tuple  # differentiable inputs, in call order (the spec's)
    make: Callable  # (rng, lead, n, C, dtype) -> dict name -> jnp array
    adapter: Callable  # (*args) -> tuple of outputs
    fwd: Callable  # (module, dict of arrays) -> tuple: the op's *_fwd from mhc_cupy.reference or mhc_cupy
    bwd: Callable  # (cts tuple, dict of jnp) -> tuple of grads (functional API)
    jnp_fn: Callable  # (*args) -> tuple of outputs, pure jnp float32
    shared: tuple = ()  # inputs shared by all tokens: a shared h [n], the RMSNorm weight [C], phi / alpha / bias

    def ref(self, a: dict) -> tuple:
        """The float64 NumPy reference of the inputs ``a``."""
        return self.fwd(R, a)

    @property
    def needs_tokens(self) -> bool:  # a shared h [n] needs token dims (else it is per token)
        return "h" in self.shared


def _act(rng, shape, dt):
    return jnp.asarray(rng.standard_normal(shape), DTYPES[dt])


def _coef(rng, shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _op(name, adapter, fwd, bwd, jnp_fn, scale=None, shared=False, absent=()):
    """The Op of spec ``name``: its inputs, their shapes and which are shared come from the spec."""
    def make(r, lead, n, C, dt):
        arrays = spec_inputs(name, r, lead, n, C, dt, scale, shared, absent)
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    args = tuple(a.name for a in SPECS[f"{name}_fwd"].inputs if a.name not in absent)
    return Op(args, make, adapter, fwd, bwd, jnp_fn, spec_parameters(name, shared, absent))


def _ops():
    ops = {}
    ops["sinkhorn_knopp"] = _op(
        "sinkhorn_knopp",
        lambda L: (mj.sinkhorn_knopp(L, NI, SK_EPS),),
        lambda mod, a: (mod.sinkhorn_knopp_fwd(a["logits"], NI, SK_EPS),),
        lambda ct, a: (mhc_cupy.sinkhorn_knopp_bwd(ct[0], a["logits"], NI, SK_EPS),),
        lambda L: (sinkhorn_jnp(L),), scale={"logits": 2.0})
    ops["rmsnorm"] = _op(
        "rmsnorm",
        lambda x: (mj.rmsnorm(x, RMS_EPS),),
        lambda mod, a: (mod.rmsnorm_fwd(a["x"], RMS_EPS),),
        lambda ct, a: (mhc_cupy.rmsnorm_bwd(ct[0], a["x"], RMS_EPS),),
        lambda x: (rmsnorm_jnp(x),), absent=("weight",))
    ops["rmsnorm_weight"] = _op(
        "rmsnorm",
        lambda x, w: (mj.rmsnorm(x, RMS_EPS, weight=w),),
        lambda mod, a: (mod.rmsnorm_fwd(a["x"], RMS_EPS, a["weight"]),),
        lambda ct, a: mhc_cupy.rmsnorm_bwd(ct[0], a["x"], RMS_EPS, a["weight"]),
        lambda x, w: (rmsnorm_jnp(x, RMS_EPS, w),), scale={"weight": (0.3, 1.0)})
    ops["stream_mix"] = _op(
        "stream_mix",
        lambda x, M: (mj.stream_mix(x, M),),
        lambda mod, a: (mod.stream_mix_fwd(a["x"], a["M"]),),
        lambda ct, a: mhc_cupy.stream_mix_bwd(ct[0], a["x"], a["M"]),
        lambda x, M: (mix_jnp(x, M),))
    # the aggregate (of x) and the distribute (of y), each with per-token and shared coefficients
    for op, arg, plain in (("stream_aggregate", "x", aggregate_jnp), ("stream_distribute", "y", distribute_jnp)):
        for shared in (False, True):
            ops[op + ("_shared" if shared else "")] = _op(
                op,
                lambda v, h, op=op: (getattr(mj, op)(v, h),),
                lambda mod, a, op=op, arg=arg: (getattr(mod, op + "_fwd")(a[arg], a["h"]),),
                lambda ct, a, op=op, arg=arg: getattr(mhc_cupy, op + "_bwd")(ct[0], a[arg], a["h"]),
                lambda v, h, plain=plain: (plain(v, h),), shared=shared)
    ops["mhc_post_op"] = _op(
        "mhc_post_op",
        lambda y, x, hp, hr: (mj.mhc_post_op(y, x, hp, hr),),
        lambda mod, a: (mod.mhc_post_op_fwd(a["layer_out"], a["x"], a["H_post"], a["H_res"]),),
        lambda ct, a: mhc_cupy.mhc_post_op_bwd(ct[0], a["layer_out"], a["x"], a["H_post"], a["H_res"]),
        lambda y, x, hp, hr: (post_jnp(y, x, hp, hr),))
    ops["mhc_pre_op"] = _op(
        "mhc_pre_op",
        lambda x, a, b, c: mj.mhc_pre_op(x, a, b, c, NI, SK_EPS),
        lambda mod, a: mod.mhc_pre_op_fwd(a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"], NI, SK_EPS),
        lambda ct, a: mhc_cupy.mhc_pre_op_bwd(*ct, a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"],
                                              NI, SK_EPS),
        pre_jnp, scale={"h_res_raw": 2.0})
    ops["mhc_coeffs"] = _op(
        "mhc_coeffs",
        lambda x, phi, alpha, bias: mj.mhc_coeffs(x, phi, alpha, bias, RMS_EPS),
        lambda mod, a: mod.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], RMS_EPS),
        lambda ct, a: mhc_cupy.mhc_coeffs_bwd(*ct, a["x"], a["phi"], a["alpha"], a["bias"], RMS_EPS),
        coeffs_jnp, scale={"bias": 0.1})
    return ops


OPS = _ops()
ALL_OPS = sorted(OPS)
# (leading token dims, n, C, dtype): tokens 1, 3, 21 and (2, 3); n 1, 3, 4; odd C.
CONFIGS = [
    ((), 4, 7, "float32"),
    ((1,), 1, 33, "bfloat16"),
    ((3,), 3, 7, "float16"),
    ((21,), 4, 33, "float32"),
    ((2, 3), 4, 7, "bfloat16"),
    ((2, 3), 3, 33, "float32"),
]


def _cfg_id(c):
    lead, n, C, dt = c
    return f"lead{'x'.join(map(str, lead)) or '-'}_n{n}_C{C}_{dt}"


def op_cases(configs, names=None):
    """pytest params (op name, config), leaving out a shared h without token dims."""
    return [pytest.param(name, cfg, id=f"{name}-{_cfg_id(cfg)}")
            for name in (names or ALL_OPS) for cfg in configs if not (OPS[name].needs_tokens and not cfg[0])]


def _inputs(op, rng, cfg):
    lead, n, C, dt = cfg
    if op.needs_tokens and not lead:
        pytest.skip("a shared h needs token dims")
    a = op.make(rng, lead, n, C, dt)
    return a, tuple(a[k] for k in op.args)


def _np(a):
    return {k: np.asarray(v) for k, v in a.items()}


def _cotangents(rng, outs):
    return tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs)


# ------------------------------------------------------------- forward
@pytest.mark.parametrize("name,cfg", op_cases(CONFIGS))
def test_forward_eager_and_jit_match_reference(name, cfg, rng):
    op = OPS[name]
    a, args = _inputs(op, rng, cfg)
    ref = op.ref(_np(a))
    eager = op.adapter(*args)
    jitted = jax.jit(op.adapter)(*args)
    act_dt = cfg[3]
    for e, j, r in zip(eager, jitted, ref):
        dt = np.dtype(e.dtype).name
        assert dt in (act_dt, "float32")
        assert_rounded(e, r, dt)
        assert_same(j, e)


# ------------------------------------------------------------ backward
@pytest.mark.parametrize("name,cfg", op_cases(CONFIGS))
def test_vjp_matches_functional_bwd(name, cfg, rng):
    op = OPS[name]
    a, args = _inputs(op, rng, cfg)
    outs, vjp = jax.vjp(op.adapter, *args)
    cts = _cotangents(rng, outs)
    grads = vjp(cts)
    expected = op.bwd(cts, a)
    assert len(grads) == len(expected) == len(args)
    for g, e, x in zip(grads, expected, args):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_same(g, e)
    # the same under jit
    jgrads = jax.jit(lambda args, cts: jax.vjp(op.adapter, *args)[1](cts))(args, cts)
    for g, e in zip(jgrads, grads):
        assert_same(g, e)


@pytest.mark.parametrize("name,cfg", op_cases([c for c in CONFIGS if c[3] == "float32"]))
def test_grad_matches_jnp_autodiff(name, cfg, rng):
    op = OPS[name]
    a, args = _inputs(op, rng, cfg)
    outs = op.adapter(*args)
    cts = _cotangents(rng, outs)

    def loss(fn):
        return lambda *xs: sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in zip(fn(*xs), cts))

    argnums = tuple(range(len(args)))
    got = jax.grad(loss(op.adapter), argnums)(*args)
    want = jax.grad(loss(op.jnp_fn), argnums)(*args)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-4, scale="max")


def test_sinkhorn_implicit_grad_mode(rng):
    L = _coef(rng, (5, 4, 4), 2.0)
    G = _coef(rng, (5, 4, 4))
    for mode in ("unrolled", "implicit"):
        _, vjp = jax.vjp(lambda l: mj.sinkhorn_knopp(l, 3, SK_EPS, mode), L)
        (d,) = vjp(G)
        assert_same(d, mhc_cupy.sinkhorn_knopp_bwd(G, L, 3, SK_EPS, mode))
        np.testing.assert_allclose(np.asarray(d).sum(-1), 0, atol=1e-5)  # rows sum to 0
    # 3 iterations: the two modes differ (forward not converged)
    u = jax.vjp(lambda l: mj.sinkhorn_knopp(l, 3, SK_EPS, "unrolled"), L)[1](G)[0]
    i = jax.vjp(lambda l: mj.sinkhorn_knopp(l, 3, SK_EPS, "implicit"), L)[1](G)[0]
    assert float(jnp.abs(u - i).max()) > 1e-4


def test_pre_op_grad_mode_and_params(rng):
    a = OPS["mhc_pre_op"].make(rng, (4,), 3, 7, "float32")
    args = tuple(a[k] for k in OPS["mhc_pre_op"].args)
    for mode in ("unrolled", "implicit"):
        outs, vjp = jax.vjp(lambda *xs: mj.mhc_pre_op(*xs, num_iters=5, eps=1e-6, grad_mode=mode), *args)
        assert_rounded(outs[3], R.sinkhorn_knopp_fwd(a["h_res_raw"], 5, 1e-6), "float32")
        cts = _cotangents(rng, outs)
        for g, e in zip(vjp(cts), mhc_cupy.mhc_pre_op_bwd(*cts, *args, 5, 1e-6, mode)):
            assert_same(g, e)


# ---------------------------------------------------- unused outputs
def test_pre_op_unused_outputs_give_zero_gradient(rng):
    op = OPS["mhc_pre_op"]
    a, args = _inputs(op, rng, ((2, 3), 4, 7, "float32"))
    argnums = (0, 1, 2, 3)
    # only layer_in used: no gradient for h_post_raw / h_res_raw
    g = jax.grad(lambda *xs: mj.mhc_pre_op(*xs)[0].sum(), argnums)(*args)
    ones = jnp.ones(a["x"].shape[:-2] + (7,), jnp.float32)
    e = mhc_cupy.mhc_pre_op_bwd(ones, None, None, None, *args)
    for gi, ei in zip(g, e):
        assert_same(gi, ei)
    assert not np.any(np.asarray(g[2])) and not np.any(np.asarray(g[3]))
    assert np.all(np.isfinite(np.asarray(g[0]))) and np.any(np.asarray(g[1]))
    # only H_res used: dx, dh_pre, dh_post are zero; under jit and vmap as well
    for wrap in (lambda f: f, jax.jit):
        g = wrap(jax.grad(lambda *xs: (mj.mhc_pre_op(*xs)[3] ** 2).sum(), argnums))(*args)
        for k in range(3):
            assert not np.any(np.asarray(g[k])), k
        assert np.any(np.asarray(g[3]))
    gv = jax.vmap(jax.grad(lambda *xs: mj.mhc_pre_op(*xs)[1].sum(), argnums))(*args)
    assert not np.any(np.asarray(gv[0])) and not np.any(np.asarray(gv[2])) and not np.any(np.asarray(gv[3]))
    np.testing.assert_allclose(np.asarray(gv[1]), np.asarray(jax.grad(lambda z: jax.nn.sigmoid(z).sum())(args[1])),
                               rtol=1e-6)


def test_unused_result_gives_zero_gradient(rng):
    x = _act(rng, (3, 4, 7), "bfloat16")
    h = _coef(rng, (4,))
    gx, gh = jax.grad(lambda x, h: (mj.stream_aggregate(x, h), h.sum())[1], (0, 1))(x, h)
    assert not np.any(np.asarray(gx, np.float32))
    np.testing.assert_array_equal(np.asarray(gh), np.ones(4, np.float32))


# ----------------------------------------------------------------- vmap
def _vmap_cases():
    out = []
    for name in ALL_OPS:
        k = len(OPS[name].args)
        axes = [tuple([0] * k)]
        if k > 1:
            axes.append(tuple([0] + [None] * (k - 1)))  # only the first input batched
            axes.append(tuple([None] * (k - 1) + [0]))  # only the last input batched
        out += [(name, ax) for ax in axes]
    return out


def _loop(fn, in_axes, args, size):
    per = []
    for b in range(size):
        per.append(fn(*[a if ax is None else a[b] for a, ax in zip(args, in_axes)]))
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per)


def _batched_inputs(op, rng, B, lead, n, C, dt):
    """Inputs with a leading batch axis B (a shared input gets [B, *its shape])."""
    a = op.make(rng, (B,) + lead, n, C, dt)
    for k in op.shared:
        a[k] = jnp.stack([op.make(rng, lead, n, C, dt)[k] for _ in range(B)])
    return a


@pytest.mark.parametrize("name,in_axes", _vmap_cases(), ids=lambda v: str(v).replace(" ", ""))
def test_vmap_equals_loop(name, in_axes, rng):
    op = OPS[name]
    B, lead, n, C, dt = 3, (2,), 3, 7, "bfloat16"
    a = op.make(rng, lead, n, C, dt)
    batched = _batched_inputs(op, rng, B, lead, n, C, dt)
    args = tuple(batched[k] if ax == 0 else a[k] for k, ax in zip(op.args, in_axes))
    # forward: eager vmap and jit(vmap) == loop (the same reference per token: bitwise)
    want = _loop(op.adapter, in_axes, args, B)
    for got in (jax.vmap(op.adapter, in_axes)(*args), jax.jit(jax.vmap(op.adapter, in_axes))(*args)):
        for g, w in zip(got, want):
            assert_same(g, w)
    # backward: vmap of vjp == loop of vjp.  A shared h's per-example gradient
    # is summed over tokens in float32 by XLA (float64 in the loop): 1e-6.
    cts = _cotangents(rng, want)

    def vjp_fn(*xs_and_cts):
        xs, ct = xs_and_cts[:len(args)], xs_and_cts[len(args):]
        return jax.vjp(op.adapter, *xs)[1](ct)

    v_axes = in_axes + (0,) * len(cts)
    got = jax.vmap(vjp_fn, v_axes)(*args, *cts)
    want = _loop(vjp_fn, v_axes, args + cts, B)
    for k, g, w, x in zip(op.args, got, want, args):
        assert g.dtype == x.dtype
        if k == "h" and k in op.shared:  # a shared h: XLA sums its per-token gradient in float32
            assert_close(g, w, 1e-6, scale="max")
        else:
            assert_same(g, w)


def _nested(op, axes, inner, outer):
    return lambda *xs: _loop(lambda *ys: _loop(op.adapter, axes, ys, inner), axes, xs, outer)


def check_grad_of_nested_vmap(op, rng, lead, n, C, jit: bool):
    """vmap(vmap(op)) (jitted or not) == explicit loops, and so is the grad of a loss through it
    (float32; a shared input stays unbatched, the common case: one h / weight for the model).
    The GPU tests (tests/gpu/test_jax_gpu.py) run it on device arrays."""
    outer, inner, dt = 2, 3, "float32"
    a = op.make(rng, (outer, inner) + lead, n, C, dt)
    shared = op.make(rng, lead, n, C, dt)
    a.update({k: shared[k] for k in op.shared})
    args = tuple(a[k] for k in op.args)
    axes = tuple(None if k in op.shared else 0 for k in op.args)
    f = jax.vmap(jax.vmap(op.adapter, axes), axes)
    got = (jax.jit(f) if jit else f)(*args)
    for g, w in zip(got, _nested(op, axes, inner, outer)(*args)):
        assert_same(g, w)
    cts = _cotangents(rng, got)

    def loss(fn):
        return lambda *xs: sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in zip(fn(*xs), cts))

    argnums = tuple(range(len(args)))
    g_vmap = jax.jit(jax.grad(loss(f), argnums))(*args)
    g_loop = jax.grad(loss(_nested(op, axes, inner, outer)), argnums)(*args)
    for g, w in zip(g_vmap, g_loop):
        assert_close(g, w, 1e-6, scale="max")


@pytest.mark.parametrize("name", ALL_OPS)
def test_grad_of_nested_vmap(name, rng):
    check_grad_of_nested_vmap(OPS[name], rng, (2,), 3, 7, jit=False)


def test_vmap_rmsnorm_weight_per_example_gradient(rng):
    x = _act(rng, (4, 5, 33), "float32")
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(33), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4, 5, 33)), jnp.float32)
    # per-example weight gradients (weight unbatched, x batched)
    fn = jax.vmap(lambda x, g: jax.vjp(lambda x, w: mj.rmsnorm(x, RMS_EPS, w), x, w)[1](g), (0, 0))
    dx, dw = fn(x, g)
    assert dw.shape == (4, 33)
    for b in range(4):
        ex, ew = mhc_cupy.rmsnorm_bwd(g[b], x[b], RMS_EPS, w)
        assert_same(dx[b], ex)
        assert_same(dw[b], ew)
    # batched weight
    wb = jnp.asarray(1 + 0.3 * rng.standard_normal((4, 33)), jnp.float32)
    y = jax.vmap(lambda x, w: mj.rmsnorm(x, RMS_EPS, w))(x, wb)
    for b in range(4):
        assert_same(y[b], mj.rmsnorm(x[b], RMS_EPS, wb[b]))


def test_vmap_shared_h_stays_shared_per_example(rng):
    # x [B, T, n, C] batched, h [n] unbatched: per example out = sum_i h_i x_i,
    # and the per-example dh sums over that example's tokens only.
    x = _act(rng, (3, 5, 4, 7), "float32")
    h = _coef(rng, (4,))
    dh = jax.vmap(jax.grad(lambda x, h: mj.stream_aggregate(x, h).sum(), 1), (0, None))(x, h)
    want = np.asarray(x, np.float64).sum(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(dh), want, rtol=1e-6)
    # x [B, n, C] (no token dims per example), h [n]: h is per token per example
    dh2 = jax.vmap(jax.grad(lambda x, h: mj.stream_aggregate(x, h).sum(), 1), (0, None))(x[:, 0], h)
    np.testing.assert_allclose(np.asarray(dh2), np.asarray(x[:, 0], np.float64).sum(-1), rtol=1e-6)


# ------------------------------------------------------------ re-tracing
def test_p11_jit_retrace_other_shapes(rng):
    def model(x, hp, hq, hr):
        layer_in, H_pre, H_post, H_res = mj.mhc_pre_op(x, hp, hq, hr)
        y = mj.rmsnorm(layer_in)
        return mj.mhc_post_op(y, x, H_post, H_res)

    f = jax.jit(model)
    g = jax.jit(jax.grad(lambda *a: model(*a).astype(jnp.float32).sum(), (0, 1, 2, 3)))
    fv = jax.jit(jax.vmap(model))
    for lead, n, C, dt in [((21,), 4, 1000, "float32"), ((2, 3), 3, 33, "bfloat16"), ((5,), 1, 7, "float16"),
                           ((21,), 4, 1000, "float32")]:
        a = OPS["mhc_pre_op"].make(rng, lead, n, C, dt)
        args = (a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"])
        out = f(*args)
        xs = _np(a)
        li, Hpre, Hpost, Hres = R.mhc_pre_op_fwd(xs["x"], xs["h_pre_raw"], xs["h_post_raw"], xs["h_res_raw"])
        act = np.dtype(DTYPES[dt])
        y = R.rmsnorm_fwd(li.astype(act)).astype(act)  # each op rounds its output once
        assert_rounded(out, R.mhc_post_op_fwd(y, xs["x"], Hpost.astype(np.float32), Hres.astype(np.float32)), dt)
        grads = g(*args)
        for gr, x in zip(grads, args):
            assert gr.shape == x.shape and gr.dtype == x.dtype
            assert np.all(np.isfinite(np.asarray(gr, np.float32)))
        # gradient of the chain vs the functional backward of each op, composed by hand
        ct = jnp.ones(out.shape, out.dtype)
        H_pre, H_post, H_res = (jnp.asarray(v, jnp.float32) for v in (Hpre, Hpost, Hres))
        dy, dx_post, dHpost, dHres = mhc_cupy.mhc_post_op_bwd(ct, jnp.asarray(y), args[0], H_post, H_res)
        dli = mhc_cupy.rmsnorm_bwd(dy, jnp.asarray(li.astype(act)))
        dx_pre, dhp, dhq, dhr = mhc_cupy.mhc_pre_op_bwd(dli, None, dHpost, dHres, *args)
        assert_close(grads[1], dhp, 1e-5, scale="max")
        assert_close(grads[2], dhq, 1e-5, scale="max")
        assert_close(grads[3], dhr, 1e-5, scale="max")
        vm = fv(*[jnp.stack([v, v]) for v in args])
        assert_same(vm[1], out)


def test_lowering_uses_buffer_callback_only():
    x = jnp.ones((21, 4, 1000), jnp.float32)
    M = jnp.ones((21, 4, 4), jnp.float32)
    text = jax.jit(jax.grad(lambda x, M: mj.stream_mix(x, M).sum(), (0, 1))).lower(x, M).as_text()
    assert "xla_buffer_python_cpu_callback" in text
    assert "xla_ffi_python_cpu_callback" not in text  # no pure_callback / io_callback


# ------------------------------------------------------ edge cases
def test_zero_tokens(rng):
    x = jnp.zeros((0, 4, 7), jnp.bfloat16)
    h = _coef(rng, (4,))
    out = mj.stream_aggregate(x, h)
    assert out.shape == (0, 7) and out.dtype == jnp.bfloat16
    gx, gh = jax.grad(lambda x, h: mj.stream_aggregate(x, h).astype(jnp.float32).sum(), (0, 1))(x, h)
    assert gx.shape == x.shape and gh.shape == (4,) and not np.any(np.asarray(gh))
    L = jnp.zeros((0, 3, 3), jnp.float32)
    assert mj.sinkhorn_knopp(L).shape == (0, 3, 3)
    assert jax.grad(lambda l: mj.sinkhorn_knopp(l).sum())(L).shape == (0, 3, 3)


def test_n1_sinkhorn_is_one_with_zero_grad(rng):
    L = _coef(rng, (3, 1, 1), 5.0)
    assert_same(mj.sinkhorn_knopp(L), jnp.ones((3, 1, 1), jnp.float32))
    assert not np.any(np.asarray(jax.grad(lambda l: mj.sinkhorn_knopp(l).sum())(L)))


def test_errors_raised_at_trace_time(rng):
    x = _act(rng, (3, 4, 7), "bfloat16")
    with pytest.raises(TypeError, match="M"):
        mj.stream_mix(x, jnp.ones((3, 4, 4), jnp.bfloat16))
    with pytest.raises(TypeError, match="x"):
        jax.jit(mj.stream_mix)(jnp.ones((3, 4, 7), jnp.int32), jnp.ones((3, 4, 4), jnp.float32))
    with pytest.raises(ValueError, match="M"):
        jax.jit(mj.stream_mix)(x, jnp.ones((3, 4, 3), jnp.float32))
    with pytest.raises(ValueError, match="streams"):
        mj.sinkhorn_knopp(jnp.ones((2, 33, 33), jnp.float32))
    with pytest.raises(ValueError, match="grad_mode"):
        mj.sinkhorn_knopp(jnp.ones((2, 3, 3), jnp.float32), grad_mode="exact")
    with pytest.raises(ValueError, match="num_iters"):
        mj.mhc_pre_op(x, jnp.ones((3, 4)), jnp.ones((3, 4)), jnp.ones((3, 4, 4)), num_iters=-1)
    with pytest.raises(TypeError, match=r"num_iters must be a concrete int \(static under jax.jit\)"):
        jax.jit(lambda L, k: mj.sinkhorn_knopp(L, num_iters=k))(jnp.ones((2, 3, 3), jnp.float32), 5)
    with pytest.raises(TypeError, match="layer_out"):
        mj.mhc_post_op(jnp.ones((3, 7), jnp.float32), x, jnp.ones((3, 4)), jnp.ones((3, 4, 4)))
    with pytest.raises(ValueError, match="weight"):
        mj.rmsnorm(x, 1e-5, jnp.ones((5,), jnp.float32))


@pytest.mark.parametrize("name", ALL_OPS)
def test_gradient_of_gradient_names_the_limit(name, rng):
    """jax.grad of jax.grad reaches a kernel's derivative: a ValueError
    that says the functions are differentiable once, in reverse mode (JAX's own error blamed buffer
    callbacks and told the user to write a jax.custom_jvp).  A first-order gradient is unchanged."""
    op = OPS[name]
    a, args = _inputs(op, rng, ((3,), 3, 7, "float32"))

    def loss(*args):
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in op.adapter(*args))

    def grad_norm(*args):
        return sum(jnp.sum(g * g) for g in jax.grad(loss, tuple(range(len(args))))(*args))

    with pytest.raises(ValueError, match="differentiable once, in reverse mode"):
        jax.grad(grad_norm)(*args)
    assert np.isfinite(float(grad_norm(*args)))


def test_gradient_of_gradient_of_layer_and_stack():
    p, x = mj.mhc_init(jax.random.PRNGKey(0), 8, 4), jnp.ones((2, 4, 8))
    sp = mj.mhc_stack_init(jax.random.PRNGKey(1), 2, 8, 4)
    for f in (lambda x: mj.mhc_layer(p, x, jnp.tanh).sum(), lambda x: mj.mhc_stack(sp, x, jnp.tanh, recompute=2).sum(),
              lambda x: mj.mhc_head(mj.mhc_head_init(jax.random.PRNGKey(2), 8, 4), x).sum()):
        with pytest.raises(ValueError, match="differentiable once, in reverse mode"):
            jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)


def test_import_orders_keep_jax_intact():
    import subprocess
    import sys

    code = ("import {a}; import {b}; import jax, mhc_cupy, mhc_cupy.jax as mj; "
            "assert jax.numpy.bfloat16 is not None and jax.__name__ == 'jax'; "
            "assert mhc_cupy.jax is mj and mj.__name__ == 'mhc_cupy.jax'; "
            "assert all(hasattr(mj, f) for f in mj.__all__) and len(mj.__all__) == 17")
    for a, b in (("jax", "mhc_cupy.jax"), ("mhc_cupy.jax", "jax")):
        subprocess.run([sys.executable, "-c", code.format(a=a, b=b)], check=True, timeout=120)


def test_none_or_list_names_the_argument():
    x, M, h = jnp.ones((3, 4, 7)), jnp.ones((3, 4, 4)), jnp.ones((3, 4))
    for call, name in ((lambda: mj.stream_mix(None, M), "x"), (lambda: mj.stream_mix([[1.0]], M), "x"),
                       (lambda: mj.stream_mix(x, None), "M"), (lambda: mj.sinkhorn_knopp(None), "logits"),
                       (lambda: mj.rmsnorm([1.0, 2.0]), "x"), (lambda: mj.mhc_pre_op(x, None, h, M), "h_pre_raw"),
                       (lambda: mj.mhc_post_op(jnp.ones((3, 7)), x, h, [1.0]), "H_res")):
        with pytest.raises(TypeError, match=rf"^{name}\b"):
            call()


def test_layer_arguments_validated():
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="n_streams must be in 1..32"):
        mj.mhc_init(key, 64, n_streams=33)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        mj.mhc_init(key, 0)
    with pytest.raises(TypeError, match="dim must be an int"):
        mj.mhc_init(key, 8.0)
    params = mj.mhc_init(key, 8)
    x = jnp.ones((2, 4, 8))
    for kw, exc, match in ((dict(num_iters=-1), ValueError, "num_iters"), (dict(num_iters=True), TypeError, "num_iters"),
                           (dict(num_iters=20_000), ValueError, "num_iters must be in 0..10000"),
                           (dict(eps=-1.0), ValueError, "eps"), (dict(rms_eps="1e-5"), TypeError, "rms_eps"),
                           (dict(grad_mode="exact"), ValueError, "grad_mode")):
        with pytest.raises(exc, match=match):
            mj.mhc_layer(params, x, jnp.tanh, **kw)
    with pytest.raises(TypeError, match="params must be the dict of mhc_init"):
        mj.mhc_layer((params["phi"],), x, jnp.tanh)


def test_wrong_params_dict_names_its_keys():
    """One function's parameters handed to another (the head's to mhc_layer, a layer's to mhc_head or
    mhc_stack), or a framework's nesting ({"params": ...}): the TypeError says the keys it got (it said
    "got dict", the one thing that was right)."""
    key = jax.random.PRNGKey(0)
    layer, head = mj.mhc_init(key, dim=8, n_streams=2), mj.mhc_head_init(key, dim=8, n_streams=2)
    x = jnp.ones((3, 2, 8))
    with pytest.raises(TypeError, match=r"mhc_init \(phi, alpha, bias\), got a dict with keys "
                                        r"\['hc_base', 'hc_fn', 'hc_scale'\]$"):
        mj.mhc_layer(head, x, jnp.tanh)
    with pytest.raises(TypeError, match=r"mhc_head_init .* got a dict with keys \['alpha', 'bias', 'phi'\]$"):
        mj.mhc_head(layer, x)
    with pytest.raises(TypeError, match=r"mhc_stack_init .* got a dict with keys \['params'\]$"):
        mj.mhc_stack({"params": layer}, x, jnp.tanh)
    with pytest.raises(TypeError, match=r"mhc_init \(phi, alpha, bias\), got tuple$"):
        mj.mhc_layer((layer["phi"],), x, jnp.tanh)
