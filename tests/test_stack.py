"""``mhc_cupy.torch.MHCStack``: a sequence of MHC layers with stream recompute (issue: mHC across
the whole network).

* value and gradient equal a chain of the same layers, bitwise, with recompute off, per block of
  L_r layers and "auto"; the chain equals a chain of float64 reference layers (paper convention);
* recompute keeps the streams of block boundaries only (the others are freed after the forward)
  and rebuilds them in backward; a second backward (retain_graph) gives the same gradients;
* under torch.no_grad() the stack saves nothing; bad input raises errors naming the argument.

CPU tensors run the NumPy reference; the GPU variant at the end runs the kernels.
"""

from __future__ import annotations

import gc
import itertools
import sys
import warnings
import weakref

import pytest
import torch
from torch import nn

from harness import TOL, assert_close, count_calls, default_dtype

import mhc_cupy.torch as mt
from mhc_cupy.torch.reference import MHCReference


@pytest.fixture(autouse=True)
def _float32_default():
    with default_dtype(torch.float32):
        yield


class Mlp(nn.Module):
    """A pre-norm MLP sublayer that also takes an extra forward argument."""

    def __init__(self, C):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.Linear(2 * C, C)

    def forward(self, h, scale=1.0):
        return scale * self.down(torch.tanh(self.up(self.norm(h))))


def make_layers(L, n, C, seed, convention="paper", sublayer=True):
    """L MHC layers with coefficients moved away from their init (logits of scale ~1)."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(L):
        layer = mt.MHC(C, n, Mlp(C) if sublayer else None, alpha_init=1.0, convention=convention)
        with torch.no_grad():
            layer.bias.add_(torch.randn_like(layer.bias))
            layer.alpha.copy_(torch.tensor([0.5, 1.0, 1.5]))
        layers.append(layer)
    return layers


def run(module, x, g, *args, **kwargs):
    """(out, dx, parameter gradients) of module(x) with output gradient g."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x, *args, **kwargs)
    out.backward(g)
    return out.detach(), x.grad, [p.grad for p in module.parameters()]


def assert_bitwise(a, b, what):
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = a, b
    assert torch.equal(out_a, out_b), f"{what}: out"
    assert torch.equal(dx_a, dx_b), f"{what}: dx"
    assert len(grads_a) == len(grads_b)
    for i, (p, q) in enumerate(zip(grads_a, grads_b)):
        assert (p is None) == (q is None) and (p is None or torch.equal(p, q)), f"{what}: grad of parameter {i}"


CASES = [  # (lead, n, C, L)
    ((1,), 1, 5, 1), ((3,), 2, 8, 2), ((2, 3), 4, 7, 3), ((127,), 4, 16, 5), ((3,), 5, 3, 4),
    ((2,), 8, 9, 5), ((1,), 16, 4, 3), ((2,), 4, 6, 8),
]


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("lead,n,C,L", CASES)
def test_stack_equals_the_chain_bitwise_with_and_without_recompute(rng, lead, n, C, L, convention):
    layers = make_layers(L, n, C, int(rng.integers(1 << 30)), convention)
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    chain = nn.Sequential(*layers)
    want = run(chain, x, g)
    for recompute in (None, 1, 2, 3, "auto", L + 2):
        stack = mt.MHCStack(layers, recompute=recompute)
        assert_bitwise(run(stack, x, g), want, f"recompute={recompute!r}")


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("lead,n,C,L", CASES)
def test_stack_matches_a_chain_of_float64_reference_layers(rng, lead, n, C, L, fuse):
    layers = make_layers(L, n, C, int(rng.integers(1 << 30)))
    refs = nn.Sequential(*(MHCReference.from_layer(layer) for layer in layers)).double()
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    out, dx, grads = run(mt.MHCStack(layers, recompute=2, fuse_boundaries=fuse), x, g)
    out_ref, dx_ref, grads_ref = run(refs, x.double(), g.double())
    # one layer's bound per layer (errors compound over the chain), times 4: over 120 seeds per case the
    # worst error / (bound without the 4) was 1.2 (n 1, C 5), 0.47 (n 16), 0.42 (n 5, C 3); the layers'
    # weights come from torch's RNG, whose numbers differ between torch versions (torch 2.11 gave
    # [lead4-5-3-4-True] data past the bound without the 4)
    tol = TOL["float32_layer"].value * L * 4
    assert_close(out, out_ref, tol, "out")
    assert_close(dx, dx_ref, tol, "dx")
    for i, (p, q) in enumerate(zip(grads, grads_ref)):
        assert_close(p, q, tol, f"grad of parameter {i}")


