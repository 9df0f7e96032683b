"""A/B timings of kernel choices that wait for a GPU verdict (CuPy inputs; median per call of CUDA-graph
replays, ``mhc_cupy.bench.timing.time_ms``; the copy bandwidth of ``copy_bandwidth``).  Not yet run on a GPU.

    python scripts/ab_kernels.py boundary   # mhc_boundary_fwd: the fused kernel (boundary=True) against the
                                            # post op + pre piece kernels, bf16 n = 4; out bitwise, layer_in's
                                            # difference, and the byte floor at this run's copy bandwidth
    python scripts/ab_kernels.py bwd K      # mhc_layer_pre_fwd / _bwd with _MMA_TARGET_BLOCKS = K (the tensor-core
                                            # backward's block target; one process per K: plans are cached);
                                            # hashes of dx and dphi compare the bits across K
    python scripts/ab_kernels.py colsum     # the one-block narrow column sum (dalpha / dbias over tokens)
    python scripts/ab_kernels.py postbwd    # mhc_layer_post_bwd (the fused layer's post backward, no dx) at n = 4 on
                                            # the CUDA-core kernel (default), on the tensor-core kernel of n >= 5
                                            # (ops.stream.POST_BWD_MMA_MIN_N = 4) and with kernel choice post_pipe
                                            # (2 and 3 stages), against its byte floor
    python scripts/ab_kernels.py wgfwd      # mhc_layer_pre_fwd at n = 4 with the forward GEMM on mma.sync (default) and
                                            # on wgmma (ops.coeffs.fwd._WG_MIN_K = 24), against the read of x
    python scripts/ab_kernels.py decode     # a decode-sized layer forward's two ops (mhc_layer_pre_fwd, mhc_post_op_fwd;
                                            # T 1 / 8 / 64, C 7168, n 4 bf16) under the default, tail and small, and
                                            # under tail with the forward GEMM's D ranges at most S (S = 64: today's
                                            # ops.coeffs.common._MAX_SPLITS) of at least R 64-position steps (R = 4:
                                            # _MIN_STEPS_PER_RANGE): at one token 64 blocks of 7 steps each

GPU only; prints one line per case.
"""

from __future__ import annotations

import hashlib
import sys

import cupy as cp

MODE = sys.argv[1] if len(sys.argv) > 1 else "boundary"
if MODE == "bwd":  # before mhc_cupy plans anything
    from mhc_cupy.ops.coeffs import common

    common._MMA_TARGET_BLOCKS = int(sys.argv[2])

import mhc_cupy as m  # noqa: E402
from mhc_cupy._kernel_choice import kernel_choice  # noqa: E402
from mhc_cupy.bench.timing import copy_bandwidth, time_ms  # noqa: E402

rng = cp.random.default_rng(0)
BF16 = m._interop.numpy_dtype("bfloat16")


def graph_us(f, calls: int = 10) -> float:
    """Median GPU time of one f() in us (mhc_cupy.bench.timing.time_ms: CUDA-graph replays of ``calls`` calls)."""
    return time_ms(f, per_graph=calls) * 1e3


def act(*shape):
    return rng.standard_normal(shape, dtype=cp.float32).astype(BF16)


def digest(a) -> str:
    return hashlib.sha1(cp.asnumpy(a).tobytes()).hexdigest()[:10]


def layer_inputs(T, C, n):
    K = n * n + 2 * n
    phi = rng.standard_normal((n * C, K), dtype=cp.float32) * 0.02
    alpha = cp.asarray([0.5, 0.7, 0.3], cp.float32)
    bias = rng.standard_normal(K, dtype=cp.float32) * 0.1
    return act(T, n, C), phi, alpha, bias


