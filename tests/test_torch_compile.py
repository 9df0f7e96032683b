"""CPU tests of ``mhc_cupy.torch`` under ``torch.compile`` and of its custom ops (``torch.ops.mhc_cupy.*``).

The compiled route (the custom ops under ``torch.compile(fullgraph=True)``, dynamic shapes, inductor)
and the dispatcher route are bitwise equal to the eager route (autograd.Function, no dispatcher),
forward and backward; a bad input fails at trace time; ``torch.library.opcheck`` passes for every
custom op, with arguments derived from the op specs.
"""

from __future__ import annotations

import pytest
import torch

import mhc_cupy.torch as mt
import mhc_cupy.torch.functions as mf
from mhc_cupy.ops import SPECS
from mhc_cupy.ops.spec import GRAD_MODE, Arg, shape_of

# the op table and helpers of the eager tests (tests/ is on sys.path: tests/conftest.py)
from test_torch_adapter import OPS, as_tuple, assert_same, call, case, grads_of, tensor, upstream_like


# ------------------------------------------------------------------ torch.compile
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_backend(graphs):
    """aot_eager that records the forward and backward graphs' call targets."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def compile_fn(gm, example_inputs):
            graphs.append((kind, {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
            return make_boxed_func(gm.forward)
        return compile_fn

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_compile_fullgraph(rng, fresh_dynamo, op, dtype):
    """fullgraph compile: the custom ops appear in the forward and backward graphs; results bitwise eager."""
    if op == "sinkhorn_knopp" and dtype != torch.float32:
        pytest.skip("Sinkhorn has no activation dtype")
    c = case(op, rng, (2, 3), 4, 7, dtype=dtype)
    args = c["args"]
    graphs = []
    compiled = torch.compile(lambda *a: call(c, list(a)), fullgraph=True, backend=_recording_backend(graphs))
    got = as_tuple(compiled(*args))
    eager = as_tuple(call(c))
    for a, b in zip(got, eager):
        assert_same(a, b, f"{op} forward compiled vs eager")
    gs = upstream_like(rng, eager)
    for i, (a, b) in enumerate(zip(grads_of(got, args, gs), grads_of(eager, args, gs))):
        assert_same(a, b, f"{op} grad {i} compiled vs eager")
    fw = set().union(*[t for k, t in graphs if k == "fw"])
    bw = set().union(*[t for k, t in graphs if k == "bw"])
    assert f"mhc_cupy.{op}_fwd.default" in fw, fw
    assert any(t.startswith(f"mhc_cupy.{op}") and "_bwd" in t for t in bw), bw


def test_compile_model_dynamic_shapes(rng, fresh_dynamo):
    """A small mHC layer (pre op -> rmsnorm -> post op) with dynamic token counts: one graph, eager results."""

    def layer(x, h_pre, h_post, h_res, w):
        layer_in, H_pre, H_post, H_res = mt.mhc_pre_op(x, h_pre, h_post, h_res)
        return mt.mhc_post_op(mt.rmsnorm(layer_in, weight=w), x, H_post, H_res)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    w = tensor(rng, (7,))
    for T in (3, 5, 11):
        args = [tensor(rng, (T, 4, 7)), tensor(rng, (T, 4)), tensor(rng, (T, 4)), tensor(rng, (T, 4, 4)), w]
        got, want = compiled(*args), layer(*args)
        assert_same(got, want)
        g = tensor(rng, got.shape, grad=False)
        for a, b in zip(torch.autograd.grad(got, args, g), torch.autograd.grad(want, args, g)):
            assert_same(a, b)


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("route", ["stack", "functional"])
def test_compile_dynamic_two_fused_layers(rng, fresh_dynamo, route, convention):
    """Two fused layer pieces in one dynamic=True graph (an MHCStack, or mhc_layer_pre twice).  Dynamo
    makes a float setting it reads (eps, from the layers' one LayerSettings or the convention's
    defaults) a graph input; read first inside the first _LayerPreFn's body it belonged to that
    subgraph, and the second layer failed with Dynamo's AssertionError
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer"."""
    n, C = 4, 7
    torch.manual_seed(0)
    layers = [mt.MHC(C, n, torch.nn.Linear(C, C), convention=convention) for _ in range(3)]
    if route == "stack":
        f = mt.MHCStack(layers, recompute=2)
    else:
        def f(x):
            for layer in layers[:2]:
                li, xl, hp, hr = mt.mhc_layer_pre(x, layer.phi, layer.alpha, layer.bias, convention=convention)
                x = mt.mhc_layer_post(layer.sublayer(li), xl, hp, hr, convention=convention)
            return x
    compiled = torch.compile(f, fullgraph=route == "functional", backend="aot_eager", dynamic=True)
    params = [p for layer in layers for p in layer.parameters()]
    for T in (3, 5):
        x = tensor(rng, (T, n, C))
        got, want = compiled(x), f(x)
        assert_same(got, want)
        g = tensor(rng, got.shape, grad=False)
        for a, b in zip(torch.autograd.grad(got, [x, *params], g, allow_unused=True),
                        torch.autograd.grad(want, [x, *params], g, allow_unused=True)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("lane", [None, True])
def test_compile_fullgraph_mhc_without_grad(rng, fresh_dynamo, lane):
    """MHC compiled (fullgraph) and called under torch.no_grad (inference): the no-grad lane's kernel choice
    (a context variable, which Dynamo cannot read) is not reached while Dynamo traces; equal to eager."""
    from mhc_cupy._kernel_choice import kernel_choice

    layer = mt.MHC(16, 4, torch.nn.Linear(16, 16))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = tensor(rng, (3, 4, 16), grad=False)
    with torch.no_grad(), kernel_choice(lane=lane):
        assert_same(compiled(x), layer(x))


def test_compile_pre_op_unused_outputs(rng, fresh_dynamo):
    """Compiled: only layer_in used; gradients equal eager (None handled on the custom-op route)."""
    c = case("mhc_pre_op", rng, (2, 3), 4, 7)
    args = c["args"]
    f = lambda *a: mt.mhc_pre_op(*a)[0]  # noqa: E731
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    g = tensor(rng, got.shape, grad=False)
    ga = torch.autograd.grad(got, args, g)
    gb = torch.autograd.grad(f(*args), args, g)
    for a, b in zip(ga, gb):
        assert_same(a, b)
    assert not ga[2].any() and not ga[3].any()


def test_compile_error_at_trace_time(rng, fresh_dynamo):
    """A bad dtype is reported while tracing (the fake implementation runs the same checks)."""
    x = tensor(rng, (3, 4, 7), dtype=torch.float64)
    M = tensor(rng, (3, 4, 4))
    with pytest.raises(Exception, match="x has dtype float64"):
        torch.compile(mt.stream_mix, fullgraph=True, backend="aot_eager")(x, M)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script_method inside inductor itself
def test_compile_inductor(rng, fresh_dynamo):
    """Default backend (inductor; ~30 s of C++ compilation on a cold CPU cache): custom ops as extern kernels."""
    def f(x, M, h):
        return mt.stream_aggregate(mt.stream_mix(x, M), h)

    args = [tensor(rng, (3, 4, 33)), tensor(rng, (3, 4, 4)), tensor(rng, (4,))]
    got = torch.compile(f, fullgraph=True)(*args)
    want = f(*args)
    assert_same(got, want)
    g = tensor(rng, got.shape, grad=False)
    for a, b in zip(torch.autograd.grad(got, args, g), torch.autograd.grad(want, args, g)):
        assert_same(a, b)


# ------------------------------------------------------------------ custom op registrations
#: Every custom op (``torch.ops.mhc_cupy.*``), its arguments from the op spec (``mhc_cupy.ops.SPECS``:
#: T = 3 tokens, n = 4, C = 7, parameters at their defaults) except these: a shared h, absent
#: gradients, another Sinkhorn setting.
OPCHECK = {**{name: {} for name in SPECS}, "rmsnorm_weight_bwd": {},
           "sinkhorn_knopp_bwd": dict(num_iters=5, grad_mode="implicit"),
           "stream_aggregate_fwd": dict(h=(4,)), "stream_distribute_bwd": dict(h=(4,)),
           "mhc_pre_op_bwd": dict(grad_H_pre=None, grad_H_res=None)}


def opcheck_args(name, T):
    """Positional arguments of custom op ``name`` from its op spec; ``T(shape)`` makes a tensor."""
    spec = SPECS[mf._SPEC_OF.get(name, name)]
    arrays = {a.name: a for a in spec.args}
    defaults = {**GRAD_MODE, **spec.params}
    args = []
    for arg in getattr(torch.ops.mhc_cupy, name).default._schema.arguments:
        value = OPCHECK[name].get(arg.name, arrays.get(arg.name, defaults.get(arg.name)))
        if isinstance(value, Arg):
            value = shape_of(value, (3,), {"n": 4, "C": 7, "K": 24})
        args.append(T(value) if isinstance(value, tuple) else value)
    return args


@pytest.mark.parametrize("name", sorted(OPCHECK))
def test_opcheck(rng, name):
    """torch.library.opcheck: schema, fake (meta) shapes/strides vs real, autograd registration."""
    grad = name.endswith("_fwd") and not name.startswith(("mhc_layer", "mhc_boundary"))  # autograd in Python
    args = opcheck_args(name, lambda shape: tensor(rng, shape, grad=grad))
    torch.library.opcheck(getattr(torch.ops.mhc_cupy, name).default, args)


def test_opcheck_args_follow_the_spec(rng):
    """The derived arguments are the ones the ops take (a check of the derivation itself)."""
    def shapes(name):
        args = opcheck_args(name, lambda shape: tensor(rng, shape, grad=False))
        return [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]

    def named(name):  # by name: the arrays' shapes (or None), the parameters' values
        return dict(zip((a.name for a in getattr(torch.ops.mhc_cupy, name).default._schema.arguments), shapes(name)))

    # the parameters at the spec's defaults, whatever they are (a new one needs no edit here)
    assert named("rmsnorm_fwd") == {"x": (3, 7), "weight": (7,), **SPECS["rmsnorm_fwd"].params}
    assert shapes("stream_distribute_bwd") == [(3, 4, 7), (3, 7), (4,)]
    assert named("mhc_pre_op_bwd") == {
        "grad_layer_in": (3, 7), "grad_H_pre": None, "grad_H_post": (3, 4), "grad_H_res": None, "x": (3, 4, 7),
        "h_pre_raw": (3, 4), "h_post_raw": (3, 4), "h_res_raw": (3, 4, 4), **SPECS["mhc_pre_op_bwd"].params}
    assert shapes("mhc_layer_pre_bwd")[:9] == [(3, 7), (3, 4, 7), (3, 4), (3, 4, 4), (3, 4, 7), (28, 24), (3,), (24,),
                                               (3, 25)]


def test_custom_op_route_equals_eager_route(rng):
    """The dispatcher route (torch.ops.mhc_cupy.*) and the bypass give bitwise equal results."""
    c = case("mhc_pre_op", rng, (2, 3), 4, 7)
    args = c["args"]
    a = torch.ops.mhc_cupy.mhc_pre_op_fwd(*args, 20, 1e-8, "unrolled")
    b = mt.mhc_pre_op(*args)
    gs = upstream_like(rng, b)
    for u, v in zip(a, b):
        assert_same(u, v)
    for u, v in zip(grads_of(a, args, gs), grads_of(b, args, gs)):
        assert_same(u, v)


# ------------------------------------------------------------------ torch.jit.trace
@pytest.mark.parametrize("what", ["stream_mix", "MHC", "MHCHead"])
@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_records_the_custom_ops(rng, what, grad):
    """torch.jit.trace does not see the kernels (NumPy / CuPy): without autograd recording, the eager
    route's outputs were traced as constants and the traced function returned the example's outputs
    for any input, silently.  While tracing, the ops run as their custom operators, which the trace
    records: the traced module equals the eager one on new inputs (and the tracer's own check passes)."""
    import warnings

    torch.manual_seed(0)
    M = tensor(rng, (3, 4, 4), grad=False)
    f = {"stream_mix": lambda x: mt.stream_mix(x, M), "MHC": mt.MHC(7, 4, torch.nn.Linear(7, 7), alpha_init=0.5),
         "MHCHead": mt.MHCHead(7, 4, scale_init=0.5)}[what]
    x, x2 = tensor(rng, (3, 4, 7), grad=False), tensor(rng, (3, 4, 7), grad=False)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation
        traced = torch.jit.trace(f, (x,), check_trace=what != "MHC" or not grad)  # (MHC with grad: Python ops)
        torch.testing.assert_close(traced(x2), f(x2), rtol=0, atol=0)
