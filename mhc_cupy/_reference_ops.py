"""Float64 NumPy references of OPS.md sections 1-7: Sinkhorn-Knopp, RMSNorm, the stream mix /
aggregate / distribute, the post op and the pre op (the ops given their coefficients).  Part of
:mod:`mhc_cupy.reference` (its docstring: the conventions every reference follows), which
exports them.
"""

from __future__ import annotations

import numpy as np

from ._convention import DEFAULT, check as _check_convention, resolve as _resolve


_GRAD_MODES = ("unrolled", "implicit")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _f64(a):
    """Convert to a float64 ndarray (works for float16/32/64 and ml_dtypes.bfloat16)."""
    return np.asarray(a, dtype=np.float64)


def _sum_to_shape(g, shape):
    """Reduce a broadcast gradient ``g`` back to ``shape`` (sum over broadcast dims).

    Used for coefficients that may be shared over tokens (e.g. ``h`` of shape ``[n]`` against
    ``x`` of shape ``[..., n, C]``): the gradient is then summed over all tokens.
    """
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _sigmoid(z):
    """Numerically stable logistic function sigma(z) = 1 / (1 + exp(-z)) (no overflow)."""
    e = np.exp(-np.abs(z))  # in (0, 1], never overflows
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _check_grad_mode(grad_mode):
    if grad_mode not in _GRAD_MODES:
        raise ValueError(
            f"grad_mode must be one of {_GRAD_MODES!r}, got grad_mode={grad_mode!r}"
        )


# ----------------------------------------------------------------------------------------------
# 1. Sinkhorn-Knopp
# ----------------------------------------------------------------------------------------------

def _sinkhorn_shifted_exp(L):
    """K = exp(L - max_k L_ik) and the (first) argmax index of each row."""
    idx = np.argmax(L, axis=-1)                                  # [..., n]
    m = L.max(axis=-1, keepdims=True)                            # [..., n, 1], = L[..., idx]
    return np.exp(L - m), idx


def _sinkhorn_forward_states(L, num_iters, eps, convention="paper"):
    """Run the forward and keep, for every half-step, the scale vector and the output.

    Returns ``K, idx, states`` with ``states`` a list of ``(kind, scale, P_after)`` where kind is
    ``"row"`` (scale [..., n, 1]), ``"col"`` (scale [..., 1, n]) or, under
    ``convention="deepseek"``, ``"softmax"`` for the first row step P = K * scale + eps (scale
    [..., n, 1] = 1 / rowsum(K), no eps in the denominator; P_after is kept without the + eps).
    """
    K, idx = _sinkhorn_shifted_exp(L)
    P = K
    states = []
    for it in range(int(num_iters)):
        if it == 0 and convention == "deepseek":
            r = 1.0 / P.sum(axis=-1, keepdims=True)                  # softmax of each row
            states.append(("softmax", r, P * r))
            P = P * r + eps
        else:
            r = 1.0 / (P.sum(axis=-1, keepdims=True) + eps)          # [..., n, 1]
            P = P * r
            states.append(("row", r, P))
        c = 1.0 / (P.sum(axis=-2, keepdims=True) + eps)          # [..., 1, n]
        P = P * c
        states.append(("col", c, P))
    return K, idx, states


def sinkhorn_knopp_fwd(logits, num_iters=DEFAULT, eps=DEFAULT, convention="paper"):
    """Sinkhorn-Knopp projection onto (approximately) doubly stochastic matrices (OPS.md §1).

    Per matrix L ``[n, n]``:

    1. K_ij = exp(L_ij - max_k L_ik)   (row max subtracted; never overflows);
    2. ``num_iters`` times: row step P_ij <- P_ij / (sum_k P_ik + eps), then
       column step P_ij <- P_ij / (sum_k P_kj + eps).

    ``num_iters=0`` returns K itself. The last step is a column step, so column sums are ~1.
    Under ``convention="deepseek"`` (OPS.md "DeepSeek-V4 convention") the first row step is the
    softmax plus eps, P_ij <- K_ij / sum_k K_ik + eps, and num_iters >= 1.

    Args:
        logits: ``[..., n, n]`` any float dtype.
        num_iters: number of (row, column) iteration pairs; default 20.
        eps: added to every row / column sum before dividing; default 1e-8 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek".

    Returns:
        P: ``[..., n, n]`` float64.
    """
    num_iters, eps = _resolve(convention, num_iters=num_iters, eps=eps)
    L = _f64(logits)
    _, _, states = _sinkhorn_forward_states(L, num_iters, eps, convention)
    if states:
        return states[-1][2]
    return _sinkhorn_shifted_exp(L)[0]


