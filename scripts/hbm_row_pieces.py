"""How fast HBM serves small pieces of many rows: the access patterns of the coefficient kernels.

Usage (repo root, a CUDA GPU, CuPy):
    python scripts/hbm_row_pieces.py [--out hbm_row_pieces.json]

1. ``rows``: the forward coefficient GEMM's reads (kernels_cu/coeffs.cu, mhc_coeffs_mma_fwd_kernel):
   a block of 128 threads owns 128 token rows of x [tokens, n*C] (bf16) and one D range of them,
   and reads ``piece`` bytes of each of its rows a step (4 steps of 16-byte loads in flight per
   thread); grid = token tiles x D ranges (``splits``), block index = tile * splits + range, so
   blocks running side by side read far-apart pieces.  On an H200 (2026-12-02, this kernel) 64-byte
   pieces ran at 1.6-2.5 TB/s, 128-byte ones at 2.8-4.5 and 256-byte ones at 4.0-4.6 (the copy:
   4.2-4.3; the low ends with one D range), which is why the GEMM reads 128 bytes of each row a stage.
2. ``dx``: the n > 4 dx kernels' epilogue pattern (mhc_coeffs_mma_dx_kernel / _dx_tile_kernel):
   read x [tokens, n, C] and write another such tensor, each warp 32 columns (64 bytes) of one
   (token, stream) row, 16 tokens a step (4 steps in flight); ``streams``: a block's W warps on
   the same 32 columns of W streams (block index = column block * n / W + stream group, as on
   main), ``columns``: on W adjacent 32-column ranges of one stream (not yet run on a GPU).
Times: CUDA events around 10 launches, median of 7 after 3 warm-up launches; bytes: read (+
written for ``dx``) per launch; the device-to-device copy (cupy.copyto) measured in the same run.
Prints the results and writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import cupy as cp

_SRC = r'''
extern "C" __global__ void __launch_bounds__(128) rows(const uint4* __restrict__ x, unsigned* out,
    int row16, int c, int split16, int splits) {
  const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int rpp = 128 / c;  // rows per pass (c 16-byte chunks a row piece)
  const int r0 = threadIdx.x / c, q = threadIdx.x % c;
  const int d0 = split * split16, d1 = min(row16, d0 + split16);
  unsigned acc = 0;
  for (int d = d0; d < d1; d += 4 * c) {
    uint4 v[4][16];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int p = 0; p < 16; ++p)
        if (p < c && d + u * c < d1) v[u][p] = x[((long long)tile * 128 + r0 + p * rpp) * row16 + d + u * c + q];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int p = 0; p < 16; ++p)
        if (p < c && d + u * c < d1) acc ^= v[u][p].x ^ v[u][p].w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads
}

extern "C" __global__ void __launch_bounds__(128) dx(const uint4* __restrict__ x, uint4* __restrict__ y,
    long long T, int n, int C, int W, int columns, long long t_split) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g8 = lane >> 2, tq = lane & 3;
  int i, cb0;
  if (!columns) { const int groups = n / W, cb = blockIdx.x / groups; i = (blockIdx.x % groups) * W + warp; cb0 = cb * 32; }
  else { const int cb = blockIdx.x / n; i = blockIdx.x % n; cb0 = (cb * W + warp) * 32; }
  const long long t_begin = blockIdx.y * t_split, t_end = min(T, t_begin + t_split);
  const long long row = (long long)n * C / 8, col = ((long long)i * C + cb0) / 8 + tq;  // in 16-byte units
  for (long long t0 = t_begin; t0 < t_end; t0 += 64) {
    uint4 v[4][2];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long t = t0 + 16 * u + g8 + 8 * h;
        v[u][h] = t < t_end ? x[t * row + col] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long t = t0 + 16 * u + g8 + 8 * h;
        if (t < t_end) y[t * row + col] = v[u][h];
      }
  }
}
'''


def _median_ms(launch, reps: int = 7) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        launch()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(10):
            launch()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 10)
    return sorted(times)[reps // 2]


def _gbps(nbytes: int, ms: float) -> int:
    return round(nbytes / (ms * 1e-3) / 1e9)


def rows(module, tokens: int, D: int) -> dict:
    """GB/s of the ``rows`` pattern for 64- to 256-byte pieces and 1 to 16 D ranges (bf16 x [tokens, D])."""
    x = cp.random.randint(0, 2**31, size=(tokens, D // 2), dtype=cp.int32)
    y, out, row16 = cp.empty_like(x), cp.zeros(1, cp.uint32), D * 2 // 16
    copy = _median_ms(lambda: cp.copyto(y, x))
    res = {"copy_GBps": _gbps(2 * x.nbytes, copy)}
    kernel = module.get_function("rows")
    for piece in (64, 128, 256):
        for splits in (1, 4, 8, 16):
            args = (x, out, cp.int32(row16), cp.int32(piece // 16), cp.int32(-(-row16 // splits)), cp.int32(splits))
            ms = _median_ms(lambda: kernel((tokens // 128 * splits,), (128,), args))
            res[f"piece{piece}_splits{splits}"] = {"ms": round(ms, 4), "GBps": _gbps(x.nbytes, ms)}
    return res


def dx(module, tokens: int, n: int, C: int, W: int, splits: int) -> dict:
    """GB/s (read + written) of the ``dx`` pattern, blocks of W warps on W streams or W column ranges."""
    x = cp.random.randint(0, 2**31, size=(tokens, n, C // 2), dtype=cp.int32)
    y = cp.empty_like(x)
    copy = _median_ms(lambda: cp.copyto(y, x))
    res = {"copy_GBps": _gbps(2 * x.nbytes, copy)}
    kernel, t_split = module.get_function("dx"), -(-tokens // splits // 64) * 64
    for name, columns, grid in (("streams", 0, (C // 32) * (n // W)), ("columns", 1, (C // (32 * W)) * n)):
        args = (x, y, cp.int64(tokens), cp.int32(n), cp.int32(C), cp.int32(W), cp.int32(columns), cp.int64(t_split))
        y.fill(0)
        kernel((grid, splits), (128,), args)
        if not bool((y == x).all()):
            raise AssertionError(f"dx pattern {name}: the copy is wrong")
        ms = _median_ms(lambda: kernel((grid, splits), (128,), args))
        res[name] = {"ms": round(ms, 4), "GBps": _gbps(2 * x.nbytes, ms)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="hbm_row_pieces.json")
    args = ap.parse_args()
    module = cp.RawModule(code=_SRC)
    result = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "rows": {f"{t}x{d}": rows(module, t, d) for t, d in ((16384, 16384), (32768, 28672))},
              "dx": {f"{t}x{c}x{n}": dx(module, t, n, c, w, s)
                     for t, n, c, w, s in ((16384, 8, 2048, 4, 8), (8192, 16, 1024, 2, 4))}}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
