"""mhc_cupy.jax under token sharding on 2 devices (run by tests/test_multidevice.py).

Needs 2 JAX devices: on the CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
set before jax initialises, so this module runs in its own process (its name
does not start with ``test_``: the main pytest run does not collect it).  With
``MHC_SHARDING_PLATFORM=gpu`` it runs on the first 2 GPUs instead.

Every op and ``mhc_layer``, under ``jax.jit(jax.grad(...))`` with the token
dims sharded over a 2-device mesh, against the same program on unsharded
inputs:
* outputs and gradients equal (float32: 1e-6 relative to the largest value;
  the only difference is the order of a float32 sum over the two devices'
  tokens for a shared parameter's gradient);
* outputs and token-input gradients keep the token sharding; the gradient of
  a shared parameter (phi, alpha, bias, a shared h [n], the RMSNorm weight) is
  replicated;
* the compiled program has no all-gather, and one all-reduce per program at
  most (XLA combines the psums of the shared gradients, one per gradient).

And ``jax.grad`` inside ``jax.shard_map`` (check_vma on) for every op and the layer, tokens split
over the 2 devices: equal to the program on all tokens (tests/test_jax_rough_edges.py).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mhc_cupy.jax as mj

import test_jax_rough_edges as rough  # tests/ is on sys.path (tests/conftest.py)
from harness import assert_close
from multidevice import count_collectives

PLATFORM = os.environ.get("MHC_SHARDING_PLATFORM", "cpu")
DEVICES = jax.devices(PLATFORM)
if len(DEVICES) < 2:
    pytest.skip(f"needs 2 {PLATFORM} devices, JAX sees {len(DEVICES)}", allow_module_level=True)
MESH = Mesh(np.array(DEVICES[:2]), ("data",))
# Unsharded reference programs run on the first of them.
jax.config.update("jax_default_device", DEVICES[0])
REL = 1e-6
N, C = 4, 24



def collectives(fn, *args) -> dict:
    """Counts of collective ops in the compiled HLO of jit(fn)(*args) (a combined one counts once)."""
    return count_collectives(jax.jit(fn).lower(*args).compile().as_text())


def test_collectives_counts_combined_ones():
    """7 psums that XLA combines into one all-reduce of a 7-tuple (its type printed with an
    /*index=5*/ comment): counted, once (the CPU compiler combines them; others may less)."""
    k = 7
    f = jax.shard_map(lambda *xs: tuple(jax.lax.psum(x, "data") for x in xs), mesh=MESH,
                      in_specs=(P("data"),) * k, out_specs=(P(),) * k, check_vma=False)
    counts = collectives(f, *[jnp.ones((4, i + 1), jnp.float32) for i in range(k)])
    assert set(counts) == {"all-reduce"} and 1 <= counts["all-reduce"] <= k, counts
    assert PLATFORM != "cpu" or counts["all-reduce"] == 1, counts


def spec_of(a) -> tuple:
    s = tuple(a.sharding.spec)
    return s + (None,) * (a.ndim - len(s))


def put(a, spec):
    return jax.device_put(a, NamedSharding(MESH, P(*spec)))


# ------------------------------------------------------------------- ops
def _ops():
    """name -> (make(rng, lead) -> dict of float32 inputs, fn(**inputs) -> tuple, shared input names)."""
    r32 = lambda r, s, k=1.0: jnp.asarray(k * r.standard_normal(s), jnp.float32)  # noqa: E731
    return {
        "sinkhorn_knopp": (lambda r, L: {"logits": r32(r, L + (N, N), 2.0)},
                           lambda logits: (mj.sinkhorn_knopp(logits),), ()),
        "rmsnorm": (lambda r, L: {"x": r32(r, L + (C,)), "weight": r32(r, (C,))},
                    lambda x, weight: (mj.rmsnorm(x, weight=weight),), ("weight",)),
        "stream_mix": (lambda r, L: {"x": r32(r, L + (N, C)), "M": r32(r, L + (N, N))},
                       lambda x, M: (mj.stream_mix(x, M),), ()),
        "stream_aggregate": (lambda r, L: {"x": r32(r, L + (N, C)), "h": r32(r, L + (N,))},
                             lambda x, h: (mj.stream_aggregate(x, h),), ()),
        "stream_aggregate_shared": (lambda r, L: {"x": r32(r, L + (N, C)), "h": r32(r, (N,))},
                                    lambda x, h: (mj.stream_aggregate(x, h),), ("h",)),
        "stream_distribute": (lambda r, L: {"y": r32(r, L + (C,)), "h": r32(r, L + (N,))},
                              lambda y, h: (mj.stream_distribute(y, h),), ()),
        "stream_distribute_shared": (lambda r, L: {"y": r32(r, L + (C,)), "h": r32(r, (N,))},
                                     lambda y, h: (mj.stream_distribute(y, h),), ("h",)),
        "mhc_post_op": (lambda r, L: {"layer_out": r32(r, L + (C,)), "x": r32(r, L + (N, C)),
                                      "H_post": r32(r, L + (N,)), "H_res": r32(r, L + (N, N))},
                        lambda layer_out, x, H_post, H_res: (mj.mhc_post_op(layer_out, x, H_post, H_res),), ()),
        "mhc_pre_op": (lambda r, L: {"x": r32(r, L + (N, C)), "a": r32(r, L + (N,)), "b": r32(r, L + (N,)),
                                     "c": r32(r, L + (N, N))},
                       lambda x, a, b, c: mj.mhc_pre_op(x, a, b, c), ()),
        "mhc_coeffs": (lambda r, L: {"x": r32(r, L + (N, C)), "phi": r32(r, (N * C, N * N + 2 * N), 0.1),
                                     "alpha": r32(r, (3,)), "bias": r32(r, (N * N + 2 * N,))},
                       lambda x, phi, alpha, bias: mj.mhc_coeffs(x, phi, alpha, bias), ("phi", "alpha", "bias")),
    }


OPS = _ops()


def _loss_fn(fn, names, cts):
    def loss(*args):
        outs = fn(**dict(zip(names, args)))
        return sum(jnp.sum(o * c) for o, c in zip(outs, cts))
    return loss


def _value_and_grads(fn, names):
    def run(args, cts):
        outs = fn(**dict(zip(names, args)))
        grads = jax.grad(_loss_fn(fn, names, cts), argnums=tuple(range(len(names))))(*args)
        return outs, grads
    return run


def _check(name, lead, tok_spec, rng):
    make, fn, shared = OPS[name]
    inputs = make(rng, lead)
    names = list(inputs)
    outs0 = fn(**inputs)
    cts = tuple(jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in outs0)
    nlead = len(lead)

    def spec(a, is_shared):
        return (None,) * a.ndim if is_shared else tok_spec + (None,) * (a.ndim - nlead)

    args = [put(inputs[k], spec(inputs[k], k in shared)) for k in names]
    cts_s = [put(c, spec(c, False)) for c in cts]
    run = _value_and_grads(fn, names)
    outs, grads = jax.jit(run)(args, cts_s)
    outs_ref, grads_ref = jax.jit(run)([inputs[k] for k in names], list(cts))
    for o, e in zip(outs, outs_ref):
        assert_close(o, e, REL, scale="max")
        assert spec_of(o) == spec(o, False), (name, "output", o.sharding)
    for k, g, e in zip(names, grads, grads_ref):
        assert_close(g, e, REL, scale="max")
        want = spec(g, k in shared)
        assert spec_of(g) == want, (name, k, g.sharding, want)
    counts = collectives(run, args, cts_s)
    assert counts.get("all-gather", 0) == 0, (name, counts)
    assert counts.get("all-to-all", 0) == 0 and counts.get("collective-permute", 0) == 0, (name, counts)
    assert counts.get("all-reduce", 0) <= (1 if shared else 0), (name, counts)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_token_sharded(name, rng):
    """Tokens [6, 3] sharded on the first token dim."""
    _check(name, (6, 3), ("data", None), rng)


@pytest.mark.parametrize("name", ["mhc_coeffs", "stream_aggregate_shared", "rmsnorm", "mhc_pre_op"])
def test_op_second_token_dim_sharded(name, rng):
    """Tokens [3, 4] sharded on the second token dim (any token dim partitions)."""
    _check(name, (3, 4), (None, "data"), rng)


def test_uneven_tokens_stay_correct(rng):
    """5 tokens asked onto 2 devices inside jit: the op gets them replicated; results exact."""
    make, fn, shared = OPS["mhc_coeffs"]
    inputs = make(rng, (5,))
    names = list(inputs)
    run = _value_and_grads(fn, names)
    cts = [jnp.ones(o.shape, jnp.float32) for o in fn(**inputs)]

    def uneven(args, cts):
        x = jax.lax.with_sharding_constraint(args[0], NamedSharding(MESH, P("data")))
        return run([x] + list(args[1:]), cts)

    args = [inputs[k] for k in names]
    outs, grads = jax.jit(uneven)(args, cts)
    outs0, grads0 = jax.jit(run)(args, cts)
    for a, e in zip(list(outs) + list(grads), list(outs0) + list(grads0)):
        assert_close(a, e, REL, scale="max")


@pytest.mark.parametrize("dim", [-1, -2], ids=["C", "n"])
def test_trailing_dim_sharded_is_replicated(dim, rng):
    """x sharded over C (or n): the op gets it replicated and the results are exact."""
    make, fn, _ = OPS["mhc_post_op"]
    inputs = make(rng, (4,))
    names = list(inputs)
    spec = [None, None, None]
    spec[dim] = "data"
    args = [put(inputs[k], tuple(spec)) if k == "x" else inputs[k] for k in names]
    cts = (jnp.ones((4, N, C), jnp.float32),)
    run = _value_and_grads(fn, names)
    outs, grads = jax.jit(run)(args, list(cts))
    outs0, grads0 = jax.jit(run)([inputs[k] for k in names], list(cts))
    for a, e in zip(list(outs) + list(grads), list(outs0) + list(grads0)):
        assert_close(a, e, REL, scale="max")


def test_vmap_token_sharded(rng):
    """jit(vmap(grad)) with the vmapped (batch) axis sharded: one more token dim, no gather."""
    make, fn, _ = OPS["stream_aggregate_shared"]
    x = jnp.asarray(rng.standard_normal((4, 3, N, C)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((N,)), jnp.float32)

    def per_example(x, h):
        return jax.grad(lambda x, h: jnp.sum(mj.stream_aggregate(x, h) ** 2), argnums=(0, 1))(x, h)

    f = jax.vmap(per_example, in_axes=(0, None))
    xs = put(x, ("data", None, None, None))
    gx, gh = jax.jit(f)(xs, h)
    gx0, gh0 = jax.jit(f)(x, h)
    assert_close(gx, gx0, REL, scale="max")
    assert_close(gh, gh0, REL, scale="max")
    assert spec_of(gx)[0] == "data" and spec_of(gh)[0] == "data", (gx.sharding, gh.sharding)
    assert collectives(f, xs, h).get("all-gather", 0) == 0


# ---------------------------------------------------------------- the layer
def _layer_loss(params, x):
    return jnp.sum(mj.mhc_layer(params, x, jnp.tanh) ** 2)


@pytest.mark.parametrize("gspmd", [False, True], ids=["shardy", "gspmd"])
def test_mhc_layer_token_sharded(gspmd, rng):
    """jit(grad) of mhc_layer, x [8, 2, n, C] sharded on the batch dim: the issue's case."""
    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", not gspmd)
    try:
        params = mj.mhc_init(jax.random.PRNGKey(0), C, N)
        params["alpha"] = jnp.asarray([0.3, 0.2, 0.1], jnp.float32)  # coefficients that depend on x
        x = jnp.asarray(rng.standard_normal((8, 2, N, C)), jnp.float32)
        xs = put(x, ("data",))
        g = jax.value_and_grad(_layer_loss, argnums=(0, 1))
        (loss, (gp, gx)) = jax.jit(g)(params, xs)
        (loss0, (gp0, gx0)) = jax.jit(g)(params, x)
        assert_close(loss, loss0, REL, scale="max")
        assert_close(gx, gx0, REL, scale="max")
        assert spec_of(gx) == ("data", None, None, None), gx.sharding
        for k in gp:
            assert_close(gp[k], gp0[k], REL, scale="max")
            assert spec_of(gp[k]) == (None,) * gp[k].ndim, (k, gp[k].sharding)
        counts = collectives(g, params, xs)
        assert counts.get("all-gather", 0) == 0, counts
        # the loss sum (1 value) and phi / alpha / bias (one combined psum, or one each)
        assert 1 <= counts.get("all-reduce", 0) <= 4, counts
    finally:
        jax.config.update("jax_use_shardy_partitioner", prev)


