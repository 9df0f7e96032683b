"""Emulate the small-token forward's two kernels on the CPU, thread by thread.

The kernel choice ``small`` (mhc_cupy._kernel_choice, at most 64 tokens) runs mhc_layer_pre_fwd and
mhc_boundary_fwd in two launches: mhc_coeffs_gemv_fwd_kernel<T, POST> (kernels_cu/coeffs_gemv.cu)
then mhc_layer_pre_tail_kernel<T, N, G, DS, E> (kernels_cu/sinkhorn.cu).  Here the ops' real plans run
inside ``_jit.dry_run`` on fake pointers, each a NumPy buffer of its shape, and every launch the plan
makes (grid, block, template arguments, arguments by name) runs in NumPy: every block and thread,
vectorised over them, each with its own indices from the kernel's formulas.

mhc_coeffs_gemv_fwd_kernel: the grid (splits, groups), the D-range loop and its partial chunks, the
staging loops of s_phi and s_x (POST: the residual update out = post op(y, x, H_post, H_res) element
by element, res_t, in float32 fmaf and rounded to T, stored and staged), each thread's outputs (the
`output` lambda and its break), the fmaf chains over the staged rows, the sum of squares with its
2^-100-scaled twin and the epilogue's -qs after an overflow.
mhc_layer_pre_tail_kernel: the grid-stride token loop, staged_split_sums (the ranges' sums staged in
s_stage by every thread, STAGE_LOADS at a time, a stage of TAIL_STAGE_FLOATS, then split_sum's additions
per column from there) with SumSq, h = fmaf(alpha_grp H, rinv,
bias) into s_h, Sinkhorn on the first G lanes (lane_exp, lane_iteration, DS's softmax start, group_sum
as shfl.sync.bfly with the PTX ISA's segment rule and the mask (1u << G) - 1), the activations into
H_pre / s_pre / H_post, and layer_in = sum_i H_pre_i x_i by fmaf in i order, E columns a thread access
(every vector whole and aligned to min(E * itemsize, 16) bytes).

Asserted on the way: every global read in bounds (and of written elements, for the buffers the
plan writes), every shared index inside its array (GEMV_SMEM_FLOATS; s_h[K], s_pre[N], s_stage) and reading
a value the current phase staged (no stale or unwritten cell, no two writers of one cell), every
shuffle's source lane executing and in the mask (so < G), every part[split, t, k] (k <= K), out,
stats, H_pre, H_post, H_res and layer_in element written exactly once.  Compared: out bitwise with
the post op's float32 fmaf chain (mhc_stream_mix_distribute_fwd_kernel's order); part bitwise with
a vectorised float32 fmaf chain over each D range and, summed over the splits, with float64 x~ phi
and sum x~^2; stats bitwise with the float32 split sums; layer_in bitwise with the fmaf chain of the
emulated H_pre; h, H_pre, H_post, H_res, layer_in and stats against mhc_cupy.reference (float64)
within tolerances.

Approximate, so compared within a tolerance only: expf (CUDA: within 2 ulp; here NumPy's float32
exp) in lane_exp and sigmoid, and __fdividef(1, d) (CUDA: within 2 ulp; here float32 1 / d).
Not covered: the barriers' placement (the phases run in the kernel's order, as its __syncthreads
separate them), the compiler (FMA contraction of the plain float expressions: none changes a
compared bit here), timing, 32-bit index overflow at large shapes, NaN / inf inputs.

Usage (repo root, CPU only):
    python scripts/emulate_small.py                    # CASES
    python scripts/emulate_small.py --all              # grid(): every T, n, C, dtype
    python scripts/emulate_small.py --op mhc_boundary_fwd --T 64 --n 16 --C 72 --dtype float16 --deepseek
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import re
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: the worktree's package
    sys.path.insert(0, str(_ROOT))

from mhc_cupy import _jit, reference  # noqa: E402
from mhc_cupy._interop import ArrayInfo  # noqa: E402
from mhc_cupy._kernel_choice import kernel_choice  # noqa: E402
from mhc_cupy._settings import LayerSettings  # noqa: E402
from mhc_cupy.ops import SPECS  # noqa: E402
from mhc_cupy.ops.coeffs import fwd as coeffs_fwd  # noqa: E402
from mhc_cupy.ops.layer import PRE_TAIL  # noqa: E402
from mhc_cupy.ops.sinkhorn import fwd_group  # noqa: E402
from mhc_cupy.ops.spec import shape_of  # noqa: E402

_spec = importlib.util.spec_from_file_location("emulate_boundary", Path(__file__).with_name("emulate_boundary.py"))
_eb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_eb)
fmaf, round_to, post_chain, saved_sumsq = _eb.fmaf, _eb.round_to, _eb.post_chain, _eb.saved_sumsq
NP_DTYPE, STAT_SCALE, EmulationError, _require = _eb.NP_DTYPE, _eb.STAT_SCALE, _eb.EmulationError, _eb._require
F32 = np.float32
_CTYPE = {"__nv_bfloat16": "bfloat16", "__half": "float16", "float": "float32"}


def _kernel_constants(*files):
    """The ``constexpr int NAME = value;`` constants the kernel files define."""
    src = "".join((_ROOT / "kernels_cu" / f).read_text() for f in files)
    return {m[0]: int(m[1]) for m in re.findall(r"constexpr int (\w+) = (\d+);", src)}


_K = _kernel_constants("coeffs_gemv.cu", "sinkhorn.cu", "coeffs.cuh")
GEMV_THREADS, GEMV_MAX_OUTS, GEMV_SMEM_FLOATS = _K["GEMV_THREADS"], _K["GEMV_MAX_OUTS"], _K["GEMV_SMEM_FLOATS"]
assert (GEMV_THREADS, GEMV_MAX_OUTS, GEMV_SMEM_FLOATS) == (
    coeffs_fwd._GEMV_THREADS, coeffs_fwd._GEMV_MAX_OUTS, coeffs_fwd._GEMV_SMEM_FLOATS), "host and kernel constants"


TAIL_THREADS, TAIL_STAGE_FLOATS, STAGE_LOADS = _K["TAIL_THREADS"], _K["TAIL_STAGE_FLOATS"], _K["STAGE_LOADS"]


def _cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------ memories

class Buffer:
    """A global array (flat) with bounds checks and a write count per element; ``written`` False:
    the plan's output or scratch, whose reads must find a written element."""

    def __init__(self, name, values, written=True):
        self.name, self.a = name, np.ascontiguousarray(values).reshape(-1)
        self.writes = np.full(self.a.size, int(written), np.int64) if written else np.zeros(self.a.size, np.int64)
        self.writes0 = self.writes.copy()

    def read(self, idx, mask, what):
        """Elements at idx where mask (zero elsewhere), as float32."""
        idx, mask = np.broadcast_arrays(np.asarray(idx, np.int64), np.asarray(mask, bool))
        i = idx[mask]
        _require((i >= 0) & (i < self.a.size), f"{what}: {self.name} index out of bounds")
        _require(self.writes[i] > 0, f"{what}: {self.name} read of an element not written")
        out = np.zeros(idx.shape, F32)
        out[mask] = self.a[i].astype(F32)
        return out

    def write(self, idx, values, mask, what):
        idx, values, mask = np.broadcast_arrays(np.asarray(idx, np.int64), values, np.asarray(mask, bool))
        i = idx[mask]
        _require((i >= 0) & (i < self.a.size), f"{what}: {self.name} index out of bounds")
        self.a[i] = values[mask].astype(self.a.dtype)
        np.add.at(self.writes, i, 1)

    def new_writes(self):
        return self.writes - self.writes0


