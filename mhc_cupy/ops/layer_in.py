"""The layer's pre piece with layer_in in the form the next GEMM takes (OPS.md section 13; inference:
forward only), fused into the aggregate, ``kernels_cu/stream.cu``:

    normed, rstd, H_pre, H_post, H_res, stats = mhc_layer_pre_norm_fwd(x, phi, alpha, bias, norm_weight)
    q, scale, H_pre, H_post, H_res, stats = mhc_layer_pre_fp8_fwd(x, phi, alpha, bias[, norm_weight])

``normed`` is layer_in RMS-normalised with the sublayer's own pre-norm weight (x's dtype); ``q`` is
layer_in (or, given ``norm_weight``, ``normed``) in float8 e4m3 with one float32 scale per token,
layer_in ~= q * scale: what ``torch._scaled_mm`` takes as its first operand and ``scale_a``.  Both are
computed from layer_in as ``mhc_layer_pre_fwd`` stores it (x's dtype, its bits), so each op equals
the unfused chain (mhc_layer_pre_fwd, then the RMSNorm / quantisation of OPS.md section 13) and
H_pre, H_post, H_res, stats are mhc_layer_pre_fwd's, bitwise.  One kernel
(``mhc_stream_aggregate_out_kernel``) replaces the aggregate: the row reductions (sum of squares,
amax) and their second passes in one block per token, the row kept in shared memory.  Under the kernel
choice ``small`` (at most 64 tokens) the GEMV and the tail kernel run first (the tail's layer_in goes
to scratch), then this kernel: three launches (under ``tail``: phi's planes, the tensor-core GEMM, the tail
kernel, then this kernel: four).  On a GPU the kernel runs only under the kernel choice
``layer_in`` (off by default until a GPU run has checked it; else NotImplementedError).
"""

from __future__ import annotations

from .. import _checks, reference
from .._convention import DEFAULT
from .._dispatch import Plan, run
from .._kernel_choice import current as current_choice
from .._settings import LayerSettings
from ._launch import CTYPE, ITEMSIZE, f32, grid_for, i32, i64, launch, threads_for, vec_width
from .layer import _PARAMS, _STATS, pre_outputs, pre_piece
from .spec import ALPHA, BIAS, H_POST, H_PRE, H_RES, PHI, X, Arg, Kernel

#: Rows kept in shared memory between the kernel's passes, at most (bytes; C <= 16384 at 16 bits):
#: 7 blocks of 256 threads still fit an SM's 228 KiB.  Longer rows are recomputed from x each pass.
KEEP_MAX_BYTES = 32 * 1024
#: norm_eps's default (DeepSeek-V3's RMSNorm eps).
NORM_EPS = 1e-6


def keeps_row(C: int, dt: str) -> bool:
    """Whether mhc_stream_aggregate_out_kernel keeps a row of C elements of ``dt`` in shared memory."""
    return C * ITEMSIZE[dt] <= KEEP_MAX_BYTES


def launch_aggregate_out(dt, n, C, tokens, *, x, h, w, out, q, stat, eps, stream):
    """layer_in = sum_i h_i x_i (h per token [T, n]) then, with ``w`` (float32 [C]), its RMSNorm into
    ``out`` (x's dtype) or, with ``q``, its float8 e4m3 bits into ``q`` ([T, C] bytes) after the
    RMSNorm where ``w`` is given; ``stat`` [T] float32: rstd (RMSNorm alone) or the scale."""
    # with the RMSNorm (w), q's bytes counted as x's dtype: the vector width, and so the order of the sum of
    # squares (rstd's bits), is then the same whether the normed row is written (out) or quantised (q), so
    # that the float8 form quantises the bits mhc_layer_pre_norm_fwd returns (a 1-byte q allowed twice the
    # width); without it (amax alone, independent of the order) q keeps its own, wider accesses
    E = vec_width(n, C, [(x, dt), (out, dt), (w, "float32"), (q, dt if w is not None else "float8_e4m3fn")])
    keep = keeps_row(C, dt)
    expr = (f"mhc_stream_aggregate_out_kernel<{CTYPE[dt]},{n},{E},{'true' if w is not None else 'false'},"
            f"{'true' if q is not None else 'false'}>")
    launch("stream.cu", expr, grid_for(tokens), (threads_for(C, E), 1, 1),
           (x, h, w, out, q, stat, i64(tokens), i32(C), f32(eps), i32(keep)), stream, C * ITEMSIZE[dt] if keep else 0)


