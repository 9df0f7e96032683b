"""GPU tests of the JAX adapter ``mhc_cupy.jax`` (on a GPU, retracing included).

On a GPU every kernel call of the adapter is a ``buffer_callback`` custom call
that launches the CuPy kernels on XLA's stream, in place in XLA's buffers.

* eager and ``jit`` forward, and ``jax.vjp``, bitwise equal to the functional
  API (``mhc_cupy.*_fwd`` / ``*_bwd`` on the same JAX GPU arrays: the same
  kernels at the same alignment), and close to the float64 reference;
* ``vmap`` (flat and nested, shared ``h`` / RMSNorm weight) equal to a
  per-example loop: bitwise, except a shared ``h``'s per-example gradient,
  which vmap sums over tokens with XLA in float32 (1e-6 relative);
* re-tracing: every op inside ``jit`` at tokens 21, n 4, C 1000, under ``grad`` and
  ``vmap``, then re-traced at other shapes, with ``jax.transfer_guard("disallow")``
  around the compiled calls and no host callback but ``buffer_callback`` in the
  lowered program; an unused output gives a zero gradient;
* ordering on XLA's stream: XLA ops producing our inputs and consuming our
  outputs inside one ``jit`` (large enough that a wrong stream would race);
* repeated backward bitwise identical; a second GPU (if any) gives the same results.

Tolerances vs the float64 reference, relative to ``|ref| + rms(ref)``
(``harness.assert_close``), rows of ``harness.TOL``: activations one rounding plus
float32 accumulation ("activation"); float32 coefficient sums over C ("coefficient");
values out of the 20-step Sinkhorn iteration "sinkhorn", gradients through it
"sinkhorn_chain_grad" (logits of scale 2).
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import TOL, assert_close

from .helpers import ACT_TOL, JAX_GPU, jax_gpu_ok


pytestmark = JAX_GPU

if jax_gpu_ok():
    import jax
    import jax.numpy as jnp

    import mhc_cupy
    import mhc_cupy.jax as mj

    # The op table, oracles and helpers of the CPU adapter tests (tests/ is on sys.path: conftest.py).
    import test_jax_adapter as C

    OPS, ALL_OPS = C.OPS, C.ALL_OPS
else:  # collected but skipped
    OPS, ALL_OPS = {}, []

# the forward checks keep their 1e-3 (the chain row) until 2e-4 is measured on a GPU for these calls
SINKHORN_TOL, SINKHORN_GRAD_TOL, COEF_TOL = (TOL[k].value for k in ("sinkhorn_chain_grad", "sinkhorn_chain_grad",
                                                                    "coefficient"))
#: (leading token dims, n, C, dtype): the re-tracing shape first, then others.
CONFIGS = [((21,), 4, 1000, "float32"), ((21,), 4, 1000, "bfloat16"), ((2, 3), 3, 33, "bfloat16"),
           ((5,), 1, 7, "float16"), ((), 4, 1000, "float32")]


def _tol(name, k, dtype):
    """Tolerance of output / gradient number ``k`` of op ``name`` vs the float64 reference."""
    if "sinkhorn" in name or (name == "mhc_pre_op" and k == 3):
        return SINKHORN_TOL
    return ACT_TOL[dtype]


def _check_ref(name, got, ref):
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_close(np.asarray(g, np.float64), r, _tol(name, k, np.dtype(g.dtype).name), f"{name} output {k}")


def _on_gpu(a):
    return all(d.platform == "gpu" for d in a.devices())


# --------------------------------------------------------------- forward
@pytest.mark.parametrize("name,cfg", C.op_cases(CONFIGS) if ALL_OPS else [])
def test_forward_bitwise_equal_to_functional_api(name, cfg, rng):
    op = OPS[name]
    a, args = C._inputs(op, rng, cfg)
    assert all(_on_gpu(x) for x in args)
    f = jax.jit(op.adapter)
    with jax.transfer_guard("disallow"):
        jitted = jax.block_until_ready(f(*args))
        eager = jax.block_until_ready(op.adapter(*args))
    functional = op.fwd(mhc_cupy, dict(zip(op.args, args)))
    for j, e, fn in zip(jitted, eager, functional):
        assert _on_gpu(j)
        C.assert_same(j, fn)
        C.assert_same(e, fn)
    _check_ref(name, jitted, op.ref(C._np(a)))


# -------------------------------------------------------------- backward
@pytest.mark.parametrize("name,cfg", C.op_cases(CONFIGS) if ALL_OPS else [])
def test_vjp_bitwise_equal_to_functional_bwd(name, cfg, rng):
    op = OPS[name]
    a, args = C._inputs(op, rng, cfg)
    outs = op.adapter(*args)
    cts = C._cotangents(rng, outs)
    run = jax.jit(lambda args, cts: jax.vjp(op.adapter, *args)[1](cts))
    with jax.transfer_guard("disallow"):
        grads = jax.block_until_ready(run(args, cts))
        again = jax.block_until_ready(run(args, cts))
    expected = op.bwd(cts, a)
    for g, g2, e, x in zip(grads, again, expected, args):
        assert g.dtype == x.dtype and g.shape == x.shape and _on_gpu(g)
        C.assert_same(g, e)
        C.assert_same(g2, g)  # reproducible


@pytest.mark.parametrize("name", ALL_OPS)
def test_grad_close_to_reference(name, rng):
    """jax.grad on the GPU vs the float64 reference backward (same upstream gradient)."""
    op = OPS[name]
    a, args = C._inputs(op, rng, ((21,), 4, 1000, "float32"))
    outs = op.adapter(*args)
    cts = C._cotangents(rng, outs)

    def loss(*xs):
        return sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in zip(op.adapter(*xs), cts))

    grads = jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)
    # the float64 reference backward (NumPy inputs: the functional API's CPU path)
    ref = op.bwd(tuple(np.asarray(c) for c in cts), C._np(a))
    tol = SINKHORN_GRAD_TOL if name in ("sinkhorn_knopp", "mhc_pre_op") else COEF_TOL
    for k, (g, r) in enumerate(zip(grads, ref)):
        assert_close(np.asarray(g, np.float64), np.asarray(r, np.float64), tol, f"{name} grad {k}")


# ------------------------------------------------------------------ vmap
@pytest.mark.parametrize("name,in_axes", C._vmap_cases() if ALL_OPS else [],
                         ids=lambda v: str(v).replace(" ", ""))
def test_vmap_equals_loop(name, in_axes, rng):
    op = OPS[name]
    B, lead, n, Cc, dt = 3, (7,), 4, 1000, "bfloat16"
    a = op.make(rng, lead, n, Cc, dt)
    batched = C._batched_inputs(op, rng, B, lead, n, Cc, dt)
    args = tuple(batched[k] if ax == 0 else a[k] for k, ax in zip(op.args, in_axes))
    want = C._loop(op.adapter, in_axes, args, B)
    with jax.transfer_guard("disallow"):
        got = jax.jit(jax.vmap(op.adapter, in_axes))(*args)
    for g, w in zip(got, want):
        C.assert_same(g, w)
    cts = C._cotangents(rng, want)

    def vjp_fn(*xs_and_cts):
        xs, ct = xs_and_cts[:len(args)], xs_and_cts[len(args):]
        return jax.vjp(op.adapter, *xs)[1](ct)

    v_axes = in_axes + (0,) * len(cts)
    with jax.transfer_guard("disallow"):
        got = jax.jit(jax.vmap(vjp_fn, v_axes))(*args, *cts)
    want = C._loop(vjp_fn, v_axes, args + cts, B)
    for k, g, w in zip(op.args, got, want):
        if k == "h" and k in op.shared:  # a shared h: XLA sums its per-token gradient in float32
            assert_close(g, w, 1e-6, scale="max")
        else:
            C.assert_same(g, w)


@pytest.mark.parametrize("name", ALL_OPS)
def test_nested_vmap_grad(name, rng):
    C.check_grad_of_nested_vmap(OPS[name], rng, (5,), 3, 33, jit=True)


# ------------------------------------------------------------ re-tracing
def _model(x, hp, hq, hr):
    layer_in, H_pre, H_post, H_res = mj.mhc_pre_op(x, hp, hq, hr)
    y = mj.rmsnorm(layer_in)
    mixed = mj.stream_mix(x, mj.sinkhorn_knopp(hr))
    agg = mj.stream_aggregate(mixed, H_pre)
    out = mj.mhc_post_op(y + agg, x, H_post, H_res)
    return out + mj.stream_distribute(agg, H_post)


def test_p11_every_op_jit_grad_vmap_retrace_no_host_copy(rng):
    f = jax.jit(_model)
    g = jax.jit(jax.grad(lambda *a: _model(*a).astype(jnp.float32).sum(), (0, 1, 2, 3)))
    fv = jax.jit(jax.vmap(_model))
    for lead, n, Cc, dt in [((21,), 4, 1000, "float32"), ((21,), 4, 1000, "bfloat16"), ((2, 3), 3, 33, "bfloat16"),
                            ((5,), 1, 7, "float16"), ((21,), 4, 1000, "float32")]:
        a = OPS["mhc_pre_op"].make(rng, lead, n, Cc, dt)
        args = (a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"])
        text = f.lower(*args).as_text() + g.lower(*args).as_text()
        assert "xla_buffer_python_gpu_callback" in text
        assert "xla_ffi_python_gpu_callback" not in text and "xla_python_gpu_callback" not in text
        stacked = [jnp.stack([v, 2 * v]) for v in args]
        with jax.transfer_guard("disallow"):
            out = jax.block_until_ready(f(*args))
            grads = jax.block_until_ready(g(*args))
            vm = jax.block_until_ready(fv(*stacked))
        # eager runs each op as its own program: XLA's elementwise glue may
        # round differently when fused, so one activation rounding apart at most
        assert_close(np.asarray(_model(*args), np.float64), np.asarray(out, np.float64), ACT_TOL[dt], "eager")
        C.assert_same(vm[0], out)
        C.assert_same(vm[1], f(*[2 * v for v in args]))
        for gr, x in zip(grads, args):
            assert gr.shape == x.shape and gr.dtype == x.dtype and _on_gpu(gr)
            assert np.all(np.isfinite(np.asarray(gr, np.float32)))


def test_p11_unused_outputs_zero_gradient(rng):
    a = OPS["mhc_pre_op"].make(rng, (21,), 4, 1000, "bfloat16")
    args = (a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"])
    argnums = (0, 1, 2, 3)
    with jax.transfer_guard("disallow"):
        g = jax.jit(jax.grad(lambda *xs: mj.mhc_pre_op(*xs)[0].astype(jnp.float32).sum(), argnums))(*args)
        gr = jax.jit(jax.grad(lambda *xs: (mj.mhc_pre_op(*xs)[3] ** 2).sum(), argnums))(*args)
    assert not np.any(np.asarray(g[2])) and not np.any(np.asarray(g[3]))
    ones = jnp.ones((21, 1000), jnp.bfloat16)
    for gi, ei in zip(g, mhc_cupy.mhc_pre_op_bwd(ones, None, None, None, *args)):
        C.assert_same(gi, ei)
    for k in range(3):
        assert not np.any(np.asarray(gr[k], np.float32)), k
    assert np.any(np.asarray(gr[3]))


# ------------------------------------------------------- streams, devices
def test_ordered_on_xla_stream_with_xla_producers_and_consumers(rng):
    """XLA kernels write our inputs and read our outputs inside one program:
    a launch on any stream but XLA's would race (sizes make the race visible)."""
    T, n, Cc = 4096, 4, 2048
    x = jnp.asarray(rng.standard_normal((T, n, Cc)), jnp.bfloat16)
    M = jnp.asarray(rng.standard_normal((T, n, n)), jnp.float32)

    @jax.jit
    def chain(x, M):
        x2 = jnp.sin(x) * 3 + x  # produced by XLA right before our kernel
        y = mj.stream_mix(x2, M)
        return jnp.cos(y) + y, y, x2  # consumed by XLA right after it

    with jax.transfer_guard("disallow"):
        outs = [jax.block_until_ready(chain(x, M)) for _ in range(3)]
    for z, y, x2 in outs:
        C.assert_same(y, mhc_cupy.stream_mix_fwd(x2, M))
        assert_close(np.asarray(z, np.float64), np.asarray(jnp.cos(y) + y, np.float64), ACT_TOL["bfloat16"], "z")


