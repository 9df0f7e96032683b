"""Command line of ``python -m mhc_cupy.bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .._checks import MAX_N
from .._kernel_choice import LIBRARY_CHOICE, kernel_choice
from . import block, cases, env, layer, small, stack
from .block import BLOCK_BATCH, BLOCK_CONFIGS, BLOCK_N, BLOCK_SEQ
from .layer import LAYER_BASELINES, LAYER_SHAPES, SUBLAYERS
from .small import SMALL_C, SMALL_TOKENS
from .stack import STACK_CONFIGS
from .report import format_report, merge_results, merged_from, write_json, write_outputs
from .specs import BASELINES, DEFAULT_OPS, DTYPE_ALIASES, SPECS

QUICK = {"tokens": "32768", "C": "2560", "n": "4", "reps": 10, "warmup": 3}
DEFAULT_EXTRA = "16384x4096x8"


_DESCRIPTION = """\
Time mhc_cupy on a GPU against the same maths in PyTorch eager, torch.compile and jax.jit, in one run,
with a byte model and the device-to-device copy bandwidth measured in that run (CUDA-event medians
after warm-up).  Modes:
  (default)  the ops (--ops) forward and backward at tokens x C x n
  --layer    one mHC layer (MHC, mhc_cupy.jax.mhc_layer) against its byte floor
  --block    a pre-norm transformer block with and without mHC
  --stack    L blocks: plain residuals, MHCStack (recompute off / on), a chain of MHC; time and peak memory
  --small    a decode-sized layer forward (1-4096 tokens): eager per call and CUDA-graph replay
