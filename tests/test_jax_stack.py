"""``mhc_cupy.jax.mhc_stack``: L mHC layers over stacked per-layer parameters, with stream recompute
(issue 44 items 1 and 3, JAX side; docs/OPS.md section 12).

On the CPU every kernel call runs the float64 NumPy reference rounded once, so:

* value and gradients (x, phi, alpha, bias, per-layer f_params) equal a Python loop of
  ``mhc_layer`` bitwise, with recompute off, L_r = 1, 2, 3, "auto" and L_r > L; both conventions;
  bfloat16 / float16 / float32.  The loop runs under ``jax.jit`` like the stack's ``lax.scan``:
  eagerly, f's jnp ops run one XLA op at a time and may round otherwise than compiled.  The
  gradient of a weight that f closes over (shared by all layers) too, except where XLA fuses the
  sum over the layers with f's gradient op otherwise (seen at one token: a few roundings);
* float32: close to a float64 plain-jnp chain of the layer maths (paper and DeepSeek);
* recompute saves ceil(L / L_r) copies of the streams [..., n, C] instead of L;
* under jit(grad), jax.checkpoint, an outer lax.scan and vmap it equals the plain call; keys
  (per layer in f_params, or closed over) work; bad input raises errors naming the argument.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import mhc_cupy.jax as mj  # noqa: E402
from mhc_cupy._stack import recompute_blocks  # noqa: E402
from mhc_cupy.bench.baselines import jnp_sinkhorn  # noqa: E402

from harness import TOL, assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_on_cpu")

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
#: (token dims, n, C, L, dtype): tokens 1, 3, 127 and (2, 3); n 1, 2, 4, 5, 8, 16; C 3, 5, 8; L 1..5.
CASES = [((1,), 1, 5, 1, "float32"), ((3,), 2, 8, 2, "bfloat16"), ((127,), 4, 3, 5, "float32"),
         ((3,), 5, 5, 4, "float16"), ((1,), 8, 3, 3, "bfloat16"), ((3,), 16, 5, 3, "float32"),
         ((2, 3), 4, 8, 4, "bfloat16")]


def _id(case):
    lead, n, C, L, dt = case
    return f"T{'x'.join(map(str, lead))}-n{n}-C{C}-L{L}-{dt}"


def make(rng, lead, n, C, L, dtype="float32", convention="paper"):
    """(params, x, g, W [L, C, C]): coefficients moved off their init (logits of scale ~1)."""
    params = mj.mhc_stack_init(jax.random.PRNGKey(int(rng.integers(1 << 30))), L, C, n, alpha_init=0.5,
                               convention=convention)
    params["bias"] = params["bias"] + jnp.asarray(rng.standard_normal(params["bias"].shape), jnp.float32)
    params["alpha"] = jnp.tile(jnp.asarray([0.5, 1.0, 1.5], jnp.float32), (L, 1))
    x = jnp.asarray(rng.standard_normal(lead + (n, C)), DTYPES[dtype])
    g = jnp.asarray(rng.standard_normal(lead + (n, C)), DTYPES[dtype])
    W = jnp.asarray(rng.standard_normal((L, C, C)) / math.sqrt(C), jnp.float32)
    return params, x, g, W


def sub(w, h):
    """The sublayer of one layer, weight w [C, C]."""
    return jnp.tanh(h.astype(jnp.float32) @ w).astype(h.dtype)


def loop(params, x, f, f_params=None, **kw):
    """The reference: mhc_layer applied layer by layer (layer l's f_params slices bound to f)."""
    for l in range(params["phi"].shape[0]):
        f_l = f if f_params is None else partial(f, jax.tree.map(lambda a: a[l], f_params))
        x = mj.mhc_layer(jax.tree.map(lambda a: a[l], params), x, f_l, **kw)
    return x


def vjp_all(fn, args, g):
    """[out, *gradients of every leaf of args], compiled."""
    def run(args, g):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(g)
    out, grads = jax.jit(run)(args, g)
    return [out, *jax.tree_util.tree_leaves(grads)]


def assert_same(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), err_msg=f"{what}: {i}")