@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("lead,n,C,L", [((3,), 2, 8, 2), ((2, 3), 4, 7, 3), ((127,), 4, 16, 5), ((2,), 8, 9, 4)])
def test_fused_boundaries_equal_the_chain_and_run_the_boundary_op(rng, monkeypatch, lead, n, C, L, recompute):
    """fuse_boundaries=True: layers 1 .. L-1 take their pre piece from the previous layer's residual
    update (mhc_boundary_fwd), none computes it again; on the CPU (float64 references, the streams
    rounded between them as the kernels store them) the values and gradients are the chain's bitwise."""
    from mhc_cupy import reference

    calls = count_calls(monkeypatch, reference, ("mhc_boundary_fwd", "mhc_layer_pre_fwd"))
    layers = make_layers(L, n, C, int(rng.integers(1 << 30)))
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    want = run(nn.Sequential(*layers), x, g)
    calls.update(dict.fromkeys(calls, 0))
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)
    assert_bitwise(run(stack, x, g), want, "fused boundaries")
    assert calls == {"mhc_boundary_fwd": L - 1, "mhc_layer_pre_fwd": 1}, calls
    assert "fuse_boundaries=True" in repr(stack)
    with torch.no_grad():
        assert torch.equal(stack(x), want[0])


@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("lead,n,C,L,convention", [((3,), 1, 8, 2, "paper"), ((2, 3), 4, 7, 3, "deepseek"),
                                                   ((127,), 4, 16, 5, "paper"), ((2,), 8, 9, 4, "paper")])
def test_fused_boundary_backward_equals_the_chain(rng, monkeypatch, lead, n, C, L, convention, recompute):
    """Under the kernel choice boundary_bwd (OPS.md section 12, "Fused boundary backward"), layer l+1's
    pre-piece backward also returns layer l's dy (mhc_boundary_bwd) and layer l's coefficient gradients of
    its residual update come from its own pre-piece backward (layer_out): layer l's residual update runs
    no backward of its own, except the last layer's; for n > 4 (the post op's dx given as grad_x) nothing
    changes.  On the CPU the gradients are the chain's bitwise."""
    from mhc_cupy import _kernel_choice, reference

    names = ("mhc_boundary_bwd", "mhc_layer_pre_bwd", "mhc_post_op_bwd")
    calls = count_calls(monkeypatch, reference, names)
    layers = make_layers(L, n, C, int(rng.integers(1 << 30)), convention)
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    want = run(nn.Sequential(*layers), x, g)
    unfused = dict(calls)
    calls.update(dict.fromkeys(calls, 0))
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        got = run(mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True), x, g)
    assert_bitwise(got, want, "fused boundary backward")
    if n <= 4:  # (mhc_layer_post_bwd is mhc_post_op_bwd's reference; one call per layer in the chain)
        assert unfused == {"mhc_boundary_bwd": 0, "mhc_layer_pre_bwd": L, "mhc_post_op_bwd": L}, unfused
        assert calls == {"mhc_boundary_bwd": L - 1, "mhc_layer_pre_bwd": 1, "mhc_post_op_bwd": 1}, calls
    else:
        assert calls == unfused, calls


@pytest.mark.parametrize("recompute", [None, 2])
def test_fused_boundary_backward_twice_and_after_a_frozen_layer(rng, monkeypatch, recompute):
    """Under boundary_bwd: a second backward through a retained graph hands dy over again (the same
    gradients); a first layer with frozen coefficients whose input needs no gradient (its residual update
    has no pre-piece backward to leave dH to; its sublayer trains) runs its own post-op backward; both
    the unfused stack's bitwise."""
    from mhc_cupy import _kernel_choice, reference

    layers = make_layers(3, 4, 8, 31)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    xg = x.clone().requires_grad_()
    params = [xg, *nn.Sequential(*layers).parameters()]
    want = torch.autograd.grad(nn.Sequential(*layers)(xg), params, g)
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        out = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)(xg)
        for _ in range(2):
            got = torch.autograd.grad(out, params, g, retain_graph=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    for p in (layers[0].phi, layers[0].alpha, layers[0].bias):
        p.requires_grad_(False)
    trained = [p for p in nn.Sequential(*layers).parameters() if p.requires_grad]
    want = torch.autograd.grad(nn.Sequential(*layers)(x), trained, g)
    calls = count_calls(monkeypatch, reference, ("mhc_boundary_bwd", "mhc_post_op_bwd"))
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        got = torch.autograd.grad(mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)(x), trained, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == {"mhc_boundary_bwd": 2, "mhc_post_op_bwd": 2}, calls  # (layer 0's and the last layer's)


def test_fused_boundary_backward_where_a_layer_output_has_another_use(rng, monkeypatch):
    """A layer output also used outside the stack (a forward hook keeps it; the loss reads it): its
    gradient is not the next layer's dx alone, so that layer's residual update runs its own backward
    (no dy handed over): the chain's gradients bitwise."""
    from mhc_cupy import _kernel_choice, reference

    layers = make_layers(3, 4, 8, 21)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float().requires_grad_()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    kept = []
    hook = layers[1].register_forward_hook(lambda m, a, out: kept.append(out))

    def grads(module):
        kept.clear()
        for p in [x, *module.parameters()]:
            p.grad = None
        out = module(x)
        ((out * g).sum() + (kept[0] ** 2).sum()).backward()
        return [x.grad, *(p.grad for p in module.parameters())]

    want = grads(nn.Sequential(*layers))
    calls = count_calls(monkeypatch, reference, ("mhc_boundary_bwd", "mhc_post_op_bwd"))
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        got = grads(mt.MHCStack(layers, fuse_boundaries=True))
    hook.remove()
    assert calls == {"mhc_boundary_bwd": 2, "mhc_post_op_bwd": 2}, calls  # layer 1's update and the last
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("hook", ["tensor", "module"])
def test_fused_boundary_backward_after_a_gradient_changed_in_place(rng, recompute, hook):
    """A backward hook that changes a layer output's gradient in place (gradient clipping, scaling: a
    tensor hook on the output, a module's full backward pre-hook) hands the previous layer's residual
    update the very dx tensor that the next layer's pre piece returned, changed: the dy computed from
    it before the change used to be taken (every gradient wrong); now the update runs its own backward,
    the unfused stack's bitwise."""
    from mhc_cupy import _kernel_choice

    layers = make_layers(3, 4, 8, 23)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    def scale_in_place(m, a, out):
        out.register_hook(lambda d: d.mul_(2))

    if hook == "tensor":
        handle = layers[0].register_forward_hook(scale_in_place)
    else:
        handle = layers[1].register_full_backward_pre_hook(lambda m, go: [d.clamp_(-0.5, 0.5) for d in go] and None)
    want = run(nn.Sequential(*layers), x, g)
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        got = run(mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True), x, g)
    handle.remove()
    assert_bitwise(got, want, f"{hook} hook")