class Shared:
    """One shared array per block [B, size] float32: each cell's value and the phase that wrote it;
    writes of one phase may not overlap (two threads, one cell)."""

    def __init__(self, name, B, size):
        self.name, self.size = name, size
        self.v = np.full((B, size), np.nan, F32)
        self.phase = np.full((B, size), -1, np.int64)
        self.count = np.zeros((B, size), np.int64)

    def begin(self):  # a barrier: a new phase of writes
        self.count[:] = 0

    def store(self, idx, vals, mask, phase, lo, hi, what):
        idx, vals, mask = np.broadcast_arrays(np.asarray(idx, np.int64), np.asarray(vals, F32), np.asarray(mask, bool))
        b = np.broadcast_to(np.arange(idx.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 1)), idx.shape)[mask]
        i = idx[mask]
        _require((i >= lo) & (i < hi) & (i < self.size), f"{what}: {self.name} store outside its array")
        np.add.at(self.count, (b, i), 1)
        _require(self.count[b, i] == 1, f"{what}: two stores to one {self.name} cell in one phase")
        self.v[b, i] = vals[mask]
        self.phase[b, i] = phase

    def load(self, idx, mask, phase, lo, hi, what):
        idx, mask = np.broadcast_arrays(np.asarray(idx, np.int64), np.asarray(mask, bool))
        b = np.broadcast_to(np.arange(idx.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 1)), idx.shape)[mask]
        i = idx[mask]
        _require((i >= lo) & (i < hi) & (i < self.size), f"{what}: {self.name} load outside its array")
        _require(self.phase[b, i] == np.broadcast_to(phase, idx.shape)[mask],
                 f"{what}: {self.name} load of a cell not staged in this phase")
        out = np.zeros(idx.shape, F32)
        out[mask] = self.v[b, i]
        return out


class SumSq:
    """mhc_coeffs::SumSq, vectorised."""

    def __init__(self, shape):
        self.q, self.qs, self.scaled = np.zeros(shape, F32), np.zeros(shape, F32), np.zeros(shape, bool)

    def add(self, v):
        neg = v < 0
        self.scaled |= neg
        qs_pos = fmaf((v * STAT_SCALE).astype(F32), STAT_SCALE, self.qs)
        self.qs = np.where(neg, (self.qs - v).astype(F32), qs_pos)
        self.q = np.where(neg, self.q, (self.q + v).astype(F32))

    def overflowed(self):
        return self.scaled | np.isinf(self.q)

    def saved(self):
        return np.where(self.overflowed(), -self.qs, self.q)

    def rinv(self, D, eps):
        eps = F32(eps)
        with np.errstate(under="ignore", over="ignore"):
            plain = F32(1) / np.sqrt(self.q / F32(D) + eps)
            scaled = STAT_SCALE / np.sqrt(self.qs / F32(D) + (eps * STAT_SCALE) * STAT_SCALE)
        return np.where(self.overflowed(), scaled, plain).astype(F32)


# ------------------------------------------------------------------ hooks (a test may replace them to inject a fault)

def gemv_output(o, KW):
    """The `output` lambda: output o of the group -> (token t, column k)."""
    t = o // KW
    return t, o - t * KW


