"""Framework-free initialisation of an mHC layer's coefficient parameters,
shared by :mod:`mhc_cupy.torch.layers` (PyTorch) and :mod:`mhc_cupy.jax`."""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import _checks


def logit(p: float) -> float:
    """log(p / (1 - p)): the sigmoid's inverse."""
    return math.log(p) - math.log1p(-p)


def init_value(name: str, value) -> float:
    """An initial parameter value (``alpha_init``, ``scale_init``): a finite real (Python or NumPy
    int / float; not bool).  TypeError / ValueError naming the argument otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past the float range
        v = math.inf
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    if abs(v) > _checks.F32_MAX:  # the parameters are float32 (torch's fill_ raised a RuntimeError)
        raise ValueError(f"{name} must be finite in float32 (|value| <= {_checks.F32_MAX:.4g}), got {value}")
    return v


def init_std(name: str, value, fan_in: int) -> float:
    """The std of a normal initialisation (``phi_init_std``, ``fn_init_std``): None gives
    1/sqrt(fan_in), else a finite real >= 0 (0: zeros).  TypeError / ValueError naming the argument."""
    return 1.0 / math.sqrt(fan_in) if value is None else _checks.eps(name, value)


def identity_bias(n: int, pre: float | None = None, post: float = 1.0, res_diag: float = 0.95) -> np.ndarray:
    """Biases [n*n + 2n] (pre | post | res, float32) that start mHC at a plain residual connection.

    H_pre = sigmoid(b_pre) = ``pre`` (default 1/n, 0.99 for n = 1);
    H_post = 2 sigmoid(b_post) = ``post`` (default 1); b_res = d on the diagonal,
    0 elsewhere, with d = log(res_diag (n - 1) / (1 - res_diag)) so that
    Sinkhorn-Knopp returns exactly ``res_diag`` on the diagonal (default 0.95).
    See :func:`mhc_cupy.torch.identity_bias` for the reasoning.

    Raises:
        ValueError: n < 1, or pre / post / res_diag outside (0, 1) / (0, 2) / [1/n, 1).
    """
    n = _checks._int("n", n)  # (4.0 failed in NumPy, True gave one stream)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if pre is None:
        pre = 1.0 / n if n > 1 else 0.99
    if not 0.0 < pre < 1.0:
        raise ValueError(f"pre (H_pre at init) must be in (0, 1), got {pre}")
    if not 0.0 < post < 2.0:
        raise ValueError(f"post (H_post at init) must be in (0, 2), got {post}")
    b = np.zeros(n * n + 2 * n, dtype=np.float32)
    b[:n] = logit(pre)
    b[n:2 * n] = logit(post / 2.0)
    if n > 1:
        if not 1.0 / n <= res_diag < 1.0:
            raise ValueError(f"res_diag (diagonal of H_res at init) must be in [1/n, 1) = [{1.0 / n}, 1), "
                             f"got {res_diag}")
        b[2 * n:] = (np.eye(n) * math.log(res_diag * (n - 1) / (1.0 - res_diag))).reshape(-1)
    return b


def deepseek_sizes(fn_shape, scale_shape, base_shape, head: bool) -> tuple:
    """(C, n) of DeepSeek-V4-layout parameter shapes (docs/DEEPSEEK.md): ``hc_fn`` [m, n*C] with
    m = n*n + 2n (a layer; rows pre | post | res) or m = n (the head), ``hc_scale`` [3] (layer) or
    [1] (head), ``hc_base`` [m].

    Raises:
        ValueError: naming the argument whose shape does not fit, and what it needs.
    """
    fn_shape = tuple(fn_shape)
    m, D = fn_shape if len(fn_shape) == 2 else (0, 0)
    n = m if head else math.isqrt(m + 1) - 1
    if n < 1 or (not head and n * n + 2 * n != m) or D % n or D < n:
        what = "[n, n*C]" if head else "[n*n + 2n, n*C] (rows pre | post | res)"
        raise ValueError(f"hc_fn has shape {fn_shape}; it needs {what} with n >= 1 and C >= 1")
    for name, shape, want in (("hc_scale", scale_shape, (1,) if head else (3,)), ("hc_base", base_shape, (m,))):
        if tuple(shape) != want:
            raise ValueError(f"{name} has shape {tuple(shape)}; it needs {want}")
    return D // n, n