Writes <out>/<mode>.json and .md; --merge joins runs.  How each number is taken and what the columns
mean: benchmarks/README.md (and the docstring of mhc_cupy.bench).  Without a GPU: --merge, and the
--layer / --block / --stack / --small modes at tiny sizes given explicitly (--shapes, --block-configs,
--stack-configs, --small-tokens and --small-C), which time the NumPy reference path; else exit 2.
"""


def _ints(text: str, flag: str, ap) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        ap.error(f"{flag}: expected positive integers, got {text!r}")
    return vals


def _sizes_help(mode: str, form: str, default) -> str:
    """Help of a mode's sizes option: ``form`` entries (TxCxn or C:heads:...), comma-separated, and
    its ``default`` entries."""
    sep = ":" if ":" in form else "x"
    return f"{mode}: {form}, comma-separated (default {','.join(sep.join(map(str, e)) for e in default)})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy.bench", description=_DESCRIPTION,
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
    ap.add_argument("--min-calls", type=int, default=None,
                    help="at least this many calls per timed sample (default 10; 4 in the other modes)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one shape ({QUICK['tokens']}x{QUICK['C']}x{QUICK['n']}), {QUICK['reps']} reps")
    ap.add_argument("--baselines", default=None,
                    help="comma-separated: torch, torch.compile, jax.jit (default: all three); with --layer also "
                         "transformer_engine (default: all four); with --block only torch.compile counts "
                         "(default: it)")
    ap.add_argument("--no-baselines", action="store_true", help="time mhc_cupy only")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead measurements")
    ap.add_argument("--convention", default="paper", choices=("paper", "deepseek"),
                    help="the maths of sinkhorn_knopp, mhc_pre_op, mhc_post_op, mhc_coeffs (OPS.md 'DeepSeek-V4 "
                         "convention'); deepseek times mhc_cupy under both conventions in the same run (the paper one as the "
                         "baseline, target: deepseek <= 1.05x) and no framework baselines (they are the paper maths)")
    ap.add_argument("--check-tol", type=float, default=1e-2,
                    help="warn when a baseline differs from mhc_cupy by more than this (relative L2)")
    ap.add_argument("--choose", default="", metavar="VARIANT=BOOL,...",
                    help="kernel variants in force for the whole run (mhc_cupy._kernel_choice.KernelChoice), e.g. "
                         "boundary=true,small=true: the fused layer boundary and the small-token path, which are "
                         "off by default until checked on a GPU")
    ap.add_argument("--out", default="bench_out", help="output directory (bench.json, bench.txt, bench.png)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no GPU needed: merge saved results of one mode (bench.json, or layer.json / block.json, "
                         "whose mode is read from the files) and write the report, JSON (and plot) to --out")
    mode = ap.add_argument_group("layer, block, stack and small modes (benchmarks/README.md)")
    one = mode.add_mutually_exclusive_group()
    one.add_argument("--layer", action="store_true",
                     help="the whole mHC layer, fwd and fwd+bwd, against torch / torch.compile of MHCReference, "
                          "jax.jit of plain jnp and TransformerEngine (writes layer.json, layer.md)")
    one.add_argument("--block", action="store_true",
                     help="a pre-norm transformer block, plain residual vs mHC, fwd+bwd (writes block.json, block.md)")
    one.add_argument("--stack", action="store_true",
                     help="a model of L pre-norm blocks: plain residual vs a chain of MHC vs MHCStack with recompute "
                          "off / 'auto', fwd+bwd time and peak memory (writes stack.json, stack.md)")
    one.add_argument("--small", action="store_true",
                     help="the layer forward at decode-sized token counts: eager wall time per call and CUDA-graph "
                          "replay, against torch / torch.compile of MHCReference (writes small.json, small.md)")
    mode.add_argument("--shapes", default=None, help=_sizes_help("--layer", "TxCxn", LAYER_SHAPES))
    mode.add_argument("--sublayers", default=",".join(SUBLAYERS), help="--layer: identity, tanh (default: both)")
    mode.add_argument("--fused", default="both", choices=("both", "true", "false", "default"),
                      help="--layer / --block: the MHC variants to time, each built under its kernel choice: both "
                           "(the fused pieces and the separate ops), true, false, or default (the library's choice; "
                           "default: both)")
    mode.add_argument("--graph", action="store_true",
                      help="--layer / --block / --stack: capture the PyTorch calls into a CUDA graph (default: eager "
                           "calls; --small times both)")
    mode.add_argument("--block-configs", default=None, help=_sizes_help("--block", "C:heads:ffn", BLOCK_CONFIGS))
    mode.add_argument("--stack-configs", default=None,
                      help=_sizes_help("--stack", "L:C:heads:ffn:batch:seq", STACK_CONFIGS))
    mode.add_argument("--small-tokens", default=None,
                      help=f"--small: token counts, comma-separated (default {','.join(map(str, SMALL_TOKENS))})")
    mode.add_argument("--small-C", type=int, default=SMALL_C, help=f"--small: hidden size C (default {SMALL_C})")
    mode.add_argument("--batch", type=int, default=BLOCK_BATCH,
                      help=f"--block: batch (default {BLOCK_BATCH}; --stack-configs give their own)")
    mode.add_argument("--seq", type=int, default=BLOCK_SEQ,
                      help=f"--block: sequence length (default {BLOCK_SEQ}; --stack-configs give their own)")
    mode.add_argument("--streams", type=int, default=BLOCK_N,
                      help=f"--block / --stack / --small: mHC streams n, 1..{MAX_N} (default {BLOCK_N})")
    return ap


_BASELINE_ALIASES = {"torch": "torch", "eager": "torch", "torch.compile": "torch.compile", "compile": "torch.compile",
                     "inductor": "torch.compile", "jax": "jax.jit", "jax.jit": "jax.jit",
                     "te": "transformer_engine", "transformer_engine": "transformer_engine"}
_MODE_BASELINES = {"ops": BASELINES, "layer": LAYER_BASELINES, "block": ("torch.compile",),
                   "stack": ("torch.compile", "jax.jit"), "small": ("torch", "torch.compile")}
#: Per mode other than "ops": (run, evaluate targets, format the report, the flag of its sizes).
_MODES = {"layer": (layer.run_layer, layer.evaluate_layer_targets, layer.format_layer_report, "--shapes"),
          "block": (block.run_block, block.evaluate_block_targets, block.format_block_report, "--block-configs"),
          "stack": (stack.run_stack, stack.evaluate_stack_targets, stack.format_stack_report, "--stack-configs"),
          "small": (small.run_small, small.evaluate_small_targets, small.format_small_report, "--small-tokens")}


def _shape_list(text: str | None, flag: str, ap, form: str = "TxCxn", default=()) -> list[tuple]:
    """'AxBxC,...' (``form`` "TxCxn") or 'A:B:C,...' (``form`` "C:heads:ffn", as many numbers as ``form``
    names) -> [(A, B, C), ...]; ``text`` None (the option not given): ``default``'s entries."""
    if text is None:
        return list(default)
    sep = ":" if ":" in form else "x"
    out = []
    for item in (e.strip() for e in text.split(",") if e.strip()):
        try:
            vals = tuple(int(v) for v in item.lower().split(sep))
        except ValueError:
            vals = ()
        if len(vals) != len(form.split(sep)) or any(v <= 0 for v in vals):
            ap.error(f"{flag}: expected {form} of positive integers, got {item!r}")
        if form == "TxCxn" and vals[2] > 32:
            ap.error(f"{flag}: mHC takes n_streams in 1..32, got n = {vals[2]} in {item!r}")
        out.append(vals)
    if not out:
        ap.error(f"{flag}: no entries in {text!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve: adds ``mode`` ("ops" or a key of ``_MODES``), ``shapes`` [(T, C, n)] (the op grid,
    or the layer shapes with --layer), ``ops``, ``baselines`` (of the mode), ``sublayers``,
    ``block_configs`` [(C, heads, ffn)], ``sizes_given`` and ``argv``."""
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
    args.mode = next((m for m in _MODES if getattr(args, m)), "ops")
    allowed = _MODE_BASELINES[args.mode]
    if args.convention != "paper" and args.mode != "ops":
        ap.error(f"--convention: only the op benchmark (no {' / '.join('--' + m for m in _MODES)}) takes it")
    if args.no_baselines or args.convention != "paper":
        args.baselines = []
    elif args.baselines is None:
        args.baselines = list(allowed)
    else:
        names = [b.strip() for b in args.baselines.split(",") if b.strip()]
        bad = [b for b in names if b not in _BASELINE_ALIASES]
        if bad:
            ap.error(f"--baselines: unknown {bad}; choose from {', '.join(allowed)}")
        args.baselines = [b for b in allowed if b in {_BASELINE_ALIASES[x] for x in names}]
    args.sizes_given = any(v is not None for v in (args.shapes, args.block_configs, args.stack_configs,
                                                   args.small_tokens))
    args.layer_shapes = _shape_list(args.shapes, "--shapes", ap, default=LAYER_SHAPES)
    args.sublayers = [s.strip() for s in args.sublayers.split(",") if s.strip()]
    if not args.sublayers or any(s not in SUBLAYERS for s in args.sublayers):
        ap.error(f"--sublayers: choose from {', '.join(SUBLAYERS)}, got {args.sublayers}")
    args.block_configs = _shape_list(args.block_configs, "--block-configs", ap, "C:heads:ffn", BLOCK_CONFIGS)
    args.stack_configs = _shape_list(args.stack_configs, "--stack-configs", ap, "L:C:heads:ffn:batch:seq",
                                     STACK_CONFIGS)
    args.small_tokens = (list(SMALL_TOKENS) if args.small_tokens is None
                         else _ints(args.small_tokens, "--small-tokens", ap))
    if min(args.batch, args.seq, args.streams, args.small_C) < 1:
        ap.error("--batch, --seq, --streams and --small-C must be >= 1")
    if args.streams > MAX_N:
        ap.error(f"--streams: mHC takes n_streams in 1..{MAX_N}, got {args.streams}")
    for flag, configs, at in (("--block-configs", args.block_configs, 0), ("--stack-configs", args.stack_configs, 1)):
        for c in configs:  # (what would otherwise stop the run at that configuration, after the earlier ones)
            if c[at] % c[at + 1]:
                ap.error(f"{flag}: C = {c[at]} is not a multiple of heads = {c[at + 1]} in {':'.join(map(str, c))}")
    q = args.quick
    tokens = _ints(args.tokens or (QUICK["tokens"] if q else "4096,16384,32768"), "--tokens", ap)
    Cs = _ints(args.C or (QUICK["C"] if q else "2560,4096,7168"), "--C", ap)
    ns = _ints(args.n or (QUICK["n"] if q else "4"), "--n", ap)
    if max(ns) > MAX_N:
        ap.error(f"--n: mHC takes n_streams in 1..{MAX_N}, got {max(ns)}")
    big = args.mode != "ops"  # layer and block calls take milliseconds: fewer samples
    args.reps = args.reps if args.reps is not None else (QUICK["reps"] if q else 20 if big else 30)
    args.warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if q else 3 if big else 5)
    args.min_calls = args.min_calls if args.min_calls is not None else (4 if big else 10)
    if args.reps < 1 or args.warmup < 0 or args.min_calls < 1:
        ap.error("--reps and --min-calls must be >= 1, --warmup >= 0")
    if not args.check_tol >= 0:  # nan turned the check off silently, a negative one warned always (inf: never)
        ap.error(f"--check-tol: expected a number >= 0, got {args.check_tol}")
    shapes = [(T, C, n) for n in ns for T in tokens for C in Cs]
    extra = args.extra_shapes if args.extra_shapes is not None else ("" if q else DEFAULT_EXTRA)
    for T, C, n in (_shape_list(extra, "--extra-shapes", ap) if extra.strip() else []):
        if (T, C, n) not in shapes:
            shapes.append((T, C, n))
    args.shapes = args.layer_shapes if args.mode == "layer" else shapes
    args.choose = _choice(args.choose, ap)
    return args


def _choice(text: str, ap) -> dict:
    """'variant=true,variant=false,...' -> {variant: bool} of mhc_cupy._kernel_choice.KernelChoice."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if name not in LIBRARY_CHOICE or value not in ("true", "false", "none"):
            ap.error(f"--choose: {item!r}; give VARIANT=true|false|none with VARIANT one of {', '.join(LIBRARY_CHOICE)}")
        out[name] = None if value == "none" else value == "true"
    return out


