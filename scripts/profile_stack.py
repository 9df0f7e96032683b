"""Where a model's training step goes: plain residual blocks vs the same blocks with mHC
(``python -m mhc_cupy.bench --stack``'s models), per step: wall time (CUDA events), the device time
of every kernel summed (torch.profiler) and the share of it in mhc_cupy's kernels, and the device's
idle share (1 - device time / wall time: a step whose GPU waits for the host).

Use it to see what a network-level change should target (the mHC kernels, the sublayers, or the
host) before spending device time on the whole benchmark.  Without a GPU it runs on the CPU (the
NumPy reference; wall time only: a smoke test).

Usage (repo root):
    python scripts/profile_stack.py [--config 8:2048:16:5504:4:2048] [--steps 5] [--rows 12]
                                    [--variants plain,MHCStack,"MHCStack fused"] [--choose boundary=true]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.bench.stack import build_models


def _choice(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        out[k] = {"true": True, "false": False}[v.lower()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="8:2048:16:5504:4:2048", help="L:C:heads:ffn:batch:seq")
    ap.add_argument("--variants", default="plain,MHCStack,MHCStack recompute,MHCStack fused",
                    help="names of mhc_cupy.bench.stack.build_models' models, comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=12, help="kernels listed per variant")
    ap.add_argument("--choose", default="", help="kernel choice in force, VARIANT=true|false,...")
    cfg = ap.parse_args(argv)
    L, C, heads, ffn, B, S = (int(v) for v in cfg.config.split(":"))
    on_gpu = torch.cuda.is_available()
    dev, dt, n = ("cuda" if on_gpu else "cpu"), torch.bfloat16, 4
    with kernel_choice(**_choice(cfg.choose)):
        torch.manual_seed(0)
        models = build_models(L, C, heads, ffn, n, dev, dt)
        for name in cfg.variants.split(","):
            model = models[name]
            shape = (B, S, C) if name.startswith("plain") else (B, S, n, C)
            x = torch.randn(shape, device=dev, dtype=dt, requires_grad=True)
            g = torch.randn(shape, device=dev, dtype=dt)
            params = list(model.parameters())

            def step():
                return torch.autograd.grad(model(x), [x, *params], g)

            for _ in range(3):
                step()
            if on_gpu:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            with profile(activities=acts) as prof:
                for _ in range(cfg.steps):
                    step()
                if on_gpu:
                    end.record()
                    torch.cuda.synchronize()
            wall = (start.elapsed_time(end) * 1e3 if on_gpu else (time.perf_counter() - t0) * 1e6) / cfg.steps
            line = f"=== {name}: {wall / 1e3:.3f} ms per step (profiled, {cfg.steps} steps)"
            if on_gpu:
                events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
                total = sum(e.self_device_time_total for e in events) / cfg.steps
                mhc = sum(e.self_device_time_total for e in events if "mhc_" in e.key) / cfg.steps
                line += (f"; device time {total / 1e3:.3f} ms (mhc_cupy kernels {mhc / 1e3:.3f} ms, "
                         f"{100 * mhc / max(total, 1e-9):.1f}%); device idle {100 * (1 - total / wall):.1f}%")
                events.sort(key=lambda e: -e.self_device_time_total)
                rows = [f"  {e.self_device_time_total / cfg.steps:9.1f} us {e.count / cfg.steps:6.3g}x  {e.key[:100]}"
                        for e in events[:cfg.rows]]
                line += "\n" + "\n".join(rows)
            print(line, flush=True)
            del x, g
    return 0


if __name__ == "__main__":
    sys.exit(main())