def test_fused_boundary_backward_keeps_nothing_after_the_pass(rng, monkeypatch):
    """A backward that does not reach a layer's residual update (torch.autograd.grad of the last layer's
    parameters only) left the dx and dy handed to it held by the graph (as long as the output lived), and
    a residual update that handed its coefficient gradients to a pre-piece backward that did not run (the
    sublayer's parameters only) left that hand-over standing: a later backward through the retained graph
    whose residual update ran its own backward (the output also used in the loss) then counted them
    twice.  Now whatever a pass hands over is dropped at its end: the unfused stack's bitwise."""
    from mhc_cupy import _kernel_choice
    from mhc_cupy.torch import functions

    made = []

    class Recorded(functions.BoundaryGrad):
        __slots__ = ("__weakref__",)

        def __init__(self, H_post):
            super().__init__(H_post)
            made.append(weakref.ref(self))

    monkeypatch.setattr(functions, "BoundaryGrad", Recorded)
    layers = make_layers(3, 4, 8, 29)
    params = list(nn.Sequential(*layers).parameters())
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float().requires_grad_()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()

    def grads(module):
        kept = []
        hook = layers[0].register_forward_hook(lambda m, a, out: kept.append(out))
        out = module(x)
        hook.remove()
        torch.autograd.grad(out, list(layers[2].parameters()), g, retain_graph=True)
        held = [b for b in (r() for r in made) if b is not None and (b.dx is not None or b.dy is not None)]
        torch.autograd.grad(out, list(layers[0].sublayer.parameters()), g, retain_graph=True)
        return held, torch.autograd.grad((out * g).sum() + (kept[0] ** 2).sum(), [x] + params)

    _, want = grads(nn.Sequential(*layers))
    with _kernel_choice.kernel_choice(boundary_bwd=True):
        held, got = grads(mt.MHCStack(layers, fuse_boundaries=True))
    assert len(made) == 2 and not held, held
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def test_fused_boundary_backward_runs_under_the_choice_of_its_forward(rng, monkeypatch):
    """The backward across the boundaries that a forward under kernel_choice(boundary_bwd=True) set up runs
    its ops under that choice, also where backward runs outside the block: in another thread (CUDA tensors'
    backward runs in autograd's device thread, which does not see the caller's context variables) or after
    it.  Their plans were made under the choice in force there, off: on a GPU they raised
    NotImplementedError ("run only under kernel_choice(boundary_bwd=True)") in every stack backward."""
    import threading

    from mhc_cupy import _dispatch, _kernel_choice
    from mhc_cupy.ops import layer as ops_layer

    planned = []
    monkeypatch.setattr(_dispatch, "_plans", {})  # (planned anew: the cache keys on the choice)

    def current():
        choice = _kernel_choice.current()
        if sys._getframe(1).f_code.co_name != "_plan_post_bwd":  # (that plan reads post_pipe only)
            planned.append(choice.runs("boundary_bwd"))
        return choice

    monkeypatch.setattr(ops_layer, "current_choice", current)
    layers = make_layers(3, 4, 8, 37)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    def chain(backward):  # the chain's gradients, its backward run as the stack's is (a thread's torch ops may
        model = nn.Sequential(*layers)  # split their sums over another number of threads than the caller's)
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = model(xg)
        backward(out)
        return out.detach(), xg.grad, [p.grad for p in model.parameters()]

    def in_a_thread(out):
        thread = threading.Thread(target=out.backward, args=(g,))
        thread.start()
        thread.join()

    want = {"thread": chain(in_a_thread), "after": chain(lambda out: out.backward(g))}
    stack = mt.MHCStack(layers, recompute=2, fuse_boundaries=True)
    for where in ("thread", "after"):
        planned.clear()
        _dispatch._plans.clear()
        stack.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        with _kernel_choice.kernel_choice(boundary_bwd=True):
            out = stack(xg)
        if where == "thread":
            with _kernel_choice.kernel_choice(boundary_bwd=True):
                in_a_thread(out)
        else:
            out.backward(g)
        assert planned == [True] * 3, (where, planned)  # mhc_boundary_bwd twice, mhc_layer_pre_bwd(layer_out)
        assert_bitwise((out.detach(), xg.grad, [p.grad for p in stack.parameters()]), want[where], where)


