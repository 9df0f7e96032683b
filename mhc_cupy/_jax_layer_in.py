"""``mhc_cupy.jax.mhc_layer_in``: an mHC layer's pre piece with layer_in in the form the next GEMM
wants (docs/OPS.md section 13, inference): RMS-normalised by the sublayer's pre-norm, and / or float8
e4m3 with one scale per token, under ``jax.jit`` (the kernels ``mhc_layer_pre_norm_fwd`` /
``mhc_layer_pre_fp8_fwd``; on a GPU under the kernel choice ``layer_in``, ``mhc_cupy._kernel_choice``)."""

from __future__ import annotations

import functools

import jax

from . import _checks
from ._convention import DEFAULT
from ._jax_kernels import _k
from ._jax_layer import check_params, check_x
from .ops.layer_in import NORM_EPS


def mhc_layer_in(params: dict, x, norm_weight=None, *, fp8: bool = False, num_iters=DEFAULT, eps=DEFAULT,
                 rms_eps=DEFAULT, convention: str = "paper", hc_eps=DEFAULT, post_mult=DEFAULT, norm_eps=NORM_EPS):
    """The pre piece of :func:`mhc_cupy.jax.mhc_layer` with layer_in ready for the next GEMM (OPS.md
    section 13).  Forward only (no VJP: inference).

    Args:
        params: {"phi", "alpha", "bias"} from :func:`mhc_cupy.jax.mhc_init`.
        x: [..., n, C] residual streams (bfloat16 / float16 / float32).
        norm_weight: float32 [C], the sublayer's RMSNorm weight, or None (default): layer_in is not
            normalised (then ``fp8`` must be True: the plain pre piece is ``mhc_layer``'s).
        fp8: False (default): layer_in RMS-normalised, in x's dtype, and its rstd; True: layer_in (or,
            given norm_weight, the normalised one) as float8 e4m3fn and its per-token scale.
        num_iters, eps, rms_eps, convention, hc_eps, post_mult: as :func:`mhc_cupy.jax.mhc_layer`.
        norm_eps: the RMSNorm's eps, a float (static, not a JAX array), finite and >= 0 (default 1e-6).

    Returns:
        fp8=False: (layer_in_normed [..., C] dtype of x, rstd float32 [..., 1], H_pre, H_post, H_res,
        stats); fp8=True: (layer_in_fp8 [..., C] float8_e4m3fn, scale float32 [..., 1], H_pre, H_post,
        H_res, stats), with layer_in ~= layer_in_fp8 * scale.  H_pre [..., n], H_post [..., n],
        H_res [..., n, n], stats [..., n*n + 2n + 1] float32, as the layer's pre piece gives them.

    Raises:
        TypeError / ValueError: as :func:`mhc_cupy.jax.mhc_layer` for params, x and the settings;
        norm_weight not float32 [C]; norm_weight None with fp8=False; fp8 not a bool (TypeError);
        norm_eps not a Python / NumPy real (TypeError: a JAX array or traced value included; it is
        static), negative or not finite.
        ValueError: differentiated (jax.grad / jax.jvp of a function that reaches it with tangents:
            forward only).  NotImplementedError: on a GPU while the kernel choice ``layer_in`` is off.
    """
    from .jax import _layer_settings

    check_params(params)
    fp8 = _checks.flag("fp8", fp8)
    norm_eps = _checks.eps("norm_eps", norm_eps)
    if not fp8 and norm_weight is None:
        raise ValueError("norm_weight is None with fp8=False; mhc_layer_in needs a norm weight float32 [C] to "
                         "normalise layer_in, or fp8=True")
    settings = _layer_settings(num_iters, eps, rms_eps, "unrolled", convention, hc_eps, post_mult)
    check_x(params, x)
    op = "mhc_layer_pre_fp8_fwd" if fp8 else "mhc_layer_pre_norm_fwd"
    return _forward_only(op, (("settings", settings), ("norm_eps", norm_eps)), x, params["phi"], params["alpha"],
                         params["bias"], norm_weight)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward_only(op, params, *arrays):
    """The kernel call, with a JVP rule that says why there is none (JAX's own refusal names buffer
    callbacks)."""
    return _k(op, params, *arrays)


@_forward_only.defjvp
def _no_jvp(op, params, primals, tangents):
    raise ValueError("mhc_cupy.jax.mhc_layer_in is forward only (inference: no JVP / VJP, OPS.md section 13), "
                     "but a gradient (jax.grad / jax.jvp) reached it; to train use mhc_cupy.jax.mhc_layer, or "
                     "jax.lax.stop_gradient the arguments of mhc_layer_in")
