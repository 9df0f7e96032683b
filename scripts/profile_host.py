"""Where the host time of one tiny op call goes (cProfile), for torch and CuPy inputs.

Usage on a GPU machine:  python scripts/profile_host.py
"""

import cProfile
import pstats
import time

import cupy as cp

import mhc_cupy as m

x = cp.random.standard_normal((1, 4, 64), dtype=cp.float32)
M = cp.random.standard_normal((1, 4, 4), dtype=cp.float32)
cases = {"cupy": (x, M)}
try:
    import torch

    cases["torch"] = (torch.from_dlpack(x), torch.from_dlpack(M))
except ImportError:
    pass
for name, (a, b) in cases.items():
    for _ in range(100):
        m.stream_mix_fwd(a, b)
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        m.stream_mix_fwd(a, b)
    cp.cuda.Device().synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per stream_mix_fwd call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        m.stream_mix_fwd(a, b)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
if "torch" in cases:
    a = torch.randn(1, 4, 64, device="cuda")
    for _ in range(100):
        torch.add(a, a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        torch.add(a, a)
    torch.cuda.synchronize()
    print(f"native torch.add: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
