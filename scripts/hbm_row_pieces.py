"""How fast HBM serves small pieces of many rows: the forward coefficient GEMM's access pattern.

Usage (repo root, a CUDA GPU, CuPy):
    python scripts/hbm_row_pieces.py [--out hbm_row_pieces.json]

``rows`` is the forward coefficient GEMM's read pattern (kernels_cu/coeffs_fwd.cu,
mhc_coeffs_mma_fwd_kernel): a block of 128 threads owns 128 token rows of x [tokens, n*C] (bf16) and
one D range of them, and reads ``piece`` bytes of each of its rows a step (4 steps of 16-byte loads in
flight per thread); grid = token tiles x D ranges (``splits``), block index = tile * splits + range,
so blocks running side by side read far-apart pieces.  On an H200 (2026-12-02) 64-byte pieces ran at
1.6-2.5 TB/s, 128-byte ones at 2.8-4.5 and 256-byte ones at 4.0-4.6 (the copy: 4.2-4.3; the low ends
with one D range), which is why the GEMM reads 128 bytes of each row a stage.

Times: CUDA events around 10 launches, median of 7 after 3 warm-up launches; bytes: read per launch;
the device-to-device copy (cupy.copyto) measured in the same run.  Prints the results and writes them
as JSON to ``--out``.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="hbm_row_pieces.json")
    args = ap.parse_args()
    module = cp.RawModule(code=_SRC)
    result = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "rows": {f"{t}x{d}": rows(module, t, d) for t, d in ((16384, 16384), (32768, 28672))}}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