def sx_index(t, r, rows, nr):
    """s_x's cell of token t, row r (the kernel: xr = s_x + t * rows)."""
    return t * rows + r


def res_index(si, j, n, res_t):
    """H_res's element of the post op's M[si, j]."""
    return np.where(res_t, j * n + si, si * n + j)


def butterfly_offsets(G):
    """group_sum<G>'s shuffle offsets."""
    offs, off = [], G // 2
    while off > 0:
        offs.append(off)
        off >>= 1
    return offs


def shfl_bfly_source(lane, off, width):
    """The source lane of shfl.sync.bfly (the PTX ISA) as __shfl_xor_sync(mask, v, off, width) issues
    it: c = ((32 - width) << 8) | 31, j = lane ^ off, own lane when j > maxLane."""
    segmask, cval = 32 - width, 31
    max_lane = (lane & segmask) | (cval & ~segmask)
    j = lane ^ off
    return np.where(j <= max_lane, j, lane)


# ------------------------------------------------------------------ mhc_coeffs_gemv_fwd_kernel

def run_gemv(targs, grid, block, a, mem):
    dt, POST = _CTYPE[targs[0]], targs[1] == "true"
    _require(block == (GEMV_THREADS, 1, 1) and grid[2] == 1, "gemv launch shape")
    tokens, D, K, tt, outs, rows, d_split = (int(a[k]) for k in ("tokens", "D", "K", "tt", "outs", "rows", "d_split"))
    C, n, res_t = int(a["C"]), int(a["n"]), int(a["res_t"])
    x, phi, part = mem[a["x"]], mem[a["phi"]], mem[a["part"]]
    if POST:
        y, h_post, h_res, out = mem[a["y"]], mem[a["h_post"]], mem[a["h_res"]], mem[a["out"]]
    else:
        _require(all(a[k] is None for k in ("y", "h_post", "h_res", "out")), "POST=false: null post pointers")
    _require(all(b.a.dtype == NP_DTYPE[dt] for b in ([x, y, out] if POST else [x])), "T is the activations' dtype")
    gx, gy = grid[0], grid[1]
    B = gx * gy
    bid = np.arange(B)[:, None]
    split, t0 = bid % gx, (bid // gx) * tt  # blockIdx.x, blockIdx.y * tt
    tid = np.arange(GEMV_THREADS)[None, :]
    d_begin = split * d_split
    d_end = np.minimum(D, d_begin + d_split)
    KW = K + 1
    sm = Shared("s_gemv", B, GEMV_SMEM_FLOATS)
    PHI0, X0 = 0, rows * K  # s_phi [rows][K], s_x [tt][rows]
    acc = np.zeros((B, GEMV_THREADS, GEMV_MAX_OUTS), F32)
    qs = np.zeros_like(acc)
    chunks = int(_cdiv(np.maximum(d_end - d_begin, 0), rows).max())
    for ci in range(chunks):
        d0 = d_begin + ci * rows
        live = d0 < d_end  # [B, 1]: the block is still in its D-range loop
        nr = np.minimum(rows, d_end - d0)
        sm.begin()
        for it in range(_cdiv(rows * K, GEMV_THREADS)):
            i = tid + GEMV_THREADS * it
            m = live & (i < nr * K)
            sm.store(PHI0 + i, phi.read(d0 * K + i, m, "phi"), m, ci, PHI0, X0, "s_phi")
        for it in range(_cdiv(tt * rows, GEMV_THREADS)):
            i = tid + GEMV_THREADS * it
            m = live & (i < tt * rows)
            t = i // rows
            r = i - t * rows
            tok, d = t0 + t, d0 + r
            ok = m & (r < nr) & (tok < tokens)
            if POST:
                si = d // C
                c = d - si * C
                o = (h_post.read(tok * n + si, ok, "h_post") * y.read(tok * C + c, ok, "y")).astype(F32)
                for j in range(n):
                    mv = h_res.read(tok * n * n + res_index(si, j, n, res_t), ok, "h_res")
                    o = fmaf(mv, x.read((tok * n + j) * C + c, ok, "x"), o)
                q = round_to(o, dt)
                out.write(tok * D + d, q, ok, "out")
                v = q
            else:
                v = x.read(tok * D + d, ok, "x")
            sm.store(X0 + i, np.where(ok, v, F32(0)), m, ci, X0, X0 + tt * rows, "s_x")
        alive = np.ones((B, GEMV_THREADS), bool)
        for j in range(GEMV_MAX_OUTS):
            o = tid + GEMV_THREADS * j
            alive = alive & (j < outs) & (o < tt * KW)  # `if (!output(j, t, k)) break;`
            if not (alive & live).any():
                break
            t, k = gemv_output(o, KW)
            is_k = k < K
            for r in range(rows):
                m = live & alive & (r < nr)
                if not m.any():
                    break
                xv = sm.load(X0 + sx_index(t, r, rows, nr), m, ci, X0, X0 + tt * rows, "s_x")
                pv = sm.load(PHI0 + r * K + k, m & is_k, ci, PHI0, X0, "s_phi")
                acc[:, :, j] = np.where(m, fmaf(xv, np.where(is_k, pv, xv), acc[:, :, j]), acc[:, :, j])
                s = (xv * STAT_SCALE).astype(F32)
                qs[:, :, j] = np.where(m & ~is_k, fmaf(s, s, qs[:, :, j]), qs[:, :, j])
    alive = np.ones((B, GEMV_THREADS), bool)
    for j in range(GEMV_MAX_OUTS):
        o = tid + GEMV_THREADS * j
        alive = alive & (j < outs) & (o < tt * KW)
        t, k = gemv_output(o, KW)
        w = alive & (t0 + t < tokens)
        val = np.where((k == K) & np.isinf(acc[:, :, j]), -qs[:, :, j], acc[:, :, j])
        part.write((split * tokens + t0 + t) * KW + k, val, w, "part")


# ------------------------------------------------------------------ mhc_layer_pre_tail_kernel

def sigmoid(z):
    z = np.asarray(z, F32)
    with np.errstate(over="ignore"):
        pos = F32(1) / (F32(1) + np.exp(-z))
        e = np.exp(z)
        neg = e / (F32(1) + e)
    return np.where(z >= 0, pos, neg).astype(F32)


def tail_mask(G):
    """The tail's shuffle mask: G == 32 ? 0xffffffffu : (1u << G) - 1u."""
    return 0xFFFFFFFF if G == 32 else (1 << G) - 1


def group_width(G):
    """group_sum<G>'s shuffle width (and butterfly span)."""
    return G


def group_sum(v, G, mask, executing, add=lambda a, b: (a + b).astype(F32)):
    """group_sum<G>(v, mask) on warp 0's lanes: v [B, 32, ...]; every executing lane must be in the
    mask, and read from an executing lane in the mask (so a lane < G)."""
    lane = np.arange(32)
    in_mask = ((mask >> lane) & 1).astype(bool)
    _require(in_mask[executing].all() and executing[in_mask].all(), "shuffle mask != the lanes that execute it")
    W = group_width(G)
    for off in butterfly_offsets(W):
        src = shfl_bfly_source(lane, off, W)
        s = src[executing]
        _require(in_mask[s].all() & executing[s].all() & (s < G).all(),
                 f"group_sum<{G}>: a shuffle reads a lane outside the mask / not executing")
        v = np.where(executing.reshape((1, 32) + (1,) * (v.ndim - 2)), add(v, v[:, src]), v)
    return v


def check_group_sum_lanes(n):
    """The tail's group_sum for n streams (G = fwd_group(n), lanes < G executing, tail_mask(G)): every
    shuffle stays on those lanes, and each lane ends with every lane's value exactly once."""
    G = fwd_group(n)
    executing = np.arange(32) < G
    v = np.where(executing, np.uint64(1) << np.arange(32, dtype=np.uint64), np.uint64(0))[None, :]
    total = group_sum(v, G, tail_mask(G), executing, add=lambda a, b: a + b)[0, :G]
    _require(total == (1 << G) - 1, f"group_sum<{G}> (n = {n}): a lane's sum is not each lane's value once")
    return G


def lane_sinkhorn(L, lanes_ok, N, G, DS, iters, eps, mask, executing):
    """lane_sinkhorn<N, G, DS> on warp 0: L(i, j, valid) reads s_h's logits; returns p [B, 32, R, N]."""
    R = _cdiv(N, G)
    lane = np.arange(32)[None, :]
    B = lanes_ok.shape[0]
    p = np.zeros((B, 32, R, N), F32)
    rows_ok = []
    for r in range(R):  # lane_exp
        i = lane + r * G
        ok = lanes_ok & (i < N)
        rows_ok.append(ok)
        Li = np.stack([L(i, j, ok) for j in range(N)], axis=-1)
        m = Li[..., 0]
        for j in range(1, N):
            m = np.where(Li[..., j] > m, Li[..., j], m)
        with np.errstate(over="ignore"):
            p[:, :, r] = np.where(ok[..., None], np.exp((Li - m[..., None]).astype(F32)), F32(0))

    def iteration(row_eps, row_add):
        for r in range(R):
            s = np.zeros(p.shape[:2], F32)
            for j in range(N):
                s = (s + p[:, :, r, j]).astype(F32)
            d = (s + F32(row_eps)).astype(F32)
            with np.errstate(divide="ignore"):
                inv = (F32(1) / d).astype(F32)  # __fdividef(1, d): approximate (2 ulp on the GPU)
            p[:, :, r] = np.where(rows_ok[r][..., None], fmaf(p[:, :, r], inv[..., None], F32(row_add)), p[:, :, r])
        c = np.zeros((B, 32, N), F32)
        for r in range(R):
            c = (c + p[:, :, r]).astype(F32)
        d = (group_sum(c, G, mask, executing) + F32(eps)).astype(F32)
        with np.errstate(divide="ignore"):
            inv = (F32(1) / d).astype(F32)
        p[:] = np.where(executing[None, :, None, None], (p * inv[:, :, None, :]).astype(F32), p)

    it = 0
    if DS and iters > 0:
        iteration(0.0, eps)
        it = 1
    for _ in range(it, iters):
        iteration(eps, 0.0)
    return p, rows_ok


def stage_source(i, KW, stride, s0, t):
    """Where staged_split_sums loads stage element i from: range s0 + i // KW, column i % KW of token t."""
    s = i // KW
    return s0 * stride + t * KW + s * stride + (i - s * KW)


def run_tail(targs, grid, block, a, mem):
    dt, N, G, DS, E = _CTYPE[targs[0]], int(targs[1]), int(targs[2]), targs[3] == "true", int(targs[4])
    _require(block[1:] == (1, 1) and block[0] % 32 == 0 and block[0] >= 32 >= G, "tail launch shape")
    NT = block[0]
    K = N * N + 2 * N
    tokens, C, splits, iters = (int(a[k]) for k in ("tokens", "C", "splits", "iters"))
    rms_eps, eps, hc_eps, post_mult = (F32(a[k]) for k in ("rms_eps", "eps", "hc_eps", "post_mult"))
    part, alpha, bias, x = mem[a["part"]], mem[a["alpha"]], mem[a["bias"]], mem[a["x"]]
    stats, H_pre, H_post, H_res, layer_in = (mem[a[k]] for k in ("stats", "H_pre", "H_post", "H_res", "layer_in"))
    _require(x.a.dtype == NP_DTYPE[dt] and layer_in.a.dtype == NP_DTYPE[dt], "T is the activations' dtype")
    D = N * C
    B = grid[0]
    _require(grid[1:] == (1, 1), "tail grid")
    tid = np.arange(NT)[None, :]
    lane = np.arange(32)
    s_h, s_pre = Shared("s_h", B, K), Shared("s_pre", B, N)
    mask = tail_mask(G)
    _require(NT == TAIL_THREADS, "blockDim.x = TAIL_THREADS (the kernel's columns a thread)")
    s_stage = Shared("s_stage", B, TAIL_STAGE_FLOATS)
    KW, KPT = K + 1, _cdiv(K, TAIL_THREADS)
    chunk, stride = TAIL_STAGE_FLOATS // KW, tokens * KW
    debug_h = np.full((tokens, K), np.nan, F32)
    for it in range(_cdiv(tokens, B)):
        t = np.arange(B)[:, None] + it * B  # blockIdx.x + it * gridDim.x
        active = t < tokens
        s_h.begin()
        # staged_split_sums: each stage's ranges loaded by every thread, STAGE_LOADS a thread at a time,
        # then the threads k < K sum their columns' ranges in order (split_sum's additions)
        H = [np.zeros((B, NT), F32) for _ in range(KPT)]
        q = SumSq((B, NT))
        summing = active & (tid < K)
        for si, s0 in enumerate(range(0, splits, chunk)):
            count, phase = min(chunk, splits - s0) * KW, it * 1_000_000 + si
            s_stage.begin()
            for base in range(0, count, STAGE_LOADS * NT):
                for b in range(STAGE_LOADS):
                    i = tid + base + b * NT
                    m = active & (i < count)
                    s_stage.store(i, part.read(stage_source(i, KW, stride, s0, t), m, "part"), m, phase, 0, count,
                                  "s_stage")
            for row in range(0, count, KW):  # (a barrier before)
                for j in range(KPT):
                    k = tid + j * NT
                    m = summing & (k < K)
                    H[j] = np.where(m, (H[j] + s_stage.load(row + k, m, phase, 0, count, "s_stage")).astype(F32),
                                    H[j])
                q.add(s_stage.load(np.full(summing.shape, row + K), summing, phase, 0, count, "s_stage"))
        for kk in range(KPT):
            k = tid + NT * kk
            m = active & (k < K)
            H_k = H[kk]
            stats.write(t * (K + 1) + k, H_k, m, "stats")
            stats.write(t * (K + 1) + K, q.saved(), m & (k == 0), "stats")
            grp = np.where(k < N, 0, np.where(k < 2 * N, 1, 2))
            al = alpha.read(grp, m, "alpha")
            h = fmaf((al * H_k).astype(F32), q.rinv(D, rms_eps), bias.read(k, m, "bias"))
            s_h.store(k, h, m, it, 0, K, "s_h")
            debug_h[np.broadcast_to(t, m.shape)[m], np.broadcast_to(k, m.shape)[m]] = h[m]
        # __syncthreads; the first G threads (warp 0's lanes < G)
        executing = lane < G
        lanes_ok = active & executing[None, :]
        tw = t  # [B, 1]
        s_pre.begin()

        def L(i, j, ok):
            return s_h.load(2 * N + i * N + j, ok, it, 2 * N, K, "s_h (logits)")

        p, rows_ok = lane_sinkhorn(L, lanes_ok, N, G, DS, iters, eps, mask, executing)
        for r in range(len(rows_ok)):
            i = lane[None, :] + r * G
            ok = rows_ok[r]
            for j in range(N):
                H_res.write((tw * N + i) * N + j, p[:, :, r, j], ok, "H_res")
            hp = (sigmoid(s_h.load(i, ok, it, 0, N, "s_h (pre)")) + hc_eps).astype(F32)
            H_pre.write(tw * N + i, hp, ok, "H_pre")
            s_pre.store(i, hp, ok, it, 0, N, "s_pre")
            hq = (post_mult * sigmoid(s_h.load(N + i, ok, it, N, 2 * N, "s_h (post)"))).astype(F32)
            H_post.write(tw * N + i, hq, ok, "H_post")
        # __syncthreads; layer_in: E columns a thread access (load_vec / store_vec: whole vectors, aligned)
        size = np.dtype(NP_DTYPE[dt]).itemsize
        for cc in range(_cdiv(C, NT * E)):
            c0 = (tid + NT * cc) * E
            m0 = active & (c0 < C)
            _require(E == 1 or C % E == 0, "C % E == 0 (no partial vector)")
            for base, start in ((a["x"], t * N * C + np.arange(N)[:, None, None] * C + c0), (a["layer_in"], t * C + c0)):
                off = (base + np.broadcast_to(start, (start.shape[0],) + m0.shape)[..., m0] * size) % min(E * size, 16)
                _require((off == 0).all(), "vector accesses aligned to min(E * itemsize, 16) bytes")
            for e in range(E):
                c = c0 + e
                m = m0 & (c < C)
                s = np.zeros(m.shape, F32)
                for i in range(N):
                    hp = s_pre.load(np.full(m.shape, i), m, it, 0, N, "s_pre")
                    s = fmaf(hp, x.read(t * N * C + i * C + c, m, "x"), s)
                layer_in.write(t * C + c, round_to(s, dt), m, "layer_in")
    return debug_h


KERNELS = {"mhc_coeffs_gemv_fwd_kernel": run_gemv, "mhc_layer_pre_tail_kernel": run_tail}


# ------------------------------------------------------------------ the host's plan, run on emulated memory

def emulated_inputs(k, arrays, ptr, misalign=()):
    """(mem, infos): op spec ``k``'s inputs (NumPy arrays by name; absent or None: a null input) as
    Buffers at the fake device pointers ``ptr`` yields, and their ArrayInfo (the names in ``misalign``
    one element past their pointer: the kernels' unaligned path)."""
    T = arrays["x"].shape[0]
    n, C = arrays["x"].shape[-2:]
    sizes = {"n": n, "C": C, "K": n * n + 2 * n}
    mem, infos = {}, {}
    for arg in k.args:
        v = arrays.get(arg.name)
        if v is None:
            infos[arg.name] = None
            continue
        v = np.ascontiguousarray(v)
        assert v.shape == shape_of(arg, (T,), sizes), (arg.name, v.shape)
        p = next(ptr) + (v.itemsize if arg.name in misalign else 0)
        mem[p] = Buffer(arg.name, v.copy())
        dtn = {np.dtype(t): name for name, t in NP_DTYPE.items()}[v.dtype]
        infos[arg.name] = ArrayInfo(v.shape, dtn, ("cuda", 0), p, None)
    return mem, infos


def plan_launches(op, arrays, conv, tail_grid=None):
    """Run SPECS[op]'s plan under kernel_choice(small=True) in _jit.dry_run on fake pointers, one per
    array; then each launch on the emulated memory.  arrays: the op's inputs by name (NumPy).
    Returns (the outputs' Buffers, memory dict ptr -> Buffer, [(kernel name, template args, grid,
    args by name, extra)]).  tail_grid: run the tail on this many blocks instead of the host's (the
    grid-stride loop)."""
    k = SPECS[op]
    ptr = iter(range(1 << 32, 1 << 48, 1 << 32))
    mem, infos = emulated_inputs(k, arrays, ptr)
    with kernel_choice(small=True), _jit.dry_run() as launches:
        plan = k.planner(infos, settings=LayerSettings.resolve(conv))
        outs = []
        for shape, dtn in plan.outputs:
            p = next(ptr)
            mem[p] = Buffer("out", np.full(shape, np.nan, NP_DTYPE[dtn]), written=False)
            outs.append(p)
        scratch = []
        for name, (shape, dtn) in plan.scratch.items():
            p = next(ptr)
            mem[p] = Buffer(name, np.full(shape, np.nan, NP_DTYPE[dtn]), written=False)
            scratch.append(p)
        plan.launch({a: v.ptr for a, v in infos.items()}, outs, scratch, 0)
    for name, p in zip(("out", "layer_in", "H_pre", "H_post", "H_res", "stats")[-len(outs):], outs):
        mem[p].name = name
    specs = {"mhc_coeffs_gemv_fwd_kernel": coeffs_fwd.GEMV_FWD, "mhc_layer_pre_tail_kernel": PRE_TAIL}
    ran = []
    for _, expr, grid, block, args, smem in launches:
        name, targs = expr.split("<")[0], [s.strip() for s in expr.split("<", 1)[1].rstrip(">").split(",")]
        _require(name in KERNELS, f"the small path launched {name}")
        _require(smem == 0, f"{name}: dynamic shared memory {smem}")
        byname = dict(zip([p for _, p in specs[name].params], args))
        if name == "mhc_layer_pre_tail_kernel" and tail_grid is not None:
            grid = (tail_grid, 1, 1)
        extra = KERNELS[name](targs, tuple(grid), tuple(block), byname, mem)
        ran.append((name, targs, tuple(grid), byname, extra))
    return [mem[p] for p in outs], mem, ran


# ------------------------------------------------------------------ inputs, references, checks

def make_inputs(T, n, C, dt, seed=0, scale=1.0):
    """x [T, n, C] and y [T, C] (dt, standard normal times scale), H_post [T, n], H_res [T, n, n]
    (row-stochastic), phi [n C, K], alpha [3], bias [K] float32."""
    rng = np.random.default_rng(seed)
    K = n * n + 2 * n
    act = lambda *s: (scale * rng.standard_normal(s)).astype(F32).astype(NP_DTYPE[dt])  # noqa: E731
    h_res = rng.random((T, n, n)).astype(F32)
    h_res /= h_res.sum(-1, keepdims=True)
    return {"x": act(T, n, C), "layer_out": act(T, C), "H_post": (2 * rng.random((T, n))).astype(F32),
            "H_res": h_res, "phi": (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(F32),
            "alpha": (0.5 + rng.random(3)).astype(F32), "bias": rng.standard_normal(K).astype(F32)}


def gemv_chain(xt, phi, splits, d_split):
    """part [splits, T, K+1] as the kernel's order claims: per D range, fmaf over the positions in order."""
    T, D = xt.shape
    K = phi.shape[1]
    part = np.zeros((splits, T, K + 1), F32)
    qs = np.zeros((splits, T), F32)
    for s in range(splits):
        for d in range(s * d_split, min(D, (s + 1) * d_split)):
            v = xt[:, d]
            part[s, :, :K] = fmaf(v[:, None], phi[d][None, :], part[s, :, :K])
            part[s, :, K] = fmaf(v, v, part[s, :, K])
            sc = (v * STAT_SCALE).astype(F32)
            qs[s] = fmaf(sc, sc, qs[s])
    part[:, :, K] = np.where(np.isinf(part[:, :, K]), -qs, part[:, :, K])
    return part


def _rel(err, scale):
    return float((np.abs(err) / (scale + 1e-30)).max()) if np.size(err) else 0.0


def check(op, T, n, C, dt, deepseek=False, seed=0, scale=1.0, tail_grid=None, verbose=False):
    """Emulate one case of op ("mhc_layer_pre_fwd" / "mhc_boundary_fwd") and compare (module
    docstring); returns the measured errors.  Raises EmulationError where a check fails."""
    conv = "deepseek" if deepseek else "paper"
    inp = make_inputs(T, n, C, dt, seed, scale)
    args = {a.name: inp[a.name] for a in SPECS[op].args}
    outs, mem, ran = plan_launches(op, args, conv, tail_grid)
    _require([r[0] for r in ran] == ["mhc_coeffs_gemv_fwd_kernel", "mhc_layer_pre_tail_kernel"], "two launches")
    (_, gt, ggrid, ga, _), (_, tt_, tgrid, ta, debug_h) = ran
    _require(int(tt_[2]) == fwd_group(n) and (tt_[3] == "true") == deepseek, "the tail's G, DS")
    _require((gt[1] == "true") == (op == "mhc_boundary_fwd"), "the GEMV's POST")
    K = n * n + 2 * n
    for b in outs:
        _require(b.new_writes() == 1, f"{b.name}: an element not written exactly once")
    part_buf = mem[ga["part"]]
    splits = ggrid[0]
    _require(int(ta["splits"]) == splits, "the tail's splits")
    used = splits * T * (K + 1)
    _require(part_buf.new_writes()[:used] == 1, "part: an element not written exactly once")
    part = part_buf.a[:used].reshape(splits, T, K + 1)
    if op == "mhc_boundary_fwd":
        out = outs[0].a.reshape(T, n, C)
        chain = post_chain(inp["x"], inp["layer_out"], inp["H_post"], inp["H_res"], deepseek)
        _require(out.view(np.uint8) == chain.view(np.uint8), "out differs in bits from the post op's fmaf chain")
        xs, (layer_in, H_pre, H_post, H_res, stats) = out, [b.a for b in outs[1:]]
    else:
        xs, (layer_in, H_pre, H_post, H_res, stats) = inp["x"], [b.a for b in outs]
    xt = xs.astype(F32).reshape(T, n * C)
    d_split = int(ga["d_split"])
    _require(part.view(np.uint32) == gemv_chain(xt, inp["phi"], splits, d_split).view(np.uint32),
             "part differs in bits from the fmaf chain over each D range")
    # float64: part summed over the splits, then the tail
    x64, phi64 = xt.astype(np.float64), inp["phi"].astype(np.float64)
    Hx = x64 @ phi64
    mag = np.abs(x64) @ np.abs(phi64)
    q64 = (x64 ** 2).sum(1)
    worst = {"H": _rel(part[:, :, :K].astype(np.float64).sum(0) - Hx, mag),
             "sumsq": _rel(saved_sumsq(part[:, :, K]).sum(0) - q64, q64)}
    Hs = np.zeros((T, K), F32)
    q = SumSq(T)
    for s in range(splits):
        Hs = (Hs + part[s, :, :K]).astype(F32)
        q.add(part[s, :, K])
    stats = stats.reshape(T, K + 1)
    _require(stats[:, :K].view(np.uint32) == Hs.view(np.uint32), "stats: H~ differs from the float32 split sums")
    _require(stats[:, K].view(np.uint32) == q.saved().view(np.uint32), "stats: the sum of squares differs")
    ref = reference.mhc_layer_pre_fwd(xs, inp["phi"], inp["alpha"], inp["bias"], convention=conv)
    h_ref = np.concatenate([r.reshape(T, -1) for r in reference.mhc_coeffs_fwd(xs, inp["phi"], inp["alpha"],
                                                                               inp["bias"], convention=conv)], 1)
    rinv = 1 / np.sqrt(q64 / (n * C) + LayerSettings.resolve(conv).rms_eps)
    a_col = np.repeat(inp["alpha"].astype(np.float64), [n, n, n * n])
    worst["h"] = _rel(debug_h - h_ref, np.abs(a_col) * rinv[:, None] * mag + np.abs(inp["bias"]))
    worst["stats_H"] = _rel(stats[:, :K] - ref[4][:, :K], mag)
    worst["stats_sumsq"] = _rel(saved_sumsq(stats[:, K]) - saved_sumsq(ref[4][:, K]), saved_sumsq(ref[4][:, K]))
    worst["H_pre"] = float(np.abs(H_pre.reshape(T, n) - ref[1]).max())
    worst["H_post"] = float(np.abs(H_post.reshape(T, n) - ref[2]).max())
    worst["H_res"] = float(np.abs(H_res.reshape(T, n, n) - ref[3]).max())
    li = layer_in.reshape(T, C)
    hp = H_pre.reshape(T, n)
    s = np.zeros((T, C), F32)
    for i in range(n):
        s = fmaf(hp[:, i, None], xs[:, i].astype(F32), s)
    _require(li.view(np.uint8) == round_to(s, dt).astype(li.dtype).view(np.uint8),
             "layer_in differs in bits from the fmaf chain of H_pre")
    ulp = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23}[dt]  # one ulp (relative)
    lmag = np.abs(xs.astype(np.float64)).transpose(0, 2, 1) @ np.abs(ref[1])[:, :, None]
    worst["layer_in"] = _rel(np.maximum(np.abs(li.astype(np.float64) - ref[0]) - ulp * np.abs(ref[0]), 0), lmag[..., 0])
    # Measured over grid(): H, h, stats_H 2e-7 relative; H_pre 1.3e-6, H_post 2.5e-6, H_res 1.4e-6 absolute;
    # layer_in 6e-7 past one ulp; the sums of squares 4e-6 relative (n = 32, C = 200, ranges of 1600 positions),
    # bounded by their terms: sequential float32 sums of positive terms, at most (terms) 2^-24 relative.  An
    # index error is of order 1 (the bitwise comparisons above are the sharp checks).
    sq = max(4e-6, (d_split + splits + 8) * 2.0 ** -24)
    tol = {"H": 2e-6, "sumsq": sq, "h": 2e-6, "stats_H": 2e-6, "stats_sumsq": sq, "H_pre": 1e-5, "H_post": 2e-5,
           "H_res": 2e-5, "layer_in": 5e-6}
    for key, bound in tol.items():
        _require(worst[key] <= bound, f"{key}: error {worst[key]:.3g} above {bound:.3g}")
    if verbose:
        print(f"{op} T={T} n={n} C={C} {dt} {conv}: gemv grid {ggrid[:2]} tt={ga['tt']} outs={ga['outs']} "
              f"rows={ga['rows']} d_split={d_split}; tail grid {tgrid[0]} G={tt_[2]}: ok; "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return worst


CASES = [  # (op, T, n, C, dtype, deepseek)
    ("mhc_layer_pre_fwd", 1, 1, 7, "bfloat16", False),
    ("mhc_layer_pre_fwd", 3, 2, 8, "float16", True),
    ("mhc_layer_pre_fwd", 3, 5, 7, "float32", False),  # two D ranges, the second a partial chunk
    ("mhc_layer_pre_fwd", 64, 4, 72, "bfloat16", True),  # 4 token groups of 16
    ("mhc_boundary_fwd", 1, 4, 200, "bfloat16", True),
    ("mhc_boundary_fwd", 3, 8, 8, "float32", False),
    ("mhc_boundary_fwd", 64, 2, 7, "float16", False),
    ("mhc_layer_pre_fwd", 1, 32, 8, "float16", True),  # K + 1 = 1089: 5 outputs a thread, rows 11, partial chunks
    ("mhc_boundary_fwd", 3, 16, 7, "bfloat16", True),  # tt 3 of at most 7
    ("mhc_boundary_fwd", 64, 16, 72, "float16", True),  # 10 token groups of 7 (the last 1), 8 outputs a thread,
    # ranges of 45 rows: a chunk of 32 then one of 13
    ("mhc_boundary_fwd", 1, 32, 200, "bfloat16", False),  # 256 ranges of 25 rows: chunks of 11, 11, 3
]


def grid(Ts=(1, 3, 64)):
    """Both ops at each T, every n in (1, 2, 4, 5, 8, 16, 32), C in (7, 8, 72, 200) and dtype, the
    convention alternating."""
    for T, n, C, dt in itertools.product(Ts, (1, 2, 4, 5, 8, 16, 32), (7, 8, 72, 200), sorted(NP_DTYPE)):
        for op in ("mhc_layer_pre_fwd", "mhc_boundary_fwd"):
            yield op, T, n, C, dt, (n + C + len(dt) + len(op)) % 2 == 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="mhc_layer_pre_fwd", choices=["mhc_layer_pre_fwd", "mhc_boundary_fwd"])
    ap.add_argument("--T", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--C", type=int)
    ap.add_argument("--dtype", choices=sorted(NP_DTYPE), default="bfloat16")
    ap.add_argument("--deepseek", action="store_true")
    ap.add_argument("--scale", type=float, default=1.0, help="x, y times this (1e20: sums of squares overflow)")
    ap.add_argument("--tail-grid", type=int, help="blocks of the tail (default: the host's, one a token)")
    ap.add_argument("--all", action="store_true", help="grid(): every T in (1, 3, 64), n, C, dtype")
    a = ap.parse_args(argv)
    if a.T is not None:
        check(a.op, a.T, a.n, a.C, a.dtype, a.deepseek, scale=a.scale, tail_grid=a.tail_grid, verbose=True)
        return
    cases = list(grid()) if a.all else CASES
    for case in cases:
        check(*case, verbose=True)
    print(f"{len(cases)} cases: every check passed")


if __name__ == "__main__":
    main()
