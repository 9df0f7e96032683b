"""CPU tests of the PyTorch adapter ``mhc_cupy.torch`` (autograd, dtypes, errors, imports, functional API).

On CPU the adapter runs the functional API, which runs the float64 NumPy
reference and rounds each output once to its dtype.  So:

* forward vs ``mhc_cupy.reference``: one rounding to the output dtype;
* backward via autograd vs the functional ``*_bwd``: bitwise equal (same call);
* backward vs float64 torch autograd of an independent pure-torch forward
  (tests/paper_oracle.py; Sinkhorn exactly as OPS.md with the row-max shift): one
  rounding of each gradient to its dtype;
* float32 central finite differences: exact for the bilinear ops up to the
  float32 rounding of the two loss evaluations, whose bound is computed.

torch.compile and the custom ops (``torch.ops.mhc_cupy.*``) are in tests/test_torch_compile.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import mhc_cupy as m
import mhc_cupy.torch as mt
from mhc_cupy import reference as R
from mhc_cupy.ops import SPECS
from mhc_cupy.torch.reference import sinkhorn_reference

from harness import NP_DTYPES, TOL, assert_close, spec_inputs
from paper_oracle import t_aggregate, t_coeffs, t_distribute, t_mix, t_post, t_pre, t_rmsnorm

REPO = Path(__file__).resolve().parents[1]

# The CPU path rounds a float64 result once: harness.TOL["rounding"], per output dtype.
ROUNDING = TOL["rounding"]

SHAPES = [  # (lead dims, n, C): n = 1 (trivial Sinkhorn), odd C, one token, 2-D lead
    ((1,), 1, 7),
    ((3,), 3, 33),
    ((2, 3), 4, 7),
    ((3,), 4, 33),
    ((2, 3), 3, 1),
]


# ------------------------------------------------------------------ helpers
def tensor(rng, shape, dtype=torch.float32, scale=1.0, grad=True):
    """Random normal data rounded to ``dtype`` (explicit dtype: other test files change the default)."""
    t = torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)
    return t.requires_grad_(grad)


def f64(t):
    return None if t is None else t.detach().to(torch.float64).numpy()


def leaf64(t):
    return t.detach().to(torch.float64).requires_grad_(True)


def assert_same(a, b, what=""):
    """Bitwise equal tensors (or both None)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a!r} vs {b!r}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: not bitwise equal (max diff {(a.double() - b.double()).abs().max():.3e})"


def as_tuple(o):
    return o if isinstance(o, tuple) else (o,)


def grads_of(outs, inputs, upstream):
    """torch.autograd.grad of outputs (upstream None = output unused) w.r.t. inputs (None for unused)."""
    pairs = [(o, g) for o, g in zip(as_tuple(outs), upstream) if g is not None]
    return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)


# ------------------------------------------------------------ op table
# A case is a dict: fn (adapter), fwd (functional forward; its name picks the
# reference), bwd (functional backward: (upstream grads, inputs, params) -> grads),
# oracle (pure-torch forward), args (input tensors, all differentiable, the op spec's inputs:
# harness.spec_inputs), params.
_SCALES = {"sinkhorn_knopp": {"logits": 3.0}, "mhc_pre_op": {"h_res_raw": 3.0}, "mhc_coeffs": {"bias": 0.1}}
_DT_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _case_fns(name, num_iters):
    """(adapter, functional forward, oracle, params, functional backward) of op ``name``."""
    sk = dict(num_iters=num_iters, eps=1e-8)
    return {
        "sinkhorn_knopp": (mt.sinkhorn_knopp, m.sinkhorn_knopp_fwd, sinkhorn_reference, sk,
                           lambda gs, a, p: m.sinkhorn_knopp_bwd(gs[0], a[0], **p)),
        "rmsnorm": (mt.rmsnorm, m.rmsnorm_fwd, t_rmsnorm, dict(eps=1e-5),
                    lambda gs, a, p: m.rmsnorm_bwd(gs[0], a[0], p["eps"], a[1] if len(a) > 1 else None)),
        "stream_mix": (mt.stream_mix, m.stream_mix_fwd, t_mix, {}, lambda gs, a, p: m.stream_mix_bwd(gs[0], *a)),
        "stream_aggregate": (mt.stream_aggregate, m.stream_aggregate_fwd, t_aggregate, {},
                             lambda gs, a, p: m.stream_aggregate_bwd(gs[0], *a)),
        "stream_distribute": (mt.stream_distribute, m.stream_distribute_fwd, t_distribute, {},
                              lambda gs, a, p: m.stream_distribute_bwd(gs[0], *a)),
        "mhc_post_op": (mt.mhc_post_op, m.mhc_post_op_fwd, t_post, {},
                        lambda gs, a, p: m.mhc_post_op_bwd(gs[0], *a)),
        "mhc_pre_op": (mt.mhc_pre_op, m.mhc_pre_op_fwd, t_pre, sk, lambda gs, a, p: m.mhc_pre_op_bwd(*gs, *a, **p)),
        "mhc_coeffs": (mt.mhc_coeffs, m.mhc_coeffs_fwd, t_coeffs, dict(eps=1e-5),
                       lambda gs, a, p: m.mhc_coeffs_bwd(*gs, *a, **p)),
    }[name]