# ------------------------------------------------------------------ bitwise vs the loop of mhc_layer
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_stack_equals_the_layer_loop_bitwise(rng, case, convention):
    """Value and gradients of x, phi, alpha, bias and the per-layer f_params, every recompute."""
    lead, n, C, L, dt = case
    params, x, g, W = make(rng, lead, n, C, L, dt, convention)
    want = vjp_all(lambda p, x, W: loop(p, x, sub, W, convention=convention), (params, x, W), g)
    assert want[0].dtype == x.dtype and len(want) == 6
    done = set()
    for recompute in (None, 1, 2, 3, "auto", L + 1):
        blocks = recompute_blocks(recompute, n, L)
        if (blocks and min(blocks, L)) in done:  # the same program as one checked already
            continue
        done.add(blocks and min(blocks, L))
        got = vjp_all(lambda p, x, W: mj.mhc_stack(p, x, sub, W, recompute=recompute, convention=convention),
                      (params, x, W), g)
        assert_same(got, want, f"recompute={recompute!r}")
        got = vjp_all(lambda p, x, W: mj.mhc_stack(p, x, sub, W, recompute=recompute, convention=convention,
                                                   unroll=True), (params, x, W), g)
        assert_same(got, want, f"recompute={recompute!r}, unroll")


@pytest.mark.parametrize("recompute,fuse", [(None, False), (2, False), (None, True), (2, True)])
def test_unroll_leaves_no_loop_nor_stacked_streams(rng, recompute, fuse):
    """unroll=True: the compiled jit(vjp) has no while loop and no dynamic-update-slice (a scan's body
    writes each layer's saved streams into a stacked array); the scan's has the loop (and, without
    recompute, the stacking).  Values and gradients bitwise the scan's."""
    L, lead, n, C = 7, (5,), 4, 8  # (recompute 2: a scan of 3 blocks; XLA removes a loop of one trip)
    params, x, g, W = make(rng, lead, n, C, L, "bfloat16")
    hlo = {}
    for unroll in (False, True):
        def fn(p, x, W):
            return mj.mhc_stack(p, x, sub, W, recompute=recompute, fuse_boundaries=fuse, unroll=unroll)

        def run(args, g):
            out, vjp = jax.vjp(fn, *args)
            return out, vjp(g)
        hlo[unroll] = jax.jit(run).lower((params, x, W), g).compile().as_text()
        assert_same(vjp_all(fn, (params, x, W), g), vjp_all(lambda p, x, W: mj.mhc_stack(
            p, x, sub, W, recompute=recompute, fuse_boundaries=fuse), (params, x, W), g), f"unroll={unroll}")
    assert " while(" in hlo[False] and "dynamic-update-slice" in hlo[False]
    assert " while(" not in hlo[True] and "dynamic-update-slice" not in hlo[True]
    with pytest.raises(TypeError, match="unroll"):
        mj.mhc_stack(params, x, sub, W, unroll=1)


@pytest.mark.parametrize("lead", [(3,), (1,)])
def test_weight_shared_by_all_layers(rng, lead):
    """f closes over a traced weight w0 shared by all layers, besides its per-layer W: w0's gradient
    is the sum over the layers, which the recompute blocks add up one layer at a time in the order
    of the layer-by-layer backward.  Bitwise, except where XLA fuses an addition of that sum with
    the op of f's gradient that produces the term (a multiply: at one token the transposed dot
    [C, 1] x [1, C] is one) differently in another program (on the CPU into one fused multiply-add):
    then within a few float32 roundings of the sum."""
    L = 5
    params, x, g, W = make(rng, lead, 4, 6, L)
    w0 = jnp.asarray(np.eye(6) + 0.3 * rng.standard_normal((6, 6)), jnp.float32)

    def f(w, h, w0):
        return sub(w @ w0, h)

    want = vjp_all(lambda p, x, W, w0: loop(p, x, partial(f, w0=w0), W), (params, x, W, w0), g)
    got = {recompute: vjp_all(lambda p, x, W, w0: mj.mhc_stack(p, x, partial(f, w0=w0), W, recompute=recompute),
                              (params, x, W, w0), g) for recompute in (None, 2, 3, "auto")}
    for recompute, grads in got.items():
        assert_same(grads[:-1], want[:-1], f"recompute={recompute!r}")
        if lead == (1,):
            for ref in (want, got[None]):
                assert_close(grads[-1], ref[-1], 4 * TOL["float32_unit"].value * L, "d w0", scale="max")
        else:
            assert_same(grads[-1:], want[-1:], f"recompute={recompute!r}: d w0")