def test_fused_boundaries_only_between_layers_of_one_convention(rng):
    layers = make_layers(2, 4, 8, 11) + make_layers(1, 4, 8, 12, convention="deepseek")
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    assert_bitwise(run(mt.MHCStack(layers, fuse_boundaries=True), x, g), run(nn.Sequential(*layers), x, g), "mixed")
    with pytest.raises(TypeError, match="fuse_boundaries must be a bool, got int 1"):
        mt.MHCStack(layers, fuse_boundaries=1)


@pytest.mark.parametrize("recompute", [None, 2])
def test_fused_boundary_after_a_frozen_layer_warns_nothing(rng, recompute):
    """A frozen first layer (x needing no gradient) ran the boundary op with the next layer's trainable
    parameters outside autograd and warned AutogradNotRecordedWarning ("backward() will not reach its
    inputs"), though the next layer's pre piece records their gradient: the chain's, bitwise."""
    layers = make_layers(3, 4, 8, 13)
    layers[0].requires_grad_(False)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    want = run(nn.Sequential(*layers), x, g)
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack.zero_grad(set_to_none=True)
        out = stack(x)
        out.backward(g)
    assert torch.equal(out, want[0])
    for p, q in zip([p.grad for p in stack.parameters()], want[2]):
        assert (p is None) == (q is None) and (p is None or torch.equal(p, q))


def test_extra_forward_arguments_reach_every_sublayer(rng):
    layers = make_layers(3, 4, 8, 1)
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    want = run(nn.Sequential(*layers), x, g)  # scale = 1
    got = run(mt.MHCStack(layers, recompute=2), x, g, scale=0.5)
    assert not torch.equal(got[0], want[0])
    chain = lambda x, scale: [x := layer(x, scale=scale) for layer in layers][-1]  # noqa: E731
    x1 = x.clone().requires_grad_()
    out = chain(x1, 0.5)
    out.backward(g)
    assert torch.equal(got[0], out.detach()) and torch.equal(got[1], x1.grad)


def _forward_with_refs(stack, x, outputs: bool = False):
    """(stack(x), weak references to each layer's input streams, or with ``outputs`` its output)."""
    refs = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: refs.append(weakref.ref(out))) if outputs else
             layer.register_forward_pre_hook(lambda mod, args: refs.append(weakref.ref(args[0])))
             for layer in stack.layers]
    try:
        return stack(x), refs
    finally:
        for h in hooks:
            h.remove()


def _streams_alive_after_forward(stack, x):
    """Which layers' input streams are still held (by the autograd graph) after the forward."""
    out, refs = _forward_with_refs(stack, x)
    gc.collect()
    return out, [r() is not None for r in refs]


@pytest.mark.parametrize("L,recompute,boundaries", [(6, None, [0, 1, 2, 3, 4, 5]), (6, 2, [0, 2, 4]), (6, 3, [0, 3]),
                                                    (6, "auto", [0, 3, 5]), (8, "auto", [0, 4, 6, 7]),
                                                    (8, 3, [0, 3, 6])])
def test_recompute_keeps_only_the_block_boundaries(rng, L, recompute, boundaries):
    """After the forward, the graph holds the input streams of boundary layers only (the starts of
    ``stack.blocks``: "auto" at L = 6, n = 4 in blocks of 3, 2, 1 layers, at L = 8 of 4, 2, 1, 1); the
    backward rebuilds the others (bitwise: see above) and frees them again."""
    layers = make_layers(L, 4, 8, 2)
    stack = mt.MHCStack(layers, recompute=recompute)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float().requires_grad_()
    out, alive = _streams_alive_after_forward(stack, x)
    assert [i for i, a in enumerate(alive) if a] == boundaries
    assert list(itertools.accumulate(stack.blocks or [1] * L, initial=0))[:-1] == boundaries
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("recompute,held", [(None, 8), (2, 5), ("auto", 4)])
def test_streams_held_where_the_backward_starts(rng, monkeypatch, recompute, held):
    """When the backward reaches the last layer's sublayer (the top of a model's memory: every sublayer's
    activations still held), the streams [..., n, C] alive: the saved inputs of the boundary layers and the
    streams rebuilt so far.  8 layers, n = 4 (L_r* = 2): blocks of 2 keep layers 0, 2, 4, 6 and rebuild 7;
    "auto" (blocks 4, 2, 1, 1) keeps 0, 4, 6, 7 and rebuilds none."""
    lead, n, C = (5,), 4, 8
    layers = make_layers(8, n, C, 3)
    stack = mt.MHCStack(layers, recompute=recompute)
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float().requires_grad_()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    rebuilt, seen = [], []
    rebuild = mt.stack.mhc_post_op_fwd

    def rebuilding(*args, **kwargs):  # the streams the backward rebuilds
        out = rebuild(*args, **kwargs)
        rebuilt.append(weakref.ref(out))
        return out

    monkeypatch.setattr(mt.stack, "mhc_post_op_fwd", rebuilding)

    def count(module, grad_output):
        gc.collect()
        seen.append(sum(r() is not None for r in inputs + rebuilt))

    hook = layers[-1].sublayer.register_full_backward_pre_hook(count)
    try:
        out, inputs = _forward_with_refs(stack, x)  # (weak references to each layer's input streams)
        out.backward(g)
    finally:
        hook.remove()
    assert seen == [held], seen


