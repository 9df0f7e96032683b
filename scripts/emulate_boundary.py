"""Emulate mhc_boundary_fwd_kernel (kernels_cu/boundary.cu) on the CPU, thread by thread.

Checks the kernel's index maths and data layout without a GPU: every block of the launch that
mhc_cupy/ops/boundary.py plans (boundary_layout: grid, splits, c_split, Dp, Kp = 8 NTILE) is run
in NumPy, vectorised over the block's 128 threads but with each thread's own indices from the
kernel's formulas:

* the phi planes [3, Kp, Dp] as mhc_coeffs_split_phi_fwd_kernel writes them (split_bits<3>);
* shared memory as bytes: phi's rows of a step (N streams x 3 planes x 8 NTILE columns, PROW =
  64 SUB bytes each) at the exact offsets the fill lambda's cp_async16 copies write (swizzle
  ``q ^ ((kk & 1) * SWZ)``, SWZ = 4 where PROW is 128, zeros where the copy is not valid), landing
  only when their commit group is waited for (pipeline_start / pipeline_next / cp_async_wait), and
  the coefficients s_coef;
* x and y straight from global memory: per 32-channel unit of the split, each lane's 16-byte loads
  of its 8 channels c = c_begin + 32 u + 8 tq of rows g, g + 8 of the N streams of x and of y
  (zeros past the last token or c_end);
* the post op mix in float32 (fmaf exactly: one rounding) and the rounding to the dtype.  bf16:
  every stream of a channel from the same inputs, the sum of squares ss over (unit, channel,
  stream), the rounded bits packed into out's 16-byte words, which are also the A fragments.
  float16 / float32: one stream at a time, ss over (unit, stream, channel), store_vec, split_bits<P>
  packed into the A fragments;
* the B fragments at phi_o, the mma.sync m16n8k16 as its definition on the PTX ISA's fragment
  layout (float64 sum, rounded to float32 per MMA), the fresh accumulator of each unit and stream
  added to acc;
* the epilogue: ss's quad shuffles; where the quad's sum is inf, each lane's sum of
  (out 2^-100)^2 read back from the out values it stored (per unit in ss's order) and shuffled;
  the writes to part[split, t, k].

Asserted on the way: every global access in bounds, inside its row and aligned (16 bytes for the
vector loads, stores and cp.async sources), every x and y element loaded exactly once by the
launch, every shared-memory read inside its stage and row, of bytes the current step's fill wrote
(no copy in flight, no stale stage), every out[t, i, c] written exactly once and read back only by
the thread that stored it, the re-sum after an overflow equal in bits to the scaled sum of ss's
terms in ss's order (kept beside ss by the emulation), every part[split, t, k] (k <= K) written
exactly once.  Then out is compared bitwise with a vectorised float32 fmaf chain (and with
mhc_cupy.reference.mhc_post_op_fwd, float64, to within one ulp of the dtype plus the chain's float32
rounding), and the partial sums per split and summed over the splits with the float64 reference
out~ phi and sum out~^2 (also after a float32 overflow: minus the scaled sum).  Hooks a test may
replace to check that the emulation catches a fault: swizzle, wait_depth, lane_offsets, pack2,
a_fragment, overflowed, resum_order.

Not covered: the tensor cores' own accumulation order and rounding inside one MMA, the compiler
(registers, unrolling, whether the read-back of out stays a coherent load), timing beyond the
commit-group model, 32-bit index overflow at large shapes, split_bits' overflow case, NaN / inf
inputs.

Usage (repo root, CPU only):
    python scripts/emulate_boundary.py                 # a set of small cases (CASES)
    python scripts/emulate_boundary.py --all           # grid(): 225 cases
    python scripts/emulate_boundary.py --T 65 --n 4 --C 200 --dtype float16 --stages 2 --sub 2

Importable: ``emulate(...)`` returns the emulated outputs, ``check(...)`` / ``check_arrays(...)`` run and
verify one case.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

if __package__ in (None, ""):  # run as a script: the worktree's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhc_cupy import reference  # noqa: E402
from mhc_cupy.ops.boundary import BOUNDARY_FWD, boundary_layout  # noqa: E402

BF16 = ml_dtypes.bfloat16
NP_DTYPE = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}
PARTS = {"bfloat16": 1, "float16": 2, "float32": 3}  # XParts<T>
STAT_SCALE = np.float32(2.0 ** -100)
TOK, THREADS = 64, 128
_COEF = -2  # the writer mark of s_coef's bytes (stages' bytes carry their step)


class EmulationError(AssertionError):
    """A check of the emulated kernel failed (bad index, race, missing or repeated write)."""


def _require(ok, what):
    if not np.all(ok):
        raise EmulationError(what)


# ------------------------------------------------------------------ float32 arithmetic as on the GPU

def fmaf(a, b, c):
    """fmaf(a, b, c) of float32 arrays, rounded once: the float64 product is exact, the float64 sum
    is made round-to-odd (TwoSum's error sets the sticky bit), and round-to-odd to 53 bits then
    rounding to 24 is the correctly rounded result."""
    p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
    s = np.array(s, ndmin=1)
    err = np.broadcast_to(err, s.shape)
    fix = np.isfinite(s) & (err != 0)
    if fix.any():
        bits = s.view(np.uint64).copy()
        mag = bits & np.uint64(0x7FFFFFFFFFFFFFFF)
        sign = bits & np.uint64(0x8000000000000000)
        toward_zero = fix & (np.signbit(err) != np.signbit(s))  # |exact| < |s|: truncation is s's neighbour
        mag = np.where(toward_zero, mag - np.uint64(1), mag)
        mag = np.where(fix, mag | np.uint64(1), mag)
        s = (sign | mag).view(np.float64)
    with np.errstate(over="ignore"):
        return s.astype(np.float32).reshape(np.broadcast_shapes(p.shape, c.shape))


def round_to(v, dt):
    """float32 -> the activation dtype (round to nearest even) -> float32 (to_float(from_float(v)))."""
    return np.asarray(v, np.float32).astype(NP_DTYPE[dt]).astype(np.float32)


def split_bits(v, parts):
    """split_bits<P> (mma.cuh) of float32 values: [..., P] bf16 bits (the overflow case is left out)."""
    r = np.asarray(v, np.float32)
    out = []
    for _ in range(parts):
        h = r.astype(BF16)
        out.append(h.view(np.uint16).astype(np.uint32))
        r = (r - h.astype(np.float32)).astype(np.float32)
    return np.stack(out, axis=-1)


def bf16_of_bits(bits):
    return np.asarray(bits, np.uint16).view(BF16).astype(np.float64)


def split_planes(phi, K, Kp, Dp):
    """mhc_coeffs_split_phi_fwd_kernel: phi [D, K] float32 -> planes [3, Kp, Dp] bf16 bits (uint16)."""
    D = phi.shape[0]
    flat = phi.astype(np.float32).reshape(-1)
    i = np.arange(Kp * Dp)
    k, d = i // Dp, i % Dp
    ok = (k < K) & (d < D)
    v = np.where(ok, flat[np.where(ok, d * K + k, 0)], np.float32(0))
    p = split_bits(v, 3)  # [Kp * Dp, 3]
    planes = np.zeros(3 * Kp * Dp, np.uint16)
    for j in range(3):
        planes[j * Kp * Dp + i] = p[:, j]
    return planes


# ------------------------------------------------------------------ mma.sync m16n8k16 .row.col bf16 -> f32

def _fragment_maps():
    """(A rows, A cols) [32 lanes, 8 elements], (B rows, B cols) [32, 4], (C rows, C cols) [32, 4]:
    the PTX ISA's 'Matrix Fragments for mma.m16n8k16 with floating point type'.  Element e of a
    fragment is the (e & 1) half (low first) of register e >> 1."""
    lane = np.arange(32)[:, None]
    g, tq = lane >> 2, lane % 4
    i = np.arange(8)[None, :]
    a_row = g + 8 * ((i % 4) >= 2)  # row groupID for a0, a1, a4, a5; groupID + 8 otherwise
    a_col = 2 * tq + (i & 1) + 8 * (i >= 4)
    i = np.arange(4)[None, :]
    b_row = 2 * tq + (i & 1) + 8 * (i >= 2)
    b_col = np.broadcast_to(g, (32, 4))
    c_row = g + 8 * (i >= 2)
    c_col = 2 * tq + (i & 1)
    for rows, cols, shape in ((a_row, a_col, (16, 16)), (b_row, b_col, (16, 8)), (c_row, c_col, (16, 8))):
        seen = np.zeros(shape, int)
        np.add.at(seen, (rows, cols), 1)
        assert (seen == 1).all(), "a fragment map must cover its matrix once"
    return (a_row, a_col), (b_row, b_col), (c_row, c_col)


_A_MAP, _B_MAP, _C_MAP = _fragment_maps()


def _halves(regs):
    """[..., R] uint32 registers -> [..., 2R] elements as bf16 bits, low half first."""
    regs = np.asarray(regs, np.uint32)
    return np.stack([regs & 0xFFFF, regs >> 16], axis=-1).reshape(*regs.shape[:-1], -1)


def mma_m16n8k16(d, a, b0, b1):
    """mhc::mma_m16n8k16<__nv_bfloat16> for every warp of the block: d [128, 4] float32 (in/out),
    a [128, 4] and b0, b1 [128] uint32 registers.  D = A B + C from the fragments, summed in
    float64 and rounded to float32 (the tensor cores' products of bf16 values are exact)."""
    W = d.shape[0] // 32
    A = np.zeros((W, 16, 16))
    B = np.zeros((W, 16, 8))
    Cm = np.zeros((W, 16, 8))
    ae = bf16_of_bits(_halves(a).reshape(W, 32, 8))
    be = bf16_of_bits(_halves(np.stack([b0, b1], axis=-1)).reshape(W, 32, 4))
    w = np.arange(W)[:, None, None]
    A[w, _A_MAP[0][None], _A_MAP[1][None]] = ae
    B[w, _B_MAP[0][None], _B_MAP[1][None]] = be
    Cm[w, _C_MAP[0][None], _C_MAP[1][None]] = d.reshape(W, 32, 4).astype(np.float64)
    D = (A @ B + Cm).astype(np.float32)
    d[:] = D[w, _C_MAP[0][None], _C_MAP[1][None]].reshape(-1, 4)


# ------------------------------------------------------------------ memories

class Global:
    """A global array as bytes: vector reads and writes at element indices, with bounds, row and
    alignment checks (the base pointer is taken as 16-byte aligned, as the host requires), a count
    of the lanes' loads of each element and the thread (block * 128 + tid) that stored each."""

    def __init__(self, name, values, row=None):
        self.name, self.a = name, np.ascontiguousarray(values)
        self.bytes = self.a.reshape(-1).view(np.uint8)
        self.isz = self.a.dtype.itemsize
        self.row = row  # elements per row that no access may cross (None: the whole array)
        self.reads = np.zeros(self.a.size, np.int64)
        self.writes = np.zeros(self.a.size, np.int64)
        self.owner = np.full(self.a.size, -1, np.int64)

    def _span(self, idx, count, what):
        idx = np.asarray(idx, np.int64)
        _require((idx >= 0) & (idx + count <= self.a.size), f"{what}: {self.name} index out of bounds")
        _require((idx * self.isz) % min(16, count * self.isz) == 0, f"{what}: {self.name} access misaligned")
        if self.row is not None:
            _require(idx // self.row == (idx + count - 1) // self.row, f"{what}: {self.name} access crosses a row")
        return idx

    def read16(self, idx, what="cp.async source"):
        """16 bytes from element idx [m] -> [m, 16] uint8."""
        idx = self._span(idx, 16 // self.isz, what)
        return self.bytes[(idx * self.isz)[:, None] + np.arange(16)]

    def load(self, idx, count, what):
        """A lane's count elements from element idx [m] in 16-byte loads (mhc::Packed::load) -> [m, count]."""
        idx = self._span(idx, count, what)
        raw = np.concatenate([self.read16(idx + k, what) for k in range(0, count, 16 // self.isz)], axis=1)
        np.add.at(self.reads, (idx[:, None] + np.arange(count)).reshape(-1), 1)
        return raw.view(self.a.dtype)

    def write(self, idx, values, count, who):
        """count elements from element idx [m] (values [m, count] of the array's dtype) by threads who [m]."""
        idx = self._span(idx, count, "store")
        el = idx[:, None] + np.arange(count)
        self.a.reshape(-1)[el] = values
        np.add.at(self.writes, el.reshape(-1), 1)
        self.owner[el] = np.asarray(who, np.int64)[:, None]

    def read_back(self, idx, who, what):
        """One element at idx [m] per thread who [m], which must be the thread that stored it."""
        idx = self._span(idx, 1, what)
        _require(self.owner[idx] == who, f"{what}: {self.name} element not stored by the reading thread")
        return self.a.reshape(-1)[idx]


class Shared:
    """A block's dynamic shared memory: bytes, the step whose fill wrote each byte (_COEF: the
    coefficients) and the cp.async copies in flight, one list per commit group."""

    def __init__(self, size):
        self.mem = np.zeros(size, np.uint8)
        self.writer = np.full(size, -1, np.int64)
        self.inflight = np.zeros(size, np.int64)
        self.groups, self.open = [], []

    def cp_async16(self, dst, data, step):
        dst = np.asarray(dst, np.int64)
        _require(dst % 16 == 0, "cp.async destination not 16-byte aligned")
        b = (dst[:, None] + np.arange(16)).reshape(-1)
        _require((b >= 0) & (b < self.mem.size), "cp.async destination outside shared memory")
        self.open.append((b, data.reshape(-1), step))
        np.add.at(self.inflight, b, 1)

    def commit(self):
        self.groups.append(self.open)
        self.open = []

    def wait(self, pending):
        """cp.async.wait_group pending: every group but the newest `pending` lands."""
        while len(self.groups) > pending:
            for b, data, step in self.groups.pop(0):
                self.mem[b] = data
                self.writer[b] = step
                np.subtract.at(self.inflight, b, 1)

    def read(self, addr, nbytes, lo, hi, step, what):
        """nbytes from addr [m] (each access inside [lo, hi), written by `step`, nothing in flight)."""
        addr = np.asarray(addr, np.int64)
        _require((addr >= lo) & (addr + nbytes <= hi), f"{what}: shared read outside its region")
        _require(addr % min(nbytes, 16) == 0, f"{what}: shared read misaligned")
        b = addr[:, None] + np.arange(nbytes)
        _require(self.inflight[b] == 0, f"{what}: shared read of bytes a copy in flight writes")
        _require(self.writer[b] == step, f"{what}: shared read of bytes not written by this step's fill")
        return self.mem[b]


# ------------------------------------------------------------------ the kernel (hooks a test may replace)

def swizzle(q, kk, SWZ):
    """The fill's 16-byte chunk of chunk q in the phi row of column kk."""
    return q ^ ((kk & 1) * SWZ)


def wait_depth(STAGES):
    """pipeline_next's cp_async_wait<STAGES - 2>: commit groups that may stay in flight."""
    return STAGES - 2


def lane_offsets(s, sub, SUB, g, tq, SWZ):
    """(phi_o, cu): the byte offset of a lane's 8 positions in a phi row of the stage, and its first
    channel in the split, c - c_begin, at step s, unit sub."""
    return (sub * 64 + tq * 16) ^ ((g & 1) * SWZ * 16), (s * SUB + sub) * 32 + tq * 8


def pack2(lo, hi):
    """Two elements' 16-bit bits -> a 32-bit word, the first element in the low half."""
    return np.asarray(lo, np.uint32) | (np.asarray(hi, np.uint32) << 16)


def a_fragment(aw, pa, j):
    """The A registers of k-step j from aw [128, P, 2 row halves, 4 words]."""
    return np.stack([aw[:, pa, 0, 2 * j], aw[:, pa, 1, 2 * j], aw[:, pa, 0, 2 * j + 1], aw[:, pa, 1, 2 * j + 1]],
                    axis=-1)


def overflowed(s_quad, s_lane):
    """The epilogue's test for re-summing a row half scaled: the quad's sum is inf."""
    return np.isinf(s_quad)


def resum_order(P, N):
    """The epilogue's (stream i, channel e) order within a unit: bf16 (P 1) (e, i), else (i, e)."""
    if P == 1:
        return [(i, e) for e in range(8) for i in range(N)]
    return [(i, e) for i in range(N) for e in range(8)]


def run_block(bid, gm, planes, part, *, dt, N, C, K, Dp, tokens, tiles, c_split, res_t, NTILE, STAGES, SUB):
    """One block blockIdx.x = bid of mhc_boundary_fwd_kernel<T, N, NTILE, STAGES, SUB>."""
    T_ = NP_DTYPE[dt]
    isz = np.dtype(T_).itemsize
    P = PARTS[dt]
    KC, PROW = NTILE * 8, 64 * SUB
    SB = N * 3 * KC * PROW
    CW = N + N * N
    SWZ = 4 if PROW == 128 else 0
    PC = PROW // 16
    assert N >= 1 and KC >= N * N + 2 * N and NTILE <= 6
    smem_size = STAGES * SB + TOK * CW * 4
    assert smem_size == BOUNDARY_FWD.smem(T=dt, N=N, NTILE=NTILE, STAGES=STAGES, SUB=SUB), "the launch's smem"
    sm = Shared(smem_size)
    coef0 = STAGES * SB

    tid = np.arange(THREADS)
    who = bid * THREADS + tid
    lane, warp = tid & 31, tid >> 5
    g, tq = lane >> 2, lane & 3
    split, tile = bid // tiles, bid % tiles
    c_begin = split * c_split
    c_end = min(C, c_begin + c_split)
    steps = (c_end - c_begin + 32 * SUB - 1) // (32 * SUB)
    t0 = tile * TOK
    plane = KC * Dp
    x, y, h_post, h_res, out = gm["x"], gm["y"], gm["h_post"], gm["h_res"], gm["out"]

    # s_coef: every k < TOK * CW (thread k % 128), zero past the last token
    k = np.arange(TOK * CW)
    r, c = k // CW, k % CW
    t = t0 + r
    m = c - N
    i, j = m // N, m % N
    hp_idx = np.where((t < tokens) & (c < N), t * N + c, 0)
    hr_idx = np.where((t < tokens) & (c >= N), t * (N * N) + (j * N + i if res_t else m), 0)
    _require(hp_idx < h_post.size, "h_post index out of bounds")
    _require(hr_idx < h_res.size, "h_res index out of bounds")
    v = np.where(t < tokens, np.where(c < N, h_post[hp_idx], h_res[hr_idx]), np.float32(0)).astype(np.float32)
    sm.mem[coef0 + 4 * k[:, None] + np.arange(4)] = v.view(np.uint8).reshape(-1, 4)
    sm.writer[coef0 + 4 * k[:, None] + np.arange(4)] = _COEF

    def coef(rows, idx):  # s_coef[rows * CW + idx]
        return sm.read(coef0 + 4 * (rows * CW + idx), 4, coef0, smem_size, _COEF, "s_coef").view(np.float32)[:, 0]

    def fill(step, stage):  # phi: stream i, plane p, column kk, chunk q
        st = stage * SB
        c0 = c_begin + step * 32 * SUB
        k = np.arange(N * 3 * KC * PC)
        q, row = k % PC, k // PC
        kk, ip = row % KC, row // KC
        p, i = ip % 3, ip // 3
        c = c0 + q * 8
        ok = c < c_end
        dst = st + row * PROW + swizzle(q, kk, SWZ) * 16
        _require((dst >= st) & (dst + 16 <= st + SB), "phi fill outside its stage")
        data = np.zeros((k.size, 16), np.uint8)
        data[ok] = planes.read16((p * plane + kk * Dp + i * C + c)[ok])
        sm.cp_async16(dst, data, step)
        seen = np.zeros(SB, np.int64)  # the fill's copies do not overlap
        np.add.at(seen, sm.open[-1][0] - st, 1)
        _require(seen <= 1, "two copies of one fill write the same bytes")

    acc = np.zeros((THREADS, NTILE, 4), np.float32)
    ss = np.zeros((THREADS, 2), np.float32)
    qs = np.zeros((THREADS, 2), np.float32)  # not the kernel's: ss's terms (x 2^-100)^2 in ss's order
    row0 = warp * 16 + g
    trow = [t0 + row0, t0 + row0 + 8]

    def add_sq(h, o):  # ss[h] += o^2 for o [128]
        ss[:, h] = fmaf(o, o, ss[:, h])
        sc = (o * STAT_SCALE).astype(np.float32)
        qs[:, h] = fmaf(sc, sc, qs[:, h])

    def mix(h, i, xv):  # stream i's 8 outputs of row half h, float32 before rounding: [128, 8]
        rr = row0 + 8 * h
        v = coef(rr, i)[:, None] * xv[N, h]
        for jj in range(N):
            v = fmaf(coef(rr, N + i * N + jj)[:, None], xv[jj, h], v)
        return v

    def store(h, i, c, ok, vals):  # out[trow[h], i, c .. c + 7] = vals [128, 8] in 16-byte stores
        idx = (trow[h] * N + i) * C + c
        for e0 in range(0, 8, 16 // isz):
            out.write(idx[ok] + e0, vals[ok, e0:e0 + 16 // isz], 16 // isz, who[ok])

    def gemm(s, i, aw, phi_o):  # phi's words of stream i at phi_o, every plane and column; the MMAs
        st = (s % STAGES) * SB
        bw = np.zeros((THREADS, NTILE, 3, 4), np.uint32)
        for q in range(NTILE):
            for p in range(3):
                base = st + ((i * 3 + p) * KC + 8 * q + g) * PROW
                bw[:, q, p] = sm.read(base + phi_o, 16, base, base + PROW, s, "phi").view(np.uint32)
        stp = np.zeros((THREADS, NTILE, 4), np.float32)
        for j in range(2):
            for pa in range(P):
                for pb in range(3 - pa):
                    a = a_fragment(aw, pa, j)
                    for q in range(NTILE):
                        d = stp[:, q].copy()
                        mma_m16n8k16(d, a, bw[:, q, pb, 2 * j], bw[:, q, pb, 2 * j + 1])
                        stp[:, q] = d
        acc[:] = (acc + stp).astype(np.float32)

    for s in range(STAGES - 1):  # pipeline_start
        if s < steps:
            fill(s, s)
        sm.commit()
    for s in range(steps):
        sm.wait(wait_depth(STAGES))  # pipeline_next: wait, __syncthreads, fill step + STAGES - 1, commit
        if s + STAGES - 1 < steps:
            fill(s + STAGES - 1, (s + STAGES - 1) % STAGES)
        sm.commit()
        for sub in range(SUB):
            phi_o, cu = lane_offsets(s, sub, SUB, g, tq, SWZ)
            c = c_begin + cu
            xv = np.zeros((N + 1, 2, THREADS, 8), np.float32)  # streams of x, then y; zeros where not ok
            ok = [(trow[h] < tokens) & (c < c_end) for h in range(2)]
            for h in range(2):
                for jj in range(N + 1):
                    src, idx = (x, (trow[h] * N + jj) * C + c) if jj < N else (y, trow[h] * C + c)
                    xv[jj, h, ok[h]] = src.load(idx[ok[h]], 8, "x / y load").astype(np.float32)
            if P == 1:  # every stream of a channel at once; the bf16 bits are out's words and the A fragments
                ow = np.zeros((N, THREADS, 1, 2, 4), np.uint32)
                for h in range(2):
                    bits = [mix(h, i, xv).astype(BF16).view(np.uint16) for i in range(N)]  # to_bits
                    for e in range(8):
                        for i in range(N):
                            add_sq(h, bits[i][:, e].view(BF16).astype(np.float32))  # from_bits
                    for i in range(N):
                        ow[i, :, 0, h] = pack2(bits[i][:, 0::2], bits[i][:, 1::2])
                        store(h, i, c, ok[h], np.ascontiguousarray(ow[i, :, 0, h]).view(T_))  # store_words<4>
                for i in range(N):
                    gemm(s, i, ow[i], phi_o)
            else:  # one stream at a time
                for i in range(N):
                    aw = np.zeros((THREADS, P, 2, 4), np.uint32)  # [thread][part][row half][word]
                    for h in range(2):
                        o = round_to(mix(h, i, xv), dt)
                        for e in range(8):
                            add_sq(h, o[:, e])
                        store(h, i, c, ok[h], o.astype(T_))  # store_vec<T, 8>
                        bits = split_bits(o, P)  # [128, 8, P]
                        for p in range(P):
                            aw[:, p, h] = pack2(bits[:, 0::2, p], bits[:, 1::2, p])
                    gemm(s, i, aw, phi_o)
    sm.wait(0)

    for h in range(2):
        s_ = ss[:, h].copy()
        for off in (1, 2):  # __shfl_xor_sync
            with np.errstate(over="ignore"):
                s_ = (s_ + s_[tid ^ off]).astype(np.float32)
        t = trow[h]
        live = t < tokens
        # after an overflow: the lane's sum of (out 2^-100)^2 re-read from out, per unit in resum_order
        redo = overflowed(s_, ss[:, h]) & live
        sq = np.zeros(THREADS, np.float32)
        for u in range(-(-(c_end - c_begin) // 32) if redo.any() else 0):
            c = c_begin + u * 32 + tq * 8
            on = redo & (c < c_end)
            for i, e in resum_order(P, N):
                v = out.read_back(((t * N + i) * C + c + e)[on], who[on], "overflow re-sum").astype(np.float32)
                v = (v * STAT_SCALE).astype(np.float32)
                sq[on] = fmaf(v, v, sq[on])
        _require(sq[redo].view(np.uint32) == qs[redo, h].view(np.uint32),
                 "the overflow's re-sum differs in bits from the scaled sum in ss's order")
        for off in (1, 2):
            sq = (sq + sq[tid ^ off]).astype(np.float32)
        base = (split * tokens + t) * (K + 1)
        w0 = live & (tq == 0)
        part.write((base + K)[w0], np.where(np.isinf(s_), -sq, s_)[w0, None], 1, who[w0])
        for q in range(NTILE):
            for e in range(2):
                kk = 8 * q + 2 * tq + e
                ok = live & (kk < K)
                part.write((base + kk)[ok], acc[ok, q, 2 * h + e][:, None], 1, who[ok])


def make_inputs(T, n, C, dt, seed=0, scale=1.0):
    """Random x [T, n, C], y [T, C] (dtype dt; standard normal times scale), H_post [T, n],
    H_res [T, n, n], phi [n C, K] float32."""
    rng = np.random.default_rng(seed)
    K = n * n + 2 * n
    x = (scale * rng.standard_normal((T, n, C))).astype(np.float32).astype(NP_DTYPE[dt])
    y = (scale * rng.standard_normal((T, C))).astype(np.float32).astype(NP_DTYPE[dt])
    h_post = (2 * rng.random((T, n))).astype(np.float32)
    h_res = rng.random((T, n, n)).astype(np.float32)
    h_res /= h_res.sum(-1, keepdims=True)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    return x, y, h_post, h_res, phi


def emulate(x, y, h_post, h_res, phi, *, res_t, stages, sub, c_split=None):
    """Run every block of the launch launch_boundary_gemm makes for these arrays (x [T, n, C] of
    bfloat16 / float16 / float32, y [T, C], h_post [T, n], h_res [T, n, n], phi [n C, K] float32),
    with STAGES = stages, SUB = sub and c_split (None: boundary_layout's; else a multiple of 64).

    Returns (out [T, n, C] dtype of x, part [splits, T, K + 1] float32, layout dict); raises
    EmulationError where a check fails (see the module docstring)."""
    T, n, C = x.shape
    dt = {np.dtype(v): k for k, v in NP_DTYPE.items()}[x.dtype]
    K = n * n + 2 * n
    b = boundary_layout(T, n, C)
    if b is None:
        raise ValueError(f"boundary_layout({T}, {n}, {C}) is None: the fused kernel does not take it")
    if c_split is not None:
        if c_split % 64 or c_split <= 0:
            raise ValueError(f"c_split must be a positive multiple of 64, got {c_split}")
        b = b._replace(c_split=c_split, splits=-(-C // c_split))
    Kp = b.ntile * 8
    assert b.planes_shape[0] == (3, Kp, b.Dp) and b.Dp >= n * C and b.Dp % 8 == 0
    planes = Global("planes", split_planes(phi, K, Kp, b.Dp), row=b.Dp)
    gm = {"x": Global("x", x, row=C), "y": Global("y", y, row=C), "h_post": h_post.reshape(-1),
          "h_res": h_res.reshape(-1), "out": Global("out", np.zeros_like(x), row=C)}
    part = Global("part", np.full((b.splits, T, K + 1), np.nan, np.float32), row=K + 1)
    for bid in range(b.tiles * b.splits):
        run_block(bid, gm, planes, part, dt=dt, N=n, C=C, K=K, Dp=b.Dp, tokens=T, tiles=b.tiles, c_split=b.c_split,
                  res_t=int(res_t), NTILE=b.ntile, STAGES=stages, SUB=sub)
    _require(gm["x"].reads == 1, "an x element not loaded exactly once")
    _require(gm["y"].reads == 1, "a y element not loaded exactly once")
    _require(gm["out"].writes == 1, "an out element not written exactly once")
    _require(part.writes == 1, "a part element not written exactly once")
    return gm["out"].a, part.a, dict(b._asdict(), K=K, dt=dt)


def post_chain(x, y, h_post, h_res, res_t):
    """The post op's float32 sum order, vectorised: H_post_i y, then + M_ij x_j by fmaf, rounded."""
    dt = {np.dtype(v): k for k, v in NP_DTYPE.items()}[x.dtype]
    M = np.swapaxes(h_res, -1, -2) if res_t else h_res
    xf, yf = x.astype(np.float32), y.astype(np.float32)
    v = (h_post[:, :, None] * yf[:, None, :]).astype(np.float32)
    for j in range(x.shape[1]):
        v = fmaf(M[:, :, j, None], xf[:, None, j, :], v)
    return round_to(v, dt).astype(x.dtype)


def saved_sumsq(v):
    """part's sum of squares as float64: a negative value is minus the sum of (x 2^-100)^2 (SumSq)."""
    v = np.asarray(v, np.float64)
    return np.where(v < 0, -v * 2.0 ** 200, v)


def check(T, n, C, dt, res_t=False, stages=2, sub=1, c_split=None, seed=0, scale=1.0, verbose=False):
    """Emulate one case of make_inputs(T, n, C, dt, seed, scale) and compare with the references
    (check_arrays)."""
    return check_arrays(*make_inputs(T, n, C, dt, seed, scale), res_t=res_t, stages=stages, sub=sub,
                        c_split=c_split, verbose=verbose)


def check_arrays(x, y, h_post, h_res, phi, *, res_t=False, stages=2, sub=1, c_split=None, verbose=False):
    """Emulate the launch for these arrays (as emulate takes them) and compare with the references;
    returns a dict of the measured errors (relative: H to sum |out~| |phi|, the sums of squares to
    themselves) and the share of out equal to the float64 post op rounded once to the dtype."""
    T, n, C = x.shape
    dt = {np.dtype(v): k for k, v in NP_DTYPE.items()}[x.dtype]
    out, part, lay = emulate(x, y, h_post, h_res, phi, res_t=res_t, stages=stages, sub=sub, c_split=c_split)
    chain = post_chain(x, y, h_post, h_res, res_t)
    _require(out.view(np.uint8) == chain.view(np.uint8), "out differs in bits from the float32 fmaf chain")
    conv = "deepseek" if res_t else "paper"
    ref = reference.mhc_post_op_fwd(y, x, h_post, h_res, convention=conv)  # float64
    ref_r = ref.astype(NP_DTYPE[dt]).astype(np.float64)  # float64 rounded once to the dtype
    mag = np.abs(np.swapaxes(h_res, -1, -2) if res_t else h_res) @ np.abs(x.astype(np.float64)) + \
        np.abs(h_post[:, :, None] * y.astype(np.float64)[:, None, :])
    ulp, tiny = {"bfloat16": (2.0 ** -7, 2.0 ** -133), "float16": (2.0 ** -10, 2.0 ** -24),
                 "float32": (2.0 ** -23, 2.0 ** -149)}[dt]  # one ulp (relative), the least subnormal
    post_err = np.abs(out.astype(np.float64) - ref_r)
    _require(post_err <= ulp * np.abs(ref) + (n + 2) * 2.0 ** -23 * mag + tiny,
             "out differs from mhc_post_op_fwd by more than its rounding")
    # the GEMM: per split over its channel range, and summed over the splits
    xo = out.astype(np.float64)
    phi64 = phi.astype(np.float64).reshape(n, C, -1)
    K, cs = lay["K"], lay["c_split"]
    worst = {"H": 0.0, "sumsq": 0.0}
    for sp in range(part.shape[0]):
        rng = slice(sp * cs, min(C, (sp + 1) * cs))
        H = np.einsum("tic,ick->tk", xo[:, :, rng], phi64[:, rng])
        scale = np.einsum("tic,ick->tk", np.abs(xo[:, :, rng]), np.abs(phi64[:, rng])) + 1e-30
        q = (xo[:, :, rng] ** 2).sum((1, 2))
        worst["H"] = max(worst["H"], float((np.abs(part[sp, :, :K] - H) / scale).max()))
        worst["sumsq"] = max(worst["sumsq"], float((np.abs(saved_sumsq(part[sp, :, K]) - q) / (q + 1e-30)).max()))
    Hs = part[:, :, :K].astype(np.float64).sum(0)
    H = np.einsum("tic,ick->tk", xo, phi64)
    scale = np.einsum("tic,ick->tk", np.abs(xo), np.abs(phi64)) + 1e-30
    worst["H_total"] = float((np.abs(Hs - H) / scale).max())
    q = (xo ** 2).sum((1, 2))
    worst["sumsq_total"] = float((np.abs(saved_sumsq(part[:, :, K]).sum(0) - q) / (q + 1e-30)).max())
    worst["post_bitwise_ref"] = float((out.astype(np.float64) == ref_r).mean())
    # H: measured at most 2.2e-7 (per split) over grid(); an index error is of order 1.  The sums of squares are
    # sequential float32 sums of positive terms: at most (terms + shuffles) 2^-24 relative.
    tol = {"H": 4e-6, "H_total": 4e-6, "sumsq": max(4e-6, (n * cs / 4 + 8) * 2.0 ** -24)}
    tol["sumsq_total"] = tol["sumsq"]
    for key, bound in tol.items():
        _require(worst[key] <= bound, f"{key}: relative error {worst[key]:.3g} above {bound:.3g}")
    if verbose:
        print(f"T={T} n={n} C={C} {dt} res_t={int(res_t)} STAGES={stages} SUB={sub} splits={part.shape[0]} "
              f"c_split={cs} tiles={lay['tiles']} NTILE={lay['ntile']}: ok; rel err H {worst['H_total']:.2e} "
              f"(per split {worst['H']:.2e}), sumsq {worst['sumsq_total']:.2e}, out == ref rounded "
              f"{100 * worst['post_bitwise_ref']:.1f} %")
    return worst


CASES = [  # (T, n, C, dtype, res_t, STAGES, SUB, c_split)
    (1, 1, 8, "bfloat16", False, 3, 2, None),
    (3, 2, 24, "float16", True, 2, 2, None),
    (3, 4, 72, "float32", False, 3, 1, None),
    (65, 2, 200, "bfloat16", True, 2, 1, None),
    (65, 4, 200, "float16", False, 3, 2, 128),
    (65, 5, 64, "float32", True, 2, 1, None),
    (65, 6, 72, "bfloat16", False, 2, 2, None),
    (3, 6, 200, "float32", True, 3, 2, 192),
]


def grid(Ts=(1, 3, 65)):
    """Cases at each T: every n in (1, 2, 4, 5, 6), C in (8, 24, 64, 72, 200) and dtype, with both
    conventions, pipeline depths 2 and 3, SUB 1 and 2 and, for some, a c_split of 128 (two steps,
    the last partly past C)."""
    for T, n, C, dt in itertools.product(Ts, (1, 2, 4, 5, 6), (8, 24, 64, 72, 200), sorted(NP_DTYPE)):
        yield (T, n, C, dt, (n + C) % 2 == 1, 2 + (C % 3 == 0), 1 + (dt != "float32" or n % 2 == 0),
               128 if C == 200 and n % 2 else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--C", type=int)
    ap.add_argument("--dtype", choices=sorted(NP_DTYPE), default="bfloat16")
    ap.add_argument("--res-t", action="store_true")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--sub", type=int, default=1)
    ap.add_argument("--c-split", type=int)
    ap.add_argument("--scale", type=float, default=1.0, help="x, y times this (1e20: the sums of squares overflow)")
    ap.add_argument("--all", action="store_true", help="every T in (1, 3, 65), n 1..6, C in (8, 24, 64, 72, 200)")
    a = ap.parse_args(argv)
    if a.T is not None:
        cases = [(a.T, a.n, a.C, a.dtype, a.res_t, a.stages, a.sub, a.c_split)]
        check(*cases[0], scale=a.scale, verbose=True)
        return
    elif a.all:
        cases = list(grid())
    else:
        cases = CASES
    for T, n, C, dt, res_t, stages, sub, cs in cases:
        check(T, n, C, dt, res_t, stages, sub, cs, verbose=True)
    print(f"{len(cases)} cases: every check passed")


if __name__ == "__main__":
    main()