def _plan(infos, s: LayerSettings, norm_eps, fp8: bool):
    pp = pre_piece(infos, s)
    dt, lead, n, C, K, tokens = pp.dt, pp.lead, pp.n, pp.C, pp.K, pp.tokens
    w = infos["norm_weight"]  # (None only where optional, the fp8 form: the dispatch refuses it elsewhere)
    if w is not None:
        _checks.coefficient("norm_weight", w)
        _checks.expect_shape("norm_weight", w.shape, (C,), "one weight per element of layer_in [..., C]")
    norm_eps = _checks.eps("norm_eps", norm_eps)
    scratch = pp.scratch()
    if pp.tail:  # the tail kernel's layer_in, recomputed by the out kernel
        scratch["layer_in"] = ((tokens, C), dt)
    outputs = [(lead + (C,), "float8_e4m3fn" if fp8 else dt), (lead + (1,), "float32")] + \
        pre_outputs(lead, n, C, K, dt)[1:]

    gpu_ok = current_choice().runs("layer_in")

    def run_kernels(p, outs, sc, stream):
        if not gpu_ok:
            raise NotImplementedError(
                f"mhc_layer_pre_{'fp8' if fp8 else 'norm'}_fwd on a GPU: its kernel (mhc_stream_aggregate_out_kernel) "
                "has not been checked on a GPU yet, so it runs only under "
                "mhc_cupy._kernel_choice.kernel_choice(layer_in=True); CPU inputs run the reference")
        row, stat, *pre = outs

        def aggregate(H_pre):
            launch_aggregate_out(dt, n, C, tokens, x=p["x"], h=H_pre, w=p["norm_weight"], out=None if fp8 else row,
                                 q=row if fp8 else None, stat=stat, eps=norm_eps, stream=stream)

        pp.launch(s, p, (sc.get("layer_in"), *pre), sc, stream, aggregate)

    op = reference.mhc_layer_pre_fp8_fwd if fp8 else reference.mhc_layer_pre_norm_fwd

    def ref(a):
        return op(a["x"], a["phi"], a["alpha"], a["bias"], a["norm_weight"], s.num_iters, s.eps, pp.rms_eps,
                  s.convention, s.hc_eps, s.post_mult, norm_eps)

    return Plan(outputs, run_kernels, ref, scratch=scratch, empty=tokens == 0)


def _plan_norm_fwd(infos, settings: LayerSettings | None = None, norm_eps=NORM_EPS, **params):
    """Planner of mhc_layer_pre_norm_fwd: the layer's settings resolved (``settings``) or by name."""
    return _plan(infos, LayerSettings.resolve(**params) if settings is None else settings, norm_eps, False)


def _plan_fp8_fwd(infos, settings: LayerSettings | None = None, norm_eps=NORM_EPS, **params):
    """Planner of mhc_layer_pre_fp8_fwd: the layer's settings resolved (``settings``) or by name."""
    return _plan(infos, LayerSettings.resolve(**params) if settings is None else settings, norm_eps, True)