@pytest.mark.parametrize("recompute,fuse", [(3, False), (None, True), (3, True)])
def test_streams_that_took_a_freed_outputs_address_are_not_it(rng, monkeypatch, recompute, fuse):
    """The stack knows a layer's output (the next streams of its recompute block; the streams its fused
    next pre piece was computed for) by its key: address, shape, strides, dtype, device, version.  A
    forward hook that replaces the output frees it, and the next tensor of that size may take its
    address and so its key (break-it pass 16: a second hook's o * 2 did, on the CPU now and then):
    backward then rebuilt the freed output for it (recompute), or the next layer took the pre piece of
    the freed output (fused), silently wrong.  Forced here by keys without the address: the layer's output
    counts only while it lives."""
    from mhc_cupy.torch import functions

    def key(t):  # every tensor of one shape, dtype and version alike
        return (tuple(t.shape), t.stride(), t.dtype, t.device, t._version)

    monkeypatch.setattr(mt.stack, "stream_key", key)
    monkeypatch.setattr(functions, "_stream_key", key)
    layers = make_layers(4, 4, 8, 17)
    layers[1].register_forward_hook(lambda mod, args, out: out * 2.0)  # the output freed, another in its place
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    want = run(nn.Sequential(*layers), x, g)
    assert_bitwise(run(mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse), x, g), want, "hooked")


@pytest.mark.parametrize("backward", ["none", "partial", "retain_graph"])
@pytest.mark.parametrize("recompute,fuse", [(2, False), (3, True)])
def test_a_graph_dropped_without_its_full_backward_frees_the_streams(rng, recompute, fuse, backward):
    """A forward whose graph is dropped without a backward through it all (an evaluation with grad mode
    on, a gradient of the last layer's parameters only, a retain_graph backward) frees every layer's
    streams.  Inside a block the pack hook returned the mHC pieces' other saved tensors as they were:
    H_res, an output of the pre piece that saves it, then held its own node (the reference cycle that
    torch.autograd.graph.saved_tensors_hooks warns of), which held the hook and so the block with its
    boundary streams, for good (break-it pass 13)."""
    stack = mt.MHCStack(make_layers(6, 4, 8, 15), recompute=recompute, fuse_boundaries=fuse)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float().requires_grad_()
    out, outputs = _forward_with_refs(stack, x, outputs=True)
    if backward == "partial":
        torch.autograd.grad(out.sum(), [stack[5].phi])
    elif backward == "retain_graph":
        out.sum().backward(retain_graph=True)
    del out
    gc.collect()
    assert [r() is not None for r in outputs] == [False] * 6


def test_no_grad_saves_nothing(rng):
    stack = mt.MHCStack(make_layers(4, 4, 8, 3), recompute=2)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    with torch.no_grad():
        out, alive = _streams_alive_after_forward(stack, x.clone())
    assert out.grad_fn is None and alive[1:] == [False] * 3  # (alive[0]: the argument)
    with torch.no_grad():
        assert torch.equal(out, nn.Sequential(*stack.layers)(x))


