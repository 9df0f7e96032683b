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


_DESCRIPTION = """\
mhc_cupy tools: versions for bug reports, and precompiling kernels.
'python -m mhc_cupy COMMAND --help' describes a command.  The benchmarks
and the training demo have their own commands: python -m mhc_cupy.bench
and python -m mhc_cupy.demo."""

_WARMUP = """\
Compile (NVRTC) or load from the disk cache the common kernel specialisations:
every op forward and backward, for the given activation dtypes and stream
counts, for the architecture of this machine's GPU.  Later processes then load
the compiled kernels instead of compiling them at their first call.

Needs a CUDA GPU that CuPy can use (the kernels are compiled for it and loaded
onto it); without one it prints why and exits with code 2."""


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy", description=_DESCRIPTION, formatter_class=raw)
    sub = ap.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    sub.add_parser("info", help="print versions and paths: mhc_cupy, Python, NumPy, torch, JAX, CuPy, NVRTC, "
                                "CUDA driver, devices, kernel cache and include folders (no GPU needed)",
                   description="Print versions and paths for bug reports; works without a GPU.")
    w = sub.add_parser("warmup", help="precompile the common kernels into the disk cache (needs a CUDA GPU)",
                       description=_WARMUP, formatter_class=raw)
    w.add_argument("--dtypes", default="bfloat16,float32",
                   help="comma-separated activation dtypes: bfloat16, float16, float32 (default: bfloat16,float32)")
    w.add_argument("--n", default="4", help="comma-separated stream counts, 1 to 32 (default: 4)")
    w.add_argument("-v", "--verbose", action="store_true", help="print each kernel as it is compiled or loaded")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:  # no command: the help, listing the commands
        ap.print_help()
        return 2
    if args.cmd == "info":
        for k, v in info().items():
            print(f"{k:>15}: {v}")
        return 0
    try:
        ns = [int(v) for v in args.n.split(",")]
    except ValueError:
        ap.error(f"warmup --n: expected comma-separated integers, got {args.n!r}")
    import time

    from . import _jit, _kernels

    t = time.perf_counter()
    try:
        count = _kernels.warmup(dtypes=args.dtypes.split(","), ns=ns, verbose=args.verbose)
    except ValueError as e:  # a dtype or n it cannot compile for: checked before the GPU
        ap.error(f"warmup: {e}")
    except RuntimeError as e:  # no GPU: one clear line, not a traceback
        print(f"python -m mhc_cupy warmup: {e}", file=sys.stderr)
        return 2
    print(f"{count} kernels ready in {time.perf_counter() - t:.1f} s "
          f"({_jit.stats['compiles']} compiled, {_jit.stats['disk_hits']} from {_jit.cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
