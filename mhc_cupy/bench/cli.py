"""Command line of ``python -m mhc_cupy.bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import __doc__ as _PACKAGE_DOC
from . import cases, env
from .report import format_report, merge_results, write_outputs
from .specs import BASELINES, DEFAULT_OPS, DTYPE_ALIASES, SPECS

QUICK = {"tokens": "32768", "C": "2560", "n": "4", "reps": 10, "warmup": 3}
DEFAULT_EXTRA = "16384x4096x8"


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"{flag}: expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy.bench", description=_PACKAGE_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated ops (default: all)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 4096,16384,32768)")
    ap.add_argument("--C", default=None, help="comma-separated hidden sizes (default 2560,4096,7168)")
    ap.add_argument("--n", default=None, help="comma-separated stream counts (default 4)")
    ap.add_argument("--extra-shapes", default=None,
                    help=f"extra TxCxn shapes, comma-separated (default {DEFAULT_EXTRA}; '' for none; "
                         f"none with --quick)")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype: bfloat16, float16 or float32")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (median; default 30)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls before capture (default 5)")
    ap.add_argument("--min-calls", type=int, default=10, help="at least this many calls per timed graph")
    ap.add_argument("--quick", action="store_true",
                    help=f"one shape ({QUICK['tokens']}x{QUICK['C']}x{QUICK['n']}), {QUICK['reps']} reps")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help="comma-separated: torch, torch.compile, jax.jit (default: all three)")
    ap.add_argument("--no-baselines", action="store_true", help="time mhc_cupy only")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead measurements")
    ap.add_argument("--check-tol", type=float, default=1e-2,
                    help="warn when a baseline differs from mhc_cupy by more than this (relative L2)")
    ap.add_argument("--out", default="bench_out", help="output directory (bench.json, bench.txt, bench.png)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no GPU needed: merge saved bench.json files and write the report, JSON and plot to --out")
    return ap


_BASELINE_ALIASES = {"torch": "torch", "eager": "torch", "torch.compile": "torch.compile", "compile": "torch.compile",
                     "inductor": "torch.compile", "jax": "jax.jit", "jax.jit": "jax.jit"}


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve: adds ``shapes`` [(T, C, n)], ``ops``, ``baselines`` lists and ``argv``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in SPECS]
    if bad or not ops:
        ap.error(f"--ops: unknown {bad}; choose from {', '.join(SPECS)}")
    args.ops = ops
    dt = DTYPE_ALIASES.get(args.dtype.lower())
    if dt is None:
        ap.error(f"--dtype: expected bfloat16, float16 or float32, got {args.dtype!r}")
    args.dtype = dt
    if args.no_baselines:
        args.baselines = []
    else:
        names = [b.strip() for b in args.baselines.split(",") if b.strip()]
        bad = [b for b in names if b not in _BASELINE_ALIASES]
        if bad:
            ap.error(f"--baselines: unknown {bad}; choose from torch, torch.compile, jax.jit")
        args.baselines = [b for b in BASELINES if b in {_BASELINE_ALIASES[x] for x in names}]
    q = args.quick
    tokens = _ints(args.tokens or (QUICK["tokens"] if q else "4096,16384,32768"), "--tokens")
    Cs = _ints(args.C or (QUICK["C"] if q else "2560,4096,7168"), "--C")
    ns = _ints(args.n or (QUICK["n"] if q else "4"), "--n")
    args.reps = args.reps if args.reps is not None else (QUICK["reps"] if q else 30)
    args.warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if q else 5)
    if args.reps < 1 or args.warmup < 0 or args.min_calls < 1:
        ap.error("--reps and --min-calls must be >= 1, --warmup >= 0")
    shapes = [(T, C, n) for n in ns for T in tokens for C in Cs]
    extra = args.extra_shapes if args.extra_shapes is not None else ("" if q else DEFAULT_EXTRA)
    for item in (e.strip() for e in extra.split(",") if e.strip()):
        try:
            T, C, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            ap.error(f"--extra-shapes: expected TxCxn, got {item!r}")
        if (T, C, n) not in shapes:
            shapes.append((T, C, n))
    args.shapes = shapes
    return args


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.merge:
        try:
            results = [json.loads(Path(p).read_text()) for p in cfg.merge]
        except (OSError, json.JSONDecodeError) as e:
            print(f"python -m mhc_cupy.bench --merge: cannot read {e}", file=sys.stderr)
            return 2
        result = merge_results(results)
    else:
        why = env.gpu_problem()
        if why:
            print(f"python -m mhc_cupy.bench needs a CUDA GPU: {why}.\n"
                  f"(Saved results can be re-rendered without one: --merge bench.json --out DIR.)", file=sys.stderr)
            return 2
        # JAX would otherwise take 75% of the GPU at its first use, starving CuPy and PyTorch.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        result = cases.run_benchmarks(cfg)
    paths = write_outputs(result, cfg.out)
    print(format_report(result))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")
    return 0