def test_second_backward_with_retain_graph_rebuilds_again(rng):
    stack = mt.MHCStack(make_layers(5, 4, 8, 4), recompute=2)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float().requires_grad_()
    out = stack(x)
    (dx1,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    (dx2,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(dx1, dx2)


@pytest.mark.parametrize("recompute,fuse", [(2, False), (3, True)])
def test_backward_with_create_graph_rebuilds_without_a_warning(rng, monkeypatch, recompute, fuse):
    """``torch.autograd.grad(..., create_graph=True)`` runs the backward in grad mode: the rebuild of a
    block's streams from its input (which requires grad) warned AutogradNotRecordedWarning ("backward()
    will not reach its inputs"), which is not so (break-it pass 13).  The first-order gradient is the
    chain's, bitwise; a second-order one raises, as the layers' (first order only)."""
    from mhc_cupy import _dispatch

    monkeypatch.setattr(_dispatch, "_autograd_warned", set())  # (the warning is once per op and process)
    layers = make_layers(5, 4, 8, 14)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    x_chain = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(nn.Sequential(*layers)(x_chain), x_chain, g)
    x_stack = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (dx,) = torch.autograd.grad(mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)(x_stack), x_stack,
                                    g, create_graph=True)
    assert torch.equal(dx, want)
    with pytest.raises(RuntimeError, match="first order only"):
        dx.square().sum().backward()


class StaticOutput(nn.Module):
    """A sublayer that writes its output into one persistent buffer (a static output, as a CUDA-graph
    replay gives) and returns that buffer."""

    def __init__(self, shape):
        super().__init__()
        self.register_buffer("out", torch.zeros(shape))

    def forward(self, h):
        return self.out.copy_(torch.tanh(h))


@pytest.mark.parametrize("changed", ["input", "sublayer output"])
@pytest.mark.parametrize("recompute,fuse", [(2, False), (3, True)])
def test_what_recompute_rebuilds_from_changed_in_place_before_backward_raises(rng, recompute, fuse, changed):
    """The first layer frozen and x needing no gradient: that layer's pieces save nothing autograd
    checks, and an in-place change of x, or of the layer's sublayer output, after the forward went into
    the streams rebuilt from them: the later layers' parameter gradients were silently wrong (the
    chain's do not depend on them any more).  Now autograd's RuntimeError for a changed saved tensor;
    without the change, the chain's gradients bitwise."""
    layers = make_layers(4, 4, 8, 5)
    layers[0].sublayer = StaticOutput((3, 8))
    layers[0].requires_grad_(False)
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()

    def grads(module):
        module.zero_grad(set_to_none=True)
        module(x.clone()).backward(g)
        return [p.grad for p in stack.parameters() if p.grad is not None]

    assert all(torch.equal(a, b) for a, b in zip(grads(stack), grads(nn.Sequential(*layers))))
    x_in = x.clone()
    out = stack(x_in)
    changed_tensor, what = (x_in, "the input streams") if changed == "input" else \
        (layers[0].sublayer.out, "the sublayer output")
    version = changed_tensor._version
    changed_tensor.add_(1.0)
    with pytest.raises(RuntimeError, match=f"modified by an inplace operation: {what} .* of an MHCStack "
                                           f"recompute block .* at version {version + 1}; expected version {version}"):
        out.backward(g)


@pytest.mark.parametrize("recompute,fuse", [(None, False), (2, False), (2, True)])
def test_torch_func_transforms_are_refused_as_by_the_layers(rng, recompute, fuse):
    """With recompute the stack used to fail on the functorch tensor's missing storage (RuntimeError)."""
    stack = mt.MHCStack(make_layers(3, 4, 8, 4), recompute=recompute, fuse_boundaries=fuse)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    for transform in (lambda: torch.func.vjp(stack, x), lambda: torch.func.grad(lambda x: stack(x).sum())(x),
                      lambda: torch.func.vmap(stack)(x[None])):
        with pytest.raises(NotImplementedError, match="does not support torch.func transforms"):
            transform()


@pytest.mark.parametrize("recompute,fuse", [(None, False), (2, False), (None, True), (2, True)])
@pytest.mark.parametrize("grad", [True, False])
def test_a_hook_returning_no_tensor_gets_the_layers_error(rng, recompute, fuse, grad):
    """A layer's forward hook that returns a tuple: the next layer's TypeError naming x, in every
    configuration (with recompute or fused boundaries it was an AttributeError from the stack's bookkeeping:
    break-it pass 18)."""
    layers = make_layers(3, 4, 8, 7)
    layers[0].register_forward_hook(lambda m, i, o: (o, "extra"))
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float().requires_grad_(grad)
    with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=r"x must be a torch.Tensor .*got a tuple of 2"):
        stack(x)


def test_parameters_are_the_layers_and_load_a_chain_checkpoint(rng):
    layers = make_layers(3, 4, 8, 5)
    stack = mt.MHCStack(layers, recompute="auto")
    assert all(a is b for a, b in zip(stack.layers, layers)) and len(stack) == 3 and stack[1] is layers[1]
    assert list(stack) == layers
    assert {id(p) for p in stack.parameters()} == {id(p) for layer in layers for p in layer.parameters()}
    other = mt.MHCStack(make_layers(3, 4, 8, 6))
    other.load_state_dict(stack.state_dict())
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    with torch.no_grad():
        assert torch.equal(other(x), stack(x))
    assert "recompute='auto'" in repr(stack)


