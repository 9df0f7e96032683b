"""Float64 NumPy references of OPS.md sections 8, 9, 11 and 12: the per-token coefficients from vec(x)
(the coefficient path), the fused layer pieces, the head and the fused layer boundary.  Part of :mod:`mhc_cupy.reference`
(its docstring: the conventions every reference follows), which exports them.
"""

from __future__ import annotations

import math

import numpy as np

from ._convention import DEFAULT, resolve as _resolve
from ._reference_ops import (_f64, _res_matrix, _rms_inv, _sigmoid, mhc_post_op_fwd, mhc_pre_op_bwd, mhc_pre_op_fwd,
                             post_op_coefficient_grads)


# ----------------------------------------------------------------------------------------------
# 8. Coefficient path
# ----------------------------------------------------------------------------------------------

def _coeff_layout(n):
    """Column groups of phi / bias: pre [0, n), post [n, 2n), res [2n, 2n + n*n)."""
    return slice(0, n), slice(n, 2 * n), slice(2 * n, 2 * n + n * n)


def _alpha_per_column(alpha, n):
    """Expand alpha [3] to one scale per column of phi: [n*n + 2n]."""
    alpha = _f64(alpha)
    return np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(n * n, alpha[2])])


def mhc_coeffs_fwd(x, phi, alpha, bias, eps=DEFAULT, convention="paper"):
    """Raw mHC coefficients from the residual stream, paper Eqs. 14-18 (OPS.md §8).

    Per token, with x~ = vec(x) of length n*C (row-major reshape of ``[n, C]``):
        Ht = x~ @ phi;  r = sqrt(mean(x~^2) + eps);
        h_pre_raw  = alpha[0] * Ht[:n]   / r + bias[:n];
        h_post_raw = alpha[1] * Ht[n:2n] / r + bias[n:2n];
        h_res_raw  = (alpha[2] * Ht[2n:] / r + bias[2n:]) reshaped row-major to [n, n].

    Args:
        x: ``[..., n, C]``.
        phi: ``[n*C, n*n + 2n]`` (columns ordered pre | post | res).
        alpha: ``[3]`` = (alpha_pre, alpha_post, alpha_res).
        bias: ``[n*n + 2n]`` (same column order as phi).
        eps: added to the mean square; default 1e-5 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek" (the same maths; only the default eps).

    Returns:
        (h_pre_raw ``[..., n]``, h_post_raw ``[..., n]``, h_res_raw ``[..., n, n]``), float64.
    """
    eps = _resolve(convention, rms_eps=eps)
    x = _f64(x)
    phi = _f64(phi)
    bias = _f64(bias)
    n, C = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    xt = x.reshape(math.prod(lead), n * C)                       # tokens flattened: one 2-D matmul
    Ht = xt @ phi                                                # [T, n*n + 2n]
    rinv = _rms_inv(xt, eps)                                     # [T, 1]
    h = _alpha_per_column(alpha, n) * Ht * rinv + bias
    s_pre, s_post, s_res = _coeff_layout(n)
    return h[:, s_pre].reshape(lead + (n,)), h[:, s_post].reshape(lead + (n,)), h[:, s_res].reshape(lead + (n, n))


def mhc_coeffs_bwd(grad_h_pre_raw, grad_h_post_raw, grad_h_res_raw, x, phi, alpha, bias,
                   eps=DEFAULT, convention="paper"):
    """Backward of ``mhc_coeffs_fwd`` (OPS.md §8).

    With gh = [g_pre | g_post | vec(g_res)] (None = zero), a = alpha per column, r^-1 = rinv:
        dbias = sum_tokens gh;
        dalpha_k = sum_tokens sum_{columns of group k} gh * Ht * rinv;
        dHt = gh * a * rinv;   dphi = sum_tokens x~^T dHt;
        s = sum_columns gh * a * Ht   (gradient w.r.t. rinv);
        dx~ = dHt @ phi^T - s * rinv^3 * x~ / (n*C)   (second term: through r), reshaped [n, C].

    Args:
        grad_h_pre_raw, grad_h_post_raw: ``[..., n]`` or None.
        grad_h_res_raw: ``[..., n, n]`` or None.
        x, phi, alpha, bias, eps, convention: as in the forward.

    Returns:
        (dx ``[..., n, C]``, dphi ``[n*C, n*n + 2n]``, dalpha ``[3]``, dbias ``[n*n + 2n]``),
        float64.
    """
    eps = _resolve(convention, rms_eps=eps)
    x = _f64(x)
    phi = _f64(phi)
    n, C = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    xt = x.reshape(math.prod(lead), n * C)                       # tokens flattened: 2-D matmuls
    T = xt.shape[0]
    Ht = xt @ phi
    rinv = _rms_inv(xt, eps)
    a = _alpha_per_column(alpha, n)

    def _grad_or_zero(g, cols):
        return np.zeros((T, cols)) if g is None else _f64(g).reshape(T, cols)

    gh = np.concatenate(
        [_grad_or_zero(grad_h_pre_raw, n), _grad_or_zero(grad_h_post_raw, n), _grad_or_zero(grad_h_res_raw, n * n)],
        axis=-1,
    )                                                            # [T, m]

    dbias = gh.sum(axis=0)
    per_col = (gh * Ht * rinv).sum(axis=0)                       # [m]
    s_pre, s_post, s_res = _coeff_layout(n)
    dalpha = np.array([per_col[s_pre].sum(), per_col[s_post].sum(), per_col[s_res].sum()])

    dHt = gh * a * rinv                                          # [T, m]
    dphi = xt.T @ dHt                                            # [n*C, m]
    s = (gh * a * Ht).sum(axis=-1, keepdims=True)                # [T, 1]
    dxt = dHt @ phi.T - s * rinv**3 * xt / (n * C)
    return dxt.reshape(lead + (n, C)), dphi, dalpha, dbias


