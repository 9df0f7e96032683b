"""Host overhead of one tiny op call, and where it goes (cProfile).

Compares: a raw CuPy launch of the same kernel (the floor for a Python
launch), the functional API with CuPy and with torch inputs, the
``mhc_cupy.torch`` adapter, and a native torch op.
``--layer``: also an ``MHC`` forward under ``torch.no_grad`` at 1 token, C 7168, n 4, bf16 (the decode
call of ``bench --small``), timed and cProfiled, and with the kernel choice ``lane`` on / off (each
inside the same ``kernel_choice`` block).
Usage on a GPU machine:  python scripts/profile_host.py [--profile] [--layer]
"""

import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import mhc_cupy as m
from mhc_cupy import _jit
from mhc_cupy._kernel_choice import kernel_choice


def per_call_us(fn, calls=3000):
    for _ in range(100):
        fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / calls * 1e6


x = cp.random.standard_normal((1, 4, 64), dtype=cp.float32)
M = cp.random.standard_normal((1, 4, 4), dtype=cp.float32)
out = cp.empty_like(x)
m.stream_mix_fwd(x, M)
fn = _jit.get_function("stream.cu", "mhc_stream_mix_distribute_fwd_kernel<float,4,4,true,false>")
stream = cp.cuda.get_current_stream()
# (x, y, h_post, h_post_stride, h_res, out, tokens, C, res_t): the kernel's nine parameters, in their C types
args = (x.data.ptr, None, None, np.int64(0), M.data.ptr, out.data.ptr, np.int64(1), np.int32(64), np.int32(0))
rows = {"raw cupy Function launch": lambda: fn((1, 1, 1), (32, 1, 1), args, stream=stream),
        "functional API, cupy inputs": lambda: m.stream_mix_fwd(x, M)}
try:
    import torch

    import mhc_cupy.torch as mt

    xt, Mt = torch.from_dlpack(x), torch.from_dlpack(M)
    a = torch.randn(1, 4, 64, device="cuda")
    rows["functional API, torch inputs"] = lambda: m.stream_mix_fwd(xt, Mt)
    rows["mhc_cupy.torch.stream_mix (no grad)"] = lambda: mt.stream_mix(xt, Mt)
    xg = xt.clone().requires_grad_()
    rows["mhc_cupy.torch.stream_mix (requires grad)"] = lambda: mt.stream_mix(xg, Mt)
    rows["native torch.add"] = lambda: torch.add(a, a)
    if "--layer" in sys.argv:
        layer = mt.MHC(7168, 4, torch.nn.Identity(), device="cuda")
        xl = torch.randn(1, 4, 7168, device="cuda", dtype=torch.bfloat16)

        def layer_fwd():
            with torch.no_grad():
                return layer(xl)

        rows["MHC forward, 1 x 7168 x 4 bf16 (no grad)"] = layer_fwd

        def lane_fwd():  # the no-grad lane (kernel choice lane, mhc_cupy.torch._no_grad)
            with torch.no_grad(), kernel_choice(lane=True):
                return layer(xl)

        def general_fwd():  # the same block around the call, the lane off: the A/B of the lane
            with torch.no_grad(), kernel_choice(lane=False):
                return layer(xl)

        rows["MHC forward ... (no grad), lane"] = lane_fwd
        rows["MHC forward ... (no grad), lane off"] = general_fwd
except ImportError:
    pass
for name, f in rows.items():
    print(f"{name:<45} {per_call_us(f):7.1f} us per call")
if "--profile" in sys.argv:
    for name in ("functional API, cupy inputs", "functional API, torch inputs",
                 "MHC forward, 1 x 7168 x 4 bf16 (no grad)", "MHC forward ... (no grad), lane"):
        if name not in rows:
            continue
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            rows[name]()
        pr.disable()
        print(name)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25 if name.startswith("MHC") else 12)
