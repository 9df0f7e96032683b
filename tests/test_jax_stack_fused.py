"""``mhc_cupy.jax.mhc_stack(..., fuse_boundaries=True)`` (issue 44, "JAX: mhc_stack with fused
boundaries"; docs/OPS.md section 12): each layer's residual update and the next layer's pre piece
run as one ``mhc_boundary_fwd`` call, in the scan and inside the recompute blocks' forward.

On the CPU the boundary op runs the float64 references of the post op and of the next layer's pre
piece, with the streams rounded to x's dtype between them as the unfused ops store and read them
(reference section 12): the same computation as the unfused stack, so the values and gradients
(x, phi, alpha, bias, per-layer f_params, a closed-over weight) are bitwise the unfused stack's,
with recompute None / 2 / "auto", L 1..4, tokens 1 and 3, C 7 and 24, n 1, 3, 4, bfloat16 and
float32, both conventions, under jit / grad / checkpoint / an outer scan / vmap.  The layers have
different phi and bias (``test_jax_stack.make``): a boundary fed another layer's parameters, or
outputs fed to another layer, breaks the bitwise checks.  The float64 chain is
test_jax_stack.py's, with fuse_boundaries parametrized there.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import mhc_cupy.jax as mj  # noqa: E402
from mhc_cupy import reference  # noqa: E402

from harness import count_calls  # noqa: E402
from test_jax_stack import assert_same, make, sub, vjp_all  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_on_cpu")

#: (token dims, n, C, L, dtype): tokens 1 and 3, n 1, 3, 4, C 7 and 24, L 1..4, bfloat16 / float32.
CASES = [((1,), 1, 7, 1, "float32"), ((3,), 3, 24, 2, "bfloat16"), ((3,), 4, 7, 3, "float32"),
         ((1,), 4, 24, 4, "bfloat16"), ((3,), 1, 24, 4, "float32"), ((1,), 3, 7, 3, "bfloat16"),
         ((3,), 4, 24, 1, "bfloat16"), ((3,), 3, 7, 4, "float32")]


def _id(case):
    lead, n, C, L, dt = case
    return f"T{lead[0]}-n{n}-C{C}-L{L}-{dt}"


def stack(fuse, recompute=None, f=sub, **kw):
    return lambda p, x, *fp: mj.mhc_stack(p, x, f, *fp, recompute=recompute, fuse_boundaries=fuse, **kw)


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_boundaries_equal_the_unfused_stack_bitwise(rng, monkeypatch, case, convention):
    """Value and gradients of x, phi, alpha, bias and the per-layer f_params; the boundary op runs
    L - 1 times and the pre piece once (layer 0's), also with recompute (the backward rebuilds the
    streams with the post op, never the boundary)."""
    lead, n, C, L, dt = case
    params, x, g, W = make(rng, lead, n, C, L, dt, convention)
    calls = count_calls(monkeypatch, reference, ("mhc_boundary_fwd", "mhc_layer_pre_fwd"))
    want = vjp_all(stack(False, convention=convention), (params, x, W), g)
    assert calls == {"mhc_boundary_fwd": 0, "mhc_layer_pre_fwd": L}, calls
    for recompute in (None, 2, "auto"):
        calls.update(dict.fromkeys(calls, 0))
        got = vjp_all(stack(True, recompute, convention=convention), (params, x, W), g)
        assert calls == {"mhc_boundary_fwd": L - 1, "mhc_layer_pre_fwd": 1}, (recompute, calls)
        assert_same(got, want, f"recompute={recompute!r}")


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_boundary_backward_equals_the_unfused_stack_bitwise(rng, monkeypatch, case, convention):
    """Under the kernel choice boundary_bwd (OPS.md section 12, "Fused boundary backward"), inside a
    recompute block each layer's backward hands the previous layer its dy (mhc_boundary_bwd) and takes
    its own from the next layer's, computing its residual update's dH_post, dH_res in the pre piece's
    backward (layer_out): the post op's backward runs once per block (its last layer).  Bitwise the
    unfused stack's on the CPU; without recompute the blocks (of the paper's L_r* layers) keep every
    layer's streams."""
    from mhc_cupy._kernel_choice import kernel_choice

    lead, n, C, L, dt = case
    params, x, g, W = make(rng, lead, n, C, L, dt, convention)
    want = vjp_all(stack(False, convention=convention), (params, x, W), g)
    calls = count_calls(monkeypatch, reference, ("mhc_boundary_bwd", "mhc_post_op_bwd", "mhc_post_op_fwd"))
    auto = max(1, round((n * L / (n + 2)) ** 0.5))  # (without recompute: blocks of L_r* keeping their streams)
    for recompute, blocks in ((None, -(-L // auto)), (2, -(-L // 2)), (L, 1)):
        calls.update(dict.fromkeys(calls, 0))
        with kernel_choice(boundary_bwd=True):
            got = vjp_all(stack(True, recompute, convention=convention), (params, x, W), g)
        assert_same(got, want, f"recompute={recompute!r}")
        # the post op's forward: the last layer's, and in backward the streams a recompute block rebuilds
        rebuilt = 0 if recompute is None else L - blocks
        assert calls == {"mhc_boundary_bwd": L - blocks, "mhc_post_op_bwd": blocks, "mhc_post_op_fwd": 1 + rebuilt}, (
            recompute, calls)


@pytest.mark.parametrize("recompute", [None, 2])
def test_fused_boundaries_under_jit_grad_checkpoint_scan_and_vmap(rng, recompute):
    L = 3
    params, x, g, W = make(rng, (3,), 4, 8, L, "bfloat16")

    def loss(fn):
        return lambda p, x, W: (fn(p, x, W).astype(jnp.float32) * g).sum()

    grad = partial(jax.grad, argnums=(0, 1, 2))

    def twice_scanned(fn):  # the stack twice, inside an outer lax.scan (under checkpoint)
        return lambda p, x, W: jax.lax.scan(jax.checkpoint(lambda x, _: (fn(p, x, W), None)), x, None, length=2)[0]

    xs, ps = jnp.stack([x, 2 * x]), jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), params)
    runs = {
        "jit(grad)": lambda fn: jax.jit(grad(loss(fn)))(params, x, W),
        "checkpoint": lambda fn: jax.jit(grad(loss(jax.checkpoint(fn))))(params, x, W),
        "outer scan": lambda fn: jax.jit(grad(loss(twice_scanned(fn))))(params, x, W),
        "vmap x": lambda fn: jax.jit(jax.vmap(grad(loss(fn)), in_axes=(None, 0, None)))(params, xs, W),
        "vmap params": lambda fn: jax.jit(jax.vmap(grad(loss(fn)), in_axes=(0, None, None)))(ps, x, W),
    }  # (all compiled: eagerly f's jnp ops run one at a time, in the scan compiled: they may round otherwise)
    for name, run in runs.items():
        want = jax.tree_util.tree_leaves(run(stack(False, recompute)))
        assert_same(jax.tree_util.tree_leaves(run(stack(True, recompute))), want, name)


@pytest.mark.parametrize("recompute", [None, 2, "auto"])
def test_fused_boundaries_with_a_shared_weight_keys_and_no_f_params(rng, recompute):
    """f closing over a weight shared by all layers and a key, with per-layer keys in f_params
    (float0 cotangents); f(layer_in) for every layer; the identity: bitwise the unfused stack."""
    L = 4
    params, x, g, W = make(rng, (3,), 4, 6, L)
    w0 = jnp.asarray(np.eye(6) + 0.3 * rng.standard_normal((6, 6)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), L)

    def f(p, h, w0, key):
        w, k = p
        return sub(w @ w0, h) * jax.random.bernoulli(jax.random.fold_in(key, 1), 0.8, h.shape) * \
            jax.random.bernoulli(k, 0.8, h.shape)

    def run(fuse):
        return lambda p, x, W, w0: stack(fuse, recompute, partial(f, w0=w0, key=jax.random.PRNGKey(2)))(p, x, (W, keys))

    assert_same(vjp_all(run(True), (params, x, W, w0), g), vjp_all(run(False), (params, x, W, w0), g), "keys")
    shared = [vjp_all(lambda p, x, w0: stack(fuse, recompute, partial(sub, w0))(p, x), (params, x, w0), g)
              for fuse in (True, False)]
    assert_same(*shared, "f(layer_in)")
    identity = [vjp_all(stack(fuse, recompute, None), (params, x), g) for fuse in (True, False)]
    assert_same(*identity, "identity")


@pytest.mark.parametrize("L,recompute,copies", [(5, None, 5), (5, 2, 3), (5, "auto", 3), (6, 3, 2), (4, 9, 1)])
def test_fused_boundaries_save_the_streams_as_the_unfused_stack(rng, L, recompute, copies):
    """The residuals of jax.vjp hold ceil(L / L_r) copies of the streams [..., n, C] (L without
    recompute), as unfused: the boundary's outputs are the layers' pre-piece outputs, saved as ever."""
    n, C = 4, 6
    params, x, g, W = make(rng, (3,), n, C, L)
    for fuse in (False, True):
        _, vjp = jax.vjp(stack(fuse, recompute), params, x, W)
        streams = [a for a in jax.tree_util.tree_leaves(vjp) if tuple(a.shape[-2:]) == (n, C)]
        assert sum(a.size for a in streams) == copies * x.size, (fuse, [a.shape for a in streams])


def test_fuse_boundaries_must_be_a_bool():
    params = mj.mhc_stack_init(jax.random.PRNGKey(0), 2, 5, 4)
    x = jnp.ones((2, 4, 5))
    for bad in (1, "yes", None, np.bool_(True)):
        with pytest.raises(TypeError, match=f"fuse_boundaries must be a bool, got {type(bad).__name__}"):
            mj.mhc_stack(params, x, None, fuse_boundaries=bad)


def test_fused_boundary_backward_runs_under_the_choice_of_its_forward(rng, monkeypatch):
    """The backward that a forward under kernel_choice(boundary_bwd=True) linked (jax.vjp there, its vjp
    function called after the block) plans its fused ops under that choice: they were planned under the
    one in force when the backward was traced, off, and on a GPU raised NotImplementedError ("run only
    under kernel_choice(boundary_bwd=True)").  The gradients: the unfused stack's bitwise."""
    from mhc_cupy import _jax_kernels, _kernel_choice
    from mhc_cupy.ops import layer as ops_layer

    planned = []

    def current():
        choice = _kernel_choice.current()
        planned.append(choice.runs("boundary_bwd"))
        return choice

    monkeypatch.setattr(ops_layer, "current_choice", current)
    _jax_kernels._planned.cache_clear()  # (planned anew: the cache keys on the choice)
    params, x, g, W = make(rng, (3,), 4, 8, 3, "float32")
    out, vjp = jax.vjp(stack(False, 3), params, x, W)
    want = [out, *jax.tree_util.tree_leaves(vjp(g))]
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        out, vjp = jax.vjp(stack(True, 3), params, x, W)
    planned.clear()
    got = [out, *jax.tree_util.tree_leaves(vjp(g))]
    assert len(planned) == 3 and all(planned), planned  # mhc_boundary_bwd twice, mhc_layer_pre_bwd(layer_out)
    assert_same(got, want, "vjp after the block")
