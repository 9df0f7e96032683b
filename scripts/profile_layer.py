"""Where the time of one mHC layer goes: the device time of each kernel in the forward
(``torch.no_grad``) and in a training step (forward + ``torch.autograd.grad`` of x, phi,
alpha, bias), per call, from ``torch.profiler``.

The layer is ``mhc_cupy.torch.MHC`` with an identity sublayer (bf16 streams unless
``--dtype``), run as ``python -m mhc_cupy.bench --layer`` runs it; ``--fused both`` profiles
the fused pieces and the separate ops.  Use it to see which kernel a layer-level change
should target before spending device time on the whole benchmark.  Without a GPU it runs
the NumPy reference on the CPU and lists CPU operators instead (a smoke test).

Usage (repo root):
    python scripts/profile_layer.py [--shapes 16384x4096x4,8192x1024x16] [--dtype bfloat16]
                                    [--steps 5] [--fused default|both] [--rows 14] [--choose small=true]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mhc_cupy.torch as mt
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.bench.cli import _choice


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'TxCxn,...' -> [(T, C, n), ...]."""
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes must be TxCxn[,TxCxn...] with positive sizes, got {text!r}")
    return shapes


def kernel_table(prof, on_gpu: bool, calls: int, rows: int) -> str:
    """The events that took the most self time (CUDA kernels on a GPU, CPU operators
    without one), in microseconds per call and as a share of their sum."""
    events = prof.key_averages()
    attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = [e for e in events if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, attr))
    lines = [f"  {'us/call':>9} {'share':>6} {'count/call':>10}  name",
             f"  {total / calls:9.1f} {100.0:5.1f}% {'':>10}  (all)"]
    for e in events[:rows]:
        lines.append(f"  {getattr(e, attr) / calls:9.1f} {100 * getattr(e, attr) / total:5.1f}% "
                     f"{e.count / calls:10.2g}  {e.key[:110]}")
    return "\n".join(lines)


def profile_shape(T: int, C: int, n: int, dtype, fused: bool | None, steps: int, rows: int, dev: str) -> str:
    torch.manual_seed(0)
    x = torch.randn(T, n, C, device=dev, dtype=dtype)
    g = torch.randn(T, n, C, device=dev, dtype=dtype)
    with kernel_choice(fused=fused):  # as the benchmark builds its variants (mhc_cupy.bench.layer.kernel_variants)
        layer = mt.MHC(C, n, sublayer=torch.nn.Identity(), device=dev)
    params = [layer.phi, layer.alpha, layer.bias]

    def fwd():
        with torch.no_grad():
            return layer(x)

    def train_step():
        xx = x.detach().requires_grad_()
        return torch.autograd.grad(layer(xx), [xx] + params, g)

    on_gpu = dev == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    out = [f"=== {T}x{C}x{n} {str(dtype).replace('torch.', '')}"
           + ("" if fused is None else (" fused" if fused else " unfused"))]
    for name, step in (("forward", fwd), ("forward + backward", train_step)):
        for _ in range(3):  # compile, caches, allocator
            step()
        if on_gpu:
            torch.cuda.synchronize()
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                step()
            if on_gpu:
                torch.cuda.synchronize()
        out.append(f"{name} ({'kernels' if on_gpu else 'CPU operators'}, per call, {steps} calls):")
        out.append(kernel_table(prof, on_gpu, steps, rows))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16384x4096x4,16384x2048x8,8192x1024x16", help="TxCxn,... (tokens x C x n)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--steps", type=int, default=5, help="profiled calls per measurement (default 5)")
    ap.add_argument("--fused", default="default", choices=("default", "both"),
                    help="default: the layer's own choice; both: the fused pieces and the separate ops")
    ap.add_argument("--rows", type=int, default=14, help="kernels listed per table (default 14)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--choose", default="", metavar="VARIANT=BOOL,...",
                    help="kernel choices in force (mhc_cupy._kernel_choice), as bench --choose")
    cfg = ap.parse_args(argv)
    choose = _choice(cfg.choose, ap)
    if cfg.steps < 1 or cfg.rows < 1:
        raise SystemExit("--steps and --rows must be at least 1")
    dev = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cpu":
        print("no GPU: profiling the NumPy reference path (CPU operators)", file=sys.stderr)
    for T, C, n in parse_shapes(cfg.shapes):
        for fused in ((None,) if cfg.fused == "default" else (True, False)):
            with kernel_choice(**choose):
                text = profile_shape(T, C, n, getattr(torch, cfg.dtype), fused, cfg.steps, cfg.rows, dev)
            print(text.replace("\n", f" (choose {cfg.choose})\n", 1) if choose else text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