def main(argv=None) -> int:
    cfg = parse_args(argv)
    with kernel_choice(**cfg.choose):
        return _main(cfg)


def _main(cfg) -> int:
    if cfg.merge:
        try:
            results = []
            for p in cfg.merge:
                try:
                    results.append(json.loads(Path(p).read_text()))
                except (OSError, ValueError) as e:  # missing, unreadable, not JSON
                    raise ValueError(f"cannot read {p}: {e}") from None
            cfg.mode = merge_mode(results, cfg.merge, cfg.mode if cfg.mode != "ops" else None)
            result = _merged(results, cfg.mode, cfg.merge)
        except ValueError as e:  # and: not a bench result, modes that do not match, fields missing
            print(f"python -m mhc_cupy.bench --merge: {e}", file=sys.stderr)
            return 2
        if not _out_ok(cfg):
            return 2
        if cfg.mode != "ops":
            return _write_mode(cfg, result)
    elif cfg.mode != "ops":
        return _run_mode(cfg)
    else:
        why = env.gpu_problem()
        if why:
            print(f"python -m mhc_cupy.bench needs a CUDA GPU: {why}.\n"
                  f"(Saved results can be re-rendered without one: --merge bench.json --out DIR.)", file=sys.stderr)
            return 2
        if not _out_ok(cfg):  # before the run, not after it (its results then lost with a traceback)
            return 2
        # JAX would otherwise take 75% of the GPU at its first use, starving CuPy and PyTorch.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        result = cases.run_benchmarks(cfg)
    try:
        paths = write_outputs(result, cfg.out)
    except OSError as e:
        return _out_error(cfg, e)
    print(format_report(result))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")
    return 0


