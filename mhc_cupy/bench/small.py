"""Small mode: the mHC layer forward at decode-sized token counts (``python -m mhc_cupy.bench --small``).

Inference runs mHC on 1-256 tokens a step, where launches and host time, not bandwidth, decide
the cost.  Per token count T (default 1, 8, 64, 256, 4096) at one C and n (default 7168, 4): the
forward of one layer with an identity sublayer, without autograd (``torch.no_grad``), on
``x [T, n, C]``, for

* ``mhc_cupy``: ``mhc_cupy.torch.MHC(C, n)``;
* ``mhc_cupy small`` (T <= 64): the same under the kernel choice ``small=True`` (the coefficient GEMV
  and the pre piece's tail kernel: two launches for the pre piece; off by default: slower under CUDA
  graphs on the H200);
* ``mhc_cupy tail`` (T <= 64): under the kernel choice ``tail=True`` (the default tensor-core GEMM, then
  the pre piece's tail kernel: three launches for the pre piece instead of five, the default's bits);
* ``mhc_cupy MHCStack, per layer``: an :class:`mhc_cupy.torch.MHCStack` of ``STACK_LAYERS`` such layers
  (identity sublayers; a decode step of a model), its times and counts per layer: the whole stack's
  forward captured in one CUDA graph, and eager; ``... fused``: with ``fuse_boundaries=True`` (each residual
  update and the next layer's pre piece one op: one call less a layer);
* ``mhc_cupy lane`` / ``mhc_cupy lane off``: the layer under the kernel choice ``lane=True`` / ``False`` (the
  repeated no-grad call through :mod:`mhc_cupy.torch._no_grad`, the same launches with less host work; off by
  default until checked on a GPU), each call inside the same ``kernel_choice`` block, so the two eager
  times compare; ``mhc_cupy MHCStack lane, per layer``: the stack so; ``mhc_cupy tail lane`` (T <= 64): tail
  and lane together;
* ``torch`` / ``torch.compile``: ``mhc_cupy.torch.reference.MHCReference`` (the same maths and
  parameters in plain torch ops), eager and ``torch.compile(dynamic=False)``, each where it is
  among the baselines (``--baselines``; none with ``--no-baselines``).

Two times per row: ``eager us``, the wall clock per call of back-to-back calls (host dispatch
included: what an eager decode loop pays), and ``graph us``, the CUDA-event time per replayed call
of a CUDA graph of ``calls`` calls (host excluded: what a captured decode step pays; GPU only).
For mhc_cupy's rows on a GPU, what bounds the eager time from below whatever the Python around it
(:func:`host_counts`, :func:`host_unit_costs`): the kernel launches and the PyTorch allocations of
one call, and ``driver floor us`` = launches x the host time of one ``cuLaunchKernel`` (an empty
kernel) + allocations x that of one ``torch.empty`` on the GPU, both measured in the same run.
Targets (issue 43): T <= 64 at C 7168 graph replay <= 8 us, eager <= 30 us and <= torch.compile's.
"""

from __future__ import annotations

from pathlib import Path

from ..ops.coeffs.fwd import SMALL_MAX_TOKENS
from . import env
from .report import gpu_targets, mode_report, run_rows, target

#: Default token counts, hidden size and streams.
SMALL_TOKENS, SMALL_C, SMALL_N = (1, 8, 64, 256, 4096), 7168, 4
#: Layers of the "mhc_cupy MHCStack, per layer" row (its times and counts are the stack's / STACK_LAYERS).
STACK_LAYERS = 8
#: Targets at T <= 64 (C 7168): graph replay and eager wall time per call of mhc_cupy, microseconds.
SMALL_TARGETS = {"graph": 8.0, "eager": 30.0}


