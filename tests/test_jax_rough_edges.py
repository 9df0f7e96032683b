"""JAX adapter, issue 41 ("rough edges, round three"), on the CPU:

* item 1: ``mhc_layer`` uses its sublayer as it is at each call (a stateful object, a closure over a
  global), eagerly, under ``jax.grad`` and in a freshly traced ``jax.jit``;
* item 5: ``lax.scan`` over layers and ``jax.checkpoint`` of a layer whose sublayer closes over a
  PRNG key or an int work, like the same network in plain ``jax.numpy``;
* item 6: ``jax.grad`` inside ``jax.shard_map`` with the default ``check_vma`` works for every op and
  the layer (one device here; two in tests/multidevice/jax_sharding_cases.py);
* item 7: ``mhc_init`` / ``mhc_head_init`` give float32 under ``jax_enable_x64``;
* item 10: errors of ``mhc_layer`` and ``mhc_from_deepseek`` name the argument at fault, and
  ``f=None`` is the identity;
* item 11: ``mhc_init`` / ``mhc_head_init`` refuse a non-finite ``alpha_init`` / ``scale_init``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import mhc_cupy.jax as mj  # noqa: E402
from mhc_cupy.bench.baselines import jnp_mhc_layer  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

# The CPU path (the float64 reference, rounded once) on a GPU machine too;
# tests/gpu/test_jax_rough_edges_gpu.py runs the shard_map cases on a GPU.
pytestmark = pytest.mark.usefixtures("jax_on_cpu")
N, C = 4, 8


def _params(alpha=(0.3, 0.2, 0.1)):
    p = mj.mhc_init(jax.random.PRNGKey(0), C, N)
    p["alpha"] = jnp.asarray(alpha, jnp.float32)  # coefficients that depend on x
    return p


def _x(rng, lead=(3,)):
    return jnp.asarray(rng.standard_normal(lead + (N, C)), jnp.float32)


def _close(a, b, rtol=2e-5):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        u, v = np.asarray(u), np.asarray(v)
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * (float(np.abs(v).max()) + 1e-30))


# --------------------------------------------------------------- item 1: the sublayer as it is now
class _Scale:
    """A stateful sublayer: its weight is an attribute."""

    def __init__(self, w):
        self.w = w

    def __call__(self, li):
        return li * self.w


_GLOBAL_W = 1.0


def _global_sublayer(li):
    return li * _GLOBAL_W


def test_stateful_sublayer_used_as_it_is_at_each_call(rng):
    """Eager, under jax.grad (in x and in the weight) and in a freshly traced jit: after the state
    changed, the result is that of the new state, never the first call's."""
    global _GLOBAL_W
    p, x = _params(), _x(rng)
    w1, w5 = jnp.asarray(1.0, jnp.float32), jnp.asarray(5.0, jnp.float32)
    sub = _Scale(w1)
    first = mj.mhc_layer(p, x, sub)
    first_grad = jax.grad(lambda x: mj.mhc_layer(p, x, sub).sum())(x)
    sub.w = w5
    want = mj.mhc_layer(p, x, lambda li: li * 5.0)
    assert not np.allclose(np.asarray(first), np.asarray(want))
    _close(mj.mhc_layer(p, x, sub), want)
    _close(jax.grad(lambda x: mj.mhc_layer(p, x, sub).sum())(x),
           jax.grad(lambda x: mj.mhc_layer(p, x, lambda li: li * 5.0).sum())(x))
    assert not np.allclose(np.asarray(first_grad), np.asarray(jax.grad(lambda x: mj.mhc_layer(p, x, sub).sum())(x)))
    _close(jax.jit(lambda x: mj.mhc_layer(p, x, sub))(x), want)
    # the weight itself, as a traced value held by the object: its gradient is the sublayer's
    gw = jax.grad(lambda w: mj.mhc_layer(p, x, _Scale(w)).sum())(w5)
    gw_ref = jax.grad(lambda w: jnp_mhc_layer(p, x, _Scale(w)).sum())(w5)
    _close(gw, gw_ref, 1e-4)
    # a closure over a global
    _GLOBAL_W = 1.0
    try:
        mj.mhc_layer(p, x, _global_sublayer)
        jax.jit(lambda x: mj.mhc_layer(p, x, _global_sublayer))(x)
        _GLOBAL_W = 5.0
        _close(mj.mhc_layer(p, x, _global_sublayer), want)
        _close(jax.jit(lambda x: mj.mhc_layer(p, x, _global_sublayer))(x), want)
    finally:
        _GLOBAL_W = 1.0


