"""Benchmarks: ``python -m mhc_cupy.bench``.

Each op forward and backward at tokens x C x n (bf16 activations by default)
is timed with CUDA events (median of ``--reps`` runs after ``--warmup``); the
inputs are regenerated between shapes and are several times larger than L2
at the default shapes, so the cache does not flatter.  A byte model per op
(each input read once, each output written once; ``BYTES`` below) turns
times into GB/s, reported against the device-to-device copy bandwidth
measured in the same run (bytes read + written of a large copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import mhc_cupy as m

# Byte model: every input read once, every output written once.
# A = tokens*n*C*itemsize (one [.., n, C] tensor), Y = tokens*C*itemsize (one
# [.., C] tensor), K = tokens*4 (one float32 coefficient per token).
BYTES = {
    ("stream_mix", "fwd"): lambda A, Y, K, n: 2 * A + n * n * K,                  # x, M -> out
    ("stream_mix", "bwd"): lambda A, Y, K, n: 3 * A + 2 * n * n * K,              # g, x, M -> dx, dM
    ("stream_aggregate", "fwd"): lambda A, Y, K, n: A + Y + n * K,                # x, h -> out
    ("stream_aggregate", "bwd"): lambda A, Y, K, n: 2 * A + Y + 2 * n * K,        # g, x, h -> dx, dh
    ("stream_distribute", "fwd"): lambda A, Y, K, n: A + Y + n * K,               # y, h -> out
    ("stream_distribute", "bwd"): lambda A, Y, K, n: A + 2 * Y + 2 * n * K,       # g, y, h -> dy, dh
    ("mhc_post_op", "fwd"): lambda A, Y, K, n: 2 * A + Y + (n * n + n) * K,       # y, x, H -> out
    ("mhc_post_op", "bwd"): lambda A, Y, K, n: 3 * A + 2 * Y + 2 * (n * n + n) * K,
    ("mhc_pre_op", "fwd"): lambda A, Y, K, n: A + Y + 2 * (n * n + 2 * n) * K,    # x, raw -> layer_in, H
    ("mhc_pre_op", "bwd"): lambda A, Y, K, n: 2 * A + Y + 3 * (n * n + 2 * n) * K,
    ("sinkhorn_knopp", "fwd"): lambda A, Y, K, n: 2 * n * n * K,
    ("sinkhorn_knopp", "bwd"): lambda A, Y, K, n: 3 * n * n * K,
}


def _setup(op: str, T: int, C: int, n: int, dtype: str):
    """(forward callable, backward callable) on fresh random CuPy inputs."""
    import cupy as cp

    from ._interop import numpy_dtype

    dt = numpy_dtype(dtype)
    r = cp.random.default_rng(0)

    def act(*shape):
        return r.standard_normal(shape, dtype=cp.float32).astype(dt)

    def coef(*shape):
        return r.standard_normal(shape, dtype=cp.float32)

    x, y = act(T, n, C), act(T, C)
    if op == "stream_mix":
        M, g = coef(T, n, n), act(T, n, C)
        return (lambda: m.stream_mix_fwd(x, M)), (lambda: m.stream_mix_bwd(g, x, M))
    if op == "stream_aggregate":
        h = coef(T, n)
        return (lambda: m.stream_aggregate_fwd(x, h)), (lambda: m.stream_aggregate_bwd(y, x, h))
    if op == "stream_distribute":
        h, g = coef(T, n), act(T, n, C)
        return (lambda: m.stream_distribute_fwd(y, h)), (lambda: m.stream_distribute_bwd(g, y, h))
    if op == "mhc_post_op":
        Hp, Hr, g = coef(T, n), coef(T, n, n), act(T, n, C)
        return (lambda: m.mhc_post_op_fwd(y, x, Hp, Hr)), (lambda: m.mhc_post_op_bwd(g, y, x, Hp, Hr))
    if op == "mhc_pre_op":
        hp, hq, hr = coef(T, n), coef(T, n), coef(T, n, n)
        gp, gq, gr = coef(T, n), coef(T, n), coef(T, n, n)
        return ((lambda: m.mhc_pre_op_fwd(x, hp, hq, hr)),
                (lambda: m.mhc_pre_op_bwd(y, gp, gq, gr, x, hp, hq, hr)))
    if op == "sinkhorn_knopp":
        L, G = coef(T, n, n), coef(T, n, n)
        return (lambda: m.sinkhorn_knopp_fwd(L)), (lambda: m.sinkhorn_knopp_bwd(G, L))
    raise ValueError(f"unknown op {op!r}")


def time_ms(fn, warmup: int = 3, reps: int = 20, per_graph: int = 10) -> float:
    """Median GPU time of one fn() call, in ms.

    ``per_graph`` calls are captured into one CUDA graph on a side stream and
    the graph is replayed between CUDA events, so the host overhead of the
    Python call is excluded (it is measured separately by ``host_overhead_us``).
    """
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(warmup):
            fn()
        s.begin_capture()
        for _ in range(per_graph):
            fn()
        graph = s.end_capture()
        graph.launch(s)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(s)
            graph.launch(s)
            stop.record(s)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / per_graph)
    return statistics.median(times)


def host_overhead_us(fn, calls: int = 2000) -> float:
    """Wall-clock microseconds per call of a tiny fn() (GPU time negligible), in steady state."""
    import time

    import cupy as cp

    for _ in range(50):
        fn()
    cp.cuda.get_current_stream().synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    import cupy as cp

    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    ms = time_ms(lambda: b.__setitem__(Ellipsis, a), warmup=3, reps=20, per_graph=1)
    return 2 * nbytes / ms / 1e6


def run(ops, shapes, dtype="bfloat16", warmup=5, reps=30, directions=("fwd", "bwd")):
    import cupy as cp

    from ._interop import numpy_dtype

    isz = numpy_dtype(dtype).itemsize
    copy_gbs = copy_bandwidth()
    rows = []
    for T, C, n in shapes:
        for op in ops:
            fns = _setup(op, T, C, n, dtype)
            for d, fn in zip(("fwd", "bwd"), fns):
                if d not in directions:
                    continue
                ms = time_ms(fn, warmup, reps)
                nbytes = BYTES[(op, d)](T * n * C * isz, T * C * isz, T * 4, n)
                gbs = nbytes / ms / 1e6
                rows.append(dict(op=op, dir=d, tokens=T, C=C, n=n, dtype=dtype, us=ms * 1e3, GBps=gbs,
                                 frac_of_copy=gbs / copy_gbs))
            del fns
            cp.get_default_memory_pool().free_all_blocks()
    overhead = {}
    for op in ops:
        fwd, bwd = _setup(op, 1, 64, 4, dtype)
        overhead[op] = {"fwd": host_overhead_us(fwd), "bwd": host_overhead_us(bwd)}
    return {"copy_GBps": copy_gbs, "rows": rows, "host_overhead_us": overhead}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(sorted({k[0] for k in BYTES})))
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--C", default="2560,4096,7168")
    ap.add_argument("--n", default="4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    args = ap.parse_args(argv)
    shapes = [(int(T), int(C), int(n)) for n in args.n.split(",") for T in args.tokens.split(",")
              for C in args.C.split(",")]
    res = run(args.ops.split(","), shapes, args.dtype, reps=args.reps)
    print(f"device-to-device copy: {res['copy_GBps']:.0f} GB/s")
    print(f"{'op':<18}{'dir':<5}{'tokens':>7}{'C':>6}{'n':>3}{'us':>10}{'GB/s':>8}{'of copy':>9}")
    for r in res["rows"]:
        print(f"{r['op']:<18}{r['dir']:<5}{r['tokens']:>7}{r['C']:>6}{r['n']:>3}{r['us']:>10.1f}"
              f"{r['GBps']:>8.0f}{r['frac_of_copy']:>9.1%}")
    print("host overhead per call (tokens 1, C 64, n 4), us:")
    for op, v in res["host_overhead_us"].items():
        print(f"  {op:<18} fwd {v['fwd']:6.1f}   bwd {v['bwd']:6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
