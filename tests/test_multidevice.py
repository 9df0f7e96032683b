"""Multi-device support on the CPU (CI): JAX token sharding over 2 host devices,
PyTorch DDP / FSDP2 / torch.compile(DDP) with 2 gloo ranks.

Each check runs in its own processes (``tests/multidevice``): JAX takes its
device count from ``XLA_FLAGS`` once, when it initialises; torch.distributed
runs one process per rank (torchrun).  See
``tests/multidevice/jax_sharding_cases.py`` for the JAX checks and
``examples/distributed.py`` (``--check``) for the torch ones: losses and
parameters after 3 SGD steps equal to one process on the full batch
(float32, 1e-5 relative); with FSDP2's bf16 policy, phi / alpha / bias stay
float32 in the forward while the sublayers run in bfloat16.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from multidevice import ROOT, count_collectives, pytest_cases, torchrun


def test_count_collectives_sees_combined_and_async_ones():
    """XLA's combined collectives have a tuple type, printed with /*index=5*/ comments past five
    elements: each counts once, as do plain and async (-start) ones; -done and non-collective
    ops (and names that merely contain a collective's name) do not."""
    tup = ", ".join(f"{'/*index=5*/' if i == 5 else ''}f32[2,{i + 1}]{{1,0}}" for i in range(7))
    args = ", ".join(f"{'/*index=5*/' if i == 5 else ''}%p.{i}" for i in range(7))
    hlo = "\n".join([
        "HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[8]{0}}",
        f"  %all-gather = ({tup}) all-gather({args}), channel_id=1, replica_groups={{{{0,1}}}}, dimensions={{0}}",
        f"  ROOT %all-reduce.3 = ({tup}) all-reduce({args}), channel_id=2, to_apply=%region_0.0",
        "  %all-gather-start = (f32[2]{0}, f32[4]{0}) all-gather-start(f32[2]{0} %p), dimensions={0}",
        "  %all-gather-done = f32[4]{0} all-gather-done((f32[2]{0}, f32[4]{0}) %all-gather-start)",
        "  %all_gather.21 = f32[4,1]{1,0} all-gather(%param.7), channel_id=3, dimensions={0}",
        "  %all-reduce-copy = f32[4]{0} copy(f32[4]{0} %all-reduce.3)",
        "  %fusion = f32[4]{0:S(1)} fusion(%all-gather), kind=kLoop, calls=%fused_computation",
    ])
    assert count_collectives(hlo) == {"all-gather": 3, "all-reduce": 1}


@pytest.mark.slow
def test_jax_token_sharding_two_host_devices():
    pytest.importorskip("jax")
    pytest_cases("jax_sharding_cases.py", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                           "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_torch_ddp_fsdp2_compile_two_gloo_ranks():
    pytest.importorskip("torch")
    out = torchrun([str(ROOT / "examples" / "distributed.py"), "--mode", "ddp", "fsdp2", "fsdp2-bf16",
                    "ddp-compile", "--check"], env={"CUDA_VISIBLE_DEVICES": ""})
    for mode in ("ddp", "fsdp2", "fsdp2-bf16", "ddp-compile"):
        assert f"{mode}: 2 ranks on cpu" in out and f"{mode} check against one process on the full batch: OK" in out, \
            out[-4000:]


@pytest.mark.slow
def test_demo_torchrun_two_ranks_matches_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m mhc_cupy.demo``: DDP over 2 gloo ranks, each its half of every
    global batch; the held-out losses equal one process at the same global batch (float32 rounding)."""
    from mhc_cupy import demo

    common = ["--tiny", "--device", "cpu", "--steps", "6", "--eval-every", "3", "--layers", "1"]
    one = demo.main(common + ["--out", str(tmp_path / "one")])
    out = torchrun(["-m", "mhc_cupy.demo", *common, "--out", str(tmp_path / "two")],
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.count("data-parallel: 2 ranks (DistributedDataParallel, gloo)") == 1, out[-3000:]
    assert out.count("wrote ") == 1, out[-3000:]  # rank 0 only
    with open(tmp_path / "two" / "summary.json") as f:
        two = json.load(f)
    assert two["ranks"] == 2 and one["ranks"] == 1
    assert two["mhc"]["eval_step"] == one["mhc"]["eval_step"] == [0, 3, 6]
    np.testing.assert_allclose(two["mhc"]["eval_loss"], one["mhc"]["eval_loss"], rtol=1e-5)
    assert two["mhc"]["eval_loss"][-1] < two["mhc"]["eval_loss"][0] - 0.1  # it trained
