"""Command line: ``python -m mhc_cupy info`` and ``python -m mhc_cupy warmup``."""

from __future__ import annotations

import argparse
import platform
import sys


def info() -> dict:
    """Versions and paths for bug reports (works without a GPU)."""
    import numpy

    from . import __version__, _headers, _jit, _sources

    rows = {"mhc_cupy": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
            "numpy": numpy.__version__, "kernel sources": str(_sources.kernel_dir()),
            "cache dir": str(_jit.cache_dir()), "include dirs": ", ".join(_headers.include_dirs()) or "(none found)"}
    for mod in ("ml_dtypes", "torch", "jax"):
        try:
            rows[mod] = __import__(mod).__version__
        except Exception as e:  # report, never fail
            rows[mod] = f"not available ({type(e).__name__})"
    try:
        import cupy

        rows["cupy"] = cupy.__version__
        rows["NVRTC"] = ".".join(map(str, _jit.nvrtc_version()))
        rows["CUDA runtime"] = str(cupy.cuda.runtime.runtimeGetVersion())
        if cupy.cuda.is_available():
            rows["CUDA driver"] = str(cupy.cuda.runtime.driverGetVersion())
            for d in range(cupy.cuda.runtime.getDeviceCount()):
                p = cupy.cuda.runtime.getDeviceProperties(d)
                rows[f"device {d}"] = f"{p['name'].decode()} (sm_{p['major']}{p['minor']}, {p['totalGlobalMem'] >> 20} MiB)"
        else:
            rows["GPU"] = "none available: CPU inputs run the NumPy reference"
    except Exception as e:
        rows["cupy"] = f"not available ({type(e).__name__}: {e})"
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy", description=__doc__)
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("info", help="print versions (CuPy, CUDA, NVRTC, driver, device, cache dir)")
    w = sub.add_parser("warmup", help="precompile the common kernel specialisations into the disk cache")
    w.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated activation dtypes")
    w.add_argument("--n", default="4", help="comma-separated stream counts")
    w.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd is None:  # no command: the help, listing the commands
        ap.print_help()
        return 2
    if args.cmd == "info":
        for k, v in info().items():
            print(f"{k:>15}: {v}")
        return 0
    import time

    from . import _jit, _kernels

    t = time.perf_counter()
    try:
        count = _kernels.warmup(dtypes=args.dtypes.split(","), ns=[int(v) for v in args.n.split(",")],
                                verbose=args.verbose)
    except RuntimeError as e:  # no GPU: one clear line, not a traceback
        print(f"python -m mhc_cupy warmup: {e}", file=sys.stderr)
        return 2
    print(f"{count} kernels ready in {time.perf_counter() - t:.1f} s "
          f"({_jit.stats['compiles']} compiled, {_jit.stats['disk_hits']} from {_jit.cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
