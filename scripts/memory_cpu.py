"""Peak memory of a training step of bench --stack's models, on a machine without a GPU (a proxy).

CPU tensors take mhc_cupy's GPU route (``host_overhead_cpu.pose_as_gpu``: plans as for the GPU,
outputs and temporaries allocated as there, launches no-ops, so values are garbage), and the
torch profiler's allocator events give the peak bytes held during one step
``torch.autograd.grad(model(x), [x, *weights], g)`` beyond what was held before it (bench's measure).
The mHC pieces allocate and save as on a GPU; the sublayers' own transients (CPU SDPA, RMSNorm)
differ from CUDA's, so compare the mHC variants' extra over plain, in [T, C] units (the bytes of one
activation of the plain model), and measure the ratio on a GPU (``python -m mhc_cupy.bench --stack``).

    python scripts/memory_cpu.py --config 4:1024:8:2752:512 --recompute auto,2,3
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_overhead_cpu  # noqa: E402

import mhc_cupy.torch as mt  # noqa: E402
from mhc_cupy.bench.stack import build_models  # noqa: E402


def peak_bytes(step) -> int:
    """Peak of the CPU allocator's bytes held during ``step()`` beyond those held before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="4:1024:8:2752:512", help="blocks:C:heads:ffn:tokens (one sequence)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--recompute", default="auto,2", help="MHCStack recompute settings besides none")
    args = ap.parse_args()
    L, C, heads, ffn, S = (int(v) for v in args.config.split(":"))
    n = args.streams
    host_overhead_cpu.pose_as_gpu()
    torch.manual_seed(0)
    models = build_models(L, C, heads, ffn, n, torch.device("cpu"), torch.bfloat16)
    variants = {"plain": models["plain"], "MHCStack": models["MHCStack"]}
    for r in args.recompute.split(","):
        r = r if r == "auto" else int(r)
        variants[f"MHCStack recompute={r!r} {mt.block_sizes(r, n, 2 * L)}"] = mt.MHCStack(models["MHCStack"].layers,
                                                                                       recompute=r)
    unit = S * C * 2
    print(f"{L} blocks (2L = {2 * L} mHC layers), C {C}, {S} tokens, n {n}, bfloat16; peak of one step, "
          f"in [T, C] units of {unit / 2**20:.2f} MiB")
    plain = None
    for name, model in variants.items():
        shape = (1, S, C) if name == "plain" else (1, S, n, C)
        x, g = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
        params = list(model.parameters())

        def step():
            xg = x.detach().requires_grad_()
            torch.autograd.grad(model(xg), [xg, *params], g)

        step()
        p = peak_bytes(step) / unit
        plain = plain or p
        print(f"  {name:52s} {p:8.1f}   over plain {p - plain:+7.1f}", flush=True)


if __name__ == "__main__":
    main()