# --------------------------------------------------------- item 5: scan / checkpoint over layers
def _noise(key, li):
    return li + 0.1 * jax.random.normal(key, li.shape, li.dtype)


@pytest.mark.parametrize("closed", ["key", "int", "typed_key"])
def test_scan_over_layers_with_closed_over_key_or_int(rng, closed):
    """grad of lax.scan over 3 stacked layers, each sublayer closing over the layer's PRNG key (or
    its index, an int): equal to the same scan of the plain jax.numpy layer."""
    p = _params()
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 0.9, a * 1.1]), p)
    if closed == "int":
        per_layer = jnp.arange(1, 4)
        sub = lambda v: lambda li: jnp.tanh(li * v)  # noqa: E731
    else:
        make = jax.random.key if closed == "typed_key" else jax.random.PRNGKey
        per_layer = jax.vmap(make)(jnp.arange(3))
        sub = lambda v: lambda li: _noise(v, li)  # noqa: E731
    x = _x(rng)

    def net(layer, params, x):
        def body(h, pv):
            return layer(pv[0], h, sub(pv[1])), None
        return (jax.lax.scan(body, x, (params, per_layer))[0] ** 2).sum()

    got = jax.grad(lambda params, x: net(mj.mhc_layer, params, x), argnums=(0, 1))(stacked, x)
    want = jax.grad(lambda params, x: net(jnp_mhc_layer, params, x), argnums=(0, 1))(stacked, x)
    _close(got, want, 1e-4)
    _close(jax.jit(jax.grad(lambda params, x: net(mj.mhc_layer, params, x)))(stacked, x), want[0], 1e-4)


@pytest.mark.parametrize("closed", ["key", "int"])
def test_checkpointed_layer_with_closed_over_key_or_int(rng, closed):
    """jit(grad) of a jax.checkpoint-ed layer whose sublayer closes over a key / int passed into the
    checkpointed function: equal to the plain jax.numpy layer."""
    p, x = _params(), _x(rng)
    v = jax.random.PRNGKey(3) if closed == "key" else 3
    sub = (lambda v: lambda li: _noise(v, li)) if closed == "key" else (lambda v: lambda li: jnp.tanh(li * v))

    def loss(layer, x, v):
        return (jax.checkpoint(lambda x, v: layer(p, x, sub(v)))(x, v) ** 2).sum()

    got = jax.jit(jax.grad(lambda x, v: loss(mj.mhc_layer, x, v)))(x, v)
    _close(got, jax.grad(lambda x, v: loss(jnp_mhc_layer, x, v))(x, v), 1e-4)


def test_vmap_of_layer_with_closed_over_batched_weight(rng):
    """vmap over a weight the sublayer closes over (a batched traced value becomes an argument)."""
    p, x = _params(), _x(rng)
    ws = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    got = jax.vmap(lambda w: mj.mhc_layer(p, x, lambda li: jnp.tanh(li * w)))(ws)
    want = jnp.stack([mj.mhc_layer(p, x, lambda li, w=w: jnp.tanh(li * w)) for w in ws])
    _close(got, want)


