"""What ``MHCStack`` reads of its layers' parameters and saved tensors, and when; the torch oracle of a layer
(found by a break-it pass over the PyTorch network API; CPU, NumPy reference):

* a fusing stack (``fuse_boundaries=True``) reads the next layer's phi / alpha / bias before that layer's
  own forward pre-hooks run; a pre-hook that changes them (in place: a max-norm clip; or other tensors in
  their place: an old-style ``torch.nn.utils.weight_norm``, FSDP2's unshard) made the layer use the pre
  piece computed from the old parameters while its backward differentiated the new ones (every later
  value and gradient wrong; NaN under FSDP2 with one unit per MHC); now a stack does not fuse into a layer
  with forward pre-hooks, and a layer takes the pre piece only for the parameter tensors it was computed
  from, unchanged: the chain's bits;
* ``mhc_cupy.torch.reference.MHCReference`` (the documented autograd oracle of ``MHC``; ``from_layer``)
  ignored the layer's convention, hc_eps and post_mult: a DeepSeek-convention layer's "reference" was the
  paper's maths (values off by ~0.2-2), silently; now it follows them (checked against the independent
  float64 oracle tests/deepseek_oracle.py), and a DeepSeek-convention stack matches a chain of float64
  reference layers as a paper one does;
* inside a recompute block (not at its first layer) the stack's saved-tensor hook handed autograd the
  mHC pieces' other saved tensors detached, without autograd's check that they are unchanged at
  backward: a layer's phi / alpha / bias changed in place between forward and backward (an optimizer
  step or an EMA update before the backward), or a sublayer output changed after the forward, gave
  gradients of the changed values silently where the chain (and the stack without recompute) raise
  autograd's in-place RuntimeError; now they raise it too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import deepseek_oracle
from harness import TOL, assert_close, default_dtype
from test_stack import CASES, assert_bitwise, make_layers, run

import mhc_cupy.torch as mt
from mhc_cupy.torch.reference import MHCReference


@pytest.fixture(autouse=True)
def _float32_default():
    with default_dtype(torch.float32):
        yield


def _scale_in_place(name, data):
    """A forward pre-hook that scales the layer's parameter ``name`` in place (a max-norm clip does so),
    through ``.data`` (no version change) or under no_grad."""
    def hook(module, args):
        with torch.no_grad():
            p = getattr(module, name)
            (p.data if data else p).mul_(3.0)

    return hook


@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("what", ["phi no_grad", "alpha no_grad", "phi .data", "bias .data", "weight_norm"])
def test_fused_boundary_follows_parameters_a_pre_hook_changes(rng, recompute, what):
    seed = int(rng.integers(1 << 30))
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()

    def build():
        layers = make_layers(3, 4, 8, seed)
        if what == "weight_norm":  # phi recomputed from phi_g, phi_v by a pre-hook at each call
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (its deprecation warning)
                for layer in layers:
                    torch.nn.utils.weight_norm(layer, "phi", dim=1)
            with torch.no_grad():
                layers[1].phi_g.mul_(2.0)  # as an optimizer step does: layer 1's phi is stale until its pre-hook
        else:
            name, how = what.split()
            layers[1].register_forward_pre_hook(_scale_in_place(name, how == ".data"))
        return layers

    want = run(nn.Sequential(*build()), x, g)
    got = run(mt.MHCStack(build(), recompute=recompute, fuse_boundaries=True), x, g)
    assert_bitwise(got, want, what)


@pytest.mark.parametrize("recompute", [None, 2])
@pytest.mark.parametrize("what", ["in place", "new parameter"])
def test_fused_boundary_follows_parameters_changed_before_the_layers_call(rng, recompute, what):
    """Layer 1's forward hook changes layer 2's phi after layer 1's residual update computed layer 2's pre
    piece (in place under no_grad, or another Parameter in its place): layer 2 computes its own."""
    seed = int(rng.integers(1 << 30))
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()

    def build():
        layers = make_layers(3, 4, 8, seed)

        def hook(module, args, out):
            with torch.no_grad():
                if what == "in place":
                    layers[2].phi.mul_(3.0)
                else:
                    layers[2].phi = nn.Parameter(layers[2].phi * 3.0)

        layers[1].register_forward_hook(hook)
        return layers

    want = run(nn.Sequential(*build()), x, g)
    got = run(mt.MHCStack(build(), recompute=recompute, fuse_boundaries=True), x, g)
    assert_bitwise(got, want, what)


def test_a_parametrized_next_layer_is_not_fused_into(rng, monkeypatch):
    """Each read of a parametrized phi computes another tensor: no boundary op computes the pre piece for
    it (it would go unused); the stack is the chain bitwise."""
    import torch.nn.utils.parametrize as parametrize

    from mhc_cupy.torch import functions

    class Twice(nn.Module):
        def forward(self, w):
            return 2 * w

    runs = []
    real = functions.NextPre.run
    monkeypatch.setattr(functions.NextPre, "run", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    seed = int(rng.integers(1 << 30))
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((5, 4, 8))).float()

    def build():
        layers = make_layers(3, 4, 8, seed)
        parametrize.register_parametrization(layers[2], "phi", Twice())
        return layers

    want = run(nn.Sequential(*build()), x, g)
    runs.clear()
    got = run(mt.MHCStack(build(), fuse_boundaries=True), x, g)
    assert_bitwise(got, want, "parametrized phi")
    assert len(runs) == 1  # the boundary 0 -> 1 only


_FSDP_FUSED_SCRIPT = r"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import sys
sys.path.insert(0, "tests")
from test_stack import make_layers, run
import mhc_cupy.torch as mt

dist.init_process_group("gloo")
torch.manual_seed(0)
x, g = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
want = run(nn.Sequential(*make_layers(3, 4, 8, 70)), x, g)
stack = mt.MHCStack(make_layers(3, 4, 8, 70), recompute=2, fuse_boundaries=True)
for layer in stack.layers:
    fully_shard(layer)  # one unit per MHC, as README's "Distributed" says
fully_shard(stack)
for step in range(2):
    out, dx, grads = run(stack, x, g)
    assert torch.equal(out, want[0]) and torch.equal(dx, want[1]), (step, (out - want[0]).abs().max())
    for p, q in zip(grads, want[2]):
        assert torch.equal(p.full_tensor(), q), step
dist.destroy_process_group()
print("FSDP2 FUSED OK")
"""


