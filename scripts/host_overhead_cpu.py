"""Host cost per call of mhc_cupy's GPU route, measured on a machine without a GPU (a proxy).

CPU torch tensors pose as device-0 CUDA tensors; each op is planned as for the GPU (``_jit.dry_run``:
no compiler, no device), its outputs and temporaries are allocated on the CPU, and its recorded
launches are no-ops.  What is timed is therefore mhc_cupy's Python work plus the allocations, not
cuLaunchKernel nor the CUDA caching allocator: use it to compare two versions of the host code on
one machine, and ``python -m mhc_cupy.bench`` (host rows) on a GPU for the real numbers.

    python scripts/host_overhead_cpu.py
    python scripts/host_overhead_cpu.py --plans   # also: the plans' Python per call at 8192 x 2048 x 4 (what a
                                                  # JAX callback, a first call or a call that cannot replay runs)
"""

from __future__ import annotations

import sys
import time

import torch

import mhc_cupy as m
import mhc_cupy.torch as mt
from mhc_cupy import _dispatch, _interop, _jit
from mhc_cupy._kernel_choice import kernel_choice


class _NoLaunch:
    @staticmethod
    def launch(ptrs, stream):
        pass


class _FrontEnd:
    """The torch front end, on the CPU, with stream 0."""

    name = "torch"
    from_name = _interop.frontend("torch").from_name

    def empty(self, shape, dtype, like):
        return like.new_empty(shape, dtype=self.from_name[dtype])

    @staticmethod
    def ptr(x):
        return x.data_ptr()

    @staticmethod
    def stream(dev):
        return 0


_REPLAY = _NoLaunch()  # the fast-path entries' replay (None: their plans launch, dry runs record them)


def _first_call(planner, arrays, fast_key, params):
    """In place of ``_dispatch._run`` (a key's first call): plan as for device 0, remember the entry."""
    arrays = {k: None if v is None else v.contiguous() for k, v in arrays.items()}
    for v in arrays.values():
        if v is not None:
            _dispatch._framework(v)
    fast = _dispatch._fast_inputs(arrays)
    infos = {k: None if v is None else _interop.ArrayInfo(tuple(v.shape), str(v.dtype)[6:], ("cuda", 0))
             for k, v in arrays.items()}
    with _jit.dry_run():
        plan = _dispatch._plan(planner, infos, params)
    entry = _dispatch._fast[_dispatch._key(planner, fast[0], params)] = _dispatch._Entry(plan, _FrontEnd(), 0,
                                                                                           _REPLAY)
    return _dispatch._run_fast(entry, fast[1], fast[2], arrays)


def pose_as_gpu(setattr=setattr, record: bool = False) -> None:
    """Patch torch and mhc_cupy so that CPU tensors take the GPU route (this process only; tests pass
    ``monkeypatch.setattr``).  ``record``: the fast path's calls launch their plans (which, within
    ``_jit.dry_run()``, record their launches), else nothing."""
    global _REPLAY
    setattr(torch.Tensor, "get_device", lambda self: 0)
    setattr(_dispatch, "_get_device", lambda: 0)
    setattr(_dispatch._replay, "ensure_context", lambda dev: None)
    setattr(_dispatch._replay, "aligned", lambda ptrs: True)
    setattr(_dispatch, "_run", _first_call)
    _REPLAY = None if record else _NoLaunch()


def per_call_us(f, calls: int = 4000, bursts: int = 15) -> float:
    """Minimum over bursts of the mean wall time per call, after 200 warm-up calls."""
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(bursts):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def plan_python_us(tokens: int = 8192, n: int = 4, C: int = 2048) -> dict:
    """{op: (launches, us a call)}: the Python of the layer ops' plans (``Plan.launch`` on fake bf16 pointers,
    ``_jit.dry_run``, its name normalising stubbed: not on the launch path), best of 7 bursts; CuPy's
    launch itself is not in it."""
    from mhc_cupy import _kernels
    from mhc_cupy.ops import SPECS

    real, _jit.normalise = _jit.normalise, lambda expr: expr
    out = {}
    try:
        for op, absent in (("mhc_layer_pre_fwd", ()), ("mhc_post_op_fwd", ()), ("mhc_layer_post_bwd", ()),
                           ("mhc_layer_pre_bwd", ("layer_out", "grad_x"))):
            k = SPECS[op]
            infos = _kernels._infos(k, (tokens,), {"n": n, "C": C, "K": n * n + 2 * n}, "bfloat16", "bfloat16",
                                    _kernels._ALIGNED)
            infos.update(dict.fromkeys(absent))
            plan = k.planner(infos, **k.params)
            ptrs = {a: None if v is None else v.ptr for a, v in infos.items()}
            outs, scratch = [_kernels._ALIGNED] * len(plan.outputs), [_kernels._ALIGNED] * len(plan.scratch)
            with _jit.dry_run() as launches:
                us = per_call_us(lambda: (plan.launch(ptrs, outs, scratch, 0), launches.clear()), 500, 7)
                plan.launch(ptrs, outs, scratch, 0)
                out[op] = (len(launches), us)
    finally:
        _jit.normalise = real
    return out


def main() -> None:
    pose_as_gpu()
    torch.manual_seed(0)
    T, n, C = 1, 4, 64
    x = torch.randn(T, n, C, dtype=torch.bfloat16)
    M = torch.rand(T, n, n)
    xg = x.detach().requires_grad_()
    g = torch.randn_like(x)
    layer = mt.MHC(C, n, torch.nn.Identity())
    rows = {
        "torch.add (no grad)": lambda: torch.add(x, x),
        "torch.add (requires grad)": lambda: torch.add(xg, xg),
        "functional stream_mix_fwd": lambda: m.stream_mix_fwd(x, M),
        "mhc_cupy.torch.stream_mix (no grad)": lambda: mt.stream_mix(x, M),
        "mhc_cupy.torch.stream_mix (requires grad)": lambda: mt.stream_mix(xg, M),
        "functional mhc_layer_pre_fwd": lambda: m.mhc_layer_pre_fwd(x, layer.phi.detach(), layer.alpha.detach(),
                                                                   layer.bias.detach()),
        "MHC forward (requires grad)": lambda: layer(xg),
        "MHC forward + backward": lambda: layer(xg).backward(g),
        "torch.add forward + backward": lambda: torch.add(xg, xg).backward(g),
    }
    print(f"host cost per call on the CPU, launches stubbed out (tokens {T}, n {n}, C {C}, bfloat16), us:")
    with torch.no_grad():
        print(f"  {'MHC forward (no grad)':44s} {per_call_us(lambda: layer(x), 1000):8.2f}")
        with kernel_choice(lane=True):  # (mhc_cupy.torch._no_grad; off by default until checked on a GPU)
            print(f"  {'MHC forward (no grad), kernel choice lane':44s} {per_call_us(lambda: layer(x), 1000):8.2f}")
    for name, f in rows.items():
        print(f"  {name:44s} {per_call_us(f, 1000 if 'MHC' in name else 4000):8.2f}")
    if "--plans" in sys.argv:
        print("the plans' Python per call (8192 x 2048 x 4 bfloat16, dry run; no CuPy launch), us:")
        for op, (count, us) in plan_python_us().items():
            print(f"  {op:24s} {count:2d} launches {us:8.1f}")


if __name__ == "__main__":
    main()
