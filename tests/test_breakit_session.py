"""What a demanding user does to the fused layer boundary, the fusing / recomputing ``MHCStack`` and the
kernel choice (CPU: the NumPy reference):

* ``mhc_boundary_fwd`` is ``mhc_post_op_fwd`` then ``mhc_layer_pre_fwd`` (value, dtype and shape of every
  output) over dtypes, conventions, leading dims, n and C; bad input names the argument;
* a stack equals the chain of its layers bitwise when forward hooks or pre-hooks change the streams
  between layers (a new tensor or an in-place change), and when some layers were built under
  ``kernel_choice(fused=False)``;
* ``KernelChoice.runs`` of a name that is not a variant raises naming it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import default_dtype
from test_stack import assert_bitwise, make_layers, run

import mhc_cupy
import mhc_cupy.torch as mt
from mhc_cupy._kernel_choice import KernelChoice, kernel_choice


@pytest.fixture(autouse=True)
def _float32_default():
    with default_dtype(torch.float32):
        yield


def _boundary_args(rng, lead, n, C, dtype):
    m = n * n + 2 * n

    def f(*shape, dt=torch.float32):
        return torch.from_numpy(rng.standard_normal(shape)).to(dt)

    return {"layer_out": f(*lead, C, dt=dtype), "x": f(*lead, n, C, dt=dtype), "H_post": f(*lead, n).abs(),
            "H_res": f(*lead, n, n).abs(), "phi": 0.1 * f(n * C, m), "alpha": torch.tensor([0.5, 1.0, 1.5]),
            "bias": f(m)}


# ------------------------------------------------------------------ mhc_boundary_fwd
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead,n,C", [((5,), 4, 8), ((2, 3), 1, 3), ((), 5, 9), ((0,), 4, 8), ((2, 0, 3), 2, 1)])
def test_boundary_op_is_the_post_op_then_the_pre_piece(rng, lead, n, C, dtype, convention):
    a = _boundary_args(rng, lead, n, C, dtype)
    got = mhc_cupy.mhc_boundary_fwd(**a, convention=convention)
    out = mhc_cupy.mhc_post_op_fwd(a["layer_out"], a["x"], a["H_post"], a["H_res"], convention=convention)
    want = (out, *mhc_cupy.mhc_layer_pre_fwd(out, a["phi"], a["alpha"], a["bias"], convention=convention))
    assert len(got) == 6
    for i, (p, q) in enumerate(zip(got, want)):
        assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q), i


@pytest.mark.parametrize("name", ["layer_out", "x", "H_post", "H_res", "phi", "alpha", "bias"])
def test_boundary_op_bad_input_names_the_argument(rng, name):
    a = _boundary_args(rng, (5,), 4, 8, torch.float32)
    shape = "C of x" if name == "x" else f"{name} has shape"  # (x's token dims read against layer_out's)
    for bad, exc, match in [(None, TypeError, f"{name} is None"), (a[name].tolist(), TypeError, f"{name}: .*list"),
                            (a[name].double(), TypeError, f"{name} has dtype float64"),
                            (a[name][None], ValueError, shape)]:
        with pytest.raises(exc, match=match):
            mhc_cupy.mhc_boundary_fwd(**{**a, name: bad})


# ------------------------------------------------------------------ MHCStack
def _hook(kind, layers):
    """A hook that changes the streams between layers 0 and 1: a new tensor or an in-place change,
    after layer 0 (forward hook) or before layer 1 (forward pre-hook)."""
    def change(t):
        return t * 2.0 if kind.endswith("new tensor") else t.mul_(2.0)

    if kind.startswith("output"):
        return layers[0].register_forward_hook(lambda mod, args, out: change(out))
    return layers[1].register_forward_pre_hook(lambda mod, args: (change(args[0]),))


@pytest.mark.parametrize("kind", ["output, new tensor", "output, in place", "input, new tensor", "input, in place"])
@pytest.mark.parametrize("recompute,fuse", [(None, True), (3, False), (3, True), (2, True)])
def test_stack_follows_streams_that_hooks_change(rng, kind, recompute, fuse):
    """The stack hands on what each layer call returned, hooks included: the recomputed streams are
    those the layers got (a changed stream starts a new block) and a fused boundary's pre piece is used
    only for the streams it was computed from (not after an in-place change)."""
    layers = make_layers(4, 4, 8, int(rng.integers(1 << 30)))
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=fuse)
    handle = _hook(kind, layers)
    try:
        want = run(nn.Sequential(*layers), x, g)
        assert_bitwise(run(stack, x, g), want, kind)
        with torch.no_grad():
            assert torch.equal(stack(x), want[0])
    finally:
        handle.remove()


@pytest.mark.parametrize("recompute", [None, 2])
def test_fused_boundaries_skip_layers_built_with_the_separate_ops(rng, recompute):
    """A layer built under kernel_choice(fused=False) runs the separate ops in a fusing stack too (no
    boundary op hands it a pre piece): the stack is the chain bitwise."""
    seed = int(rng.integers(1 << 30))
    fused = make_layers(3, 4, 8, seed)
    with kernel_choice(fused=False):
        separate = make_layers(3, 4, 8, seed)
    layers = [separate[0], fused[1], separate[2]]
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    g = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    stack = mt.MHCStack(layers, recompute=recompute, fuse_boundaries=True)
    assert_bitwise(run(stack, x, g), run(nn.Sequential(*layers), x, g), "fused=False layers")


# ------------------------------------------------------------------ KernelChoice
@pytest.mark.parametrize("variant", ["bogus", "__class__", "runs"])
def test_runs_of_an_unknown_variant_names_it(variant):
    with pytest.raises(ValueError, match=f"variant must be one of .*wg_fwd.*got {variant!r}"):
        KernelChoice().runs(variant)