def case(name, rng, lead, n, C, dtype=torch.float32, shared=False, num_iters=20, weight=True):
    fn, fwd, oracle, params, bwd = _case_fns(name, num_iters)
    cols = n * C if name == "rmsnorm" else C  # RMSNorm of vec(x), as the mHC paper normalises it
    arrays = spec_inputs(name, rng, tuple(lead), n, cols, _DT_NAME[dtype], _SCALES.get(name), shared,
                         () if weight else ("weight",))
    args = [torch.from_numpy(a.astype(np.float32)).to(dtype if a.dtype == NP_DTYPES[_DT_NAME[dtype]] else torch.float32)
            .requires_grad_() for a in arrays.values()]
    return dict(fn=fn, fwd=fwd, oracle=oracle, args=args, params=params, bwd=bwd, weight_kw=name == "rmsnorm")


def call(c, args=None, fn=None):
    """Call the adapter (or ``fn``) with the case's tensors (rmsnorm's weight as keyword) and params."""
    args = c["args"] if args is None else args
    fn = c["fn"] if fn is None else fn
    if c.get("weight_kw"):
        return fn(args[0], weight=args[1] if len(args) > 1 else None, **c["params"])
    return fn(*args, **c["params"])


def upstream_like(rng, outs):
    return [tensor(rng, o.shape, dtype=o.dtype, grad=False) for o in as_tuple(outs)]


OPS = ["sinkhorn_knopp", "rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op", "mhc_pre_op",
       "mhc_coeffs"]


# ------------------------------------------------------------------ forward / backward
@pytest.mark.parametrize("lead,n,C", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_forward_and_backward(rng, op, lead, n, C):
    c = case(op, rng, lead, n, C)
    args = c["args"]
    outs = as_tuple(call(c))
    # forward vs the float64 reference (one rounding to the output dtype)
    refs = as_tuple(call(c, [f64(a) for a in args], fn=getattr(R, c["fwd"].__name__)))
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.device == args[0].device and o.is_contiguous()
        assert_close(o, r, ROUNDING[o.dtype], f"{op} output {i}")
    # backward via autograd
    gs = upstream_like(rng, outs)
    got = grads_of(outs, args, gs)
    # ... equals the functional *_bwd bitwise
    want = as_tuple(c["bwd"](gs, [a.detach() for a in args], c["params"]))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{op} grad {i} vs functional bwd")
        assert g.dtype == args[i].dtype  # activation grads in the activation dtype, coefficients float32
    # ... and float64 torch autograd of the pure-torch forward
    a64 = [leaf64(a) for a in args]
    o64 = as_tuple(call(c, a64, fn=c["oracle"]))
    ref = grads_of(o64, a64, [g.to(torch.float64) for g in gs])
    for i, (o, r) in enumerate(zip(outs, o64)):
        assert_close(o, r, ROUNDING[o.dtype], f"{op} output {i} vs torch float64")
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, ROUNDING[g.dtype], f"{op} grad {i} vs torch float64 autograd")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("op", ["stream_aggregate", "stream_distribute"])
def test_shared_h(rng, op, shared):
    """h shared by all tokens ([n]): dh summed over tokens."""
    c = case(op, rng, (2, 3), 4, 33, shared=shared)
    outs = call(c)
    gs = upstream_like(rng, outs)
    got = grads_of(outs, c["args"], gs)
    a64 = [leaf64(a) for a in c["args"]]
    ref = grads_of(c["oracle"](*a64), a64, [g.double() for g in gs])
    assert got[1].shape == c["args"][1].shape
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, ROUNDING[g.dtype], f"{op} grad {i}")


