"""PyTorch adapter edges (issue 41): dtype casts of ``MHC`` / ``MHCHead`` keep the coefficient
parameters float32 (item 13), ``torch.func`` transforms are refused with a clear error (item 12),
and the FSDP2 bf16 recipe of ``examples/distributed.py`` runs the residual streams in bf16 (item 3).
CPU only.
"""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

import mhc_cupy.torch as mt
from mhc_cupy.torch import MHC, MHCHead
from mhc_cupy.torch.reference import MHCReference

from multidevice import ROOT, run

COEFFS = {MHC: ("phi", "alpha", "bias"), MHCHead: ("hc_fn", "hc_scale", "hc_base")}


def _module(cls):
    torch.manual_seed(0)
    return MHC(8, 4, nn.Linear(8, 8), alpha_init=0.3) if cls is MHC else MHCHead(8, 4, scale_init=0.3)


# ------------------------------------------------------------------ item 13: coefficients stay float32
@pytest.mark.parametrize("cls", [MHC, MHCHead])
@pytest.mark.parametrize("cast", ["to_bf16", "bfloat16", "half", "double", "type_f16"])
def test_dtype_casts_keep_coefficients_float32(cls, cast):
    """A dtype cast of the module leaves phi / alpha / bias (hc_fn / hc_scale / hc_base) and their
    gradients float32 and bitwise unchanged (not rounded through the other dtype), casts the
    sublayer, and the module still runs on activations of the sublayer's dtype."""
    module = _module(cls)
    x = torch.randn(3, 4, 8)
    module(x).sum().backward()
    before = {k: (getattr(module, k).detach().clone(), getattr(module, k).grad.clone()) for k in COEFFS[cls]}
    to = {"to_bf16": lambda m: m.to(torch.bfloat16), "bfloat16": nn.Module.bfloat16, "half": nn.Module.half,
          "double": nn.Module.double, "type_f16": lambda m: m.type(torch.float16)}[cast]
    assert to(module) is module
    for k, (value, grad) in before.items():
        p = getattr(module, k)
        assert isinstance(p, nn.Parameter) and p.dtype == p.grad.dtype == torch.float32, k
        assert torch.equal(p, value) and torch.equal(p.grad, grad), k
    if cls is MHC:
        low = module.sublayer.weight.dtype
        assert low == {"to_bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "double": torch.float64}.get(
            cast, torch.float16)
        if low != torch.float64:  # activations: bf16 / f16 / f32 only
            x_low = x.to(low).requires_grad_()
            out = module(x_low)
            out.float().sum().backward()
            assert out.dtype == x_low.grad.dtype == low and module.phi.grad.dtype == torch.float32
    else:
        assert module(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [MHC, MHCHead])
def test_dtype_casts_keep_a_parametrized_coefficient_float32(cls):
    """torch.nn.utils.parametrize on phi (hc_fn): the stored original stays float32 and unrounded
    through a dtype cast (it was cast to bfloat16, silently rounding the parameter; reading the
    computed phi's .grad also warned), and the module still trains."""
    import warnings
    import torch.nn.utils.parametrize as parametrize

    class Twice(nn.Module):
        def forward(self, t):
            return 2 * t

    module = _module(cls)
    name = COEFFS[cls][0]
    parametrize.register_parametrization(module, name, Twice())
    original = module.parametrizations[name].original
    module(torch.randn(3, 4, 8)).sum().backward()
    value, grad = original.detach().clone(), original.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.to(torch.bfloat16)
    original = module.parametrizations[name].original
    assert original.dtype == original.grad.dtype == torch.float32
    assert torch.equal(original, value) and torch.equal(original.grad, grad)
    x = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    module(x).float().sum().backward()
    assert original.grad.dtype == torch.float32


