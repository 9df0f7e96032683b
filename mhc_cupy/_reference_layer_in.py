"""NumPy references of OPS.md section 13: layer_in in the form the next GEMM takes, RMS-normalised with
the sublayer's pre-norm weight or as float8 e4m3 with one scale per token.  Part of
:mod:`mhc_cupy.reference` (its docstring: the conventions every reference follows), which exports them.

Unlike the other references these round as the kernels do, step by step: layer_in to x's dtype (as
``mhc_layer_pre_fwd`` stores it), then float32 products and quotients, then x's dtype or float8.  So
given the same layer_in (and, for the RMSNorm, the same float32 rstd) :func:`rms_normalise` and
:func:`quantise_e4m3` give the kernels' bits; only rstd itself is computed in float64 here (the kernels
sum the squares in float32).  The ops return float64 arrays holding those rounded values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._convention import DEFAULT
from ._reference_coeffs import mhc_layer_pre_fwd
from ._reference_ops import _f64

#: float8 e4m3fn (no infinities; NaN 0x7f / 0xff) and its largest finite value.
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = np.float32(448)
_F32 = np.float32


def to_e4m3(v):
    """float32 values as float8 e4m3fn: rounded to nearest even, saturating (infinities too) at +-448,
    NaN to NaN (``ml_dtypes``' cast of the values clipped to +-448)."""
    return np.clip(np.asarray(v, _F32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantise_e4m3(u):
    """(q float8 e4m3fn [..., C], scale float32 [..., 1]) of float32 rows u [..., C] (OPS.md 13):
    scale = max|u| / 448 in float32, 1 where that is 0, NaN where some u is; q = to_e4m3(u / scale)
    (the float32 quotient)."""
    u = np.asarray(u, _F32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        amax = np.max(np.abs(u), axis=-1, keepdims=True, initial=_F32(0))  # NaN if any u is
        scale = (amax / E4M3_MAX).astype(_F32)
        scale = np.where(scale == 0, _F32(1), scale).astype(_F32)
        return to_e4m3((u / scale).astype(_F32)), scale


def rms_rstd(v, eps):
    """rstd = 1 / sqrt(mean(v^2, last dim) + eps) of rows v [..., C], float64 maths rounded to float32
    [..., 1] (the kernels sum the squares in float32: their rstd differs in the last bits)."""
    v = np.asarray(v, np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)).astype(_F32)


def rms_normalise(v, rstd, weight, dtype):
    """(v * rstd) * weight in float32 (two rounded products), then rounded to ``dtype`` (OPS.md 13):
    v [..., C], rstd [..., 1], weight [C]."""
    with np.errstate(invalid="ignore", over="ignore"):
        u = (np.asarray(v, _F32) * np.asarray(rstd, _F32)).astype(_F32) * np.asarray(weight, _F32)
    return u.astype(_F32).astype(dtype)


def _layer_in(x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult):
    """(layer_in rounded to x's dtype, [H_pre, H_post, H_res, stats] float64) of mhc_layer_pre_fwd."""
    layer_in, *rest = mhc_layer_pre_fwd(x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult)
    return np.asarray(layer_in).astype(np.asarray(x).dtype), rest


def mhc_layer_pre_norm_fwd(x, phi, alpha, bias, norm_weight, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT,
                           convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT, norm_eps=1e-6):
    """``mhc_layer_pre_fwd`` with layer_in RMS-normalised by the sublayer's pre-norm weight (OPS.md §13).

    With v = layer_in rounded to x's dtype: rstd = :func:`rms_rstd` (v, norm_eps),
    layer_in_normed = :func:`rms_normalise` (v, rstd, norm_weight, x's dtype).

    Returns:
        (layer_in_normed ``[..., C]``, rstd ``[..., 1]``, H_pre, H_post, H_res, stats), float64.
    """
    li, rest = _layer_in(x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult)
    v = li.astype(_F32)
    rstd = rms_rstd(v, norm_eps)
    return (_f64(rms_normalise(v, rstd, norm_weight, li.dtype)), _f64(rstd), *rest)


def mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, norm_weight=None, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT,
                          convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT, norm_eps=1e-6):
    """``mhc_layer_pre_fwd`` with layer_in as float8 e4m3 and one scale per token (OPS.md §13).

    u = layer_in rounded to x's dtype, or with ``norm_weight`` ``mhc_layer_pre_norm_fwd``'s
    layer_in_normed; (layer_in_fp8, scale) = :func:`quantise_e4m3` (u).

    Returns:
        (layer_in_fp8 ``[..., C]`` (float8 values), scale ``[..., 1]``, H_pre, H_post, H_res, stats), float64.
    """
    li, rest = _layer_in(x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult)
    u = li.astype(_F32)
    if norm_weight is not None:
        u = rms_normalise(u, rms_rstd(u, norm_eps), norm_weight, li.dtype).astype(_F32)
    q, scale = quantise_e4m3(u)
    return (_f64(q), _f64(scale), *rest)