@pytest.mark.parametrize("fuse", [False, True])
def test_eager_layer_and_stack_keep_the_token_sharding(fuse, rng):
    """mhc_layer / mhc_stack called eagerly (no jax.jit) on token-sharded x: the output and dx keep the
    sharding, the values are jit's (they came back replicated: outside jit the kernels' sharding wrapper
    ran once, on the whole arrays)."""
    params = mj.mhc_init(jax.random.PRNGKey(0), C, N)
    x = jnp.asarray(rng.standard_normal((8, 2, N, C)), jnp.float32)
    xs = put(x, ("data",))
    stacked = jax.tree.map(lambda a: jnp.stack([a, a * 1.5]), params)
    for fn in (lambda x: mj.mhc_layer(params, x, jnp.tanh),
               lambda x: mj.mhc_stack(stacked, x, jnp.tanh, fuse_boundaries=fuse)):
        out, gx = fn(xs), jax.grad(lambda x: jnp.sum(fn(x) ** 2))(xs)
        assert spec_of(out)[0] == "data" and spec_of(gx)[0] == "data", (out.sharding, gx.sharding)
        assert_close(out, jax.jit(fn)(x), REL, scale="max")
        assert_close(gx, jax.jit(jax.grad(lambda x: jnp.sum(fn(x) ** 2)))(x), REL, scale="max")