@pytest.mark.parametrize("weight", [False, True])
def test_rmsnorm_weight(rng, weight):
    """With a weight (an nn.Parameter) rmsnorm returns dx and dweight; without, dx only."""
    x = tensor(rng, (2, 3, 33))
    w = torch.nn.Parameter(tensor(rng, (33,), grad=False)) if weight else None
    out = mt.rmsnorm(x, eps=1e-2, weight=w)
    g = tensor(rng, out.shape, grad=False)
    out.backward(g)
    want = m.rmsnorm_bwd(g, x.detach(), 1e-2, None if w is None else w.detach())
    assert_same(x.grad, want[0] if weight else want)
    if weight:
        assert_same(w.grad, want[1])
    x64 = leaf64(x)
    w64 = None if w is None else leaf64(w)
    t_rmsnorm(x64, 1e-2, w64).backward(g.double())
    assert_close(x.grad, x64.grad, ROUNDING[torch.float32])
    if weight:
        assert_close(w.grad, w64.grad, ROUNDING[torch.float32])


@pytest.mark.parametrize("num_iters", [0, 1, 3, 20])
@pytest.mark.parametrize("grad_mode", ["unrolled", "implicit"])
def test_sinkhorn_grad_modes(rng, num_iters, grad_mode):
    L = tensor(rng, (3, 4, 4), scale=3.0)
    P = mt.sinkhorn_knopp(L, num_iters=num_iters, grad_mode=grad_mode)
    g = tensor(rng, P.shape, grad=False)
    (dL,) = torch.autograd.grad(P, L, g)
    assert_same(dL, m.sinkhorn_knopp_bwd(g, L.detach(), num_iters, 1e-8, grad_mode))
    assert float(dL.sum(-1).abs().max()) <= 1e-5 * float(dL.abs().max() + 1e-30), "rows of d_logits sum to 0"
    if grad_mode == "unrolled":
        L64 = leaf64(L)
        (r,) = torch.autograd.grad(sinkhorn_reference(L64, num_iters), L64, g.double())
        assert_close(dL, r, ROUNDING[torch.float32])


def test_sinkhorn_large_logits(rng):
    """Logits beyond exp's float32 range (~88): the row-max shift keeps everything finite."""
    L = tensor(rng, (2, 4, 4), scale=100.0)
    P = mt.sinkhorn_knopp(L)
    g = tensor(rng, P.shape, grad=False)
    (dL,) = torch.autograd.grad(P, L, g)
    assert torch.isfinite(P).all() and torch.isfinite(dL).all()
    L64 = leaf64(L)
    P64 = sinkhorn_reference(L64)
    (r,) = torch.autograd.grad(P64, L64, g.double())
    assert_close(P, P64, ROUNDING[torch.float32])
    assert_close(dL, r, 1e-5)  # near-one-hot P: tiny gradients, compare at the scale of the largest


# ------------------------------------------------------------------ finite differences
def _directional_fd(c, rng, h):
    """Central difference of L = <G, f(inputs)> along a random direction, float32 inputs.

    Returns (fd, analytic, noise_bound).  The perturbed inputs are rounded to
    float32, so the analytic side uses the actual perturbation (xp - xm) / 2.
    The two loss evaluations differ from exact by the float32 rounding of each
    output element: |G_k f_k| 2^-24 per element, per evaluation.
    """
    args = [a.detach() for a in c["args"]]
    outs = as_tuple(call(c, [a.clone().requires_grad_() for a in args]))
    G = [tensor(rng, o.shape, grad=False) for o in outs]
    leaves = [a.clone().requires_grad_() for a in args]
    grads = grads_of(call(c, leaves), leaves, G)
    dirs = [torch.from_numpy(rng.standard_normal(a.shape)).to(a.dtype) * float(a.abs().max()) for a in args]
    xp = [a + h * d for a, d in zip(args, dirs)]
    xm = [a - h * d for a, d in zip(args, dirs)]

    def loss(xs):
        with torch.no_grad():
            os_ = as_tuple(call(c, xs))
        val = sum(float((g.double() * o.double()).sum()) for g, o in zip(G, os_))
        noise = sum(float((g.double() * o.double()).abs().sum()) for g, o in zip(G, os_)) * 2.0**-24
        return val, noise

    lp, np_ = loss(xp)
    lm, nm = loss(xm)
    fd = (lp - lm) / 2
    an = sum(float((g.double() * (p.double() - q.double())).sum()) / 2 for g, p, q in zip(grads, xp, xm))
    return fd, an, (np_ + nm) / 2


