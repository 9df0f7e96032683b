"""The mHC coefficient path: raw coefficients from the residual stream (OPS.md section 8,
paper Eqs. 14-18), ``kernels_cu/coeffs.cu``.

Per token: H~ = vec(x) @ phi, r = sqrt(mean(vec(x)^2) + eps), h = alpha_grp H~ / r + bias,
split into h_pre_raw [n], h_post_raw [n], h_res_raw [n, n].  The launch layout
(column chunks, D ranges, token splits) depends only on shapes and is the same
on every device, so results are bitwise reproducible for given shapes.
"""

from __future__ import annotations

from .. import _checks, reference
from .._dispatch import Plan, run
from ._launch import CTYPE, MAX_GRID, column_sum, f32, i32, launch, tokens_of, vec_width
from .stream import check_x

_FILE = "coeffs.cu"
_NT = 256  # threads per block of the GEMM kernels (kernels_cu/coeffs.cu NT)
_WARPS = _NT // 32
_TT = 4  # tokens per warp of the forward GEMM
_KC = 24  # at most this many columns of phi per block (accumulators per thread ~ TT * (KC + 1))
_FUSED_K = 24  # K <= this: dx and dphi in one kernel (n <= 4)
_TS = 32  # tokens of dH staged per step of the backward (kernels_cu/coeffs.cu TS)
_DX_KC = 16  # columns per chunk of the general dx kernel
#: Widest x access (elements) of the backward kernels.  The fused kernel keeps 2 * E * K
#: floats per thread: E = 1 (100 registers, 2 blocks per SM) measured ~8% faster than
#: E = 2 (158 registers) on an H200 (n = 4, C = 4096, bf16).
_FUSED_E = 1
_BWD_E = 2
#: D positions per step of the widest forward (32 lanes x 4); D ranges are multiples of it.
_D_UNIT = 128
#: Block count the D / token splits aim for.  A constant (not the SM count) so the
#: summation order, hence every bit of the result, is the same on every GPU.
_TARGET_BLOCKS = 512
_MIN_STEPS_PER_RANGE = 4  # a D range spans at least this many _D_UNITs
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
_MAX_PARTIAL_FLOATS = 16 * 2**20  # dphi partials of the backward: at most 64 MiB
_MAX_I32 = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def columns(n: int) -> int:
    """K = n*n + 2n columns of phi (pre | post | res)."""
    return n * n + 2 * n


def column_chunk(K: int, limit: int | None = None) -> int:
    """Columns per chunk: K split into ceil(K / limit) nearly equal chunks (limit: _KC)."""
    limit = _KC if limit is None else limit
    return _cdiv(K, _cdiv(K, limit))


def padded_row(K: int) -> int:
    """Row stride of dH [T, K+1] (column K holds c), rounded up to a multiple of 4."""
    return _cdiv(K + 1, 4) * 4


# ------------------------------------------------------------------ checks
def _check(infos, eps, with_grads: bool):
    dt, lead, n, C = check_x("x", infos["x"])
    if C == 0:
        raise ValueError(f"x has shape {tuple(infos['x'].shape)}; mhc_coeffs needs C >= 1 "
                         "(the RMS of an empty vector is undefined)")
    D, K = n * C, columns(n)
    if D > _MAX_I32:
        raise ValueError(f"x has n * C = {D}; mhc_coeffs supports n * C < 2^31")
    for name, shape, why in (("phi", (D, K), "[n*C, n*n + 2n] with n, C of x; columns pre | post | res"),
                             ("alpha", (3,), "(alpha_pre, alpha_post, alpha_res)"),
                             ("bias", (K,), "[n*n + 2n], the column order of phi")):
        _checks.coefficient(name, infos[name])
        _checks.expect_shape(name, infos[name].shape, shape, why)
    if with_grads:
        for name, shape in (("grad_h_pre_raw", lead + (n,)), ("grad_h_post_raw", lead + (n,)),
                            ("grad_h_res_raw", lead + (n, n))):
            if infos[name] is not None:
                _checks.coefficient(name, infos[name])
                _checks.expect_shape(name, infos[name].shape, shape, "the shape of the forward output")
    return dt, lead, n, C, D, K, tokens_of(lead), _checks.eps("eps", eps)