def _out_error(cfg, e: OSError, what: str = "cannot write there") -> int:
    """One line naming --out and why (exit code 2), as the demo's --out."""
    print(f"python -m mhc_cupy.bench: --out {cfg.out}: {what} ({e.strerror or e}"
          + (f": {e.filename}" if e.filename and str(e.filename) != str(cfg.out) else "") + ")", file=sys.stderr)
    return 2


def _out_ok(cfg) -> bool:
    """Make ``--out`` (a folder); False, with one line naming the flag, where that fails (a file there, a
    folder below a file, a read-only place): checked before a run, which writes its partial results there."""
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _out_error(cfg, e, "cannot create it")
        return False
    return True


def _merged(results: list, mode: str, paths: list) -> dict:
    """The merged result of files of ``mode``, its report rendered once to check it: a file with that
    mode's schema but a missing or malformed field (no "meta", rows without their shape) raised a
    KeyError / TypeError / AttributeError traceback here; now ValueError naming the files."""
    try:
        if mode == "ops":
            result = merge_results(results)
            format_report(result)
        else:
            result = merge_mode_results(results, mode)
            _MODES[mode][2](result)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        what = f"no field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{', '.join(map(str, paths))}: {_WHAT[mode]} result with a missing or malformed field "
                         f"({what}); not a complete result of this version of python -m mhc_cupy.bench") from None
    return result


