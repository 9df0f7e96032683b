"""Op specs, the byte model, the rotation and the case plan of the op benchmark."""

from __future__ import annotations

import math

#: Implementations, in table order.
IMPLS = ("mhc_cupy", "torch", "torch.compile", "jax.jit")
BASELINES = IMPLS[1:]

#: Ops benchmarked by default, in table order.
DEFAULT_OPS = ("stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op", "mhc_pre_op",
               "sinkhorn_knopp", "rmsnorm", "mhc_coeffs")

#: Shape codes of the arrays below: T tokens, n streams, C hidden size, N = n*C (vec(x)),
#: m = n*n + 2n (columns of phi).
_DIMS = {
    "TnC": lambda T, C, n: (T, n, C),
    "TC": lambda T, C, n: (T, C),
    "Tn": lambda T, C, n: (T, n),
    "Tnn": lambda T, C, n: (T, n, n),
    "TN": lambda T, C, n: (T, n * C),
    "Nm": lambda T, C, n: (n * C, n * n + 2 * n),
    "m": lambda T, C, n: (n * n + 2 * n,),
    "3": lambda T, C, n: (3,),
}

#: Per op: its inputs and forward outputs as (name, kind, shape code); kind "act" = activation
#: dtype, "coef" = float32.  The backward takes one upstream gradient per forward output
#: (same kind and shape) followed by the forward inputs, and returns one gradient per input
#: (same kind and shape): ``<op>_bwd(*grads, *inputs)``.  ``uses_C`` False: C does not
#: change the op (Sinkhorn), so it runs once per (tokens, n).
SPECS = {
    "stream_mix": dict(inputs=(("x", "act", "TnC"), ("M", "coef", "Tnn")),
                       outputs=(("out", "act", "TnC"),)),
    "stream_aggregate": dict(inputs=(("x", "act", "TnC"), ("h", "coef", "Tn")),
                             outputs=(("out", "act", "TC"),)),
    "stream_distribute": dict(inputs=(("y", "act", "TC"), ("h", "coef", "Tn")),
                              outputs=(("out", "act", "TnC"),)),
    "mhc_post_op": dict(inputs=(("layer_out", "act", "TC"), ("x", "act", "TnC"), ("H_post", "coef", "Tn"),
                                ("H_res", "coef", "Tnn")),
                        outputs=(("out", "act", "TnC"),)),
    "mhc_pre_op": dict(inputs=(("x", "act", "TnC"), ("h_pre_raw", "coef", "Tn"), ("h_post_raw", "coef", "Tn"),
                               ("h_res_raw", "coef", "Tnn")),
                       outputs=(("layer_in", "act", "TC"), ("H_pre", "coef", "Tn"), ("H_post", "coef", "Tn"),
                                ("H_res", "coef", "Tnn"))),
    "sinkhorn_knopp": dict(inputs=(("logits", "coef", "Tnn"),), outputs=(("P", "coef", "Tnn"),), uses_C=False),
    "rmsnorm": dict(inputs=(("x", "act", "TN"),), outputs=(("out", "act", "TN"),)),
    "mhc_coeffs": dict(inputs=(("x", "act", "TnC"), ("phi", "coef", "Nm"), ("alpha", "coef", "3"),
                               ("bias", "coef", "m")),
                       outputs=(("h_pre_raw", "coef", "Tn"), ("h_post_raw", "coef", "Tn"),
                                ("h_res_raw", "coef", "Tnn"))),
}

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                  "float16": "float16", "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32"}

def shape_of(code: str, T: int, C: int, n: int) -> tuple:
    return _DIMS[code](T, C, n)


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
    return SPECS[op].get("uses_C", True)


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

