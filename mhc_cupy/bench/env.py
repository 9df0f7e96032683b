"""Probes of the environment (GPU, PyTorch, JAX, device, versions) and run helpers."""

from __future__ import annotations

import contextlib
import importlib
import sys

#: PyTorch intra-op threads of a --layer / --block run without a CUDA GPU (see :func:`cpu_torch_threads`).
CPU_TORCH_THREADS = 1


def _import(module: str, label: str):
    """(the module, None) when ``module`` imports, else (None, why not)."""
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001
        return None, f"{label} is not importable ({type(e).__name__}: {e})"


def _import_status(module: str) -> str | None:
    """None when ``module`` imports, else why not."""
    return _import(module, module)[1]


def _status(module: str, label: str, gpu_problem_of) -> str | None:
    """None when ``module`` imports and ``gpu_problem_of(module)`` is None, else why not."""
    mod, why = _import(module, label)
    return why or gpu_problem_of(mod)


def _cupy_gpu(cupy) -> str | None:
    try:
        if not cupy.cuda.is_available():
            return "no CUDA GPU is visible (cupy.cuda.is_available() is False)"
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"the CUDA runtime failed ({type(e).__name__}: {e})"
    return None


def _jax_gpu(jax) -> str | None:
    try:
        jax.devices("gpu")
    except Exception as e:  # noqa: BLE001
        return f"JAX {jax.__version__} has no GPU backend ({type(e).__name__}: {str(e)[:160]})"
    return None


def gpu_problem() -> str | None:
    """Why the GPU benchmarks cannot run here, or None."""
    return _status("cupy", "CuPy", _cupy_gpu)


def _torch_status() -> str | None:
    """None when PyTorch with a CUDA device is usable, else why not."""
    return _status("torch", "PyTorch",
                   lambda torch: None if torch.cuda.is_available() else f"PyTorch {torch.__version__} sees no CUDA device")


def _jax_status() -> str | None:
    """None when JAX with a GPU backend is usable, else why not."""
    return _status("jax", "JAX", _jax_gpu)


def _device_meta() -> dict:
    import cupy as cp

    d = cp.cuda.Device()
    p = cp.cuda.runtime.getDeviceProperties(d.id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    l2 = p.get("l2CacheSize")
    if not l2:
        try:
            l2 = d.attributes["L2CacheSize"]
        except Exception:  # noqa: BLE001
            l2 = None
    meta = {"name": name, "ordinal": d.id, "sm": f"{p['major']}{p['minor']}",
            "multiprocessors": p.get("multiProcessorCount"), "memory_bytes": p.get("totalGlobalMem"),
            "l2_bytes": l2}
    clock, width = p.get("memoryClockRate"), p.get("memoryBusWidth")
    if clock and width:  # kHz, bits; DDR: 2 transfers per clock
        meta["datasheet_style_peak_GBps"] = 2 * clock * 1e3 * width / 8 / 1e9
    return meta


def _versions() -> dict:
    from ..__main__ import info

    v = dict(info())
    for mod in ("jaxlib", "triton", "matplotlib"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"not available ({type(e).__name__})"
    try:
        import torch

        v["torch CUDA"] = str(torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    return v


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    if gpu_problem() is None:  # the layer and block modes also run without a GPU
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


@contextlib.contextmanager
def cpu_torch_threads():
    """Within the block, when PyTorch sees no CUDA device: PyTorch on :data:`CPU_TORCH_THREADS`
    intra-op thread(s), restored after; yields that number (None with a CUDA device: nothing changes).

    Without a GPU the layer and block modes time wall clock, and mhc_cupy's rows run the NumPy
    reference, whose BLAS keeps its own thread pool, between PyTorch ops.  A second (PyTorch)
    pool on the same cores spins against it and against any other busy process, so a row's time
    depended on the machine's load more than on its work: on 2 cores shared with other work,
    plain torch's layer forward took 292 ms with 2 threads and 6 ms with one (forward + backward
    271 / 38 ms), a forward "slower" than forward + backward (issue 41 item 17; the demo runs
    its CPU configuration on one PyTorch thread for the same reason).
    """
    import torch

    if torch.cuda.is_available():
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_TORCH_THREADS)
    try:
        yield CPU_TORCH_THREADS
    finally:
        torch.set_num_threads(before)

def torch_mode_start(cfg, mode: str, **settings) -> tuple:
    """Start a PyTorch mode's run (``--block``, ``--stack``, ``--small``): ``(result, on_gpu, compile_, t0)``
    with the result's skeleton (schema, meta: date, argv, device, versions, the timing settings, whether
    torch.compile is among the baselines and ``settings``; the copy bandwidth; empty lists), whether
    a CUDA GPU runs it, whether to compile, and the start time; ``cfg.out`` made."""
    import datetime
    import time
    from pathlib import Path

    import torch

    from .timing import copy_bandwidth, host_copy_bandwidth

    t0 = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    compile_ = "torch.compile" in cfg.baselines
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    device = _device_meta() if on_gpu else {"name": "CPU (no CUDA GPU: wall clock)", "sm": None}
    result = {
        "schema": f"mhc_cupy.bench.{mode}/1",
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "argv": list(cfg.argv), "device": device, "versions": _versions(),
                 "settings": {"mode": mode, "dtype": cfg.dtype, "reps": cfg.reps, "warmup": cfg.warmup,
                              "calls": cfg.min_calls, "graph": cfg.graph, "compile": compile_, **settings}},
        "copy": copy_bandwidth() if on_gpu else host_copy_bandwidth(), "results": [], "targets": [], "skipped": [],
    }
    return result, on_gpu, compile_, t0
