"""Op specs, the byte model, the rotation and the case plan of the op benchmark."""

from __future__ import annotations

import math

from ..ops import SPECS as _OPS
from ..ops.spec import Arg as _Arg
from ..ops.spec import shape_of as _shape_of

#: Implementations, in table order.
IMPLS = ("mhc_cupy", "torch", "torch.compile", "jax.jit")
BASELINES = IMPLS[1:]
#: Under ``--convention deepseek`` the baseline of an op in CONVENTION_OPS: mhc_cupy under the paper
#: convention, timed in the same run (the issue's "deepseek within 5% of paper").
PAPER = "mhc_cupy.paper"

#: Ops benchmarked by default, in table order.
DEFAULT_OPS = ("stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op", "mhc_pre_op",
               "sinkhorn_knopp", "rmsnorm", "mhc_coeffs")

#: Ops that take ``convention`` (OPS.md "DeepSeek-V4 convention"; ``--convention deepseek`` times them
#: with it, the other ops as they are).
CONVENTION_OPS = ("sinkhorn_knopp", "mhc_pre_op", "mhc_post_op", "mhc_coeffs")

#: Ops whose benchmark runs on vec(x), [T, n*C] (shape code letter ``N``), as mHC calls them (OPS.md 2).
_VEC_X = ("rmsnorm",)


def _arrays(args, op: str) -> tuple:
    """(name, kind, shape code) of the present arrays: kind "act" = activation dtype, "coef" = float32."""
    vec = op in _VEC_X
    return tuple((a.name, "act" if a.kind == "activation" else "coef", a.shape.replace("C", "N") if vec else a.shape)
                 for a in args if not a.optional)


def _spec(op: str) -> dict:
    k = _OPS[f"{op}_fwd"]
    return dict(inputs=_arrays(k.inputs, op), outputs=_arrays(k.outputs, op),
                uses_C=any("C" in a.shape for a in k.inputs + k.outputs))


#: Per op: its inputs and forward outputs as (name, kind, shape code), from the op specs
#: (``mhc_cupy.ops.SPECS``: shape codes of ``mhc_cupy.ops.spec``, ``...`` = T tokens,
#: N = n*C), without optional inputs.  The backward takes one upstream gradient per forward
#: output (same kind and shape) followed by the forward inputs, and returns one gradient per
#: input (same kind and shape): ``<op>_bwd(*grads, *inputs)``.  ``uses_C`` False: C does not
#: change the op (Sinkhorn), so it runs once per (tokens, n).
SPECS = {op: _spec(op) for op in DEFAULT_OPS}

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                  "float16": "float16", "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32"}

def shape_of(code: str, T: int, C: int, n: int) -> tuple:
    return _shape_of(_Arg("", code, ""), (T,), {"n": n, "C": C, "N": n * C, "K": n * n + 2 * n})


def nbytes(op: str, direction: str, T: int, C: int, n: int, itemsize: int) -> int:
    """Bytes of one call under the byte model: every array of ``SPECS[op]`` read or written once.

    Forward: the inputs read, the outputs written.  Backward (``<op>_bwd(*grads, *inputs)``):
    one upstream gradient per output and the inputs read, one gradient per input written.
    Activations count ``itemsize`` bytes per element, coefficients (kind "coef") 4.
    benchmarks/README.md gives the same model as formulas (a test checks them against this).
    """
    s = SPECS[op]

    def size(arrays):
        return sum(math.prod(shape_of(code, T, C, n)) * (itemsize if kind == "act" else 4) for _, kind, code in arrays)

    if direction == "fwd":
        return size(s["inputs"]) + size(s["outputs"])
    if direction == "bwd":
        return size(s["outputs"]) + 2 * size(s["inputs"])  # grads in; inputs in; input grads out
    raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


#: The byte model as a table: ``BYTES[(op, dir)](T, C, n, itemsize)`` = :func:`nbytes` (derived from ``SPECS``).
BYTES = {(op, d): (lambda T, C, n, itemsize, _op=op, _d=d: nbytes(_op, _d, T, C, n, itemsize))
         for op in SPECS for d in ("fwd", "bwd")}


def uses_C(op: str) -> bool:
    return SPECS[op]["uses_C"]


def rotation(bytes_per_call: int, l2_bytes: int, min_calls: int = 10, max_sets: int = 64) -> tuple[int, int]:
    """(input sets R, calls per timed graph).

    R = 1 + ceil(2 * L2 / bytes_per_call), clamped to [2, max_sets]: between two uses of a
    set the other sets move at least 2 L2 through the cache.  Calls per graph: the smallest
    multiple of R that is >= min_calls.
    """
    sets = 1 + math.ceil(2 * l2_bytes / max(1, bytes_per_call))
    sets = max(2, min(max_sets, sets))
    calls = sets * math.ceil(max(1, min_calls) / sets)
    return sets, calls


def plan_cases(ops, shapes) -> list[tuple]:
    """(op, T, C, n) in run order; C is None for ops that do not use it (run once per T, n)."""
    cases, seen = [], set()
    for T, C, n in shapes:
        for op in ops:
            c = C if uses_C(op) else None
            if (op, T, c, n) not in seen:
                seen.add((op, T, c, n))
                cases.append((op, T, c, n))
    return cases


def shape_str(T, C, n) -> str:
    return f"{T}x{'-' if C is None else C}x{n}"