@pytest.mark.parametrize("recompute", [None, 2])
def test_sublayer_without_f_params_and_identity(rng, recompute):
    """f_params=None: f(layer_in) for every layer (here closing over a traced weight, its gradient
    summed over the layers); f=None: the identity.  Bitwise the loop; eager = jitted."""
    params, x, g, W = make(rng, (3,), 4, 5, 5)
    w0 = W[0]
    shared = vjp_all(lambda p, x, w0: mj.mhc_stack(p, x, partial(sub, w0), recompute=recompute), (params, x, w0), g)
    assert_same(shared, vjp_all(lambda p, x, w0: loop(p, x, partial(sub, w0)), (params, x, w0), g), "shared f")
    identity = vjp_all(lambda p, x: mj.mhc_stack(p, x, None, recompute=recompute), (params, x), g)
    assert_same(identity, vjp_all(lambda p, x: loop(p, x, None), (params, x), g), "identity")
    assert_same([mj.mhc_stack(params, x, None, recompute=recompute)], identity[:1], "eager")


def test_per_layer_and_closed_over_keys(rng):
    """Integer / key leaves: per-layer PRNG keys in f_params and a key f closes over (float0
    cotangents) work; recompute bitwise the loop."""
    L = 4
    params, x, g, W = make(rng, (3,), 4, 5, L)
    keys = jax.random.split(jax.random.PRNGKey(1), L)

    def f(p, h, key):
        w, k = p
        return sub(w, h) * jax.random.bernoulli(jax.random.fold_in(key, 1), 0.8, h.shape) * \
            jax.random.bernoulli(k, 0.8, h.shape)

    def loss(stacked):
        def run(params, x, W, key):
            if stacked is None:
                return loop(params, x, partial(f, key=key), (W, keys))
            return mj.mhc_stack(params, x, partial(f, key=key), (W, keys), recompute=stacked)
        return run

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: (fn(*a) * g).sum(), argnums=(0, 1, 2)))(params, x, W, jax.random.PRNGKey(2))

    want = jax.tree_util.tree_leaves(grads(loss(None)))
    for recompute in (None, 2):
        assert_same(jax.tree_util.tree_leaves(grads(loss(recompute))), want, f"recompute={recompute!r}")


# ------------------------------------------------------------------ vs a float64 chain of the maths
def _ref_layer(p, x, w, convention):
    """One layer in plain float64 jnp (OPS.md sections 1, 6-10): coefficients, pre op, f, post op."""
    n, C = x.shape[-2:]
    ds = convention == "deepseek"
    rms_eps, eps, hc_eps = (1e-6, 1e-6, 1e-6) if ds else (1e-5, 1e-8, 0.0)
    xt = x.reshape(x.shape[:-2] + (n * C,))
    h = (xt @ p["phi"]) / jnp.sqrt(jnp.mean(xt * xt, -1, keepdims=True) + rms_eps)
    a, b = p["alpha"], p["bias"]
    pre, post = a[0] * h[..., :n] + b[:n], a[1] * h[..., n:2 * n] + b[n:2 * n]
    logits = (a[2] * h[..., 2 * n:] + b[2 * n:]).reshape(x.shape[:-2] + (n, n))
    if ds:  # softmax start plus eps, a column step, then 19 row / column steps (section 10)
        P = jax.nn.softmax(logits, -1) + eps
        P = P / (P.sum(-2, keepdims=True) + eps)
        for _ in range(19):
            P = P / (P.sum(-1, keepdims=True) + eps)
            P = P / (P.sum(-2, keepdims=True) + eps)
    else:
        P = jnp_sinkhorn(logits, 20, eps)
    H_pre, H_post = jax.nn.sigmoid(pre) + hc_eps, 2 * jax.nn.sigmoid(post)
    y = jnp.tanh(jnp.einsum("...i,...ic->...c", H_pre, x) @ w)
    mixed = jnp.einsum("...ji,...jc->...ic" if ds else "...ij,...jc->...ic", P, x)
    return mixed + H_post[..., :, None] * y[..., None, :]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == "float32"], ids=_id)
def test_stack_matches_a_float64_chain(rng, case, convention, fuse):
    """Also with fused boundaries (tests/test_jax_stack_fused.py)."""
    lead, n, C, L, dt = case
    params, x, g, W = make(rng, lead, n, C, L, dt, convention)
    got = vjp_all(lambda p, x, W: mj.mhc_stack(p, x, sub, W, recompute="auto", fuse_boundaries=fuse,
                                               convention=convention), (params, x, W), g)
    with jax.enable_x64(True):
        def chain(p, x, W):
            for l in range(L):
                x = _ref_layer(jax.tree.map(lambda a: a[l], p), x, W[l], convention)
            return x
        as64 = partial(jax.tree.map, lambda a: jnp.asarray(np.asarray(a, np.float64)))
        out, vjp = jax.vjp(chain, *as64((params, x, W)))
        want = [np.asarray(a) for a in (out, *jax.tree_util.tree_leaves(vjp(as64(g))))]
    tol = TOL["float32_layer"].value * L  # one float32 layer per layer: errors compound over the chain
    for name, a, w in zip(("out", "dalpha", "dbias", "dphi", "dx", "dW"), got, want):
        assert_close(a, w, tol, name)