@pytest.mark.parametrize("swap", [False, True])
def test_device_moves_and_swap_conversion_keep_float32(swap):
    """Device moves still apply (meta, to_empty), also with torch's swap-tensors conversion; the
    plain-torch oracle MHCReference casts its parameters (``.double()`` is the float64 oracle)."""
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        layer = _module(MHC)
        layer.to("meta", torch.bfloat16)
        assert layer.phi.device.type == "meta" and layer.phi.dtype == torch.float32
        assert layer.sublayer.weight.device.type == "meta" and layer.sublayer.weight.dtype == torch.bfloat16
        layer.to_empty(device="cpu")
        assert layer.phi.device.type == "cpu" and layer.phi.dtype == torch.float32
        layer = _module(MHC).bfloat16()
        assert layer.phi.dtype == torch.float32 and layer.sublayer.weight.dtype == torch.bfloat16
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    ref = MHCReference.from_layer(_module(MHC)).double()
    assert ref.phi.dtype == ref.alpha.dtype == ref.bias.dtype == torch.float64


# ------------------------------------------------------------------ item 12: torch.func transforms
def _transforms(module, x):
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss(p, x):
        return torch.func.functional_call(module, p, (x,)).float().sum()

    return {
        "grad": lambda: torch.func.grad(loss)(params, x),
        "vmap": lambda: torch.func.vmap(module)(x.unsqueeze(0)),
        "vmap_no_grad": lambda: torch.no_grad()(torch.func.vmap(module))(x.unsqueeze(0)),
        "jacrev": lambda: torch.func.jacrev(lambda x: module(x).sum())(x),
        "jvp": lambda: torch.func.jvp(module, (x,), (torch.ones_like(x),)),
        "vjp": lambda: torch.func.vjp(module, x),
    }


@pytest.mark.parametrize("cls", [MHC, MHCHead])
@pytest.mark.parametrize("transform", ["grad", "vmap", "vmap_no_grad", "jacrev", "jvp", "vjp"])
def test_func_transforms_refused_clearly(cls, transform):
    """torch.func transforms raise NotImplementedError saying so and what to use (issue 41 item 12:
    PyTorch's generic setup_context message, or a missing data pointer, before)."""
    module = _module(cls)
    with pytest.raises(NotImplementedError, match=r"does not support torch.func transforms .* torch.autograd"):
        _transforms(module, torch.randn(3, 4, 8))[transform]()


def test_func_transforms_refused_by_the_ops_and_functional_call_works():
    """The ops themselves refuse too (every public op checks first); functional_call, not a
    transform, works and gives the module's result."""
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.vmap(mt.sinkhorn_knopp)(torch.randn(2, 3, 4, 4))
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.vmap(lambda x: mt.stream_aggregate(x, torch.full((4,), 0.25)))(torch.randn(2, 3, 4, 8))
    layer = _module(MHC)
    x = torch.randn(3, 4, 8)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(layer, params, (x,)), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("where", ["x", "param"])
def test_forward_ad_dual_tensors_refused(where):
    """torch.autograd.forward_ad: a dual tensor's tangent never reaches the kernels.  An op given
    one without requires_grad returned no tangent (read as zero: a silent wrong jvp); it raises,
    like the torch.func transforms.  Inside dual_level, plain tensors still work."""
    import torch.autograd.forward_ad as fwAD

    layer = _module(MHC)
    x = torch.randn(3, 4, 8)
    with fwAD.dual_level():
        torch.testing.assert_close(mt.rmsnorm(x), mt.rmsnorm(x))  # no tangent anywhere: fine
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            if where == "x":
                mt.rmsnorm(fwAD.make_dual(x, torch.ones_like(x)))
            else:
                w = torch.ones(8)
                mt.rmsnorm(x, 1e-5, fwAD.make_dual(w, torch.ones_like(w)))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            layer(fwAD.make_dual(x, torch.ones_like(x)))