def test_second_gpu_same_results(rng):
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    a = OPS["mhc_post_op"].make(rng, (21,), 4, 1000, "bfloat16")
    args = tuple(a[k] for k in OPS["mhc_post_op"].args)
    on1 = tuple(jax.device_put(v, gpus[1]) for v in args)
    cts = jnp.asarray(rng.standard_normal((21, 4, 1000)), jnp.bfloat16)
    f = jax.jit(lambda xs, ct: jax.vjp(mj.mhc_post_op, *xs)[1](ct))
    r0 = f(args, cts)
    r1 = f(on1, jax.device_put(cts, gpus[1]))
    for g0, g1 in zip(r0, r1):
        assert g1.devices() == {gpus[1]}
        C.assert_same(jax.device_put(g1, gpus[0]), g0)


@pytest.mark.parametrize("n,C,dtype", [(4, 1000, "bfloat16"), (8, 2048, "bfloat16"), (3, 33, "float32")])
def test_replay_is_bitwise_the_plan(n, C, dtype, rng, monkeypatch):
    """mhc_cupy._jax_kernels.REPLAY (off by default until this passes on a GPU): a jitted layer's forward and
    VJP on fresh inputs each call, with the callbacks' recorded launches replayed after their first call,
    bitwise the run that plans every call; and the replay did run."""
    from mhc_cupy import _jax_kernels, _replay

    p = mj.mhc_init(jax.random.PRNGKey(0), C, n)
    p = {k: v + jnp.asarray(rng.normal(0, 0.05, v.shape), jnp.float32) for k, v in p.items()}
    xs = [jnp.asarray(rng.standard_normal((37, n, C)), dtype) for _ in range(3)]
    gs = [jnp.asarray(rng.standard_normal((37, n, C)), dtype) for _ in range(3)]
    W = jnp.asarray(rng.standard_normal((C, C)) / np.sqrt(C), dtype)

    def step(p, x, g):
        out, vjp = jax.vjp(lambda p, x: mj.mhc_layer(p, x, lambda li: jnp.tanh(li @ W)), p, x)
        return out, vjp(g)

    replayed = []
    launch = _replay.Replay.launch
    monkeypatch.setattr(_replay.Replay, "launch", lambda self, *a: (replayed.append(1), launch(self, *a))[1])
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(_jax_kernels, "REPLAY", on)
        f = jax.jit(step)  # (a fresh trace: the callbacks are cached per plan, their replays per device)
        runs[on] = [jax.block_until_ready(f(p, x, g)) for x, g in zip(xs, gs)]
    assert replayed, "no callback replayed its launches"
    for a, b in zip(jax.tree_util.tree_leaves(runs[False]), jax.tree_util.tree_leaves(runs[True])):
        C.assert_same(b, a)