def boundary(bw):
    for T, C, n in ((16384, 4096, 4), (8192, 2048, 4), (4096, 7168, 4)):
        x, phi, alpha, bias = layer_inputs(T, C, n)
        y = act(T, C)
        H_post = rng.random((T, n), dtype=cp.float32)
        H_res = rng.random((T, n, n), dtype=cp.float32) / n
        floor = 2 * (2 * T * n * C + 2 * T * C) / bw / 1e3  # read x, y; write out, layer_in (bf16), us
        out, t = {}, {}
        for on in (False, True):
            with kernel_choice(boundary=on):
                def f():
                    return m.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias)
                out[on], t[on] = f(), graph_us(f)
        with kernel_choice(boundary=False):
            t_post = graph_us(lambda: m.mhc_post_op_fwd(y, x, H_post, H_res))
            t_pre = graph_us(lambda: m.mhc_layer_pre_fwd(x, phi, alpha, bias))
        same = bool((out[True][0].view(cp.uint16) == out[False][0].view(cp.uint16)).all())
        d_li = float(cp.abs(out[True][1].astype(cp.float32) - out[False][1].astype(cp.float32)).max())
        print(f"{T}x{C}x{n}: post+pre {t[False]:.1f} us (post {t_post:.1f}, pre {t_pre:.1f}); boundary kernel "
              f"{t[True]:.1f} us; floor {floor:.1f} us; out bitwise {same}; layer_in max |diff| {d_li:.3g}")


def bwd():
    for T, C, n in ((16384, 4096, 4), (8192, 2048, 4), (16384, 2048, 8)):
        x, phi, alpha, bias = layer_inputs(T, C, n)
        _, H_pre, _, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
        g_li, g = act(T, C), act(T, n, C)
        dH_post = rng.standard_normal((T, n), dtype=cp.float32)
        dH_res = rng.standard_normal((T, n, n), dtype=cp.float32)

        def f():
            return m.mhc_layer_pre_bwd(g_li, g, dH_post, dH_res, x, phi, alpha, bias, stats, H_pre, H_res)
        r = f()
        t_b, t_f = graph_us(f), graph_us(lambda: m.mhc_layer_pre_fwd(x, phi, alpha, bias))
        print(f"K={common._MMA_TARGET_BLOCKS} {T}x{C}x{n}: pre fwd {t_f:.1f} us, pre bwd {t_b:.1f} us; "
              f"dx {digest(r[0])} dphi {digest(r[1])}")


def colsum():
    from mhc_cupy.ops._launch import column_sum

    for rows in (16384, 32768, 131072):
        for cols in (3, 4, 16):
            a = rng.standard_normal((rows, cols), dtype=cp.float32)
            o = cp.empty(cols, cp.float32)
            t = graph_us(lambda: column_sum(a.data.ptr, o.data.ptr, rows, cols, cp.cuda.get_current_stream().ptr),
                         calls=50)
            err = float(cp.abs(o - a.sum(0)).max())
            print(f"column_sum rows {rows} cols {cols}: {t:.1f} us (|err| {err:.2g})")