# ------------------------------------------------------------------ what recompute saves
@pytest.mark.parametrize("L,recompute,copies", [(5, None, 5), (5, 1, 5), (5, 2, 3), (5, "auto", 3), (6, 3, 2),
                                                (4, 9, 1)])
def test_recompute_saves_the_streams_of_block_boundaries_only(rng, L, recompute, copies):
    """The residuals of jax.vjp hold ceil(L / L_r) copies of the streams [..., n, C] (L without
    recompute): a block keeps its input only."""
    n, C = 4, 6
    params, x, g, W = make(rng, (3,), n, C, L)
    _, vjp = jax.vjp(lambda p, x, W: mj.mhc_stack(p, x, sub, W, recompute=recompute), params, x, W)
    streams = [a for a in jax.tree_util.tree_leaves(vjp) if tuple(a.shape[-2:]) == (n, C)]
    assert sum(a.size for a in streams) == copies * x.size, [a.shape for a in streams]


# ------------------------------------------------------------------ transformations
@pytest.mark.parametrize("recompute", [None, 2])
def test_jit_grad_checkpoint_outer_scan_and_vmap(rng, recompute):
    L = 3
    params, x, g, W = make(rng, (3,), 4, 5, L)

    def stack(p, x, W):
        return mj.mhc_stack(p, x, sub, W, recompute=recompute)

    def loss(fn):
        return lambda p, x, W: (fn(p, x, W).astype(jnp.float32) * g).sum()

    want = vjp_all(stack, (params, x, W), g)
    grad = partial(jax.grad, argnums=(0, 1, 2))
    assert_same(jax.tree_util.tree_leaves(jax.jit(grad(loss(stack)))(params, x, W)), want[1:], "jit(grad)")
    assert_same(jax.tree_util.tree_leaves(jax.jit(grad(loss(jax.checkpoint(stack))))(params, x, W)), want[1:],
                "checkpoint")

    def twice_scanned(p, x, W):  # the stack twice, inside an outer lax.scan (under checkpoint)
        body = jax.checkpoint(lambda x, _: (stack(p, x, W), None))
        return jax.lax.scan(body, x, None, length=2)[0]

    assert_same(vjp_all(twice_scanned, (params, x, W), g),
                vjp_all(lambda p, x, W: stack(p, stack(p, x, W), W), (params, x, W), g), "outer scan")
    # vmap over x, and over the parameters (a batch of stacks): per-example loops
    xs = jnp.stack([x, 2 * x])
    per_x = jax.jit(jax.vmap(grad(loss(stack)), in_axes=(None, 0, None)))(params, xs, W)
    for i in range(2):
        one = jax.jit(grad(loss(stack)))(params, xs[i], W)
        assert_same(jax.tree_util.tree_leaves(jax.tree.map(lambda a: a[i], per_x)), jax.tree_util.tree_leaves(one),
                    f"vmap x {i}")
    ps = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), params)
    per_p = jax.jit(jax.vmap(stack, in_axes=(0, None, None)))(ps, x, W)
    for i in range(2):
        assert_same([per_p[i]], [stack(jax.tree.map(lambda a: a[i], ps), x, W)], f"vmap params {i}")


# ------------------------------------------------------------------ init and errors
def test_stack_init_is_the_layers_init_stacked():
    key = jax.random.PRNGKey(3)
    got = mj.mhc_stack_init(key, 3, 5, 4, alpha_init=0.1)
    layers = [mj.mhc_init(k, 5, 4, alpha_init=0.1) for k in jax.random.split(key, 3)]
    assert {k: v.shape for k, v in got.items()} == {"phi": (3, 20, 24), "alpha": (3, 3), "bias": (3, 24)}
    for k in got:
        assert got[k].dtype == jnp.float32
        assert_same([got[k]], [jnp.stack([p[k] for p in layers])], k)
    with pytest.raises(ValueError, match="L must be >= 1, got 0"):
        mj.mhc_stack_init(key, 0, 5)
    with pytest.raises(TypeError, match="L must be an int"):
        mj.mhc_stack_init(key, 2.0, 5)
    with pytest.raises(ValueError, match="n_streams"):
        mj.mhc_stack_init(key, 2, 5, 33)