def _sinkhorn_bwd_unrolled(G, L, num_iters, eps, convention="paper"):
    """Exact VJP of ``sinkhorn_knopp_fwd`` (including the row-max shift)."""
    K, idx, states = _sinkhorn_forward_states(L, num_iters, eps, convention)
    g = G
    for kind, s, y in reversed(states):
        # y = p * s with s = 1 / (sum p + eps) along the step's axis:
        #   dp = s * (gy - sum(gy * y))   (sum along the same axis)
        # (the softmax step: y = p * s + eps with s = 1 / sum p; y is kept without the eps,
        # and the same formula holds)
        axis = -2 if kind == "col" else -1
        g = s * (g - (g * y).sum(axis=axis, keepdims=True))
    # g is now dLoss/dK. K = exp(L - L[i, argmax_i]):
    #   dL_ij = gK_ij K_ij - [j == argmax_i] * sum_k gK_ik K_ik
    gKK = g * K
    n = L.shape[-1]
    onehot = np.arange(n) == idx[..., None]                      # [..., n, n]
    return gKK - onehot * gKK.sum(axis=-1, keepdims=True)


#: 2-norm condition number of the implicit backward's matrix above which it is solved by least squares
#: (``_solve_consistent``). In a sweep of n 3-32, logit scales 20-400 (~13,000 matrices) LU
#: (``np.linalg.solve``) gave dL within 4e-13 of the minimum-norm least-squares solution of the whole 2n
#: system up to a condition number of 1e16, and up to 1e21 off above (the round-off of b along its near-null
#: directions, multiplied by entries of P that are not ~0); least squares stayed within 5e-12 throughout
_SOLVE_COND_MAX = 1e12


def _solve_consistent(A, rhs):
    """Batched solve of A b = rhs (A [..., n, n], rhs [..., n]).

    ``np.linalg.solve`` normally. A matrix that is singular or nearly singular in floating
    point (condition number above ``_SOLVE_COND_MAX``: P is numerically a permutation or nearly
    so, e.g. logits of scale 100, and its bipartite graph falls apart, or nearly, into several
    components) is solved by least squares instead (``np.linalg.lstsq``: the minimum-norm
    solution, singular values below its round-off cutoff dropped). The dropped directions only
    touch entries where P is ~0, so dL is right to rounding; LU there amplified its round-off
    along them (dL off by up to 1e21 at n = 32, logit scale 100, the default settings).
    """
    n = A.shape[-1]
    A2 = A.reshape(-1, n, n)
    r2 = rhs.reshape(-1, n)
    try:
        out = np.linalg.solve(A2, r2[..., None])[..., 0]
    except np.linalg.LinAlgError:  # some matrix exactly singular: each alone (lstsq below where it is)
        out = np.empty_like(r2)
        for k in range(A2.shape[0]):
            try:
                out[k] = np.linalg.solve(A2[k], r2[k])
            except np.linalg.LinAlgError:
                out[k] = np.nan
    finite = np.isfinite(A2).all(axis=(-2, -1))
    ill = np.zeros(A2.shape[0], dtype=bool)
    if finite.any():
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ill[finite] = ~(np.linalg.cond(A2[finite]) <= _SOLVE_COND_MAX)
    for k in np.flatnonzero(ill):
        out[k] = np.linalg.lstsq(A2[k], r2[k], rcond=None)[0]
    return out.reshape(rhs.shape)