def small_case(T: int, C: int, n: int, cfg, on_gpu: bool, compile_: bool) -> dict:
    """Time every implementation at T tokens; returns the result row."""
    import torch

    import mhc_cupy.torch as mt
    from mhc_cupy.torch.reference import MHCReference

    from .timing import per_call_us

    dev = torch.device("cuda" if on_gpu else "cpu")
    dt = getattr(torch, cfg.dtype)
    torch.manual_seed(0)
    layer = mt.MHC(C, n, device=dev)
    impls = {"mhc_cupy": layer}
    stack = [layer] + [mt.MHC(C, n, device=dev) for _ in range(STACK_LAYERS - 1)]
    impls["mhc_cupy MHCStack, per layer"] = mt.MHCStack(stack)
    impls["mhc_cupy MHCStack fused, per layer"] = mt.MHCStack(stack, fuse_boundaries=True)
    # the no-grad lane's A/B, both rows paying the same kernel_choice block around each call
    impls["mhc_cupy lane"], impls["mhc_cupy lane off"] = _chosen(layer, lane=True), _chosen(layer, lane=False)
    impls["mhc_cupy MHCStack lane, per layer"] = _chosen(mt.MHCStack(stack), lane=True)
    if "torch" in cfg.baselines:
        impls["torch"] = MHCReference.from_layer(layer)
    if T <= SMALL_MAX_TOKENS:  # (where the small-token forward and the one-launch tail apply)
        impls["mhc_cupy small"] = _chosen(layer, small=True)
        impls["mhc_cupy tail"] = _chosen(layer, tail=True, small=False)  # (small would take precedence)
        impls["mhc_cupy tail lane"] = _chosen(layer, tail=True, small=False, lane=True)  # (the fewest launches and
        # the least host work together)
    if compile_:
        torch._dynamo.reset()
        impls["torch.compile"] = torch.compile(MHCReference.from_layer(layer), dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn((T, n, C), generator=gen, device=dev, dtype=torch.float32).to(dt)
    sync = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)
    row = {"tokens": T, "C": C, "n": n, "dtype": cfg.dtype, "impls": {}}
    for name, fn in impls.items():
        v = row["impls"][name] = {}
        try:
            with torch.no_grad():
                v["eager_us"] = per_call_us(lambda: fn(x), sync, calls=max(cfg.reps * cfg.min_calls, 10),
                                            warmup=max(cfg.warmup, 1), repeats=min(cfg.reps, 5))
                if on_gpu:
                    v.update(graph_time(lambda: fn(x), cfg))
        except Exception as e:  # noqa: BLE001 - report and go on
            v.update(env._error(e))
        if on_gpu and name.startswith("mhc_cupy") and "error" not in v:
            with torch.no_grad():
                v.update(host_counts(lambda: fn(x)))
            unit = host_unit_costs()
            v["driver_floor_us"] = v["launches"] * unit["launch_us"] + v["allocations"] * unit["allocation_us"]
        for k in ("eager_us", "graph_us", "launches", "allocations", "driver_floor_us"):
            if k in v and name.endswith("per layer"):  # (timed over the stack's STACK_LAYERS layers)
                v[k] /= STACK_LAYERS
        env._log(f"  {name}: " + ", ".join(f"{k} {v[k]:.1f}" for k in ("eager_us", "graph_us", "driver_floor_us")
                                           if k in v)
                 + (f" {v['error']}" if "error" in v else ""))
        env._free_gpu_memory()
    if on_gpu:
        row["host_unit_us"] = host_unit_costs()
    return row


def graph_time(call, cfg) -> dict:
    """{"graph_us": CUDA-event time per replayed ``call()`` of a graph of ``cfg.min_calls`` calls}, or, where
    the capture failed and the timer fell back to eager calls, {"graph_method": what it timed} (not a replay)."""
    from .timing import _time_torch

    res = _time_torch(lambda: lambda k: call(), 1, cfg.min_calls, cfg.warmup, cfg.reps, graph=True)
    return {"graph_us": res["us"]} if res["method"] == "cuda graph" else {"graph_method": res["method"]}


def host_counts(call) -> dict:
    """{"launches", "allocations"}: the kernel launches mhc_cupy queues (replayed or not) and the
    allocations PyTorch's CUDA allocator serves during one ``call()`` (GPU only; warmed up first, so
    a steady-state call, compiled and planned)."""
    import torch

    from .. import _replay

    call()
    _replay._driver_launch()  # (binds _replay._driver)
    real, count = _replay._driver, [0]

    class Counting:  # the replay path's cuLaunchKernel, counted
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def launchKernel(*args):
            count[0] += 1
            return real.launchKernel(*args)

    def allocated():
        return torch.cuda.memory_stats().get("allocation.all.allocated", 0)

    _replay._driver = Counting()
    try:
        with _replay.recording() as general:  # the general path's launches
            before = allocated()
            call()
            allocations = allocated() - before
    finally:
        _replay._driver = real
    return {"launches": count[0] + len(general), "allocations": allocations}


_UNIT_COSTS: dict = {}