# ----------------------------------------------------------------------------------------------
# 9. The fused layer pieces
# ----------------------------------------------------------------------------------------------

def mhc_layer_pre_fwd(x, phi, alpha, bias, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, convention="paper",
                      hc_eps=DEFAULT, post_mult=DEFAULT):
    """``mhc_coeffs_fwd`` then ``mhc_pre_op_fwd`` (OPS.md §9), plus the saved sums.

    Returns:
        (layer_in ``[..., C]``, H_pre ``[..., n]``, H_post ``[..., n]``, H_res ``[..., n, n]``,
        stats ``[..., n*n + 2n + 1]`` = (x~ phi, sum of x~^2)), float64; a sum of squares past
        the float32 range is kept as -sum((2^-100 x~)^2), as the kernels keep it (OPS.md §8).
    """
    x64 = _f64(x)
    n, C = x64.shape[-2], x64.shape[-1]
    xt = x64.reshape(x64.shape[:-2] + (n * C,))
    ss = (xt**2).sum(axis=-1, keepdims=True)
    ss = np.where(ss > np.finfo(np.float32).max, -ss * 2.0**-200, ss)
    stats = np.concatenate([xt @ _f64(phi), ss], axis=-1)
    h = mhc_coeffs_fwd(x, phi, alpha, bias, rms_eps, convention)
    return (*mhc_pre_op_fwd(x, *h, num_iters, eps, convention, hc_eps, post_mult), stats)


def mhc_layer_pre_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias, stats, H_pre,
                      H_res, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled", convention="paper",
                      hc_eps=DEFAULT, post_mult=DEFAULT, grad_x=None, layer_out=None):
    """Backward of ``mhc_layer_pre_fwd`` with the post op's dx folded in (OPS.md §9).

    dx = (pre op's dx) + (coefficient path's dx) + H_res^T grad_out (the post op's dx,
    with the H_res given; H_res grad_out under ``convention="deepseek"``) + grad_x; the coefficient
    gradients are recomputed from x (``stats`` and ``H_pre`` are not needed here).  None
    gradients count as zero.  ``layer_out`` (y, OPS.md §12 "Fused boundary backward"): the post op's
    dH_post, dH_res of grad_out (``mhc_post_op_bwd``'s, rounded to float32 as that op returns them)
    are added to grad_H_post, grad_H_res first.

    Returns:
        (dx ``[..., n, C]``, dphi, dalpha, dbias), float64.
    """
    if layer_out is not None:
        dH_post, dH_res = post_op_coefficient_grads(_f64(grad_out), _f64(layer_out), _f64(x), convention)
        f32 = lambda a: _f64(np.float32(a))  # noqa: E731
        grad_H_post, grad_H_res = (f32(d) if g is None else f32(f32(d) + _f64(g))
                                   for d, g in ((dH_post, grad_H_post), (dH_res, grad_H_res)))
    h = mhc_coeffs_fwd(x, phi, alpha, bias, rms_eps, convention)
    dx, dh_pre, dh_post, dh_res = mhc_pre_op_bwd(grad_layer_in, None, grad_H_post, grad_H_res, x, *h, num_iters,
                                                 eps, grad_mode, convention, hc_eps, post_mult)
    dx_c, dphi, dalpha, dbias = mhc_coeffs_bwd(dh_pre, dh_post, dh_res, x, phi, alpha, bias, rms_eps, convention)
    dx = dx + dx_c
    if grad_out is not None:
        dx = dx + np.swapaxes(_res_matrix(H_res, convention), -1, -2) @ _f64(grad_out)
    if grad_x is not None:
        dx = dx + _f64(grad_x)
    return dx, dphi, dalpha, dbias


# ----------------------------------------------------------------------------------------------
# 11. The head (DeepSeek-V4 hc_head)
# ----------------------------------------------------------------------------------------------