@pytest.mark.parametrize("n,L,want", [(4, 8, 2), (4, 32, 5), (1, 4, 1), (16, 60, 7)])
def test_auto_block_size_is_the_papers(n, L, want):
    """L_r* = sqrt(n L / (n + 2)) rounded (paper section 4.3); 1 means no recompute (None)."""
    got = mt.stack.recompute_blocks("auto", n, L)
    assert got == (None if want == 1 else want)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_auto_blocks_shrink_toward_the_output(n):
    """recompute="auto": B >= ceil(L / L_r*) blocks (the paper's number, so no more streams rebuilt, L - B),
    block k of 1 .. B - k layers (k = 0 the first), the last of one: at each block's last layer the stack
    holds no more streams (k boundaries, s_k - 1 rebuilt) than at the output (B - 1), where the backward
    starts with every sublayer's activations held.  An int L_r: blocks of L_r, the last of what is left."""
    for L in range(1, 131):
        L_r = mt.recompute_blocks("auto", n, L)
        sizes = mt.block_sizes("auto", n, L)
        assert (sizes is None) == (L_r is None), (n, L)
        if sizes is None:
            continue
        B = len(sizes)
        assert sum(sizes) == L and B >= -(-L // L_r) and sizes[-1] == 1, (n, L, sizes)
        assert all(1 <= s <= B - k for k, s in enumerate(sizes)), (n, L, sizes)
        assert list(sizes) == sorted(sizes, reverse=True), (n, L, sizes)
        for L_r in (2, 3, 7):
            got = mt.block_sizes(L_r, n, L)
            assert got is not None and sum(got) == L and set(got[:-1]) <= {L_r} and 1 <= got[-1] <= L_r
    assert mt.block_sizes("auto", 4, 8) == (4, 2, 1, 1) and mt.recompute_blocks("auto", 4, 8) == 2
    assert mt.block_sizes("auto", 4, 16) == (6, 5, 2, 1, 1, 1) and mt.block_sizes(3, 4, 16) == (3, 3, 3, 3, 3, 1)
    assert mt.block_sizes(None, 4, 8) is None and mt.block_sizes(1, 4, 8) is None


@pytest.mark.parametrize("layers,recompute,exc,match", [
    ([], None, ValueError, "layers must hold at least one MHC layer"),
    ([nn.Linear(8, 8)], None, TypeError, r"layers\[0\] must be an mhc_cupy.torch.MHC, got Linear"),
    ("mixed", None, ValueError, r"layers\[1\] has n_streams=2, dim=8; the stack has n_streams=4"),
    ("dims", None, ValueError, r"layers\[1\] has n_streams=4, dim=6; the stack has n_streams=4, dim=8"),
    ("ok", 0, ValueError, "recompute must be None, a positive int or 'auto', got 0"),
    ("ok", -2, ValueError, "recompute must be None, a positive int or 'auto', got -2"),
    ("ok", "sqrt", ValueError, "recompute must be None, a positive int or 'auto', got 'sqrt'"),
    ("ok", 2.0, TypeError, "recompute must be None, a positive int or 'auto', got float 2.0"),
    ("ok", True, TypeError, "recompute must be None, a positive int or 'auto', got bool True"),
])
def test_bad_input_names_the_argument(layers, recompute, exc, match):
    if layers == "mixed":
        layers = [mt.MHC(8, 4), mt.MHC(8, 2)]
    elif layers == "dims":
        layers = [mt.MHC(8, 4), mt.MHC(6, 4)]
    elif layers == "ok":
        layers = [mt.MHC(8, 4), mt.MHC(8, 4)]
    with pytest.raises(exc, match=match):
        mt.MHCStack(layers, recompute=recompute)
    with pytest.raises(TypeError, match="layers must be a sequence of MHC modules, got one MHC"):
        mt.MHCStack(mt.MHC(8, 4))


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("change,exc,match", [
    (lambda ls: ls.append(nn.Linear(8, 8)), TypeError, r"layers\[2\] must be an mhc_cupy.torch.MHC, got Linear"),
    (lambda ls: ls.insert(0, mt.MHC(8, 2)), ValueError, r"layers\[0\] has n_streams=2, dim=8; the stack has n_streams=4"),
    (lambda ls: ls.__setitem__(1, mt.MHC(6, 4)), ValueError, r"layers\[1\] has n_streams=4, dim=6; the stack has"),
    (lambda ls: [ls.pop(0) for _ in range(2)], ValueError, "layers must hold at least one MHC layer"),
])
def test_layers_changed_after_construction_are_checked_at_forward(fuse, change, exc, match):
    """stack.layers is a ModuleList the user may change: a Linear appended ran on each stream silently (or,
    fusing boundaries, raised AttributeError '_fused'); now each forward checks the layers as the constructor."""
    stack = mt.MHCStack([mt.MHC(8, 4), mt.MHC(8, 4)], fuse_boundaries=fuse)
    change(stack.layers)
    with pytest.raises(exc, match=match):
        stack(torch.randn(3, 4, 8))


@pytest.mark.parametrize("layers", [None, 3])
def test_layers_not_iterable_are_named(layers):
    """Used to be Python's bare "'NoneType' object is not iterable"."""
    with pytest.raises(TypeError, match=f"layers must be a sequence of MHC modules, got {type(layers).__name__}"):
        mt.MHCStack(layers)


def test_settings_assigned_later_are_checked_and_take_effect(rng):
    """``stack.recompute = 2`` after construction used to be ignored (the block size was computed once,
    also for the layers of that time), and any fuse_boundaries value was accepted."""
    stack = mt.MHCStack(make_layers(4, 4, 8, 7))
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    stack.recompute = 2
    assert stack.block_layers == 2 and "recompute=2" in repr(stack)
    _, alive = _streams_alive_after_forward(stack, x.clone().requires_grad_())
    assert alive == [True, False, True, False]  # block boundaries: layers 0 and 2
    stack.recompute = "auto"
    stack.layers.extend(make_layers(12, 4, 8, 8))  # 16 layers: L_r* = round(sqrt(4 * 16 / 6)) = 3
    assert stack.block_layers == 3
    for bad, exc in ((0, ValueError), (2.0, TypeError), ("sqrt", ValueError)):
        with pytest.raises(exc, match="recompute must be None, a positive int or 'auto'"):
            stack.recompute = bad
    assert stack.recompute == "auto"
    with pytest.raises(TypeError, match="fuse_boundaries must be a bool, got str 'yes'"):
        stack.fuse_boundaries = "yes"
    stack.fuse_boundaries = True
    assert stack.fuse_boundaries is True and "fuse_boundaries=True" in repr(stack)


# ---------------------------------------------------------------------------- GPU
def gpu_case(L, n, C, dtype, seed, convention="paper"):
    """(L CUDA layers with sublayers in dtype, x, g [3, 127, n, C] in dtype)."""
    layers = [layer.cuda() for layer in make_layers(L, n, C, seed, convention)]
    for layer in layers:
        layer.sublayer.to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, g = (torch.randn((3, 127, n, C), device="cuda", generator=gen).to(dtype) for _ in range(2))
    return layers, x, g


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,C", [(4, 64), (5, 24), (16, 8)])
def test_gpu_stack_recompute_is_bitwise_the_chain(dtype, n, C):
    layers, x, g = gpu_case(5, n, C, dtype, 7)
    want = run(nn.Sequential(*layers), x, g)
    for recompute in (None, 2, "auto"):
        assert_bitwise(run(mt.MHCStack(layers, recompute=recompute), x, g), want, f"recompute={recompute!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,C,convention", [(4, 64, "paper"), (4, 200, "deepseek"), (2, 24, "paper"),
                                            (6, 64, "paper"), (8, 64, "paper"), (4, 7, "paper")])
def test_gpu_fused_boundaries_match_the_chain(dtype, n, C, convention):
    """On the GPU the fused boundary kernel (n <= 6, C % 8 == 0; else the separate kernels) gives
    the chain's values and gradients to float32 rounding of the coefficient sums, bitwise
    repeatable, with and without recompute (bitwise equal to each other)."""
    from mhc_cupy._kernel_choice import kernel_choice

    layers, x, g = gpu_case(4, n, C, dtype, 9, convention)
    want = run(nn.Sequential(*layers), x, g)
    assert_bitwise(run(mt.MHCStack(layers, fuse_boundaries=True), x, g), want, "the kernel off: the chain's bits")
    with kernel_choice(boundary=True):  # (off by default until this test has passed on a GPU)
        got = run(mt.MHCStack(layers, fuse_boundaries=True), x, g)
        assert_bitwise(run(mt.MHCStack(layers, fuse_boundaries=True), x, g), got, "repeatable")
        assert_bitwise(run(mt.MHCStack(layers, recompute=2, fuse_boundaries=True), x, g), got, "recompute")
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    for a, b, what in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), ("out", "dx", *["param"] * 99)):
        assert_close(a.float().cpu().numpy(), b.float().cpu().numpy(), tol, what, scale="max")