@pytest.mark.parametrize("op", OPS)
def test_finite_differences(rng, op):
    """float32 central differences along a random direction.

    Error budget: the float32 rounding of the two loss evaluations (computed
    bound) plus the O(h^2) truncation of the nonlinear ops (sigmoid, rsqrt,
    Sinkhorn): with h = 1e-3 of each input's scale, a relative 1e-4 of the
    directional derivative is a generous bound; for the bilinear ops
    (mix, aggregate, distribute, post) the central difference is exact.
    """
    c = case(op, rng, (2, 3), 4, 33)
    fd, an, noise = _directional_fd(c, rng, 1e-3)
    assert abs(fd - an) <= 2 * noise + 1e-4 * abs(an) + 1e-12, (fd, an, noise)


# ------------------------------------------------------------------ None / unused outputs
@pytest.mark.parametrize("used", [(0,), (1,), (3,), (0, 2), (1, 2, 3)])
def test_pre_op_unused_outputs(rng, monkeypatch, used):
    """Only some pre-op outputs feed the loss: the others' gradients arrive as None = zero."""
    c = case("mhc_pre_op", rng, (2, 3), 4, 7)
    args = c["args"]
    seen = []
    real = m._dispatch._plan

    def spy(planner, infos, params):  # the planner of every kernel call (looked up at each call)
        if planner is SPECS["mhc_pre_op_bwd"].planner:
            seen.append(tuple(infos[k] is None for k in ("grad_layer_in", "grad_H_pre", "grad_H_post", "grad_H_res")))
        return real(planner, infos, params)

    monkeypatch.setattr(m._dispatch, "_plan", spy)
    outs = mt.mhc_pre_op(*args)
    gs = [tensor(rng, o.shape, dtype=o.dtype, grad=False) if i in used else None for i, o in enumerate(outs)]
    got = grads_of(outs, args, gs)
    assert seen == [tuple(i not in used for i in range(4))], "unused outputs must reach the backward as None"
    want = m.mhc_pre_op_bwd(*gs, *[a.detach() for a in args], num_iters=20, eps=1e-8)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"grad {i}")
    if 3 not in used:
        assert not got[3].any(), "H_res unused: d h_res_raw is exactly zero"
    a64 = [leaf64(a) for a in args]
    ref = grads_of(t_pre(*a64), a64, [None if g is None else g.double() for g in gs])
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, torch.zeros_like(g, dtype=torch.float64) if r is None else r, ROUNDING[g.dtype], f"grad {i}")


def test_noncontiguous_upstream_gradient(rng):
    """An expanded (stride-0) incoming gradient gives the same result as its contiguous copy."""
    x = tensor(rng, (3, 4, 33))
    M = tensor(rng, (3, 4, 4))
    out = mt.stream_mix(x, M)
    g = tensor(rng, (33,), grad=False).expand(out.shape)
    got = torch.autograd.grad(out, (x, M), g)
    want = m.stream_mix_bwd(g.contiguous(), x.detach(), M.detach())
    for a, b in zip(got, want):
        assert_same(a, b)


@pytest.mark.parametrize("op", OPS)
def test_zero_tokens(rng, op):
    """A zero-size leading dim: empty outputs of the right shape, empty (or zero) gradients."""
    c = case(op, rng, (0, 3), 4, 7)
    outs = as_tuple(call(c))
    refs = as_tuple(call(c, [f64(a) for a in c["args"]], fn=getattr(R, c["fwd"].__name__)))
    for o, r in zip(outs, refs):
        assert tuple(o.shape) == r.shape
    got = grads_of(outs, c["args"], upstream_like(rng, outs))
    for g, a in zip(got, c["args"]):
        assert g.shape == a.shape and not g.any()


def test_eager_route_bypasses_the_dispatcher(rng):
    """Eager calls build the adapter's own autograd.Function, not the custom op's generated one."""
    c = case("mhc_pre_op", rng, (3,), 4, 7)
    eager = call(c)[0]
    via_op = torch.ops.mhc_cupy.mhc_pre_op_fwd(*c["args"], 20, 1e-8, "unrolled")[0]
    assert type(eager.grad_fn).__name__.startswith("_mhc_pre_op_function"), type(eager.grad_fn).__name__
    assert "GeneratedBackwardFor_mhc_cupy_mhc_pre_op_fwd" in type(via_op.grad_fn).__name__


def test_no_grad_fast_path(rng):
    """Without grad the functional API is called directly: same values, no graph."""
    c = case("mhc_post_op", rng, (2, 3), 4, 7)
    with_grad = call(c)
    with torch.no_grad():
        without = call(c)
    assert without.grad_fn is None and not without.requires_grad
    assert_same(with_grad.detach(), without)


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op",
                                "mhc_pre_op"])
