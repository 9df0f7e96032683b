"""Validation shared by every op: the dtype / shape / device rules of OPS.md.

Every failure is a ``TypeError`` (wrong dtype) or ``ValueError`` (shapes,
devices, parameters) naming the argument, what it got and what it needs.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

#: Activation dtypes (x, y, layer_in, out, dx, dy).  Coefficients are float32.
ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")
#: Supported numbers of residual streams n (inclusive).
MIN_N, MAX_N = 1, 32


def activation(name: str, info, dtype: str | None = None) -> str:
    """Check an activation tensor's dtype; all activations of a call share ``dtype``."""
    if info.dtype not in ACTIVATION_DTYPES:
        raise TypeError(
            f"{name} has dtype {info.dtype}; it needs one of {', '.join(ACTIVATION_DTYPES)}"
        )
    if dtype is not None and info.dtype != dtype:
        raise TypeError(
            f"{name} has dtype {info.dtype} but the other activations of this call are {dtype}; "
            "all activation tensors of one call must share one dtype"
        )
    return info.dtype


def gradient(name: str, info, act_dtype: str) -> str:
    """An incoming activation gradient: the activation dtype or float32."""
    if info.dtype not in (act_dtype, "float32"):
        need = "float32 (the activation dtype)" if act_dtype == "float32" else \
            f"{act_dtype} (the activation dtype) or float32"
        raise TypeError(f"{name} has dtype {info.dtype}; it needs {need}")
    return info.dtype


def coefficient(name: str, info) -> None:
    if info.dtype != "float32":
        raise TypeError(f"{name} has dtype {info.dtype}; coefficients need float32")


@functools.cache
def optional_arrays(planner=None) -> frozenset:
    """Array arguments of the op that ``planner`` plans that may be None (an absent weight; a None
    gradient counts as zero): those its op specs mark optional (ops.SPECS; imported here, after the ops
    have imported this module); of every op for a planner that no spec names (or None)."""
    from .ops import SPECS

    specs = [k for k in SPECS.values() if k.planner is planner] or SPECS.values()
    return frozenset(a.name for k in specs for a in k.args if a.optional)


def absent(name: str, planner=None) -> None:
    """An array argument of the op that ``planner`` plans is None: fine for optional_arrays(planner),
    else TypeError naming it."""
    if name not in optional_arrays(planner):
        raise TypeError(f"{name} is None; it needs an array")


def min_ndim(name: str, info, ndim: int, what: str) -> None:
    if len(info.shape) < ndim:
        raise ValueError(f"{name} has shape {info.shape}; it needs {what}")


def streams(n: int, where: str) -> int:
    if not MIN_N <= n <= MAX_N:
        raise ValueError(
            f"{where} has n = {n} streams; supported n is {MIN_N} to {MAX_N} inclusive"
        )
    return n


def same_shape(name_a: str, shape_a, name_b: str, shape_b) -> None:
    if tuple(shape_a) != tuple(shape_b):
        raise ValueError(f"{name_a} has shape {tuple(shape_a)} but {name_b} has shape {tuple(shape_b)}; they must match")


def expect_shape(name: str, shape, expected, why: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(shape)}; it needs {tuple(expected)} ({why})")


#: Largest accepted Sinkhorn ``num_iters`` (OPS.md section 1): far beyond
#: convergence (the paper uses 20), and small enough that no call loops for hours.
MAX_NUM_ITERS = 10_000


def _int(name: str, value) -> int:
    """A Python or NumPy integer (not bool, not float), as an int."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        return int(value)
    except Exception as exc:  # noqa: BLE001 - e.g. a traced JAX value: no concrete int at trace time
        raise TypeError(f"{name} must be a concrete int (static under jax.jit), got {type(value).__name__} "
                        f"{value!r}") from exc


def num_iters(value) -> int:
    """An int in 0..MAX_NUM_ITERS (Python or NumPy integer; not bool, not float)."""
    value = _int("num_iters", value)
    if not 0 <= value <= MAX_NUM_ITERS:
        raise ValueError(f"num_iters must be in 0..{MAX_NUM_ITERS}, got {value}")
    return value


def flag(name: str, value) -> bool:
    """A Python bool (an int, None, a str, a NumPy bool or a traced value raise TypeError: a static
    switch, as ``mhc_cupy.jax.mhc_stack``'s fuse_boundaries has always been)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


#: The positive range of a float32 scalar (the kernels take every eps as one): past it, or below half
#: the smallest subnormal (which rounds to 0), the GPU would run another value than the CPU reference.
F32_MAX, F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).smallest_subnormal)


def eps(name: str, value) -> float:
    """A finite real >= 0 (Python or NumPy int / float; not bool, not str) that a float32 holds: 0 or
    in [F32_TINY, F32_MAX] (a value a float32 rounds to 0 or inf is refused: the kernels would run that
    while the CPU reference ran the value given)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past the float range
        v = math.inf
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if v > F32_MAX or 0 < v < F32_TINY / 2:
        raise ValueError(f"{name} must be 0 or between {F32_TINY:.3g} and {F32_MAX:.4g} (the kernels take it as a "
                         f"float32), got {value}")
    return v


def grad_mode(value) -> str:
    if value not in ("unrolled", "implicit"):
        raise ValueError(f"grad_mode must be 'unrolled' or 'implicit', got {value!r}")
    return value


def layer_size(dim, n_streams) -> tuple:
    """(dim, n_streams) of one mHC layer: ints, dim >= 1, n_streams in MIN_N..MAX_N."""
    dim, n = _int("dim", dim), _int("n_streams", n_streams)
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if not MIN_N <= n <= MAX_N:
        raise ValueError(f"n_streams must be in {MIN_N}..{MAX_N}, got {n}")
    return dim, n


def layer_settings(num_iters_, eps_, rms_eps, grad_mode_) -> tuple:
    """(num_iters, eps, rms_eps, grad_mode) of one mHC layer, checked."""
    return num_iters(num_iters_), eps("eps", eps_), eps("rms_eps", rms_eps), grad_mode(grad_mode_)


def same_device(infos: dict) -> tuple:
    """The common device of all given arrays; ValueError naming two that differ."""
    first = None
    for name, info in infos.items():
        if info is None:
            continue
        if first is None:
            first = (name, info.device)
        elif info.device != first[1]:
            raise ValueError(
                f"{first[0]} is on {_dev(first[1])} but {name} is on {_dev(info.device)}; "
                "all arrays of one call must be on the same device"
            )
    if first is None:
        raise ValueError("no array given")
    if first[1][0] not in ("cpu", "cuda"):
        raise ValueError(f"{first[0]} is on {_dev(first[1])}; supported devices are CPU and CUDA GPUs")
    return first[1]


def _dev(d) -> str:
    return "cpu" if d[0] == "cpu" else f"{d[0]}:{d[1]}"


#: Longest row (hidden size C) of an activation: kernels take C as a 32-bit int.
MAX_ROW = 2**31 - 1


def row_length(name: str, info) -> int:
    """C = the last dim of ``name``; raises ValueError (before anything is allocated) above MAX_ROW."""
    C = info.shape[-1]
    if C > MAX_ROW:
        raise ValueError(f"{name} has shape {tuple(info.shape)}: its last dim C = {C} exceeds the supported "
                         f"maximum 2^31 - 1 = {MAX_ROW}")
    return C