def mhc_layer_pre_norm_fwd(x, phi, alpha, bias, norm_weight, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, *,
                           convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT, norm_eps=NORM_EPS):
    """mhc_layer_pre_fwd with layer_in RMS-normalised by the sublayer's pre-norm (OPS.md section 13).

    With v = layer_in as mhc_layer_pre_fwd stores it (x's dtype): rstd = 1 / sqrt(mean(v^2) + norm_eps)
    (a float32 sum of squares), layer_in_normed = round((v * rstd) * norm_weight) (float32 products, one
    rounding to x's dtype), computed in the kernel that writes layer_in otherwise.

    Args:
        x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult: as
            :func:`mhc_layer_pre_fwd` (the last three keyword only).
        norm_weight: float32 [C], the sublayer's RMSNorm weight (ones for none).
        norm_eps: the RMSNorm's eps, finite and >= 0 (default 1e-6; keyword only).

    Returns:
        (layer_in_normed [..., C] dtype of x, rstd float32 [..., 1], H_pre, H_post, H_res, stats):
        H_pre, H_post, H_res, stats as mhc_layer_pre_fwd gives them, bitwise.

    Raises:
        TypeError: as mhc_layer_pre_fwd; norm_weight None or not float32.  ValueError: as
        mhc_layer_pre_fwd; norm_weight not [C]; norm_eps negative or not finite.

    Autograd: none (inference).  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op); to train, use ``mhc_cupy.torch.mhc_layer_pre``.
    """
    return run(_plan_norm_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias, "norm_weight": norm_weight},
               num_iters=num_iters, eps=eps, rms_eps=rms_eps, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult, norm_eps=norm_eps)


def mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, norm_weight=None, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, *,
                          convention="paper", hc_eps=DEFAULT, post_mult=DEFAULT, norm_eps=NORM_EPS):
    """mhc_layer_pre_fwd with layer_in as float8 e4m3, one scale per token (OPS.md section 13).

    With u = layer_in as mhc_layer_pre_fwd stores it (x's dtype) or, given norm_weight,
    :func:`mhc_layer_pre_norm_fwd`'s layer_in_normed: scale = max|u| / 448 in float32 (1 where that is
    0; NaN where some u is), layer_in_fp8 = e4m3(u / scale): the float32 quotient rounded to nearest
    even, saturating at +-448.  So u ~= layer_in_fp8 * scale: ``torch._scaled_mm``'s first operand
    and its row-wise ``scale_a``.

    Args:
        x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult: as
            :func:`mhc_layer_pre_fwd` (the last three keyword only).
        norm_weight: None (default: layer_in itself), or float32 [C]: the RMSNorm first.
        norm_eps: the RMSNorm's eps, finite and >= 0 (default 1e-6; keyword only).

    Returns:
        (layer_in_fp8 [..., C] float8 e4m3fn (torch.float8_e4m3fn, jnp.float8_e4m3fn,
        ml_dtypes.float8_e4m3fn; CuPy, which has no float8 dtype: its uint8 bits), scale float32
        [..., 1], H_pre, H_post, H_res, stats): H_pre, H_post, H_res, stats as mhc_layer_pre_fwd gives
        them, bitwise.

    Raises:
        TypeError: as mhc_layer_pre_fwd; norm_weight not float32.  ValueError: as mhc_layer_pre_fwd;
        norm_weight not [C]; norm_eps negative or not finite.

    Autograd: none (inference).  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op); to train, use ``mhc_cupy.torch.mhc_layer_pre``.
    """
    return run(_plan_fp8_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias, "norm_weight": norm_weight},
               num_iters=num_iters, eps=eps, rms_eps=rms_eps, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult, norm_eps=norm_eps)


# ------------------------------------------------------------------ op spec
_NORM_WEIGHT = Arg("norm_weight", "C", "parameter")
_PRE_IN = (X, PHI, ALPHA, BIAS)
_PRE_OUT = (H_PRE, H_POST, H_RES, _STATS)
_OUT_PARAMS = {**_PARAMS, "norm_eps": NORM_EPS}
KERNELS = (
    Kernel("mhc_layer_pre_norm_fwd", _plan_norm_fwd, _PRE_IN + (_NORM_WEIGHT,),
           (Arg("layer_in_normed", "...C", "activation"), Arg("rstd", "...1", "coefficient")) + _PRE_OUT,
           params=_OUT_PARAMS),
    Kernel("mhc_layer_pre_fp8_fwd", _plan_fp8_fwd, _PRE_IN + (Arg("norm_weight", "C", "parameter", optional=True),),
           (Arg("layer_in_fp8", "...C", "fp8"), Arg("scale", "...1", "coefficient")) + _PRE_OUT, params=_OUT_PARAMS),
)