def test_local_shapes_reach_the_kernels(rng, monkeypatch):
    """Each device's kernel call sees its own tokens only (half of them)."""
    import mhc_cupy._jax_kernels as mod  # where the kernels are planned

    seen = []
    real = mod._planned.__wrapped__

    def spy(name, params, signature, *rest):
        seen.append((name, signature[0][0] if signature[0] else None))
        return real(name, params, signature, *rest)

    monkeypatch.setattr(mod, "_planned", spy)
    x = jnp.asarray(rng.standard_normal((8, N, C)), jnp.float32)
    M = jnp.asarray(rng.standard_normal((8, N, N)), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x, M: mj.stream_mix(x, M) * 1.5)(put(x, ("data",)), put(M, ("data",))))
    assert ("stream_mix_fwd", (4, N, C)) in seen, seen


def test_token_sharded_wraps_a_whole_layer(rng):
    """The helper wraps any per-token function: a custom_vjp layer whose forward and backward are
    each one token_sharded function (kernels inside run per device, no nested partitioning); the
    backward's parameter gradients (sums over tokens) are reduced once."""
    from mhc_cupy._jax_shard import token_sharded

    def plain(x, phi, alpha, bias):
        return mj.mhc_layer({"phi": phi, "alpha": alpha, "bias": bias}, x, jnp.tanh)

    fwd = token_sharded(lambda *a: (plain(*a),), in_ranks=(2, None, None, None), out_ranks=(2,))
    bwd = token_sharded(lambda g, *a: jax.vjp(plain, *a)[1](g), in_ranks=(2, 2, None, None, None),
                        out_ranks=(2, None, None, None), ref=1)

    @jax.custom_vjp
    def layer(x, phi, alpha, bias):
        return fwd(x, phi, alpha, bias)[0]

    layer.defvjp(lambda *a: (fwd(*a)[0], a), lambda res, g: tuple(bwd(g, *res)))
    p = mj.mhc_init(jax.random.PRNGKey(0), C, N)
    args = (jnp.asarray(rng.standard_normal((8, 3, N, C)), jnp.float32), p["phi"], p["alpha"] * 30, p["bias"])
    g = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1, 2, 3)))
    g0 = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) ** 2), argnums=(0, 1, 2, 3)))
    xs = put(args[0], ("data",))
    got, want = g(xs, *args[1:]), g0(*args)
    for a, e in zip(got, want):
        assert_close(a, e, REL, scale="max")
    assert spec_of(got[0]) == ("data", None, None, None) and all(spec_of(a) == (None,) * a.ndim for a in got[1:])
    counts = collectives(g, xs, *args[1:])
    assert counts.get("all-gather", 0) == 0 and counts.get("all-reduce", 0) <= 2, counts