def test_recompute_takes_numpy_ints():
    """np.int64(2) (a block size from a NumPy sweep) used to raise 'recompute must be ... got int64'."""
    assert recompute_blocks(np.int64(2), 4, 8) == 2 and type(recompute_blocks(np.int32(3), 4, 8)) is int
    assert recompute_blocks(np.int64(1), 4, 8) is None
    with pytest.raises(ValueError, match="got 0"):
        recompute_blocks(np.int64(0), 4, 8)
    with pytest.raises(TypeError, match="got bool"):
        recompute_blocks(np.bool_(True), 4, 8)
    params = mj.mhc_stack_init(jax.random.PRNGKey(0), 3, 5, 4)
    x = jnp.ones((2, 4, 5))
    np.testing.assert_array_equal(mj.mhc_stack(params, x, jnp.tanh, recompute=np.int64(2)),
                                  mj.mhc_stack(params, x, jnp.tanh, recompute=2))


def test_bad_input_names_the_argument():
    params = mj.mhc_stack_init(jax.random.PRNGKey(0), 3, 5, 4)
    one = jax.tree.map(lambda a: a[0], params)
    x, W = jnp.ones((2, 4, 5)), jnp.ones((3, 5, 5))
    cases = [
        (lambda: mj.mhc_stack(one, x, None), ValueError, r"params\['phi'\] has shape \(20, 24\); .* stacked"),
        (lambda: mj.mhc_stack((params["phi"],), x, None), TypeError, "params must be the dict of mhc_stack_init"),
        (lambda: mj.mhc_stack({**params, "bias": [0.0]}, x, None), TypeError, r"params\['bias'\] has type list"),
        (lambda: mj.mhc_stack({**params, "alpha": params["alpha"][:2]}, x, None), ValueError,
         "different numbers of layers"),
        (lambda: mj.mhc_stack(jax.tree.map(lambda a: a[:0], params), x, None), ValueError, "L = 0 layers"),
        (lambda: mj.mhc_stack(params, jnp.ones((2, 4, 6)), None), ValueError, r"x has shape \(2, 4, 6\)"),
        # a stacked parameter of the wrong shape names it and its whole [L, ...] shape (pass 13: one layer's slice)
        (lambda: mj.mhc_stack({**params, "phi": params["phi"][..., :20]}, x, None), ValueError,
         r"params\['phi'\] has shape \(3, 20, 20\); mhc_stack needs \[L, n\*C, n\*n \+ 2n\] = \(3, 20, 24\)"),
        (lambda: mj.mhc_stack({**params, "alpha": params["alpha"][:, :2]}, x, None), ValueError,
         r"params\['alpha'\] has shape \(3, 2\); mhc_stack needs \[L, 3\] = \(3, 3\)"),
        (lambda: mj.mhc_stack({**params, "bias": params["bias"][:, 1:]}, x, None), ValueError,
         r"params\['bias'\] has shape \(3, 23\); .* = \(3, 24\) for x \[\.\.\., n, C\] = \[\.\.\., 4, 5\]"),
        (lambda: mj.mhc_stack(params, x, sub, W[:2]), ValueError,
         r"f_params has shape \(2, 5, 5\); it needs a leading axis of the L = 3 layers"),
        (lambda: mj.mhc_stack(params, x, sub, {"w": W, "b": jnp.float32(1)}), ValueError,
         r"f_params\['b'\] has shape \(\)"),
        (lambda: mj.mhc_stack(params, x, sub, [W, 1.0]), TypeError, r"f_params\[1\] has type float"),
        (lambda: mj.mhc_stack(params, x, None, W), TypeError, "f_params is given but f is None"),
        (lambda: mj.mhc_stack(params, x, "tanh"), TypeError, "f .the sublayer. must be callable"),
        (lambda: mj.mhc_stack(params, x, lambda w, h: h[..., :2], W), ValueError, r"f \(the sublayer\) returned"),
        (lambda: mj.mhc_stack(params, x, None, recompute=0), ValueError, "recompute must be None, a positive int"),
        (lambda: mj.mhc_stack(params, x, None, recompute="sqrt"), ValueError, "recompute must be .* got 'sqrt'"),
        (lambda: mj.mhc_stack(params, x, None, recompute=2.0), TypeError, "recompute must be .* got float 2.0"),
        (lambda: mj.mhc_stack(params, x, None, recompute=True), TypeError, "recompute must be .* got bool"),
        (lambda: mj.mhc_stack(params, x, None, num_iters=-1), ValueError, "num_iters"),
        (lambda: mj.mhc_stack(params, x, None, convention="v4"), ValueError, "convention"),
        (lambda: mj.mhc_stack(params, x, None, unroll="yes"), TypeError, "unroll"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
