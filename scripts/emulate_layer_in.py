"""Emulate mhc_stream_aggregate_out_kernel (kernels_cu/stream.cu) on the CPU, thread by thread.

mhc_layer_pre_norm_fwd and mhc_layer_pre_fp8_fwd (OPS.md section 13) end in that kernel: layer_in =
sum_i H_pre_i x_i, then its RMSNorm and / or its float8 e4m3 quantisation, one block per token.  Here
the op's real plan runs inside ``_jit.dry_run`` on fake pointers, each a NumPy buffer of its shape; the
plan's launch of the kernel (grid, block, template arguments, arguments by name, dynamic shared memory)
runs in NumPy over every block and thread, vectorised, with H_pre as given (the kernels before it, the
coefficient path, are emulated by scripts/emulate_small.py or not at all).

Emulated: the grid-stride token loop and s_h, each thread's vectors vi = tid + k blockDim (columns
c = vi E), the aggregate's fmaf chain over i and its rounding to T, the kept row's cells e V + vi (each
read must find what the same thread stored in the current phase; no two stores to one cell a phase),
the sum of squares (fmaf in the thread's order, block_sum<1>'s warp butterfly, then the warps in order),
the rescaled sum after an overflow, rstd, the normalised products, the amax (NaN-sticky butterfly, then
the warps in order), the scale, to_e4m3's integer arithmetic (:func:`to_e4m3_bits`), the byte packing of
q, and stat.  Asserted: the alignment of every pointer to its E-element access, C % E == 0, the dynamic
shared memory the launch gives (C * sizeof(T) where the row is kept, else 0), every global read in
bounds, every out / q / stat element written exactly once.  Compared: layer_in with the float64
reference within one ulp; rstd with the float64 rstd within the float32 sum's rounding; the normalised
row bitwise with :func:`mhc_cupy._reference_layer_in.rms_normalise` of the emulated layer_in and rstd;
q and scale bitwise with :func:`mhc_cupy._reference_layer_in.quantise_e4m3` (ml_dtypes' cast).

Usage (repo root, CPU only):
    python scripts/emulate_layer_in.py                 # CASES
    python scripts/emulate_layer_in.py --op mhc_layer_pre_fp8_fwd --T 3 --n 4 --C 72 --dtype float16 --norm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: the worktree's package
    sys.path.insert(0, str(_ROOT))

from mhc_cupy import _jit, reference  # noqa: E402
from mhc_cupy import _reference_layer_in as rli  # noqa: E402
from mhc_cupy._interop import BITS_OF, numpy_dtype  # noqa: E402
from mhc_cupy._kernel_choice import kernel_choice  # noqa: E402
from mhc_cupy._settings import LayerSettings  # noqa: E402
from mhc_cupy.ops import SPECS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, emulate_small
from emulate_small import (F32, NP_DTYPE, STAT_SCALE, Buffer, EmulationError, Shared, _cdiv,  # noqa: E402, F401
                           _require, emulated_inputs, fmaf, round_to)
_CTYPE = {"__nv_bfloat16": "bfloat16", "__half": "float16", "float": "float32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
KERNEL = "mhc_stream_aggregate_out_kernel"


# ------------------------------------------------------------------ the kernel's helpers, as written

def to_e4m3_bits(f):
    """to_e4m3 (stream.cu): float32 -> float8 e4m3fn bits (uint8), in the kernel's uint32 arithmetic."""
    u = np.asarray(f, F32).view(np.uint32)
    a, sign = u & np.uint32(0x7FFFFFFF), (u >> np.uint32(24)) & np.uint32(0x80)
    normal = ((a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    sub = np.rint(a.view(F32) * F32(512)).astype(np.uint32)  # __float2uint_rn: to nearest even
    out = np.where(a > 0x7F800000, 0x7F, np.where(a >= 0x43E00000, 0x7E, np.where(a >= 0x3C800000, normal, sub)))
    return (sign | out.astype(np.uint32)).astype(np.uint8)


def amax_of(a, b):
    """(b > a || b != b) ? b : a."""
    return np.where((b > a) | np.isnan(b), b, a).astype(F32)


def keep_cell(e, vi, V):
    """The kept row's cell of element e of vector vi (a test may replace it to inject a fault)."""
    return e * V + vi


def warp_butterfly(v, op):
    """v [B, NT] after the xor butterfly over offsets 16 .. 1 within each warp (lane l combines with l ^ off)."""
    lane = np.arange(v.shape[1])
    for off in (16, 8, 4, 2, 1):
        v = op(v, v[:, lane ^ off])
    return v


def block_total(acc):
    """mhc::block_sum<1>: each warp's butterfly (v += shfl_xor), then lane 0's of warps 0, 1, ... in order."""
    v = warp_butterfly(acc, lambda a, b: (a + b).astype(F32))
    s = np.zeros(v.shape[0], F32)
    for w in range(v.shape[1] // 32):
        s = (s + v[:, 32 * w]).astype(F32)
    return s


def block_amax(acc):
    v = warp_butterfly(acc, amax_of)
    m = np.zeros(v.shape[0], F32)
    for w in range(v.shape[1] // 32):
        m = amax_of(m, v[:, 32 * w])
    return m


# ------------------------------------------------------------------ the kernel

def run_out(targs, grid, block, a, smem, mem):
    """mhc_stream_aggregate_out_kernel<T, N, E, NORM, FP8> on the emulated memory; returns the emulated
    per-token (layer_in, rstd) for the comparisons."""
    dt, N, E = _CTYPE[targs[0]], int(targs[1]), int(targs[2])
    NORM, FP8 = targs[3] == "true", targs[4] == "true"
    NT, B = block[0], grid[0]
    _require(block[1:] == (1, 1) and NT % 32 == 0 and grid[1:] == (1, 1), "launch shape")
    tokens, C, keep = int(a["tokens"]), int(a["C"]), int(a["keep"])
    eps = F32(a["eps"])
    isz = _ITEMSIZE[dt]
    _require(C % E == 0, "C % E")
    for k, size in (("x", isz), ("out", isz), ("w", 4), ("q", 1)):
        _require(a[k] is None or a[k] % min(E * size, 16) == 0, f"{k} not aligned to its {E}-element access")
    _require((a["w"] is not None) == NORM and (a["q"] is not None) == FP8 and (a["out"] is None) == FP8,
             "w / out / q given as NORM, FP8 say")
    _require(smem == (C * isz if keep else 0), f"dynamic shared memory {smem} for keep = {keep}")
    x, h, stat = mem[a["x"]], mem[a["h"]], mem[a["stat"]]
    w, out, q = (mem[a[k]] if a[k] is not None else None for k in ("w", "out", "q"))
    V, tid = C // E, np.arange(NT)[None, :]
    s_row = Shared("s_row", B, C) if keep else None
    ev = np.arange(E)
    li_all, rstd_all = np.full((tokens, C), np.nan, F32), np.full(tokens, np.nan, F32)
    for it in range(_cdiv(tokens, B)):
        t = np.arange(B)[:, None] + it * B  # blockIdx.x + it * gridDim.x
        active = t < tokens
        s_h = [h.read(t * N + i, active, "h") for i in range(N)]

        def vectors(k):
            vi = tid + k * NT
            return vi, active & (vi < V)

        def aggregate(k):
            vi, m = vectors(k)
            c = vi[..., None] * E + ev
            s = np.zeros(c.shape, F32)
            for i in range(N):
                s = fmaf(s_h[i][..., None], x.read(t[..., None] * N * C + i * C + c, m[..., None], "x"), s)
            return round_to(s, dt), vi, m

        def cells(vi):
            return keep_cell(ev, vi[..., None], V)

        def again(k, phase):
            if not keep:
                return aggregate(k)
            vi, m = vectors(k)
            return s_row.load(cells(vi), m[..., None], phase, 0, C, "s_row"), vi, m

        def normalise(v, vi, m, rstd):
            wv = w.read(vi[..., None] * E + ev, m[..., None], "w")
            return round_to((((v * rstd[:, None, None]).astype(F32)) * wv).astype(F32), dt)

        phase = 3 * it
        trips = _cdiv(V, NT)
        acc = np.zeros((B, NT), F32)
        if keep:
            s_row.begin()
        for k in range(trips):
            v, vi, m = aggregate(k)
            mm = np.broadcast_to(m[..., None], v.shape)
            cols = np.broadcast_to(vi[..., None] * E + ev, v.shape)
            li_all[np.broadcast_to(t[..., None], v.shape)[mm], cols[mm]] = v[mm]
            if keep:
                s_row.store(cells(vi), v, m[..., None], phase, 0, C, "s_row")
            for e in range(E):
                nxt = fmaf(v[..., e], v[..., e], acc) if NORM else amax_of(acc, np.abs(v[..., e]))
                acc = np.where(m, nxt, acc)
        rstd = np.ones(B, F32)
        if NORM:
            ss = block_total(acc)
            acc2 = np.zeros((B, NT), F32)
            for k in range(trips):
                v, vi, m = again(k, phase)
                for e in range(E):
                    s = (v[..., e] * STAT_SCALE).astype(F32)
                    acc2 = np.where(m, fmaf(s, s, acc2), acc2)
            ss2 = block_total(acc2)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                plain = (F32(1) / np.sqrt((ss / F32(C) + eps).astype(F32))).astype(F32)
                scaled = (STAT_SCALE / np.sqrt((ss2 / F32(C) + (eps * STAT_SCALE) * STAT_SCALE).astype(F32)))
            rstd = np.where(np.isinf(ss), scaled.astype(F32), plain)
            acc = np.zeros((B, NT), F32)
            if keep:
                s_row.begin()
            for k in range(trips):
                v, vi, m = again(k, phase)
                u = normalise(v, vi, m, rstd)
                if FP8:
                    if keep:
                        s_row.store(cells(vi), u, m[..., None], phase + 1, 0, C, "s_row")
                    for e in range(E):
                        acc = np.where(m, amax_of(acc, np.abs(u[..., e])), acc)
                else:
                    out.write(t[..., None] * C + vi[..., None] * E + ev, u, m[..., None], "out")
        if FP8:
            with np.errstate(invalid="ignore", over="ignore"):
                scale = (block_amax(acc) / F32(448)).astype(F32)
            scale = np.where(scale == 0, F32(1), scale)
            for k in range(trips):
                if keep:
                    u, vi, m = again(k, phase + (1 if NORM else 0))
                else:
                    u, vi, m = aggregate(k)
                    if NORM:
                        u = normalise(u, vi, m, rstd)
                with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                    b = to_e4m3_bits((u / scale[:, None, None]).astype(F32)).astype(np.uint32)
                for w0 in range(0, E, 4):  # store_bytes: words of 4 bytes (little-endian), or 2 / 1 bytes
                    n_b = min(4, E)
                    word = np.zeros(b.shape[:-1], np.uint32)
                    for j in range(n_b):
                        word |= b[..., w0 + j] << np.uint32(8 * j)
                    for j in range(n_b):
                        q.write(t * C + vi * E + w0 + j, ((word >> np.uint32(8 * j)) & 0xFF).astype(np.uint8), m, "q")
            stat.write(t[:, 0], scale, active[:, 0], "stat")
        else:
            stat.write(t[:, 0], rstd, active[:, 0], "stat")
        rstd_all[t[active]] = rstd[active[:, 0]]
    return li_all, rstd_all


# ------------------------------------------------------------------ the host's plan, run on emulated memory

def plan_launch(op, arrays, H_pre, misalign=False, blocks=None, settings=None, norm_eps=1e-6):
    """Run SPECS[op]'s plan in _jit.dry_run on fake pointers (x one element off 16 bytes with ``misalign``: E = 1),
    fill the H_pre output's buffer with ``H_pre`` (what the kernels before it write), then emulate the
    launch of mhc_stream_aggregate_out_kernel (on ``blocks`` blocks instead of the host's one a token: the
    grid-stride loop).  Returns (the plan's output Buffers, the kernel's template
    arguments, grid, block, args by name, its emulated (layer_in, rstd))."""
    k, T = SPECS[op], arrays["x"].shape[0]
    base = iter(range(1 << 32, 1 << 48, 1 << 32))
    mem, infos = emulated_inputs(k, arrays, base, ("x",) if misalign else ())
    with _jit.dry_run() as launches, kernel_choice(layer_in=True):  # the kernel emulated (opt-in on a GPU)
        plan = k.planner(infos, settings=settings or LayerSettings.resolve(), norm_eps=norm_eps)
        outs = []
        for shape, dtn in list(plan.outputs) + list(plan.scratch.values()):
            p = next(base)
            mem[p] = Buffer("out", np.full(shape, 0xFF if dtn in BITS_OF else np.nan,  # float8: its bits
                                           numpy_dtype(BITS_OF.get(dtn, dtn))), written=False)
            outs.append(p)
        plan.launch({a: (None if v is None else v.ptr) for a, v in infos.items()}, outs[:len(plan.outputs)],
                    outs[len(plan.outputs):], 0)
    outs = outs[:len(plan.outputs)]
    for name, p in zip(("row", "stat", "H_pre", "H_post", "H_res", "stats"), outs):
        mem[p].name = name
    mem[outs[2]].a[:] = np.asarray(H_pre, F32).reshape(-1)  # as the Sinkhorn kernel (or the tail) wrote it
    mem[outs[2]].writes[:] = 1
    ran = [r for r in launches if r[1].startswith(KERNEL)]
    _require(len(ran) == 1 and launches[-1] is ran[0], f"the plan ends in one {KERNEL} launch")
    _, expr, grid, block, args, smem = ran[0]
    targs = [s.strip() for s in expr.split("<", 1)[1].rstrip(">").split(",")]
    names = ("x", "h", "w", "out", "q", "stat", "tokens", "C", "eps", "keep")  # the kernel's parameters
    byname = dict(zip(names, args))
    _require(byname["h"] == outs[2] and byname["stat"] == outs[1], "h is H_pre, stat the second output")
    _require(tuple(grid) == (T, 1, 1), "one block a token")
    grid = (blocks, 1, 1) if blocks else tuple(grid)
    emulated = run_out(targs, grid, tuple(block), byname, smem, mem)
    return [mem[p] for p in outs], targs, tuple(grid), tuple(block), byname, emulated


def make_inputs(T, n, C, dt, seed=0, scale=1.0, norm=True, special=False):
    """x [T, n, C] (dt, normal times scale), phi, alpha, bias, norm_weight [C] (or None) and H_pre [T, n].
    ``special``: token 0 holds a NaN, token 1 is zero, token 2 holds an inf (those that exist)."""
    rng = np.random.default_rng(seed)
    K = n * n + 2 * n
    x = (scale * rng.standard_normal((T, n, C))).astype(F32)
    if special:
        x[0, 0, min(3, C - 1)] = np.nan
        x[1:2] = 0
        x[2:3, 0, 0] = np.inf
    return {"x": x.astype(NP_DTYPE[dt]),
            "phi": (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(F32),
            "alpha": (0.5 + rng.random(3)).astype(F32), "bias": rng.standard_normal(K).astype(F32),
            "norm_weight": (1 + 0.2 * rng.standard_normal(C)).astype(F32) if norm else None,
            "H_pre": (0.1 + rng.random((T, n))).astype(F32)}


def check(op, T, n, C, dt, norm=True, misalign=False, seed=0, scale=1.0, blocks=None, special=False, verbose=False):
    """Emulate one case (module docstring; ``special``: as make_inputs); returns the measured errors and
    the outputs (row, stat).  Raises EmulationError."""
    inp = make_inputs(T, n, C, dt, seed, scale, norm or op == "mhc_layer_pre_norm_fwd", special)
    outs, targs, grid, block, a, (li, rstd) = plan_launch(op, inp, inp["H_pre"], misalign, blocks)
    fp8, has_w = op == "mhc_layer_pre_fp8_fwd", inp["norm_weight"] is not None
    _require((targs[3] == "true") == has_w and (targs[4] == "true") == fp8, "NORM, FP8")
    for b in outs[:2]:
        _require(b.new_writes() == 1, f"{b.name}: an element not written exactly once")
    ref_li = reference.stream_aggregate_fwd(inp["x"], inp["H_pre"])
    ulp = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[dt]
    mag = np.abs(inp["x"].astype(np.float64)).transpose(0, 2, 1) @ inp["H_pre"][:, :, None].astype(np.float64)
    with np.errstate(invalid="ignore"):
        err = np.maximum(np.abs(li - ref_li) - ulp * np.abs(ref_li), 0) / (mag[..., 0] + 1e-30)
    worst = {"layer_in": float(np.nanmax(err, initial=0))}
    _require((worst["layer_in"] <= 1e-6) & (np.isnan(li) == np.isnan(ref_li)),
             f"layer_in: error {worst['layer_in']:.3g} past one rounding")
    row, stat = outs[0].a.reshape(T, C), outs[1].a.reshape(T)
    u = li
    if has_w:
        ref_rstd = rli.rms_rstd(li, 1e-6)[:, 0]
        terms = C // int(targs[2]) // block[0] * int(targs[2]) + int(targs[2]) + 5 + block[0] // 32 + 4
        with np.errstate(invalid="ignore", divide="ignore"):
            worst["rstd"] = float(np.nanmax(np.where(rstd == ref_rstd, 0, np.abs(rstd / ref_rstd - 1)), initial=0))
        _require((worst["rstd"] <= terms * 2.0 ** -24) & (np.isnan(rstd) == np.isnan(ref_rstd)),
                 f"rstd: error {worst['rstd']:.3g}")
        u = rli.rms_normalise(li, rstd[:, None], inp["norm_weight"], NP_DTYPE[dt]).astype(F32)
        if not fp8:
            _require(row.view(np.uint8) == u.astype(NP_DTYPE[dt]).view(np.uint8), "layer_in_normed differs in bits")
            _require(stat.view(np.uint32) == rstd.view(np.uint32), "stat is not rstd")
    if fp8:
        q, scale = rli.quantise_e4m3(u)
        _require(row.view(np.uint8) == q.view(np.uint8), "q differs in bits from quantise_e4m3")
        _require(np.array_equal(stat, scale[:, 0], equal_nan=True), "scale differs")
    if verbose:
        print(f"{op} T={T} n={n} C={C} {dt} norm={has_w} misalign={misalign}: grid {grid[0]} block {block[0]} "
              f"T,N,E,NORM,FP8 = {','.join(targs)} keep={a['keep']}: ok; "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return worst, (row, stat)


CASES = [  # (op, T, n, C, dtype, norm, misalign)
    ("mhc_layer_pre_norm_fwd", 1, 1, 7, "bfloat16", True, False),
    ("mhc_layer_pre_norm_fwd", 3, 4, 1000, "float16", True, False),  # E = 8, 4 warps, several trips
    ("mhc_layer_pre_norm_fwd", 3, 3, 24, "float32", True, True),  # E = 1
    ("mhc_layer_pre_fp8_fwd", 1, 4, 7, "bfloat16", False, False),
    ("mhc_layer_pre_fp8_fwd", 3, 1, 4096, "bfloat16", False, False),  # no RMSNorm: E = 16, 16-byte stores of q
    ("mhc_layer_pre_fp8_fwd", 3, 1, 4096, "bfloat16", True, False),  # RMSNorm: q counted as x's dtype, E = 8
    ("mhc_layer_pre_fp8_fwd", 5, 3, 72, "float32", True, False),
    ("mhc_layer_pre_fp8_fwd", 3, 4, 2050, "float16", True, False),  # E = 2
    ("mhc_layer_pre_fp8_fwd", 2, 8, 33, "bfloat16", True, True),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="mhc_layer_pre_fp8_fwd",
                    choices=["mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"])
    ap.add_argument("--T", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--C", type=int)
    ap.add_argument("--dtype", choices=sorted(NP_DTYPE), default="bfloat16")
    ap.add_argument("--norm", action="store_true", help="mhc_layer_pre_fp8_fwd with a norm_weight")
    ap.add_argument("--misalign", action="store_true", help="x one element off 16 bytes: the scalar path (E = 1)")
    ap.add_argument("--scale", type=float, default=1.0, help="x times this (1e20: sums of squares overflow)")
    a = ap.parse_args(argv)
    if a.T is not None:
        check(a.op, a.T, a.n, a.C, a.dtype, a.norm, a.misalign, scale=a.scale, verbose=True)
        return
    for case in CASES:
        check(*case, verbose=True)
    print(f"{len(CASES)} cases: every check passed")


if __name__ == "__main__":
    main()