def host_unit_costs() -> dict:
    """{"launch_us", "allocation_us"}: host wall time of one ``cuLaunchKernel`` of an empty kernel
    (CuPy's driver binding, as mhc_cupy's replayed launches) and of one ``torch.empty(64)`` on the
    current GPU, per call of back-to-back calls (median of 5 bursts); measured once per process."""
    if not _UNIT_COSTS:
        import cupy
        import torch

        from .. import _replay
        from .timing import per_call_us

        kernel = cupy.RawKernel(r'extern "C" __global__ void mhc_bench_empty() {}', "mhc_bench_empty")
        kernel((1,), (32,), ())  # loaded
        fn, stream, launch = kernel.kernel.ptr, torch.cuda.current_stream().cuda_stream, _replay._driver_launch()
        sync = lambda _: torch.cuda.synchronize()  # noqa: E731
        _UNIT_COSTS["launch_us"] = per_call_us(lambda: launch(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), sync)
        _UNIT_COSTS["allocation_us"] = per_call_us(lambda: torch.empty(64, device="cuda"), sync)
    return dict(_UNIT_COSTS)


def _chosen(fn, **variants):
    """fn called with the kernel choice ``variants`` in force (mhc_cupy._kernel_choice)."""
    from .._kernel_choice import kernel_choice

    def call(x):
        with kernel_choice(**variants):
            return fn(x)

    return call


def run_small(cfg) -> dict:
    """Run the small mode ``cfg`` asks for (parsed arguments); returns the result dict."""
    result, on_gpu, compile_, t0 = env.torch_mode_start(cfg, "small", tokens=list(cfg.small_tokens), C=cfg.small_C, n=cfg.streams)
    return run_rows(result, Path(cfg.out) / "small.json", cfg.small_tokens, lambda T: f"small: {T} tokens",
                    lambda T: small_case(T, cfg.small_C, cfg.streams, cfg, on_gpu, compile_),
                    evaluate_small_targets, t0)


@gpu_targets
def evaluate_small_targets(result: dict) -> list[dict]:
    """mhc_cupy's graph replay and eager time per call at T <= 64, C 7168, against issue 43's targets."""
    out = []
    rows = [r for r in result.get("results", []) if r["tokens"] <= 64 and r["C"] == SMALL_C]
    for kind, goal in SMALL_TARGETS.items():
        name = f"layer forward, T <= 64, C {SMALL_C}, {kind} per call <= {goal:g} us"
        got = [r["impls"]["mhc_cupy"].get(f"{kind}_us") for r in rows]
        worst = None if not got or None in got else max(got)
        out.append(target(name, worst, goal, "" if worst is None else f"worst {worst:.1f} us"))
    # eager per call no slower than torch.compile's (of MHCReference), at every such T
    name = f"layer forward, T <= 64, C {SMALL_C}, eager per call <= torch.compile's"
    pairs = [(r["impls"]["mhc_cupy"].get("eager_us"), r["impls"].get("torch.compile", {}).get("eager_us"), r["tokens"])
             for r in rows]
    worst = (None if not pairs or any(a is None or b is None for a, b, _ in pairs)
             else max((a / b, T) for a, b, T in pairs))
    out.append(target(name, None if worst is None else worst[0], 1.0,
                      "" if worst is None else f"worst {worst[0]:.2f}x torch.compile's at T {worst[1]}"))
    return out


def format_small_report(result: dict) -> str:
    """The small mode's report (markdown): header, targets, table."""
    st = result.get("meta", {}).get("settings", {})

    def cells(r, name, v):
        times = [f"{v[k]:.1f}" if k in v else ("err" if "error" in v else "") for k in ("eager_us", "graph_us")]
        floor = f"{v['launches']:g} / {v['allocations']:g} / {v['driver_floor_us']:.1f}" if "driver_floor_us" in v else ""
        return [str(r["tokens"]), name, *times, floor]

    return mode_report(
        result, "small",
        f"one mHC layer forward (identity sublayer, no autograd), C {st.get('C')}, n {st.get('n')} (the MHCStack row: a "
        f"stack of {STACK_LAYERS} such layers, per layer); eager = wall clock "
        "per back-to-back call (host included); graph = CUDA-event time per replayed call (GPU only); "
        "launches / allocations / driver floor us = kernel launches and PyTorch allocations of one call, and their "
        "host time at this run's cost of one cuLaunchKernel and one torch.empty (mhc_cupy on a GPU: what bounds "
        "eager from below)",
        evaluate_small_targets, ("tokens", "impl", "eager us", "graph us", "launches / allocations / driver floor us"),
        cells)
