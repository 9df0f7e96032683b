"""Timers: CUDA-graph replays (CuPy, PyTorch), wall clock (JAX, host), the copy bandwidth."""

from __future__ import annotations

import collections
import statistics
import time

# ------------------------------------------------------------------------------ timing
def _stats(samples_ms) -> dict:
    us = [t * 1e3 for t in samples_ms]
    return {"us": statistics.median(us), "us_min": min(us), "us_max": max(us), "samples": len(us)}


def _time_cupy(call, sets: int, calls: int, warmup: int, reps: int) -> dict:
    """GPU time of ``call(k)`` (k = input set) from CUDA-graph replays; see the module doc."""
    import cupy as cp

    cp.cuda.Device().synchronize()  # inputs were made on the null stream; s does not wait for it
    s = cp.cuda.Stream(non_blocking=True)
    keep = collections.deque(maxlen=sets)
    with s:
        for i in range(max(warmup, sets)):
            keep.append(call(i % sets))
        s.synchronize()
        keep.clear()
        s.begin_capture()
        try:
            for i in range(calls):
                keep.append(call(i % sets))
        finally:
            graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(s)
            graph.launch(s)
            stop.record(s)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / calls)
    del graph
    keep.clear()
    return dict(_stats(times), method="cuda graph")


def _time_torch(prepare, sets: int, calls: int, warmup: int, reps: int, graph: bool = True) -> dict:
    """GPU time of PyTorch calls.  ``prepare()`` runs on the capture stream and returns
    ``call(k)``; calls are captured into a CUDA graph (fallback, or ``graph=False``: ``calls``
    eager calls between two CUDA events, so host overhead that the GPU does not hide counts)."""
    import torch

    torch.cuda.synchronize()  # inputs were made by CuPy on the null stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    keep = collections.deque(maxlen=sets)
    with torch.cuda.stream(s):
        call = prepare()
        for i in range(max(warmup, sets)):
            keep.append(call(i % sets))
    s.synchronize()
    keep.clear()
    capture, graph, method = graph, None, "events, eager calls"
    if capture:
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (JAX's, say) cannot invalidate the capture
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                for i in range(calls):
                    keep.append(call(i % sets))
            method = "cuda graph"
        except Exception as e:  # noqa: BLE001 - any capture failure: time eagerly instead
            graph, method = None, f"events, eager calls (graph capture failed: {type(e).__name__}: {str(e)[:120]})"
            keep.clear()
            torch.cuda.synchronize()

    def once():
        if graph is not None:
            graph.replay()
        else:
            for i in range(calls):
                keep.append(call(i % sets))

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(s):
        once()
        s.synchronize()
        for _ in range(reps):
            start.record(s)
            once()
            stop.record(s)
            stop.synchronize()
            times.append(start.elapsed_time(stop) / calls)
    del graph, call
    keep.clear()
    return dict(_stats(times), method=method)


def _time_wall(call, sets: int, calls: int, warmup: int, reps: int, sync) -> dict:
    """Wall-clock time per ``call(k)`` (k = input set, in turn): ``calls`` calls then
    ``sync(last results)``, per call, median of ``reps`` (host dispatch included)."""
    keep = collections.deque(maxlen=sets)
    for i in range(max(warmup, sets)):
        keep.append(call(i % sets))
    sync(list(keep))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(calls):
            keep.append(call(i % sets))
        sync(list(keep))
        times.append((time.perf_counter() - t) * 1e3 / calls)
    keep.clear()
    return dict(_stats(times), method="wall clock")


def _time_jax(call, sets: int, calls: int, warmup: int, reps: int) -> dict:
    """Wall-clock time per ``call(k)`` of a jitted JAX function (dispatch included)."""
    import jax

    return dict(_time_wall(call, sets, calls, warmup, reps, jax.block_until_ready),
                method="wall clock + block_until_ready")


def time_ms(fn, warmup: int = 3, reps: int = 20, per_graph: int = 10) -> float:
    """Median GPU time of one ``fn()`` in ms: ``per_graph`` calls in one CUDA graph,
    replayed between CUDA events (host overhead excluded; no input rotation: the
    caller's inputs are re-read every call, so keep them well above L2)."""
    return _time_cupy(lambda k: fn(), 1, per_graph, warmup, reps)["us"] / 1e3


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20, warmup: int = 3) -> dict:
    """Device-to-device copy bandwidth, GB/s = (bytes read + bytes written) / time.

    ``cupy.copyto`` between two ``nbytes`` buffers, run eagerly on the current stream
    (never captured: a graph turns the copy into a slower copy-engine node) between
    CUDA events; median of ``reps``.  Also an elementwise copy kernel, for reference.
    """
    import cupy as cp

    a = cp.random.default_rng(1).standard_normal(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    kernel = cp.ElementwiseKernel("T x", "T y", "y = x", "mhc_bench_copy")
    stream = cp.cuda.get_current_stream()
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def median_ms(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start.record(stream)
            fn()
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
        return statistics.median(times)

    ms = median_ms(lambda: cp.copyto(b, a))
    ms_kernel = median_ms(lambda: kernel(a, b))
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return {"GBps": 2 * nbytes / ms / 1e6, "kernel_GBps": 2 * nbytes / ms_kernel / 1e6, "bytes": 2 * nbytes,
            "method": f"cupy.copyto eager (not in a graph), 2 x {nbytes / 2**30:g} GiB buffers, CUDA events, "
                      f"median of {reps}; bytes = read + written.  kernel_GBps: an elementwise copy kernel, "
                      f"same method"}


def host_copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> dict:
    """Host memory copy bandwidth (``numpy.copyto``, wall clock, median of ``reps``; bytes read +
    written): the 100 % line of the layer and block modes when they run on the CPU."""
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    s = statistics.median(times[1:])
    return {"GBps": 2 * nbytes / s / 1e9, "bytes": 2 * nbytes,
            "method": f"numpy.copyto on the host, 2 x {nbytes / 2**20:g} MiB, wall clock, median of {reps}"}


def per_call_us(fn, sync, calls: int = 2000, warmup: int = 100, repeats: int = 5) -> float:
    """Host wall-clock microseconds per call of a tiny ``fn()`` in steady state: median over
    ``repeats`` bursts of ``calls // repeats`` calls, each burst ended by ``sync(last result)``."""
    last = None
    for _ in range(warmup):
        last = fn()
    sync(last)
    per = max(1, calls // repeats)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(per):
            last = fn()
        sync(last)
        samples.append((time.perf_counter() - t) / per * 1e6)
    return statistics.median(samples)