# ---------------------------------------------------------------- item 6: grad inside shard_map
_T, _TOK, _REP = 4, P("data"), P()  # tokens; per-token arrays split on "data", parameters replicated
_LAYER_KEYS, _HEAD_KEYS = ("phi", "alpha", "bias"), ("hc_fn", "hc_scale", "hc_base")
#: name -> (fn(*arrays) -> array(s), make(r) -> (arrays, in_specs)), r(*shape, k=scale): float32 normal.
SHARD_OPS = {
    "sinkhorn_knopp": (mj.sinkhorn_knopp, lambda r: ((r(_T, N, N, k=2.0),), (_TOK,))),
    "rmsnorm": (lambda y, w: mj.rmsnorm(y, weight=w), lambda r: ((r(_T, C), r(C)), (_TOK, _REP))),
    "stream_mix": (mj.stream_mix, lambda r: ((r(_T, N, C), r(_T, N, N)), (_TOK, _TOK))),
    "stream_aggregate_shared": (mj.stream_aggregate, lambda r: ((r(_T, N, C), r(N)), (_TOK, _REP))),
    "stream_distribute": (mj.stream_distribute, lambda r: ((r(_T, C), r(_T, N)), (_TOK, _TOK))),
    "mhc_post_op": (mj.mhc_post_op, lambda r: ((r(_T, C), r(_T, N, C), r(_T, N), r(_T, N, N)), (_TOK,) * 4)),
    "mhc_pre_op": (lambda *a: mj.mhc_pre_op(*a), lambda r: ((r(_T, N, C), r(_T, N), r(_T, N), r(_T, N, N)),
                                                           (_TOK,) * 4)),
    "mhc_coeffs": (lambda x, *a: mj.mhc_coeffs(x, *a),
                   lambda r: ((r(_T, N, C), *(_params()[k] for k in _LAYER_KEYS)), (_TOK,) + (_REP,) * 3)),
    "mhc_head": (lambda x, *a: mj.mhc_head(dict(zip(_HEAD_KEYS, a)), x),
                 lambda r: ((r(_T, N, C), *mj.mhc_head_init(jax.random.PRNGKey(1), C, N).values()),
                            (_TOK,) + (_REP,) * 3)),
    "mhc_layer": (lambda x, w, *a: mj.mhc_layer(dict(zip(_LAYER_KEYS, a)), x, lambda li: jnp.tanh(li * w)),
                  lambda r: ((r(_T, N, C), r(C), *(_params()[k] for k in _LAYER_KEYS)), (_TOK,) + (_REP,) * 4)),
}
SHARD_CASES = sorted(SHARD_OPS)


def _loss(fn):
    def loss(*arrays):
        outs = fn(*arrays)
        return sum(jnp.sum(jnp.sin(o)) for o in (outs if isinstance(outs, tuple) else (outs,)))
    return loss


def check_grad_inside_shard_map(name, rng, devices):
    """jit(shard_map(grad)) over a mesh of ``devices`` (1 or 2; the tokens split over them),
    check_vma on (the default): the gradients equal those of the same program on all tokens
    without shard_map (a replicated parameter's gradient is summed over the devices, as for
    jax.numpy ops)."""
    fn, make = SHARD_OPS[name]
    arrays, specs = make(lambda *shape, k=1.0: jnp.asarray(k * rng.standard_normal(shape), jnp.float32))
    mesh = Mesh(np.array(devices), ("data",))
    grad = jax.grad(_loss(fn), argnums=tuple(range(len(arrays))))
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]
    got = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=specs))(*sharded)
    _close(got, jax.jit(grad)(*jax.device_put(arrays, devices[0])), 1e-6)


@pytest.mark.parametrize("name", SHARD_CASES)
def test_grad_inside_shard_map(name, rng):
    check_grad_inside_shard_map(name, rng, jax.devices("cpu")[:1])


def test_shard_map_output_types_say_varying():
    """A kernel's result inside shard_map varies like its inputs: out_specs P() (replicated) for it
    is refused, as for the same jax.numpy op."""
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    x, M = jnp.ones((2, N, C)), jnp.ones((2, N, N))
    for fn in (mj.stream_mix, lambda x, M: jnp.einsum("tij,tjc->tic", M, x)):
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))(x, M)