@pytest.mark.gpu
@pytest.mark.parametrize("recompute,fuse,small", [(None, False, False), (2, False, False), (2, True, True),
                                                  (None, True, False)])
def test_gpu_cuda_graph_capture_of_a_stack(recompute, fuse, small):
    """A training step of a stack (forward + backward, recompute and fused boundaries included)
    captured in a CUDA graph on a side stream: replays after the inputs change in place equal eager
    steps bitwise.  ``small``: 8 tokens with the small-token forward chosen."""
    from mhc_cupy._kernel_choice import kernel_choice

    layers, x, g = gpu_case(4, 4, 64, torch.bfloat16, 13)
    if small:
        x, g = x[0, :8].contiguous(), g[0, :8].contiguous()
    x.requires_grad_()
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)
    params = list(stack.parameters())

    def step():
        out = stack(x)
        return out, torch.autograd.grad(out, [x] + params, g)

    with kernel_choice(small=small, boundary=fuse):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: every kernel compiled / loaded before the capture
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            static_out, static_grads = step()
        for seed in (1, 2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            with torch.no_grad():
                x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype))
                g.copy_(torch.randn(g.shape, device="cuda", generator=gen).to(g.dtype))
            graph.replay()
            torch.cuda.synchronize()
            want_out, want_grads = step()
            torch.cuda.synchronize()
            assert torch.equal(static_out, want_out), "replayed output"
            for i, (a, b) in enumerate(zip(static_grads, want_grads)):
                assert torch.equal(a, b), f"replayed grad {i}"


@pytest.mark.parametrize("recompute,fuse", [(None, False), (2, False), (2, True)])
def test_compile_fullgraph(rng, recompute, fuse):
    """torch.compile(fullgraph=True) of a stack traces without a break (recompute is eager-only:
    compiled, the stack saves every layer's streams) and gives the eager values and gradients."""
    torch._dynamo.reset()
    layers = make_layers(3, 4, 8, 8)
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((2, 3, 4, 8))).float()
    want = run(stack, x, g)
    got = run(torch.compile(stack, fullgraph=True, backend="aot_eager"), x, g)
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