def _sinkhorn_bwd_implicit(G, L, num_iters, eps, convention="paper"):
    """Implicit-function-theorem gradient of the converged projection, evaluated at P."""
    P = sinkhorn_knopp_fwd(L, num_iters, eps, convention)
    n = P.shape[-1]
    PG = P * G
    rs = P.sum(axis=-1)                                          # [..., n]
    cs = P.sum(axis=-2)                                          # [..., n]
    r = PG.sum(axis=-1)                                          # [..., n]
    c = PG.sum(axis=-2)                                          # [..., n]
    Pt = np.swapaxes(P, -1, -2)
    # System: diag(rs) a + P b = r ;  P^T a + diag(cs) b = c  (null space along (1, -1)).
    # Eliminate a = (r - P b) / rs  ->  S b = rhs with the Schur complement
    #   S = diag(cs) - P^T diag(1/rs) P,   rhs = c - P^T (r / rs).
    # S is singular along 1 and rhs is orthogonal to 1, so (S + 1 1^T) b = rhs picks the
    # solution with sum(b) = 0.
    S = -(Pt @ (P / rs[..., :, None]))
    S = S + cs[..., :, None] * np.eye(n)
    S = S + 1.0
    rhs = c - (Pt @ (r / rs)[..., None])[..., 0]
    b = _solve_consistent(S, rhs)                                # [..., n]
    a = (r - (P @ b[..., None])[..., 0]) / rs                    # [..., n]
    return P * (G - a[..., :, None] - b[..., None, :])