def test_half_precision_on_cpu(rng, op, dtype):
    """bf16 / f16 activations on CPU: outputs and activation gradients keep the dtype."""
    c = case(op, rng, (2, 3), 4, 33, dtype=dtype)
    args = c["args"]
    outs = as_tuple(call(c))
    assert outs[0].dtype == dtype and all(o.dtype == torch.float32 for o in outs[1:])
    refs = as_tuple(call(c, [f64(a) for a in args], fn=getattr(R, c["fwd"].__name__)))
    for o, r in zip(outs, refs):
        assert_close(o, r, ROUNDING[o.dtype])
    gs = upstream_like(rng, outs)
    got = grads_of(outs, args, gs)
    a64 = [leaf64(a) for a in args]
    ref = grads_of(call(c, a64, fn=c["oracle"]), a64, [g.double() for g in gs])
    for a, g, r in zip(args, got, ref):
        assert g.dtype == a.dtype
        assert_close(g, r, ROUNDING[g.dtype])


@pytest.mark.parametrize("op", ["stream_mix", "rmsnorm", "mhc_pre_op"])
def test_errors(rng, op):
    """The functional API's TypeError / ValueError come through unchanged."""
    c = case(op, rng, (3,), 4, 7)
    bad = [a.detach().double() if i == 0 else a for i, a in enumerate(c["args"])]
    with pytest.raises(TypeError, match="float64"):
        call(c, bad)
    if op == "stream_mix":
        with pytest.raises(ValueError, match="M has shape"):
            mt.stream_mix(c["args"][0], c["args"][1][:2])
    if op == "mhc_pre_op":
        with pytest.raises(ValueError, match="grad_mode"):
            mt.mhc_pre_op(*c["args"], grad_mode="exact")