@pytest.mark.slow  # a subprocess
def test_fused_stack_under_fsdp2_units_per_layer(tmp_path):
    """FSDP2 with one unit per MHC swaps each layer's unsharded parameters in with a forward pre-hook:
    a fusing stack read the next layer's (sharded, freed) parameters before it, and its pre piece came
    out NaN (one gloo rank); now the stack does not fuse into such a layer: the chain's values."""
    pytest.importorskip("torch.distributed.fsdp")
    from multidevice import run as run_python
    from test_torch_rough_edges import _free_port

    script = tmp_path / "fsdp2_fused.py"
    script.write_text(_FSDP_FUSED_SCRIPT)
    out = run_python([str(script)], env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                                         "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert "FSDP2 FUSED OK" in out, out[-3000:]


@pytest.mark.parametrize("kw", [{"convention": "deepseek"}, {"post_mult": 1.0}, {"hc_eps": 0.1},
                                {"convention": "deepseek", "post_mult": 0.5, "hc_eps": 0.01, "num_iters": 3}])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_reference_layer_follows_convention_hc_eps_and_post_mult(rng, n, kw):
    torch.manual_seed(int(rng.integers(1 << 30)))
    C = 7
    layer = mt.MHC(C, n, nn.Linear(C, C), alpha_init=1.0, **kw)
    with torch.no_grad():
        layer.bias.add_(torch.randn_like(layer.bias))
    x = torch.from_numpy(rng.standard_normal((5, n, C)))
    g = torch.from_numpy(rng.standard_normal((5, n, C)))
    ref = MHCReference.from_layer(layer).double()
    out_ref, dx_ref, grads_ref = run(ref, x, g)
    s = layer.settings
    sub = ref.sublayer
    xo = x.clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in (ref.phi, ref.alpha, ref.bias)]
    if s.convention == "deepseek":  # the independent oracle (DeepSeek's layout: hc_fn = phi^T)
        out = deepseek_oracle.layer(xo, params[0].t(), params[1], params[2], sub, s.num_iters, s.eps, s.rms_eps,
                                    s.hc_eps, s.post_mult)
        want = torch.autograd.grad(out, [xo, *params], g)
        assert_close(out_ref, out.detach(), 1e-12, "out")
        for i, (p, q) in enumerate(zip([dx_ref, *grads_ref[:3]], want)):
            assert_close(p, q, 1e-10, f"gradient {i}")
    out, dx, _ = run(layer, x.float(), g.float())  # the layer (NumPy reference) agrees with it
    assert_close(out, out_ref, TOL["float32_layer"].value, "layer out")
    assert_close(dx, dx_ref, TOL["float32_layer"].value, "layer dx")


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("lead,n,C,L", CASES[:6])
def test_deepseek_stack_matches_a_chain_of_float64_reference_layers(rng, lead, n, C, L, fuse):
    """test_stack's float64 check (paper only there) under convention="deepseek"."""
    layers = make_layers(L, n, C, int(rng.integers(1 << 30)), "deepseek")
    refs = nn.Sequential(*(MHCReference.from_layer(layer) for layer in layers)).double()
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    out, dx, grads = run(mt.MHCStack(layers, recompute=2, fuse_boundaries=fuse), x, g)
    out_ref, dx_ref, grads_ref = run(refs, x.double(), g.double())
    tol = TOL["float32_layer"].value * L * 4  # (test_stack's bound)
    assert_close(out, out_ref, tol, "out")
    assert_close(dx, dx_ref, tol, "dx")
    for i, (p, q) in enumerate(zip(grads, grads_ref)):
        assert_close(p, q, tol, f"grad of parameter {i}")


class _Keeps(nn.Module):
    """A sublayer that keeps its output (as a cache would), for the test to change it after the forward."""

    def __init__(self, C):
        super().__init__()
        self.lin, self.kept = nn.Linear(C, C), None

    def forward(self, h):
        self.kept = self.lin(h)
        return self.kept


@pytest.mark.parametrize("recompute,fuse", [(None, False), (3, False), (3, True), ("auto", True), (1, False)])
@pytest.mark.parametrize("what", ["phi", "alpha", "bias", "sublayer output"])
def test_a_saved_tensor_changed_in_place_before_backward_raises_as_in_the_chain(rng, what, recompute, fuse):
    torch.manual_seed(int(rng.integers(1 << 30)))
    layers = [mt.MHC(8, 4, _Keeps(8), alpha_init=1.0) for _ in range(3)]
    x = torch.from_numpy(rng.standard_normal((5, 4, 8))).float().requires_grad_()
    out = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)(x)
    with torch.no_grad():  # layer 1 or 2: inside the block of 3 layers ("auto" at L 3: no recompute, as None)
        (layers[2].sublayer.kept if what == "sublayer output" else getattr(layers[1], what)).mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
