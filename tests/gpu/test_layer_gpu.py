"""GPU tests of the mHC layer ``mhc_cupy.torch.MHC`` (kernels through ``mhc_cupy.torch``).

* bfloat16 on CUDA (residual streams bf16, sublayer under bf16 autocast,
  coefficients float32) against the pure-PyTorch reference layer
  ``MHCReference`` run in float32 on the same (bf16-valued) inputs and the
  same upstream gradient: forward and the gradients w.r.t. x, phi, alpha,
  bias and the sublayer's parameters;
* float32 on CUDA against the reference in float64 (tight);
* a tiny model of the demo trains a few steps on CUDA: finite, loss decreases;
  the demo's CLI runs with ``--device cuda --tiny --baseline``.

Tolerances, relative to ``|ref| + scale`` (scale = rms(ref), or for
gradients that are sums over tokens the sum of the per-token contributions'
magnitudes, see ``token_scales``):

* bf16 (unit roundoff u = 2^-8): the kernel path rounds each activation once
  (x, layer_in, the sublayer's autocast inputs and weights, y, out; in the
  backward the incoming gradient, d_layer_in, dx), accumulating in float32.
  The forward output goes through ~4 roundings in sequence: 8u = 3.1e-2.
  Gradients go through about twice as many (forward recompute + backward
  casts): 16u = 6.3e-2.  Measured by emulating this path on CPU (bf16
  autocast, the NumPy reference rounding each op output once to bf16; 4
  shapes x 6 seeds): out <= 2u, gradients <= 7u, d_alpha / d_bias <= 0.5u
  of their token scale.  A wiring error (transposed H_res, swapped
  coefficient groups, missing factor 2) is O(1) relative and fails by far.
* float32 on the GPU: kernel sums in float32 in a different order than the
  reference, and the Sinkhorn iteration repeated 20 times in float32 (the
  adapters' GPU tests: harness.TOL "sinkhorn" 2e-4 for its values,
  "sinkhorn_chain_grad" 1e-3 for gradients through it); the sublayer's cuBLAS float32 GEMMs (TF32 off by default):
  1e-3 for everything.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from torch import nn

from mhc_cupy.torch import MHC
from mhc_cupy.torch.reference import MHCReference

from harness import TOL, assert_close, default_dtype, token_scales

from .helpers import torch_cuda_ok


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch_cuda_ok(), reason="needs CUDA for both CuPy and torch")]

DEV = "cuda"
LAYER_TOL = TOL["layer_gpu"]  # (output, gradients) per activation dtype: the module docstring says why
SHAPES = [  # (lead dims, n, C): the demo's n = 4; odd token count; n = 1; n = 8, C not a multiple of 8
    ((4, 64), 4, 128),
    ((2, 33), 4, 96),
    ((50,), 1, 64),
    ((3, 16), 8, 60),
]


# ------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _float32_default():
    """Modules and random tensors here are float32 (another test module sets float64 as the default)."""
    with default_dtype(torch.float32):
        yield


def make_layer(C, n, seed, device):
    """An MHC around a pre-norm MLP, with coefficients away from their init (logits of scale ~1)."""
    torch.manual_seed(seed)
    sub = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
    layer = MHC(C, n, sub, alpha_init=1.0)
    with torch.no_grad():
        layer.bias.add_(torch.randn_like(layer.bias))
        layer.alpha.copy_(torch.tensor([0.5, 1.0, 1.5]))
    return layer.to(device)


def compare(device, dtype, lead, n, C, seed):
    """Run MHC (kernels, ``dtype`` activations) and MHCReference (float32 for bf16, float64 for float32)."""
    layer = make_layer(C, n, seed, device)
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    ref = MHCReference.from_layer(layer).to(ref_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(lead + (n, C), generator=gen, device=device).to(dtype)
    g = torch.randn(lead + (n, C), generator=gen, device=device).to(dtype)

    x1 = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = layer(x1)
    out.backward(g)
    assert out.dtype == dtype and x1.grad.dtype == dtype
    for p in (layer.phi, layer.alpha, layer.bias):
        assert p.grad.dtype == torch.float32

    x2 = x.to(ref_dtype).requires_grad_()
    out_ref = ref(x2)
    out_ref.backward(g.to(ref_dtype))

    tol_out, tol_grad = LAYER_TOL[dtype]
    scales = token_scales(ref, x2, g.to(ref_dtype))
    assert_close(out, out_ref, tol_out, "out")
    assert_close(x1.grad, x2.grad, tol_grad, "dx")
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, tol_grad, f"d_{name}", scales.get(name))


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("lead,n,C", SHAPES)
def test_layer_bf16_matches_reference_f32(lead, n, C):
    compare(DEV, torch.bfloat16, lead, n, C, zlib.crc32(f"bf16{lead}{n}{C}".encode()))


@pytest.mark.parametrize("lead,n,C", SHAPES[:2])
def test_layer_f32_matches_reference_f64(lead, n, C):
    compare(DEV, torch.float32, lead, n, C, zlib.crc32(f"f32{lead}{n}{C}".encode()))


def test_layer_kernels_match_cpu_path():
    """The same float32 layer on CUDA (kernels) and on CPU (NumPy reference): same result to 1e-3."""
    layer = make_layer(64, 4, 7, "cpu")
    x = torch.randn(3, 40, 4, 64)
    out_cpu = layer(x)
    out_gpu = layer.to(DEV)(x.to(DEV))
    assert_close(out_gpu, out_cpu, LAYER_TOL[torch.float32][0], "out cuda vs cpu")


def test_tiny_model_trains_bf16():
    """A tiny demo model (bf16 streams, bf16 autocast) on a fixed batch: finite, loss decreases."""
    from mhc_cupy import demo

    cfg = demo.Config(**demo.TINY_PRESET)
    torch.manual_seed(0)
    model = demo.TinyGPT(cfg, "mhc", stream_dtype=torch.bfloat16).to(DEV)
    train, _ = demo.split_data(demo.load_text())
    x, y = demo.get_batch(train, cfg.batch, cfg.seq, torch.Generator().manual_seed(0))
    x, y = x.to(DEV), y.to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v and abs(v) != float("inf"), losses)), losses
    for p in model.parameters():
        assert torch.isfinite(p).all()
    # from ln(256) = 5.5 at init; memorising one batch of 512 bytes goes well below 3 in 30 steps
    assert losses[-1] < losses[0] - 1.0, losses


def test_demo_cli_cuda(tmp_path):
    from mhc_cupy import demo

    out = tmp_path / "demo"
    summary = demo.main(["--tiny", "--device", "cuda", "--steps", "20", "--eval-every", "10", "--baseline",
                         "--out", str(out)])
    assert summary["device"] == "cuda" and summary["stream_dtype"] == "bfloat16"
    assert os.path.getsize(out / "loss_curve.png") > 0
    with open(out / "summary.json") as f:
        js = json.load(f)
    for name in ("mhc", "baseline"):
        assert js[name]["final_eval_loss"] < js[name]["eval_loss"][0]
        assert js[name]["tokens_per_s"] > 0