# ------------------------------------------------------------------------ item 7: float32 under x64
def test_init_float32_under_x64(rng):
    if hasattr(jax, "enable_x64"):
        x64 = jax.enable_x64(True)
    else:  # older jax
        from jax.experimental import enable_x64 as x64_on
        x64 = x64_on()
    with x64:
        p = mj.mhc_init(jax.random.PRNGKey(0), C, N)
        head = mj.mhc_head_init(jax.random.PRNGKey(0), C, N)
        for k, a in list(p.items()) + list(head.items()):
            assert a.dtype == jnp.float32, (k, a.dtype)
        x = _x(rng)
        out = mj.mhc_layer(p, x, jnp.tanh)
        assert out.dtype == jnp.float32 and mj.mhc_head(head, x).dtype == jnp.float32


# ------------------------------------------------------------------------ item 10: clear errors
def test_layer_x_without_stream_dim_names_x(rng):
    p = _params()
    for shape in ((3, C), (3, 5, C), (3, N, C + 1)):
        with pytest.raises(ValueError, match=r"^x has shape .*need x \[\.\.\., n, C\] = \[\.\.\., 4, 8\]"):
            mj.mhc_layer(p, jnp.ones(shape, jnp.float32), jnp.tanh)
    with pytest.raises(ValueError, match=r"^x has shape \(8,\); it needs \[\.\.\., n, C\]"):
        mj.mhc_layer(p, jnp.ones(C, jnp.float32), jnp.tanh)
    with pytest.raises(TypeError, match="^x has type list"):
        mj.mhc_layer(p, [[1.0]], jnp.tanh)


def test_layer_f_none_is_identity(rng):
    p, x = _params(), _x(rng)
    _close(mj.mhc_layer(p, x, None), mj.mhc_layer(p, x, lambda li: li))
    _close(jax.grad(lambda x: mj.mhc_layer(p, x, None).sum())(x),
           jax.grad(lambda x: jnp_mhc_layer(p, x, lambda li: li).sum())(x), 1e-4)
    with pytest.raises(TypeError, match="^f .*must be callable .* or None"):
        mj.mhc_layer(p, x, 3.0)


def test_layer_sublayer_output_checked(rng):
    p, x = _params(), _x(rng)
    with pytest.raises(TypeError, match=r"^f \(the sublayer\) returned a tuple of 2 array"):
        mj.mhc_layer(p, x, lambda li: (li, li))
    with pytest.raises(TypeError, match=r"^f \(the sublayer\) returned a dict"):
        mj.mhc_layer(p, x, lambda li: {"out": li})
    with pytest.raises(ValueError, match=r"^f \(the sublayer\) returned an array of shape \(3, 4\)"):
        mj.mhc_layer(p, x, lambda li: li[:, :4])


def test_from_deepseek_names_arguments_and_refuses_n_33():
    n, Cd = 33, 2
    m = n * n + 2 * n
    fn, scale, base = np.zeros((m, n * Cd), np.float32), np.ones(3, np.float32), np.zeros(m, np.float32)
    with pytest.raises(ValueError, match=r"hc_fn of shape \(1155, 66\) has n = 33 streams; supported n is 1 to 32"):
        mj.mhc_from_deepseek(fn, scale, base)
    ok = mj.mhc_from_deepseek(np.zeros((24, 32), np.float32), scale, np.zeros(24, np.float32))
    assert ok["phi"].shape == (32, 24)
    for args, name in (((None, scale, base), "hc_fn"), ((fn, None, base), "hc_scale"), ((fn, scale, None), "hc_base"),
                       (("abc", scale, base), "hc_fn")):
        with pytest.raises(TypeError, match=f"^{name} "):
            mj.mhc_from_deepseek(*args)
    with pytest.raises(ValueError, match=r"^hc_fn has shape \(15, 0\)"):
        mj.mhc_from_deepseek(np.zeros((15, 0), np.float32), scale, np.zeros(15, np.float32))