def postbwd(bw):
    from mhc_cupy.ops import stream

    variants = {"default": ({}, stream.POST_BWD_MMA_MIN_N, 2), "tensor cores": ({}, 4, 2),
                "pipe 2": ({"post_pipe": True}, stream.POST_BWD_MMA_MIN_N, 2),
                "pipe 3": ({"post_pipe": True}, stream.POST_BWD_MMA_MIN_N, 3)}
    keep = stream.POST_BWD_MMA_MIN_N, stream.POST_BWD_PIPE_STAGES
    for T, C, n in ((8192, 2048, 4), (16384, 4096, 4), (4096, 7168, 4)):
        x, y, g = act(T, n, C), act(T, C), act(T, n, C)
        H_post = rng.random((T, n), dtype=cp.float32)
        H_res = rng.random((T, n, n), dtype=cp.float32) / n
        floor = 2 * (2 * T * n * C + 2 * T * C) / bw / 1e3  # read g, x, y; write dy (bf16), us
        row = []
        for name, (choice, min_n, stages) in variants.items():
            stream.POST_BWD_MMA_MIN_N, stream.POST_BWD_PIPE_STAGES = min_n, stages
            m._dispatch._plans.clear(), m._dispatch._fast.clear()
            try:
                with kernel_choice(**choice):
                    def f():
                        return m.mhc_layer_post_bwd(g, y, x, H_post, H_res)
                    r = f()
                    row.append(f"{name} {graph_us(f):.1f} us (dy {digest(r[0])}, dH_res {digest(r[2])})")
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                row.append(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
            finally:
                stream.POST_BWD_MMA_MIN_N, stream.POST_BWD_PIPE_STAGES = keep
        print(f"post bwd {T}x{C}x{n} (floor {floor:.1f} us): " + "; ".join(row), flush=True)


def wgfwd(bw):
    from mhc_cupy.ops.coeffs import fwd

    keep = fwd._WG_MIN_K
    for T, C, n in ((8192, 2048, 4), (16384, 4096, 4)):
        x, phi, alpha, bias = layer_inputs(T, C, n)
        floor = 2 * T * n * C / bw / 1e3  # read x once (bf16), us
        row = []
        for name, min_k in (("mma.sync", keep), ("wgmma", 24)):
            fwd._WG_MIN_K = min_k
            m._dispatch._plans.clear(), m._dispatch._fast.clear()
            try:
                def f():
                    return m.mhc_layer_pre_fwd(x, phi, alpha, bias)
                r = f()
                row.append(f"{name} {graph_us(f):.1f} us (layer_in {digest(r[0])}, stats {digest(r[4])})")
            except Exception as e:  # noqa: BLE001 - reported, the other still runs
                row.append(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
            finally:
                fwd._WG_MIN_K = keep
        print(f"pre fwd {T}x{C}x{n} (x read once {floor:.1f} us): " + "; ".join(row), flush=True)


def decode():
    from mhc_cupy.ops.coeffs import fwd

    keep = fwd._MAX_SPLITS, fwd._MIN_STEPS_PER_RANGE
    variants = [("default", {}, None), ("tail", {"tail": True}, None), ("small", {"small": True}, None)]
    variants += [(f"tail S{s} R{r}", {"tail": True}, (s, r)) for s, r in ((128, 2), (224, 2), (448, 1))]
    for T in (1, 8, 64):
        C, n = 7168, 4
        x, phi, alpha, bias = layer_inputs(T, C, n)
        y = act(T, C)
        row = []
        for name, choice, splits in variants:
            if splits:
                fwd._MAX_SPLITS, fwd._MIN_STEPS_PER_RANGE = splits
            m._dispatch._plans.clear(), m._dispatch._fast.clear()
            try:
                with kernel_choice(**choice):
                    def pre():
                        return m.mhc_layer_pre_fwd(x, phi, alpha, bias)
                    r = pre()

                    def post():
                        return m.mhc_post_op_fwd(y, x, r[2], r[3])

                    def layer():
                        q = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
                        return m.mhc_post_op_fwd(q[0], x, q[2], q[3])
                    row.append(f"{name}: pre {graph_us(pre):.1f} post {graph_us(post):.1f} layer {graph_us(layer):.1f} us"
                               f" (layer_in {digest(r[0])}, stats {digest(r[4])})")
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                row.append(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
            finally:
                fwd._MAX_SPLITS, fwd._MIN_STEPS_PER_RANGE = keep
        print(f"decode T {T} x C {C} x n {n} (graph replay, per call):\n  " + "\n  ".join(row), flush=True)


if __name__ == "__main__":
    if MODE == "boundary":
        boundary(copy_bandwidth()["GBps"])
    elif MODE == "bwd":
        bwd()
    elif MODE == "colsum":
        colsum()
    elif MODE == "postbwd":
        postbwd(copy_bandwidth()["GBps"])
    elif MODE == "wgfwd":
        wgfwd(copy_bandwidth()["GBps"])
    elif MODE == "decode":
        decode()
    else:
        sys.exit(f"mode must be boundary, bwd K, colsum, postbwd, wgfwd or decode, got {MODE!r}")