def _run_mode(cfg) -> int:
    """A mode of ``_MODES``: run, write ``<mode>.json`` and ``<mode>.md``, print the report."""
    why = env._torch_status()
    if why and (not cfg.sizes_given or "not importable" in why):
        print(f"python -m mhc_cupy.bench --{cfg.mode} needs a CUDA GPU for its default sizes: {why}.\n"
              f"(Give {_MODES[cfg.mode][3]} with tiny sizes to run it on the CPU "
              f"with wall-clock timing.)", file=sys.stderr)
        return 2
    if not _out_ok(cfg):
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with env.cpu_torch_threads() as threads:  # on the CPU: one PyTorch thread (env.cpu_torch_threads says why)
        result = _MODES[cfg.mode][0](cfg)
    if threads:
        result["meta"]["settings"]["torch_threads"] = threads
    return _write_mode(cfg, result)


#: The ``schema`` each mode writes (``cases``, ``layer``, ``block``), and the flag that selects the mode.
_SCHEMAS = {"mhc_cupy.bench/1": "ops", **{f"mhc_cupy.bench.{m}/1": m for m in _MODES}}
_FLAG = {"ops": "no mode flag", **{m: f"--{m}" for m in _MODES}}
_WHAT = {"ops": "an op benchmark (bench.json)", **{m: f"a --{m} ({m}.json)" for m in _MODES}}


def merge_mode(results: list, paths: list, flag_mode: str | None) -> str:
    """The mode ("ops", "layer" or "block") of saved results to merge, from their ``schema``.

    ``flag_mode``: the mode a flag (--layer, --block, ...) asked for, or None (none given: the files' mode).

    Raises:
        ValueError: a file that is not a benchmark result, files of different modes, or files
            of another mode than the flag asks for (the message names the flag they need).
    """
    modes = {}
    for path, res in zip(paths, results):
        schema = res.get("schema") if isinstance(res, dict) else None
        if schema not in _SCHEMAS:
            raise ValueError(f"{path} is not a result of python -m mhc_cupy.bench (its schema is {schema!r}; "
                             f"expected one of {', '.join(_SCHEMAS)})")
        modes[path] = _SCHEMAS[schema]
    found = set(modes.values())
    if len(found) > 1:
        raise ValueError("cannot merge results of different modes: " + "; ".join(
            f"{p} needs {_FLAG[m]}" for p, m in modes.items()))
    (mode,) = found
    if flag_mode is not None and flag_mode != mode:
        raise ValueError(f"{', '.join(modes)}: {_WHAT[mode]} result, to merge with {_FLAG[mode]}, not --{flag_mode} "
                         f"(without a mode flag, --merge takes the mode from the files)")
    return mode


#: Per mode: the fields that name a result row (a later file's row replaces an earlier one's).
_ROW_KEYS = {"layer": ("sublayer", "tokens", "C", "n", "dtype"),
             "block": ("C", "heads", "ffn", "batch", "seq", "n", "dtype"),
             "stack": ("L", "C", "heads", "ffn", "batch", "seq", "n", "dtype"),
             "small": ("tokens", "C", "n", "dtype")}


def merge_mode_results(results: list[dict], mode: str) -> dict:
    """Combine saved ``layer.json`` (or ``block.json``) results: rows of later files replace rows
    with the same shape (``_ROW_KEYS``); targets re-evaluated; ``meta.merged_from`` lists the runs."""
    merged = json.loads(json.dumps(results[0]))
    rows = {}
    for res in results:
        for r in res.get("results", []):
            rows[tuple(r.get(k) for k in _ROW_KEYS[mode])] = r
    merged["results"] = list(rows.values())
    merged["skipped"] = sorted({s for res in results for s in res.get("skipped", [])})
    merged["meta"]["merged_from"] = merged_from(results)
    evaluate = _MODES[mode][1]
    merged["targets"] = evaluate(merged)
    return merged


def _write_mode(cfg, result: dict) -> int:
    """Write ``<mode>.json`` and ``<mode>.md`` to ``cfg.out`` and print the report."""
    text = _MODES[cfg.mode][2](result)
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json(result, out / f"{cfg.mode}.json")
        (out / f"{cfg.mode}.md").write_text(text + "\n")
    except OSError as e:
        return _out_error(cfg, e)
    print(text)
    print(f"\nwritten: {out / (cfg.mode + '.json')}, {out / (cfg.mode + '.md')}")
    return 0