@pytest.mark.parametrize("cls", [MHC, MHCHead, "stream_mix"])
def test_batched_gradients_refused_clearly(cls):
    """is_grads_batched (jacobian / hessian with vectorize=True) hands the backward the legacy vmap's
    batched tensors, which have no memory: it failed deep in the kernels' call with torch's
    "Batching rule not implemented for aten::detach"; it is refused as the transforms are, and the
    unbatched jacobian works."""
    M = torch.randn(3, 4, 4)
    f = (lambda t: mt.stream_mix(t, M)) if cls == "stream_mix" else _module(cls)
    x = torch.randn(3, 4, 8)
    with pytest.raises(NotImplementedError, match="batched gradients"):
        torch.autograd.functional.jacobian(f, x, vectorize=True)
    out = f(x.requires_grad_())
    with pytest.raises(NotImplementedError, match="batched gradients"):
        torch.autograd.grad(out, x, torch.ones(2, *out.shape), is_grads_batched=True)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(torch.autograd.functional.jacobian(f, x.detach()).sum(tuple(range(out.dim()))), g)


# ------------------------------------------------------------------ item 3: the FSDP2 bf16 recipe
_FSDP_SCRIPT = r"""
import importlib.util, json, sys
import mhc_cupy.torch.layers as L

seen, phase = [], ["?"]
pre = L.layer_pre  # the fused pre piece, with the settings MHC resolved
def spy(x, *args, **kwargs):  # what reaches the kernels: the streams MHC hands to the fused pre piece
    seen.append((phase[0], str(x.dtype)))
    return pre(x, *args, **kwargs)
L.layer_pre = spy

spec = importlib.util.spec_from_file_location("distributed_example", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
train = ex.train
def tagged_train(model, *args, **kwargs):  # the FSDP2 model first, then (--check) the plain reference
    phase[0] = "fsdp2" if hasattr(model, "reshard") else "reference"
    return train(model, *args, **kwargs)
ex.train = tagged_train
rc = ex.main(["--mode", "fsdp2-bf16", "--check", "--steps", "2", "--layers", "2"])
print("SEEN", json.dumps(seen))
sys.exit(rc)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("module", ["MHC", "MHCHead", "MHCStack", "MHCStack_recompute"])
def test_x_not_a_tensor_names_the_argument(module):
    """None, a list or a NumPy array for x: a TypeError naming x (OPS.md's rule for a non-array), as the
    ops give; the modules raised AttributeError ("'list' object has no attribute 'dim'", or with
    recompute "... 'is_inference'") (break-it pass 13)."""
    import numpy as np

    layers = [_module(MHC), _module(MHC)]
    call = {"MHC": layers[0], "MHCHead": _module(MHCHead), "MHCStack": mt.MHCStack(layers),
            "MHCStack_recompute": mt.MHCStack(layers, recompute=2, fuse_boundaries=True)}[module]
    x = torch.randn(3, 4, 8)
    for bad, what in ((None, "NoneType"), (x.tolist(), "list of 3"), (x.numpy(), "ndarray")):
        with pytest.raises(TypeError, match=rf"^x must be a torch.Tensor \[\.\.\., n_streams=4, dim=8\], got a {what}"):
            call(bad)


@pytest.mark.slow  # a subprocess
def test_fsdp2_bf16_recipe_keeps_bf16_streams(tmp_path):
    """``examples/distributed.py --mode fsdp2-bf16`` under FSDP2 (gloo, one CPU rank): the residual
    streams reach the MHC kernels as bfloat16 in every layer and step (issue 41 item 3: the float32
    policy on each MHC cast them to float32), and the example's own --check (float32 mHC parameters,
    bf16 streams and sublayer inputs, loss near float32 training) passes."""
    import json

    pytest.importorskip("torch.distributed.fsdp")
    script = tmp_path / "fsdp2_dtypes.py"
    script.write_text(_FSDP_SCRIPT)
    out = run([str(script), str(ROOT / "examples" / "distributed.py")],
              env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_free_port()), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert "fsdp2-bf16 check against one process on the full batch: OK" in out, out[-3000:]
    seen = json.loads(out.split("SEEN ", 1)[1].splitlines()[0])
    fsdp = [dtype for phase, dtype in seen if phase == "fsdp2"]
    assert len(fsdp) == 2 * 2 and set(fsdp) == {"torch.bfloat16"}, seen  # steps x layers
    assert {dtype for phase, dtype in seen if phase == "reference"} == {"torch.float32"}, seen
