"""Experiment: Sinkhorn backward time against lanes per matrix (temporary)."""
import cupy as cp
import mhc_cupy as m
from mhc_cupy.ops import sinkhorn as sk
from mhc_cupy.bench import time_ms

T = 32768
L = cp.random.standard_normal((T, 4, 4), dtype=cp.float32)
G = cp.random.standard_normal((T, 4, 4), dtype=cp.float32)
for name, patch in (("fwd_group", sk.fwd_group), ("bwd_group", sk.bwd_group)):
    for g in (1, 2, 4):
        setattr(sk, name, lambda n, g=g: g)
        for thr in (32, 64, 128):
            sk._THREADS = thr
            try:
                f = (lambda: m.sinkhorn_knopp_fwd(L)) if name == "fwd_group" else (lambda: m.sinkhorn_knopp_bwd(G, L))
                print(name, "G", g, "threads", thr, f"{time_ms(f) * 1e3:.1f} us")
            except Exception as e:
                print(name, g, thr, "error", e)
        setattr(sk, name, patch)
    sk._THREADS = 64