# ------------------------------------------------------------ grad inside jax.shard_map
@pytest.mark.parametrize("name", rough.SHARD_CASES)
def test_grad_inside_shard_map(name, rng):
    rough.check_grad_inside_shard_map(name, rng, DEVICES[:2])


# ------------------------------------------------------------ the functional API
def test_functional_api_sharded_array_names_the_argument(rng):
    """The eager functional API takes single-device arrays; a sharded (or replicated) one raised
    "a jax array sharded over 2 devices is not supported", naming no argument."""
    import mhc_cupy

    x = jnp.asarray(rng.standard_normal((4, N, C)), jnp.float32)
    M = jnp.asarray(rng.standard_normal((4, N, N)), jnp.float32)
    for spec in (P("data"), P()):
        with pytest.raises(ValueError, match=r"^M is a jax array on 2 devices .* mhc_cupy\.jax"):
            mhc_cupy.stream_mix_fwd(x, jax.device_put(M, NamedSharding(MESH, spec)))
    out = mhc_cupy.stream_mix_fwd(jax.device_put(x, DEVICES[1]), M)  # one device each: fine
    np.testing.assert_array_equal(np.asarray(out), np.asarray(mhc_cupy.stream_mix_fwd(np.asarray(x), np.asarray(M))))


# ------------------------------------------------------------ the stack, and a kernel choice
@pytest.mark.parametrize("choice", [{}, {"boundary_bwd": True}, {"small": True}])
@pytest.mark.parametrize("recompute,fuse", [(None, False), (2, False), (2, True), (None, True)])
def test_mhc_stack_token_sharded_under_a_kernel_choice(recompute, fuse, choice, rng):
    """jit(grad) of mhc_stack (3 layers, a sublayer weight per layer) with the tokens sharded: as the
    program on unsharded tokens.  Under any kernel choice other than the library's (the fused boundary
    backward's ``boundary_bwd=True``, here) compiling raised XLA's INTERNAL error "host callback ... is not
    registered in the program being partitioned": the per-device function is lowered in XLA's compile
    thread, which does not see the caller's kernel choice, so its kernels were planned under another one
    than the program had registered (break-it pass 13)."""
    from mhc_cupy._kernel_choice import kernel_choice

    L = 3
    params = mj.mhc_stack_init(jax.random.PRNGKey(1), L, C, N, alpha_init=0.5)
    params["bias"] = params["bias"] + jnp.asarray(rng.standard_normal(params["bias"].shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, N, C)), jnp.float32)
    W = jnp.asarray(rng.standard_normal((L, C, C)) / np.sqrt(C), jnp.float32)

    def loss(p, x, W):
        out = mj.mhc_stack(p, x, lambda w, h: jnp.tanh(h @ w), W, recompute=recompute, fuse_boundaries=fuse)
        return jnp.sum(out ** 2)

    g = jax.value_and_grad(loss, argnums=(0, 1, 2))
    with kernel_choice(**choice):
        loss0, (gp0, gx0, gW0) = jax.jit(g)(params, x, W)
        loss1, (gp, gx, gW) = jax.jit(g)(params, put(x, ("data",)), W)
    assert_close(loss1, loss0, REL, scale="max")
    assert_close(gx, gx0, REL, scale="max")
    assert spec_of(gx) == ("data", None, None), gx.sharding
    assert_close(gW, gW0, REL, scale="max")
    for k in gp:
        assert_close(gp[k], gp0[k], REL, scale="max")
