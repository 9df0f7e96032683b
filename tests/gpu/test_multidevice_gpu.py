"""Two-GPU versions of tests/test_multidevice.py, and tensors on a non-current GPU.

Skipped unless 2 GPUs are visible.  Each multi-process check runs in its own
processes (``tests/multidevice``):

* JAX: ``tests/multidevice/jax_sharding_cases.py`` on the first 2 GPUs (every
  op and ``mhc_layer`` under ``jit(grad)`` with the token dims sharded: equal to
  the unsharded program, token shardings kept, shared-parameter gradients
  replicated, no all-gather in the compiled program);
* torch: ``examples/distributed.py --check`` under torchrun with 2 NCCL ranks:
  DDP, FSDP2 (float32, and bf16 sublayers with float32 phi / alpha / bias) and
  ``torch.compile`` (inductor) of the DDP model, losses and parameters after 3
  SGD steps equal to one process on the full batch (float32, 1e-5 relative);
* the demo under ``torchrun --nproc-per-node 2`` (NCCL): it runs, says 2 ranks,
  and its held-out losses match one GPU at the same global batch (bf16: 2e-2);
* an MHC layer with its tensors on cuda:1 while cuda:0 is current: bitwise
  equal to the same layer on cuda:0, outputs and gradients on cuda:1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from multidevice import ROOT, pytest_cases, torchrun


def _gpus() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver / no CuPy: no GPU
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]


def test_jax_token_sharding_two_gpus():
    jax = pytest.importorskip("jax")
    try:
        n = len(jax.devices("gpu"))
    except RuntimeError:
        n = 0
    if n < 2:
        pytest.skip(f"JAX sees {n} GPUs")
    pytest_cases("jax_sharding_cases.py", {"MHC_SHARDING_PLATFORM": "gpu"}, timeout=600)


def test_torch_ddp_fsdp2_compile_two_nccl_ranks():
    out = torchrun([str(ROOT / "examples" / "distributed.py"), "--mode", "ddp", "fsdp2", "fsdp2-bf16",
                    "ddp-compile", "--check"], env={"CUDA_VISIBLE_DEVICES": "0,1"}, timeout=600)
    for mode in ("ddp", "fsdp2", "fsdp2-bf16", "ddp-compile"):
        assert f"{mode}: 2 ranks on cuda" in out and f"{mode} check against one process on the full batch: OK" in out, \
            out[-4000:]


def test_demo_torchrun_two_gpus(tmp_path):
    common = ["-m", "mhc_cupy.demo", "--steps", "40", "--eval-every", "20"]
    torchrun([*common, "--out", str(tmp_path / "one")], nproc=1, env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=600)
    out = torchrun([*common, "--out", str(tmp_path / "two")], env={"CUDA_VISIBLE_DEVICES": "0,1"}, timeout=600)
    assert out.count("data-parallel: 2 ranks (DistributedDataParallel, nccl)") == 1, out[-3000:]
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert two["ranks"] == 2 and one["ranks"] == 1 and two["device"] == "cuda"
    # bf16 streams and autocast: the two runs differ by bf16 rounding only
    np.testing.assert_allclose(two["mhc"]["eval_loss"], one["mhc"]["eval_loss"], rtol=2e-2)
    print(f"demo tokens/s: 1 GPU {one['mhc']['tokens_per_s']:,.0f}, 2 GPUs {two['mhc']['tokens_per_s']:,.0f} "
          "(same global batch)")


def test_mhc_layer_on_non_current_device():
    """Every op of an MHC layer (coefficients, pre, sublayer, post; forward and backward) with its
    tensors on cuda:1 while cuda:0 is current: bitwise equal to the layer on cuda:0."""
    import torch

    from mhc_cupy.torch import MHC

    torch.manual_seed(0)
    layer0 = MHC(48, 4, torch.nn.Linear(48, 48, dtype=torch.bfloat16)).to("cuda:0")
    layer1 = MHC(48, 4, torch.nn.Linear(48, 48, dtype=torch.bfloat16)).to("cuda:1")
    layer1.load_state_dict(layer0.state_dict())
    x = torch.randn(3, 37, 4, 48, device="cuda:0").to(torch.bfloat16)
    results = []
    for dev, layer in (("cuda:0", layer0), ("cuda:1", layer1)):
        xi = x.detach().to(dev).requires_grad_()
        with torch.cuda.device(0):
            out = layer(xi)
            out.float().square().sum().backward()
        assert out.device == torch.device(dev) and xi.grad.device == torch.device(dev)
        assert all(p.grad.device == torch.device(dev) for p in layer.parameters())
        torch.cuda.synchronize(dev)
        results.append([out.cpu(), xi.grad.cpu()] + [p.grad.cpu() for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