# ---------------------------------------------------------- forward GEMM layout
def gemm_layout(tokens: int, D: int, K: int):
    """(KC, ncc, tiles, splits, d_split) of mhc_coeffs_fwd_kernel.

    The D range of a block (d_split, a multiple of _D_UNIT) is split only when
    the token tiles x column chunks give fewer than _TARGET_BLOCKS blocks, and
    never below _MIN_STEPS_PER_RANGE units per range.
    """
    KC = column_chunk(K)
    ncc = _cdiv(K, KC)
    tiles = max(1, _cdiv(tokens, _WARPS * _TT))
    units = _cdiv(D, _D_UNIT)
    want = _cdiv(_TARGET_BLOCKS, ncc * tiles)
    splits = max(1, min(want, units // _MIN_STEPS_PER_RANGE, _MAX_SPLITS))
    per = _cdiv(units, splits)
    splits = _cdiv(units, per)  # no empty range
    if ncc * tiles * splits > MAX_GRID:
        raise ValueError(f"x has {tokens} tokens; mhc_coeffs supports at most "
                         f"{MAX_GRID // (ncc * splits) * _WARPS * _TT} tokens at this n")
    return KC, ncc, tiles, splits, per * _D_UNIT


def launch_gemm(dt, n, D, K, tokens, x, phi, alpha, bias, outs, part, layout, eps, stream):
    """H~ and the sum of squares: finished outputs (part None) or raw sums into part."""
    KC, ncc, tiles, splits, d_split = layout
    E = vec_width(1, D, [(x, dt)], budget=4)
    h_pre, h_post, h_res = outs if outs is not None else (None, None, None)
    launch(_FILE, f"mhc_coeffs_fwd_kernel<{CTYPE[dt]},{E},{_TT},{KC}>", (ncc * tiles * splits, 1, 1), (_NT, 1, 1),
           (x, phi, alpha, bias, h_pre, h_post, h_res, part, tokens, i32(D), i32(n), i32(K), i32(ncc), tiles,
            i32(d_split), f32(eps)), stream)


def _zero(ptr, count: int, stream, offset: int = 0) -> None:
    """float32 zeros over ptr[offset : offset + count]."""
    if count:
        launch(_FILE, "mhc_coeffs_zero_kernel", (min(_cdiv(count, _NT), 1024), 1, 1), (_NT, 1, 1),
               (ptr + 4 * offset, count), stream)


def _plan_fwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = _check(infos, eps, False)
    layout = gemm_layout(tokens, D, K)
    splits = layout[3]
    scratch = [((splits, tokens, K + 1), "float32")] if splits > 1 else []

    def run_kernels(p, outs, s, stream):
        part = s[0] if splits > 1 else None
        launch_gemm(dt, n, D, K, tokens, p["x"], p["phi"], p["alpha"], p["bias"], outs, part, layout, eps, stream)
        if splits > 1:
            launch(_FILE, "mhc_coeffs_fwd_finish_kernel", (min(_cdiv(tokens * K, _NT), MAX_GRID), 1, 1), (_NT, 1, 1),
                   (part, p["alpha"], p["bias"], *outs, tokens, i32(D), i32(n), i32(K), i32(splits), f32(eps)), stream)

    return Plan([(lead + (n,), "float32"), (lead + (n,), "float32"), (lead + (n, n), "float32")], run_kernels,
                lambda a: reference.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], eps),
                scratch=scratch, empty=tokens == 0)