def sinkhorn_knopp_bwd(grad_P, logits, num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", convention="paper"):
    """Backward of ``sinkhorn_knopp_fwd`` (OPS.md §1).

    ``grad_mode="unrolled"`` (default): the exact vector-Jacobian product of the forward as
    computed, f(L) = S(exp(L - max_row(L))), through every row / column step. The forward is
    recomputed and each half-step's state kept; each step y = p * s, s = 1/(sum p + eps) is
    back-propagated as dp = s * (gy - sum(gy * y)) along the step's axis; finally, with gK the
    gradient w.r.t. K, dL_ij = gK_ij K_ij - [j == argmax_i] sum_k gK_ik K_ik (argmax = first
    index of the row max, as ``np.argmax``).

    ``grad_mode="implicit"``: the gradient of the *converged* projection (implicit function
    theorem), evaluated at the forward output P: dL = P * (G - a 1^T - 1 b^T) where
    diag(rowsum P) a + P b = rowsum(P*G) and P^T a + diag(colsum P) b = colsum(P*G). Solved
    exactly (Schur complement on b, ``np.linalg.solve``; least squares for a matrix that is
    singular or nearly singular in floating point, see ``_solve_consistent``), so its cost does not depend on
    ``num_iters`` beyond the forward. It equals "unrolled" only as far as the forward has
    converged; for small ``num_iters`` the two differ.

    In both modes every row of d_logits sums to 0 (up to rounding); n = 1 gives 0.
    Under ``convention="deepseek"`` "unrolled" differentiates the deepseek forward (through its
    softmax start); "implicit" is the same formula at the deepseek forward's P.

    Args:
        grad_P: ``[..., n, n]`` gradient w.r.t. P.
        logits: ``[..., n, n]`` the forward's input.
        num_iters, eps, convention: as in the forward.
        grad_mode: ``"unrolled"`` or ``"implicit"``; anything else raises ``ValueError``.

    Returns:
        d_logits: ``[..., n, n]`` float64.
    """
    _check_grad_mode(grad_mode)
    num_iters, eps = _resolve(convention, num_iters=num_iters, eps=eps)
    G = _f64(grad_P)
    L = _f64(logits)
    if grad_mode == "unrolled":
        return _sinkhorn_bwd_unrolled(G, L, num_iters, eps, convention)
    return _sinkhorn_bwd_implicit(G, L, num_iters, eps, convention)


# ----------------------------------------------------------------------------------------------
# 2. RMSNorm
# ----------------------------------------------------------------------------------------------

def _rms_inv(x, eps):
    """r = 1 / sqrt(mean(x^2, -1) + eps), shape [..., 1]."""
    return 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_fwd(x, eps=1e-5, weight=None):
    """RMSNorm over the last dim (OPS.md §2).

    r = 1 / sqrt(mean_c x_c^2 + eps);  y_c = x_c * r  (* w_c if ``weight`` is given).

    Args:
        x: ``[..., C]``.
        eps: added to the mean square.
        weight: optional ``[C]``.

    Returns:
        y: ``[..., C]`` float64.
    """
    x = _f64(x)
    y = x * _rms_inv(x, eps)
    if weight is not None:
        y = y * _f64(weight)
    return y


def rmsnorm_bwd(grad, x, eps=1e-5, weight=None):
    """Backward of ``rmsnorm_fwd`` (OPS.md §2).

    With g' = g * w (g' = g without weight):
        dx_c = r g'_c - x_c r^3 mean_k(g'_k x_k);
        dw_c = sum over all tokens of g_c x_c r.

    Args:
        grad: ``[..., C]`` gradient w.r.t. y.
        x: ``[..., C]`` the forward's input.
        eps: as in the forward.
        weight: optional ``[C]``.

    Returns:
        dx ``[..., C]`` float64 when ``weight`` is None, else ``(dx, d_weight)`` with
        d_weight ``[C]`` float64.
    """
    g = _f64(grad)
    x = _f64(x)
    r = _rms_inv(x, eps)
    gp = g if weight is None else g * _f64(weight)
    dx = r * gp - x * r**3 * np.mean(gp * x, axis=-1, keepdims=True)
    if weight is None:
        return dx
    C = x.shape[-1]
    dw = (g * x * r).reshape(-1, C).sum(axis=0)
    return dx, dw


# ----------------------------------------------------------------------------------------------
# 3. Stream mix
# ----------------------------------------------------------------------------------------------

def stream_mix_fwd(x, M):
    """Mix the residual streams with a per-token matrix (OPS.md §3).

    out_i = sum_j M_ij x_j, i.e. ``M @ x`` per token.

    Args:
        x: ``[..., n, C]``.
        M: ``[..., n, n]``.

    Returns:
        out: ``[..., n, C]`` float64.
    """
    return _f64(M) @ _f64(x)


def stream_mix_bwd(grad, x, M):
    """Backward of ``stream_mix_fwd`` (OPS.md §3).

    dx_j = sum_i M_ij g_i  (``M^T @ g``);  dM_ij = sum_c g_ic x_jc  (``g @ x^T``).

    Args:
        grad: ``[..., n, C]``.
        x: ``[..., n, C]``.
        M: ``[..., n, n]``.

    Returns:
        (dx ``[..., n, C]``, dM with M's shape), float64.
    """
    g = _f64(grad)
    x = _f64(x)
    M = _f64(M)
    dx = np.swapaxes(M, -1, -2) @ g
    dM = g @ np.swapaxes(x, -1, -2)
    return _sum_to_shape(dx, x.shape), _sum_to_shape(dM, M.shape)


# ----------------------------------------------------------------------------------------------
# 4. Stream aggregate
# ----------------------------------------------------------------------------------------------

def stream_aggregate_fwd(x, h):
    """Weighted sum of the streams (OPS.md §4).

    out = sum_i h_i x_i.

    Args:
        x: ``[..., n, C]``.
        h: per token ``[..., n]`` or shared ``[n]``.

    Returns:
        out: ``[..., C]`` float64.
    """
    x = _f64(x)
    h = _f64(h)
    return (h[..., :, None] * x).sum(axis=-2)


def stream_aggregate_bwd(grad, x, h):
    """Backward of ``stream_aggregate_fwd`` (OPS.md §4).

    dx_i = h_i g;  dh_i = sum_c g_c x_ic per token; for shared h ``[n]`` summed over all tokens.

    Args:
        grad: ``[..., C]``.
        x: ``[..., n, C]``.
        h: ``[..., n]`` or ``[n]``.

    Returns:
        (dx ``[..., n, C]``, dh with h's shape), float64.
    """
    g = _f64(grad)
    x = _f64(x)
    h = _f64(h)
    dx = np.broadcast_to(h[..., :, None] * g[..., None, :], x.shape).copy()
    dh = (g[..., None, :] * x).sum(axis=-1)                      # [..., n]
    return dx, _sum_to_shape(dh, h.shape)


# ----------------------------------------------------------------------------------------------
# 5. Stream distribute
# ----------------------------------------------------------------------------------------------

def stream_distribute_fwd(y, h):
    """Copy one vector into n weighted streams (OPS.md §5).

    out_i = h_i y.

    Args:
        y: ``[..., C]``.
        h: per token ``[..., n]`` or shared ``[n]``.

    Returns:
        out: ``[..., n, C]`` float64.
    """
    y = _f64(y)
    h = _f64(h)
    return h[..., :, None] * y[..., None, :]


def stream_distribute_bwd(grad, y, h):
    """Backward of ``stream_distribute_fwd`` (OPS.md §5).

    dy = sum_i h_i g_i;  dh_i = sum_c g_ic y_c per token; for shared h summed over all tokens.

    Args:
        grad: ``[..., n, C]``.
        y: ``[..., C]``.
        h: ``[..., n]`` or ``[n]``.

    Returns:
        (dy ``[..., C]``, dh with h's shape), float64.
    """
    g = _f64(grad)
    y = _f64(y)
    h = _f64(h)
    dy = (h[..., :, None] * g).sum(axis=-2)
    dh = (g * y[..., None, :]).sum(axis=-1)                      # [..., n]
    return _sum_to_shape(dy, y.shape), _sum_to_shape(dh, h.shape)


# ----------------------------------------------------------------------------------------------
# 6. mHC post op
# ----------------------------------------------------------------------------------------------

def _res_matrix(H_res, convention):
    """The per-token matrix M with out = M x: H_res ("paper") or its transpose ("deepseek")."""
    H_res = _f64(H_res)
    return H_res if _check_convention(convention) == "paper" else np.swapaxes(H_res, -1, -2)


def mhc_post_op_fwd(layer_out, x, H_post, H_res, convention="paper"):
    """mHC residual update, paper Eq. 3 (OPS.md §6).

    out_i = sum_j H_res_ij x_j + H_post_i y   (H_post already activated, 2*sigmoid).
    ``convention="deepseek"``: H_res transposed, out_j = sum_i H_res_ij x_i + H_post_j y.

    Args:
        layer_out: y ``[..., C]``.
        x: ``[..., n, C]``.
        H_post: ``[..., n]``.
        H_res: ``[..., n, n]``.
        convention: "paper" (default) or "deepseek".

    Returns:
        out: ``[..., n, C]`` float64.
    """
    y = _f64(layer_out)
    x = _f64(x)
    H_post = _f64(H_post)
    return _res_matrix(H_res, convention) @ x + H_post[..., :, None] * y[..., None, :]


def post_op_coefficient_grads(g, y, x, convention="paper"):
    """The post op's dH_post_i = sum_c g_ic y_c and dH_res (``mhc_post_op_bwd``'s, per token, float64
    arrays in): (dH_post ``[..., n]``, dH_res ``[..., n, n]``)."""
    dM = g @ np.swapaxes(x, -1, -2)
    return (g * y[..., None, :]).sum(axis=-1), dM if convention == "paper" else np.swapaxes(dM, -1, -2)


def mhc_post_op_bwd(grad, layer_out, x, H_post, H_res, convention="paper"):
    """Backward of ``mhc_post_op_fwd`` (OPS.md §6).

    dy = sum_i H_post_i g_i;  dx_j = sum_i H_res_ij g_i;
    dH_post_i = sum_c g_ic y_c;  dH_res_ij = sum_c g_ic x_jc.
    ``convention="deepseek"`` (H_res transposed): dx_i = sum_j H_res_ij g_j; dH_res_ij = sum_c x_ic g_jc.

    Args:
        grad: ``[..., n, C]``.
        layer_out: y ``[..., C]``.
        x: ``[..., n, C]``.
        H_post: ``[..., n]``.
        H_res: ``[..., n, n]``.

    Returns:
        (d_layer_out ``[..., C]``, dx ``[..., n, C]``, dH_post ``[..., n]``,
        dH_res ``[..., n, n]``), float64.
    """
    g = _f64(grad)
    y = _f64(layer_out)
    x = _f64(x)
    H_post = _f64(H_post)
    H_res = _f64(H_res)
    M = _res_matrix(H_res, convention)
    dy = (H_post[..., :, None] * g).sum(axis=-2)
    dx = np.swapaxes(M, -1, -2) @ g
    dH_post, dH_res = post_op_coefficient_grads(g, y, x, convention)
    return (
        _sum_to_shape(dy, y.shape),
        _sum_to_shape(dx, x.shape),
        _sum_to_shape(dH_post, H_post.shape),
        _sum_to_shape(dH_res, H_res.shape),
    )


# ----------------------------------------------------------------------------------------------
# 7. mHC pre op
# ----------------------------------------------------------------------------------------------

def mhc_pre_op_fwd(x, h_pre_raw, h_post_raw, h_res_raw, num_iters=DEFAULT, eps=DEFAULT, convention="paper",
                   hc_eps=DEFAULT, post_mult=DEFAULT):
    """mHC coefficient activations (paper Eq. 8) and the layer input (OPS.md §7).

    H_pre = sigmoid(h_pre_raw) + hc_eps;  H_post = post_mult sigmoid(h_post_raw);
    H_res = sinkhorn_knopp_fwd(h_res_raw, num_iters, eps, convention);  layer_in = sum_i H_pre_i x_i.
    Defaults (left out): hc_eps 0 (paper) / 1e-6 (deepseek), post_mult 2.

    Args:
        x: ``[..., n, C]``.
        h_pre_raw, h_post_raw: ``[..., n]``.
        h_res_raw: ``[..., n, n]``.
        num_iters, eps, convention: Sinkhorn parameters.
        hc_eps, post_mult: the activations' shift and scale.

    Returns:
        (layer_in ``[..., C]``, H_pre ``[..., n]``, H_post ``[..., n]``, H_res ``[..., n, n]``),
        float64.
    """
    hc_eps, post_mult = _resolve(convention, hc_eps=hc_eps, post_mult=post_mult)
    x = _f64(x)
    H_pre = _sigmoid(_f64(h_pre_raw)) + hc_eps
    H_post = post_mult * _sigmoid(_f64(h_post_raw))
    H_res = sinkhorn_knopp_fwd(h_res_raw, num_iters, eps, convention)
    layer_in = stream_aggregate_fwd(x, H_pre)
    return layer_in, H_pre, H_post, H_res


def mhc_pre_op_bwd(grad_layer_in, grad_H_pre, grad_H_post, grad_H_res, x, h_pre_raw,
                   h_post_raw, h_res_raw, num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", convention="paper",
                   hc_eps=DEFAULT, post_mult=DEFAULT):
    """Backward of ``mhc_pre_op_fwd`` (OPS.md §7).

    With g = grad_layer_in, s_pre = sigmoid(h_pre_raw), s_post = sigmoid(h_post_raw):
        dx_i = H_pre_i g  (H_pre = s_pre + hc_eps);
        dh_pre_raw_i = (sum_c g_c x_ic + gH_pre_i) s_pre_i (1 - s_pre_i);
        dh_post_raw_i = gH_post_i post_mult s_post_i (1 - s_post_i);
        dh_res_raw = sinkhorn_knopp_bwd(gH_res, h_res_raw, num_iters, eps, grad_mode, convention).
    Any incoming gradient given as None counts as zero.

    Args:
        grad_layer_in: ``[..., C]`` or None.
        grad_H_pre, grad_H_post: ``[..., n]`` or None.
        grad_H_res: ``[..., n, n]`` or None.
        x: ``[..., n, C]``.
        h_pre_raw, h_post_raw: ``[..., n]``;  h_res_raw: ``[..., n, n]``.
        num_iters, eps, grad_mode, convention: as in ``sinkhorn_knopp_bwd``.
        hc_eps, post_mult: as in the forward.

    Returns:
        (dx ``[..., n, C]``, dh_pre_raw ``[..., n]``, dh_post_raw ``[..., n]``,
        dh_res_raw ``[..., n, n]``), float64.
    """
    _check_grad_mode(grad_mode)
    hc_eps, post_mult = _resolve(convention, hc_eps=hc_eps, post_mult=post_mult)
    x = _f64(x)
    h_pre_raw = _f64(h_pre_raw)
    h_post_raw = _f64(h_post_raw)
    h_res_raw = _f64(h_res_raw)
    s_pre = _sigmoid(h_pre_raw)
    s_post = _sigmoid(h_post_raw)
    H_pre = s_pre + hc_eps

    # d(loss)/d(H_pre): from layer_in and from the direct output gradient.
    dH_pre = np.zeros_like(H_pre)
    if grad_layer_in is not None:
        dx, dH_pre_li = stream_aggregate_bwd(grad_layer_in, x, H_pre)
        dH_pre = dH_pre + dH_pre_li
    else:
        dx = np.zeros_like(x)
    if grad_H_pre is not None:
        dH_pre = dH_pre + _f64(grad_H_pre)
    dh_pre_raw = dH_pre * s_pre * (1.0 - s_pre)

    if grad_H_post is not None:
        dh_post_raw = _f64(grad_H_post) * (post_mult * s_post) * (1.0 - s_post)
    else:
        dh_post_raw = np.zeros_like(s_post)

    if grad_H_res is not None:
        dh_res_raw = sinkhorn_knopp_bwd(grad_H_res, h_res_raw, num_iters, eps, grad_mode, convention)
    else:
        dh_res_raw = np.zeros_like(h_res_raw)
    return dx, dh_pre_raw, dh_post_raw, dh_res_raw