def _head_terms(x, hc_fn, hc_scale, hc_base, rms_eps):
    """(x~ [T, nC], H~ [T, n], 1/r [T, 1], sigmoid(z) [T, n]) of the head's forward."""
    x = _f64(x)
    n, C = x.shape[-2], x.shape[-1]
    xt = x.reshape(math.prod(x.shape[:-2]), n * C)
    Ht = xt @ _f64(hc_fn).T
    rinv = _rms_inv(xt, rms_eps)
    return xt, Ht, rinv, _sigmoid(Ht * rinv * _f64(hc_scale)[0] + _f64(hc_base))


def mhc_head_fwd(x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """The mHC head: n streams to one hidden state (OPS.md §11, DeepSeek-V4 ``hc_head``).

    Per token, with x~ = vec(x): w = sigmoid((x~ hc_fn^T) / r * hc_scale + hc_base) + hc_eps,
    r = sqrt(mean(x~^2) + rms_eps); out = sum_i w_i x_i.

    Args:
        x: ``[..., n, C]``.  hc_fn: ``[n, n*C]``.  hc_scale: ``[1]``.  hc_base: ``[n]``.

    Returns:
        out ``[..., C]``, float64.
    """
    x = _f64(x)
    n, C = x.shape[-2], x.shape[-1]
    xt, _, _, s = _head_terms(x, hc_fn, hc_scale, hc_base, rms_eps)
    out = np.einsum("tk,tkc->tc", s + hc_eps, xt.reshape(-1, n, C))
    return out.reshape(x.shape[:-2] + (C,))


def mhc_head_bwd(grad, x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """Backward of ``mhc_head_fwd`` (OPS.md §11).

    With gw_i = sum_c g_c x_ic, gz = gw sigmoid'(z), dH = gz hc_scale / r:
        dx~ = vec(w_i g) + dH hc_fn - (sum_k gz_k hc_scale H~_k) / (nC r^3) x~;
        dhc_fn = sum_tokens dH^T x~;  dhc_scale = sum_tokens sum_k gz_k H~_k / r;  dhc_base = sum_tokens gz.

    Returns:
        (dx ``[..., n, C]``, dhc_fn ``[n, n*C]``, dhc_scale ``[1]``, dhc_base ``[n]``), float64.
    """
    x = _f64(x)
    n, C = x.shape[-2], x.shape[-1]
    xt, Ht, rinv, s = _head_terms(x, hc_fn, hc_scale, hc_base, rms_eps)
    g = _f64(grad).reshape(-1, C)
    x3 = xt.reshape(-1, n, C)
    gz = np.einsum("tc,tkc->tk", g, x3) * s * (1.0 - s)
    scale = _f64(hc_scale)[0]
    dH = gz * scale * rinv
    c = (gz * scale * Ht).sum(axis=-1, keepdims=True) * rinv**3 / (n * C)
    dx = ((s + hc_eps)[:, :, None] * g[:, None, :]).reshape(xt.shape) + dH @ _f64(hc_fn) - c * xt
    return (dx.reshape(x.shape), dH.T @ xt, np.array([(gz * Ht * rinv).sum()]), gz.sum(axis=0))


# ----------------------------------------------------------------------------------------------
# 12. The fused layer boundary
# ----------------------------------------------------------------------------------------------

def mhc_boundary_fwd(layer_out, x, H_post, H_res, phi, alpha, bias, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT,
                     convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """Layer l's ``mhc_post_op_fwd`` then layer l+1's ``mhc_layer_pre_fwd`` (OPS.md §12), the streams
    between them rounded to x's dtype first, as the kernels store them and the next layer reads them.

    Returns:
        (out ``[..., n, C]`` (the rounded streams), layer_in, H_pre, H_post, H_res, stats of layer l+1 as
        ``mhc_layer_pre_fwd``), float64.
    """
    out = np.asarray(mhc_post_op_fwd(layer_out, x, H_post, H_res, convention)).astype(np.asarray(x).dtype)
    return (_f64(out), *mhc_layer_pre_fwd(out, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps,
                                          post_mult))


def mhc_boundary_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias, stats, H_pre, H_res,
                     num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled", convention="paper",
                     hc_eps=DEFAULT, post_mult=DEFAULT, grad_x=None, layer_out=None, H_post_prev=None):
    """``mhc_layer_pre_bwd`` and the previous layer's d layer_out (OPS.md §12 "Fused boundary backward"):
    dy_prev = sum_i H_post_prev_i dx_i of dx rounded to x's dtype (the gradient the previous layer's
    post op gets, ``mhc_post_op_bwd``'s dy of it).

    Returns:
        (dx ``[..., n, C]``, dphi, dalpha, dbias, dy_prev ``[..., C]``), float64.
    """
    dx, dphi, dalpha, dbias = mhc_layer_pre_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias,
                                                stats, H_pre, H_res, num_iters, eps, rms_eps, grad_mode, convention,
                                                hc_eps, post_mult, grad_x, layer_out)
    g = _f64(np.asarray(dx).astype(np.asarray(x).dtype))
    return dx, dphi, dalpha, dbias, (_f64(H_post_prev)[..., :, None] * g).sum(axis=-2)