# ----------------------------------------------------------------- backward
def token_splits(tokens: int, D: int, K: int, col_chunks: int) -> tuple[int, int]:
    """(splits, tokens per split) of the dphi reduction: enough blocks to fill
    the GPU, partials [splits, D, K] of at most _MAX_PARTIAL_FLOATS floats."""
    dblocks = _cdiv(D, _NT * 2)
    splits = _cdiv(_TARGET_BLOCKS, dblocks * col_chunks)
    splits = min(splits, _cdiv(tokens, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS, _MAX_PARTIAL_FLOATS // (D * K))
    splits = max(1, splits)
    per = _cdiv(max(tokens, 1), splits)
    return _cdiv(max(tokens, 1), per), per


def _plan_bwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = _check(infos, eps, True)
    layout = gemm_layout(tokens, D, K)
    splits = layout[3]
    KP = padded_row(K)
    fused = K <= _FUSED_K
    kc_phi = K if fused else column_chunk(K)
    ncc_phi = _cdiv(K, kc_phi)
    t_splits, t_split = token_splits(tokens, D, K, ncc_phi)
    scratch = [((splits, tokens, K + 1), "float32"),  # 0: raw H~ and sum of squares per D range
               ((tokens, KP), "float32"),  # 1: dH | c
               ((tokens, 3), "float32")]  # 2: per-token dalpha terms
    if t_splits > 1:
        scratch.append(((t_splits, D, K), "float32"))  # 3: dphi partials
    if not fused:
        scratch.append(((K, D), "float32"))  # last: phi transposed
    outputs = [(infos["x"].shape, dt), ((D, K), "float32"), ((3,), "float32"), ((K,), "float32")]
    grads = (("grad_h_pre_raw", 0, n), ("grad_h_post_raw", n, n), ("grad_h_res_raw", 2 * n, n * n))

    def run_kernels(p, outs, s, stream):
        dx, dphi, dalpha, dbias = outs
        if tokens == 0:
            for ptr, count in ((dphi, D * K), (dalpha, 3), (dbias, K)):
                _zero(ptr, count, stream)
            return
        part, dH, qa = s[0], s[1], s[2]
        launch_gemm(dt, n, D, K, tokens, p["x"], p["phi"], None, None, None, part, layout, eps, stream)
        warps_grid = min(_cdiv(tokens, _WARPS), MAX_GRID)
        launch(_FILE, "mhc_coeffs_bwd_prep_kernel", (warps_grid, 1, 1), (_NT, 1, 1),
               (part, p["grad_h_pre_raw"], p["grad_h_post_raw"], p["grad_h_res_raw"], p["alpha"], dH, qa, tokens,
                i32(D), i32(n), i32(K), i32(KP), i32(splits), f32(eps)), stream)
        column_sum(qa, dalpha, tokens, 3, stream)
        for name, offset, cols in grads:
            if p[name] is None:
                _zero(dbias, cols, stream, offset)
            else:
                column_sum(p[name], dbias + 4 * offset, tokens, cols, stream)
        dphi_out = s[3] if t_splits > 1 else dphi
        E = vec_width(1, D, [(p["x"], dt), (dx, dt)], budget=_FUSED_E if fused else _BWD_E)
        dblocks = _cdiv(D, _NT * E)
        if fused:
            launch(_FILE, f"mhc_coeffs_bwd_fused_kernel<{CTYPE[dt]},{E},{K}>", (dblocks, t_splits, 1), (_NT, 1, 1),
                   (p["x"], p["phi"], dH, dx, dphi_out, tokens, i32(D), t_split), stream)
        else:
            phi_t = s[-1]
            launch(_FILE, "mhc_coeffs_transpose_kernel", (_cdiv(D, 32), _cdiv(K, 32), 1), (32, 8, 1),
                   (p["phi"], phi_t, i32(D), i32(K)), stream)
            launch(_FILE, f"mhc_coeffs_bwd_dx_kernel<{CTYPE[dt]},{E},{_DX_KC}>",
                   (dblocks * _cdiv(tokens, _TS), 1, 1), (_NT, 1, 1),
                   (p["x"], phi_t, dH, dx, tokens, i32(D), i32(K), i32(KP), i32(dblocks)), stream)
            launch(_FILE, f"mhc_coeffs_bwd_dphi_kernel<{CTYPE[dt]},{E},{kc_phi}>",
                   (ncc_phi * dblocks * t_splits, 1, 1), (_NT, 1, 1),
                   (p["x"], dH, dphi_out, tokens, i32(D), i32(K), i32(KP), i32(ncc_phi), i32(dblocks), t_split),
                   stream)
        if t_splits > 1:
            column_sum(dphi_out, dphi, t_splits, D * K, stream)

    def ref(a):
        return reference.mhc_coeffs_bwd(a["grad_h_pre_raw"], a["grad_h_post_raw"], a["grad_h_res_raw"], a["x"],
                                        a["phi"], a["alpha"], a["bias"], eps)

    return Plan(outputs, run_kernels, ref, scratch=scratch, empty=False)


# ------------------------------------------------------------------ public
def mhc_coeffs_fwd(x, phi, alpha, bias, eps=1e-5):
    """Raw mHC coefficients of each token from its residual stream (OPS.md section 8, paper Eqs. 14-18).

    With x~ = vec(x_t) (length D = n*C), H~ = x~ @ phi and r = sqrt(mean(x~^2) + eps):
    h_pre_raw = alpha[0] H~[:n] / r + bias[:n];  h_post_raw = alpha[1] H~[n:2n] / r + bias[n:2n];
    h_res_raw = alpha[2] H~[2n:] / r + bias[2n:], reshaped row-major to [n, n].
    The GEMM and the sum of squares share one read of x (the division by r comes after).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32, C >= 1.
        phi: float32 [n*C, n*n + 2n], columns ordered pre | post | res.
        alpha: float32 [3] = (alpha_pre, alpha_post, alpha_res).
        bias: float32 [n*n + 2n], the column order of phi.
        eps: >= 0, added to the mean square (RMSNorm eps).  Default 1e-5.

    Returns:
        (h_pre_raw float32 [..., n], h_post_raw float32 [..., n], h_res_raw float32 [..., n, n]).
        Feed them to :func:`mhc_cupy.mhc_pre_op_fwd`.

    Raises:
        TypeError: x not an activation dtype, or phi / alpha / bias not float32.
        ValueError: shapes disagree, n out of range, C = 0, arrays on different devices.

    Notes:
        Float32 accumulation in a fixed order (no atomics): bitwise reproducible.
        Zero tokens return empty outputs and launch nothing.  One or two
        launches on the caller's current stream; the backward recomputes
        everything from x (nothing but the inputs needs saving).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_coeffs`` for gradients.
    """
    return run(_plan_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias}, eps=eps)


def mhc_coeffs_bwd(grad_h_pre_raw, grad_h_post_raw, grad_h_res_raw, x, phi, alpha, bias, eps=1e-5):
    """Gradient of :func:`mhc_coeffs_fwd` (OPS.md section 8).

    With g = [g_pre | g_post | vec(g_res)] per token, g' = alpha_grp g and r, H~ recomputed from x:
    dH = g' / r;  dx~ = dH @ phi^T - x~ sum_k(g'_k H~_k) / (D r^3);  dphi = sum_tokens x~^T dH;
    dalpha_j = sum_tokens sum_{k in group j} g_k H~_k / r;  dbias = sum_tokens g.

    Args:
        grad_h_pre_raw, grad_h_post_raw: float32 [..., n], or None (= zero).
        grad_h_res_raw: float32 [..., n, n], or None (= zero).
        x, phi, alpha, bias, eps: as given to the forward.

    Returns:
        (dx [..., n, C] dtype of x, dphi float32 [n*C, n*n + 2n], dalpha float32 [3],
        dbias float32 [n*n + 2n]).

    Raises:
        TypeError / ValueError: as the forward; a gradient of the wrong dtype or shape.

    Notes:
        Sums over tokens (dphi, dalpha, dbias) are per-block partials added in
        a fixed order: bitwise reproducible, no atomics.  Zero tokens give an
        empty dx and zero parameter gradients.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_coeffs`` for gradients.
    """
    return run(_plan_bwd, {"grad_h_pre_raw": grad_h_pre_raw, "grad_h_post_raw": grad_h_post_raw,
                           "grad_h_res_raw": grad_h_res_raw, "x": x, "phi": phi, "alpha": alpha, "bias": bias},
               eps=eps)