@pytest.mark.parametrize("dtype", ["complex64", "bool", "int32"])
def test_from_deepseek_refuses_complex_bool_and_integer(dtype):
    """A complex hc_fn, hc_scale or hc_base: TypeError naming it (jnp.asarray dropped the imaginary
    part, with only a ComplexWarning); a bool or integer one too (its values were taken for weights)."""
    for at, name in enumerate(("hc_fn", "hc_scale", "hc_base")):
        args = [np.zeros((24, 32), np.float32), np.ones(3, np.float32), np.zeros(24, np.float32)]
        args[at] = (args[at] + 1j).astype(dtype) if dtype == "complex64" else args[at].astype(dtype)
        with pytest.raises(TypeError, match=f"^{name} has dtype {dtype}; it needs a real floating-point dtype"):
            mj.mhc_from_deepseek(*args)


@pytest.mark.parametrize("at", [0, 1, 2])
def test_from_deepseek_names_an_argument_numpy_cannot_read(at):
    """A torch bfloat16 tensor (which NumPy cannot read): TypeError naming the argument (was torch's
    'Got unsupported ScalarType BFloat16' from np.iscomplexobj, naming none)."""
    torch = pytest.importorskip("torch")
    name = ("hc_fn", "hc_scale", "hc_base")[at]
    args = [torch.zeros(24, 32), torch.ones(3), torch.zeros(24)]
    mj.mhc_from_deepseek(*args)  # float32 tensors are read
    args[at] = args[at].bfloat16()
    with pytest.raises(TypeError, match=f"^{name} has type Tensor, which NumPy cannot read .*BFloat16"):
        mj.mhc_from_deepseek(*args)


@pytest.mark.parametrize("bad", [{"phi": 1}, None, [1, 2, 3], {"phi": 1, "alpha": 2, "bias": 3}])
def test_to_deepseek_names_params(bad):
    """mhc_to_deepseek of something other than mhc_init's dict: TypeError naming params (was
    AttributeError: 'int' object has no attribute 'T', or a TypeError from subscripting)."""
    with pytest.raises(TypeError, match=r"^params"):
        mj.mhc_to_deepseek(bad)


# ------------------------------------------------------------------------ item 11: init values
@pytest.mark.parametrize("bad,exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                     (-float("inf"), ValueError), ("0.1", TypeError), (True, TypeError),
                                     (None, TypeError)])
def test_init_values_validated(bad, exc):
    key = jax.random.PRNGKey(0)
    with pytest.raises(exc, match="^alpha_init must be"):
        mj.mhc_init(key, C, N, alpha_init=bad)
    with pytest.raises(exc, match="^scale_init must be"):
        mj.mhc_head_init(key, C, N, scale_init=bad)
    assert float(mj.mhc_init(key, C, N, alpha_init=-0.5)["alpha"][0]) == -0.5  # any finite value
    assert float(mj.mhc_head_init(key, C, N, scale_init=np.float32(0.25))["hc_scale"][0]) == 0.25


def test_cpu_callback_quiet_on_non_finite_and_underflow():
    """The jitted ops' CPU callback, like the functional API's CPU path: Sinkhorn's exp underflow
    (logits at scale 1000) and an inf in x give values, no NumPy warning or np.seterr error."""
    import warnings

    L = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 4)) * 1000, jnp.float32)
    x = jnp.ones((2, C)).at[0, 0].set(jnp.inf)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        P = jax.jit(mj.sinkhorn_knopp)(L)
        y = jax.jit(mj.rmsnorm)(x)
    assert bool(jnp.isfinite(P).all()) and bool(jnp.isnan(y[0]).any()) and bool(jnp.isfinite(y[1]).all())