# ------------------------------------------------------------------ import order (mhc_cupy must not import torch)
@pytest.mark.parametrize("first", ["mhc_cupy.torch", "torch"])
def test_import_order(first):
    """``import mhc_cupy.torch`` binds mhc_cupy.torch; the real torch must stay intact either way."""
    second = "torch" if first == "mhc_cupy.torch" else "mhc_cupy.torch"
    code = (f"import {first}\nimport {second}\nimport torch\nimport mhc_cupy\n"
            "assert torch.bfloat16 is not None and torch.__name__ == 'torch'\n"
            "assert mhc_cupy.torch.__name__ == 'mhc_cupy.torch'\n"
            "assert 'torch' not in vars(mhc_cupy) or vars(mhc_cupy)['torch'] is mhc_cupy.torch\n"
            "import mhc_cupy.torch as mt\n"
            "x = torch.ones(2, 3, dtype=torch.bfloat16)\n"
            "assert mt.rmsnorm(x).dtype == torch.bfloat16\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


def _package_imports(path):
    """Modules of mhc_cupy that ``path`` imports anywhere (also inside functions), as dotted names."""
    import ast

    pkg = "mhc_cupy." + ".".join(path.relative_to(REPO / "mhc_cupy").with_suffix("").parts)
    pkg = pkg[: -len(".__init__")] if pkg.endswith(".__init__") else pkg.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            found.update({base} | {f"{base}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {f for f in found if f.startswith("mhc_cupy")}


def test_torch_package_has_no_import_circle():
    """functions <- layers <- reference, one way: no module of mhc_cupy.torch imports one above it."""
    order = ["functions", "layers", "reference"]
    for i, name in enumerate(order):
        imported = _package_imports(REPO / "mhc_cupy" / "torch" / f"{name}.py")
        above = {f"mhc_cupy.torch.{m}" for m in order[i + 1:]} | {"mhc_cupy.torch", "mhc_cupy.layers"}
        assert not imported & above, f"mhc_cupy.torch.{name} imports {sorted(imported & above)}"
    assert not _package_imports(REPO / "mhc_cupy" / "torch" / "__init__.py") & {"mhc_cupy.torch.reference",
                                                                               "mhc_cupy.layers"}


def test_old_import_paths_are_the_same_objects():
    """mhc_cupy.layers (the old home of the layer and the oracles) names the same objects."""
    import mhc_cupy.layers as old
    from mhc_cupy.torch import reference

    for name in old.__all__:
        new = getattr(reference, name, None) or getattr(mt, name)
        assert getattr(old, name) is new, name


# ------------------------------------------------------------------ second order
def _double_backward(outs, args):
    """First-order gradients with create_graph=True, then a backward through them."""
    loss = sum((o.float() ** 2).sum() for o in as_tuple(outs)) + sum((a.float() ** 3).sum() for a in args)
    grads = torch.autograd.grad(loss, args, create_graph=True)
    sum(g.float().sum() for g in grads).backward()


@pytest.mark.parametrize("op", OPS + ["rmsnorm_no_weight"])
def test_double_backward_raises(rng, op):
    """The eager backward runs on raw pointers (no graph): a second-order
    gradient through it must raise, never silently treat it as a constant."""
    if op == "mhc_coeffs":
        n, C = 4, 7
        args = [tensor(rng, (3, n, C)), tensor(rng, (n * C, n * n + 2 * n), scale=0.1), tensor(rng, (3,)),
                tensor(rng, (n * n + 2 * n,))]
        outs = mt.mhc_coeffs(*args)
    else:
        c = case(op.replace("_no_weight", ""), rng, (3,), 4, 7, weight=op == "rmsnorm")
        args, outs = c["args"], call(c)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        _double_backward(outs, args)


@pytest.mark.parametrize("op", OPS)
def test_double_backward_raises_from_a_linear_loss(rng, op):
    """create_graph=True from a loss linear in the outputs (out.sum(), how a gradient penalty
    starts): no incoming gradient requires grad, yet the gradients depend on the inputs
    (stream_mix's dx = M^T g on M).  A backward through them must raise, not treat them as
    constants (torch's once_differentiable did: the penalty's gradient silently dropped)."""
    c = case(op, rng, (3,), 4, 7)
    args = c["args"]
    loss = sum(o.float().sum() for o in as_tuple(call(c)))
    grads = torch.autograd.grad(loss, args, create_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        sum(g.float().square().sum() for g in grads if g is not None).backward()


@pytest.mark.parametrize("op", OPS)
def test_second_order_w_r_t_inputs_raises(rng, op):
    """torch.autograd.grad of first-order gradients w.r.t. given inputs (what
    torch.autograd.functional.jvp / hvp / vhp / hessian do) runs only the nodes on a path to
    them: the node that refuses double backward must be on it.  It was attached to detached
    copies only, so it never ran and the second-order gradient came back None (zeros from
    torch.autograd.functional), silently."""
    c = case(op, rng, (3,), 4, 7)
    args = c["args"]
    loss = sum((o.float() ** 2).sum() for o in as_tuple(call(c)))
    grads = [g for g in torch.autograd.grad(loss, args, create_graph=True, allow_unused=True) if g is not None]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(sum(g.float().sum() for g in grads), args, allow_unused=True)
    plain = [a.detach() for a in args]
    with pytest.raises(RuntimeError, match="once_differentiable"):  # was: zeros
        torch.autograd.functional.jvp(lambda *a: call(c, list(a)), tuple(plain), tuple(map(torch.ones_like, plain)))


@pytest.mark.parametrize("n", [3, 5])  # the fused layer pieces: g, or the post op's dx, along x_link
def test_second_order_through_the_layer_and_head_raises(rng, n):
    layer = mt.MHC(7, n, sublayer=torch.nn.Linear(7, 7), alpha_init=0.5)
    head = mt.MHCHead(7, n, scale_init=0.5)
    x = tensor(rng, (3, n, 7), grad=False)
    for f in (layer, head):
        with pytest.raises(RuntimeError, match="once_differentiable"):  # was: zeros
            torch.autograd.functional.jvp(f, x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="once_differentiable"):
            torch.autograd.functional.hessian(lambda t: f(t).square().sum(), x[:1])
        (gx,) = torch.autograd.grad(f(x.requires_grad_()).square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            torch.autograd.grad(gx.sum(), list(f.parameters())[:1], allow_unused=True)
        x = x.detach()


def test_double_backward_raises_issue_repro(rng):
    x = tensor(rng, (3, 4, 7))
    M = tensor(rng, (3, 4, 4), grad=False)
    (g,) = torch.autograd.grad((mt.stream_mix(x, M) ** 2).sum() + (x**3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


# ------------------------------------------------------------------ negative views
def test_negative_view_read_as_its_values(rng):
    """A tensor with the negative bit (z.conj().imag: its memory holds -v) went through DLPack, which
    ignores the bit, and the op computed on -v: every output's sign silently wrong.  Its values are
    used (resolve_neg), by the functional API and the differentiable ops."""
    z = torch.complex(tensor(rng, (3, 4, 7), grad=False), tensor(rng, (3, 4, 7), grad=False))
    x = z.conj().imag  # == -z.imag, a view with the negative bit
    assert x.is_neg()
    M = tensor(rng, (3, 4, 4), grad=False)
    want = m.stream_mix_fwd(x.resolve_neg(), M)
    torch.testing.assert_close(m.stream_mix_fwd(x, M), want, rtol=0, atol=0)
    torch.testing.assert_close(mt.stream_mix(x, M), want, rtol=0, atol=0)
    Mg = M.clone().requires_grad_()
    mt.stream_mix(x, Mg).sum().backward()  # dM = sum_c g x: x's sign again
    Mr = M.clone().requires_grad_()
    mt.stream_mix(x.resolve_neg(), Mr).sum().backward()
    torch.testing.assert_close(Mg.grad, Mr.grad, rtol=0, atol=0)


class _UserTensor(torch.Tensor):
    """A torch.Tensor subclass defined outside torch (as libraries and users define them)."""


def test_tensor_subclass_is_a_torch_tensor(rng, monkeypatch):
    """A torch.Tensor subclass from another module was read as a generic DLPack producer: outputs came
    back as NumPy, a negative-bit view was read as its memory (every value's sign silently wrong) and a
    tensor that requires grad raised torch's BufferError. It is a torch tensor like any other."""
    x = tensor(rng, (3, 4, 7), grad=False)
    M = tensor(rng, (3, 4, 4), grad=False)
    want = m.stream_mix_fwd(x, M)
    out = m.stream_mix_fwd(x.as_subclass(_UserTensor), M)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(torch.as_tensor(out), want, rtol=0, atol=0)
    z = torch.complex(x, x)
    neg = z.conj().imag.as_subclass(_UserTensor)  # logical value -x, the negative bit set
    assert neg.is_neg()
    torch.testing.assert_close(torch.as_tensor(m.stream_mix_fwd(neg, M)), m.stream_mix_fwd(-x, M), rtol=0, atol=0)
    from mhc_cupy import _dispatch

    monkeypatch.setattr(_dispatch, "_autograd_warned", set())
    with pytest.warns(m.AutogradNotRecordedWarning):
        out = m.stream_mix_fwd(x.clone().requires_grad_().as_subclass(_UserTensor), M)
    torch.testing.assert_close(torch.as_tensor(out).detach(), want, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")
def test_functional_non_strided_tensor_names_the_argument(rng):
    """A sparse, MKL-DNN or nested tensor has no pointer and strides to read: the functional API raised
    torch's BufferError ("Can't export tensors with layout other than torch.strided") or a RuntimeError
    ("Internal error: NestedTensorImpl doesn't support sizes"), naming no argument."""
    x = tensor(rng, (3, 4, 7), grad=False)
    M = tensor(rng, (3, 4, 4), grad=False)
    for bad, what in ((x.to_sparse(), "layout torch.sparse_coo"), (x.to_mkldnn(), "layout torch._mkldnn"),
                      (torch.nested.nested_tensor([x[0], x[1]]), "a nested tensor")):
        with pytest.raises(TypeError, match=rf"^x is .*{what}.*dense \(torch.strided\)"):
            m.stream_mix_fwd(bad, M)
    with pytest.raises(TypeError, match=r"^M is .*layout torch.sparse_csr"):
        m.stream_mix_fwd(x[0], M[0].to_sparse_csr())


# ------------------------------------------------------------------ functional API and autograd
@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which ops already warned (the warning is once per op and process)."""
    from mhc_cupy import _dispatch

    monkeypatch.setattr(_dispatch, "_autograd_warned", set())


@pytest.mark.parametrize("op", OPS)
def test_functional_api_warns_once_per_op(rng, fresh_warnings, op):
    """The functional API records no graph: tensors that require grad give one
    AutogradNotRecordedWarning per op, naming the op and its mhc_cupy.torch twin."""
    c = case(op, rng, (3,), 4, 7)
    args, fwd = c["args"], c["fwd"]
    with pytest.warns(m.AutogradNotRecordedWarning, match=rf"mhc_cupy\.{fwd.__name__} .*mhc_cupy\.torch\.{op} "):
        outs = as_tuple(call(c, fn=fwd))
    assert all(o.grad_fn is None for o in outs)
    gs = upstream_like(rng, outs)
    with pytest.warns(m.AutogradNotRecordedWarning, match=rf"mhc_cupy\.{op}_bwd "):
        c["bwd"](gs, args, c["params"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(c, fn=fwd)  # once per op
        c["bwd"](gs, args, c["params"])


@pytest.mark.parametrize("op", OPS)
def test_functional_api_no_warning_without_grad(rng, fresh_warnings, op):
    """No warning under torch.no_grad, for detached tensors, or from the adapter (eager and custom-op routes)."""
    c = case(op, rng, (3,), 4, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            call(c, fn=c["fwd"])
        call(c, [a.detach() for a in c["args"]], fn=c["fwd"])
        outs = as_tuple(call(c))
        grads_of(outs, c["args"], upstream_like(rng, outs))
        if op != "rmsnorm":  # the custom op, its non-tensor arguments by name from its schema
            custom = getattr(torch.ops.mhc_cupy, f"{op}_fwd")
            extra = [c["params"].get(a.name, "unrolled" if a.name == "grad_mode" else a.default_value)
                     for a in custom.default._schema.arguments[len(c["args"]):]]
            outs = as_tuple(custom(*c["args"], *extra))
            grads_of(outs, c["args"], upstream_like(rng, outs))


def test_functional_docstrings_point_at_the_adapter():
    differentiable = {"mhc_boundary_fwd": "mhc_cupy.torch.MHCStack",  # (a module fuses it, no function)
                      "mhc_boundary_bwd": "mhc_cupy.torch.MHCStack",
                      "mhc_layer_pre_norm_fwd": "mhc_cupy.torch.mhc_layer_pre",  # (inference: no gradient;
                      "mhc_layer_pre_fp8_fwd": "mhc_cupy.torch.mhc_layer_pre"}   # to train, the layer piece)
    for name in m.__all__:
        if name.endswith(("_fwd", "_bwd")):
            doc = getattr(m, name).__doc__
            adapter = differentiable.get(name, f"mhc_cupy.torch.{name[:-4]}")
            assert "AutogradNotRecordedWarning" in doc and adapter in doc, name


@pytest.mark.parametrize("op", OPS)
def test_none_or_list_names_the_argument(rng, op):
    """None or a list for a tensor: a TypeError naming the argument (not torch's schema RuntimeError)."""
    import inspect

    c = case(op, rng, (3,), 4, 7, weight=False)
    names = list(inspect.signature(c["fn"]).parameters)
    for i, a in enumerate(c["args"]):
        for bad in (None, a.detach().tolist()):
            args = list(c["args"])
            args[i] = bad
            with pytest.raises(TypeError, match=rf"^{names[i]}\b"):
                call(c, args)


def test_num_iters_bounded(rng):
    L = tensor(rng, (3, 4, 4))
    with pytest.raises(ValueError, match="num_iters must be in 0..10000"):
        mt.sinkhorn_knopp(L, num_iters=10_001)
    with pytest.raises(TypeError, match="num_iters must be an int"):
        mt.sinkhorn_knopp(L, num_iters=True)


def test_eager_apply_skips_the_python_prologue_and_records_the_graph():
    """The eager route calls the C++ apply of its autograd.Functions (Function.apply's Python prologue
    is for transforms and setup_context-style Functions, neither of which reaches it): the graph is
    recorded all the same, and on this torch the prologue really is skipped."""
    from mhc_cupy.torch import _factory

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    apply = _factory.eager_apply(Double)
    assert type(apply).__name__ == "builtin_function_or_method" and apply.__self__ is Double  # the C++ apply
    assert type(Double.apply).__name__ == "method"  # Function.apply: Python
    a = torch.randn(3, requires_grad=True)
    out = apply(a)
    assert type(out.grad_fn).__name__ == "DoubleBackward"
    out.sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 2.0))


def test_mhc_init_values_named_as_the_constructor_takes_them():
    """MHC's res_diag_init outside [1/n, 1) is a ValueError naming res_diag_init (it named
    identity_bias's res_diag), and a non-real pre_init / post_init / res_diag_init a TypeError naming
    it (it was Python's "'<=' not supported between instances of 'float' and 'str'"); n = 1 ignores
    res_diag_init as identity_bias does; NumPy reals are taken; the default init is unchanged."""
    with pytest.raises(ValueError, match=r"res_diag_init .* \[1/n, 1\) = \[0.25, 1\) for n_streams = 4, got 0.1"):
        mt.MHC(8, 4, res_diag_init=0.1)
    with pytest.raises(ValueError, match=r"res_diag_init .*got 1.0"):
        mt.MHC(8, 4, res_diag_init=1.0)
    for name in ("pre_init", "post_init", "res_diag_init"):
        with pytest.raises(TypeError, match=rf"^{name} must be a float, got str 'a'"):
            mt.MHC(8, 4, **{name: "a"})
    assert torch.equal(mt.MHC(8, 1, res_diag_init=0.1).bias, mt.MHC(8, 1).bias)
    got = mt.MHC(8, 4, res_diag_init=np.float32(0.5), pre_init=np.float64(0.3), post_init=1.5).bias
    assert torch.equal(got, mt.identity_bias(4, 0.3, 1.5, 0.5))
    assert torch.equal(mt.MHC(8, 4).bias, mt.identity_bias(4))
