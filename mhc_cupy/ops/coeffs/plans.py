"""The coefficient path's plans and public functions (OPS.md section 8, paper Eqs. 14-18): which
kernel family runs for which n (backward_layout), the forward and backward plans and the op specs."""

from __future__ import annotations

from ... import _convention, reference
from ..._convention import DEFAULT
from ..._dispatch import Plan, run
from ..spec import ALPHA, BIAS, H_POST_RAW, H_PRE_RAW, H_RES_RAW, PHI, X, Kernel, optional_grads
from .bwd import MmaBwd, launch_mma_bwd, launch_prep, mma_bwd, zero_param_grads
from .common import check, padded_row
from .fwd import launch_finish, launch_mma_gemm, mma_layout
from .split_bwd import SplitBwd, launch_split_bwd

#: dx and dphi in one tensor-core kernel for K <= 32 (n <= 4): dphi accumulators 16 * ceil(K / 8) per thread
_MMA_BWD_MAX_K = 32


def param_grad_plan(x_shape, dt: str, tokens: int, D: int, K: int, scratch: dict, body, ref) -> Plan:
    """The Plan of a backward giving (dx, dphi, dalpha, dbias): ``scratch`` name -> (shape, dtype),
    ``body(p, outs, scratch by name, stream)`` launching the kernels; with zero tokens the
    parameter gradients are zero-filled instead."""

    def run_kernels(p, outs, sc, stream):
        if tokens == 0:
            zero_param_grads(*outs[1:4], D, K, stream)
        else:
            body(p, outs, sc, stream)

    return Plan([(x_shape, dt), ((D, K), "float32"), ((3,), "float32"), ((K,), "float32")], run_kernels, ref,
                scratch=scratch, empty=False)


def backward_layout(tokens: int, n: int, C: int, K: int, dt: str):
    """The backward's dx / dphi layout: MmaBwd (one fused tensor-core kernel, K <= 32) or SplitBwd."""
    return mma_bwd(tokens, n, C, K) if K <= _MMA_BWD_MAX_K else SplitBwd(n, C, K, tokens, dt)


def launch_param_bwd(b, dt: str, **kwargs):
    """launch_mma_bwd or launch_split_bwd (keyword arguments), as backward_layout chose."""
    (launch_mma_bwd if isinstance(b, MmaBwd) else launch_split_bwd)(b, dt, **kwargs)



def _plan_fwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = check(infos, eps, False)
    mma = mma_layout(tokens, D, K, dt)
    scratch = {"part": ((mma.splits, tokens, K + 1), "float32"), "planes": mma.planes_shape}

    def run_kernels(p, outs, sc, stream):
        h_pre, h_post, h_res = outs
        launch_mma_gemm(dt, D, K, tokens, x=p["x"], phi=p["phi"], part=sc["part"], planes=sc["planes"], mma=mma,
                        stream=stream)
        launch_finish(tokens, D, n, K, eps, part=sc["part"], splits=mma.splits, alpha=p["alpha"], bias=p["bias"],
                      h_pre=h_pre, h_post=h_post, h_res=h_res, stats=None, stream=stream)

    return Plan([(lead + (n,), "float32"), (lead + (n,), "float32"), (lead + (n, n), "float32")], run_kernels,
                lambda a: reference.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], eps),
                scratch=scratch, empty=tokens == 0)


def _plan_bwd(infos, eps):
    dt, lead, n, C, D, K, tokens, eps = check(infos, eps, True)
    mma = mma_layout(tokens, D, K, dt)
    KP = padded_row(K)
    b = backward_layout(tokens, n, C, K, dt)
    scratch = {"part": ((mma.splits, tokens, K + 1), "float32"),  # raw H~ and sum of squares per D range
               "dH": ((tokens, KP), "float32"),  # dH | c
               "qa": ((tokens, 3), "float32"),  # per-token dalpha terms
               "planes": mma.planes_shape, **b.scratch()}  # phi split for the forward GEMM

    def body(p, outs, sc, stream):
        dx, dphi, dalpha, dbias = outs
        part, dH, qa = sc["part"], sc["dH"], sc["qa"]
        launch_mma_gemm(dt, D, K, tokens, x=p["x"], phi=p["phi"], part=part, planes=sc["planes"], mma=mma,
                        stream=stream)
        launch_prep(tokens, D, n, K, KP, eps, part=part, splits=mma.splits,
                    grads=(p["grad_h_pre_raw"], p["grad_h_post_raw"], p["grad_h_res_raw"]), alpha=p["alpha"], dH=dH,
                    qa=qa, dalpha=dalpha, dbias=dbias, stream=stream)
        launch_param_bwd(b, dt, x=p["x"], phi=p["phi"], dH=dH, KP=KP, dx=dx, dphi=dphi, sc=sc, stream=stream)

    def ref(a):
        return reference.mhc_coeffs_bwd(a["grad_h_pre_raw"], a["grad_h_post_raw"], a["grad_h_res_raw"], a["x"],
                                        a["phi"], a["alpha"], a["bias"], eps)

    return param_grad_plan(infos["x"].shape, dt, tokens, D, K, scratch, body, ref)


# ------------------------------------------------------------------ public
def mhc_coeffs_fwd(x, phi, alpha, bias, eps=DEFAULT, *, convention="paper"):
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
        eps: >= 0, added to the mean square (RMSNorm eps).  default 1e-5 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek"; keyword only.  The maths is the same under
            both (DeepSeek-V4's hc_fn is phi^T, hc_scale alpha, hc_base bias: OPS.md
            "DeepSeek-V4 convention"); only the default eps differs.

    Returns:
        (h_pre_raw float32 [..., n], h_post_raw float32 [..., n], h_res_raw float32 [..., n, n]).
        Feed them to :func:`mhc_cupy.mhc_pre_op_fwd`.

    Raises:
        TypeError: x not an activation dtype, or phi / alpha / bias not float32.
        ValueError: shapes disagree, n out of range, C = 0, arrays on different devices, bad convention.

    Notes:
        Float32 accumulation in a fixed order (no atomics): bitwise reproducible.
        Zero tokens return empty outputs and launch nothing.  One or two
        launches on the caller's current stream; the backward recomputes
        everything from x (nothing but the inputs needs saving).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_coeffs`` for gradients.
    """
    return run(_plan_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias}, eps=_convention.resolve(convention,
                                                                                                     rms_eps=eps))


def mhc_coeffs_bwd(grad_h_pre_raw, grad_h_post_raw, grad_h_res_raw, x, phi, alpha, bias, eps=DEFAULT, *,
                   convention="paper"):
    """Gradient of :func:`mhc_coeffs_fwd` (OPS.md section 8).

    With g = [g_pre | g_post | vec(g_res)] per token, g' = alpha_grp g and r, H~ recomputed from x:
    dH = g' / r;  dx~ = dH @ phi^T - x~ sum_k(g'_k H~_k) / (D r^3);  dphi = sum_tokens x~^T dH;
    dalpha_j = sum_tokens sum_{k in group j} g_k H~_k / r;  dbias = sum_tokens g.

    Args:
        grad_h_pre_raw, grad_h_post_raw: float32 [..., n], or None (= zero).
        grad_h_res_raw: float32 [..., n, n], or None (= zero).
        x, phi, alpha, bias, eps, convention: as given to the forward.

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
               eps=_convention.resolve(convention, rms_eps=eps))


# ------------------------------------------------------------------ op spec
_INPUTS = (X, PHI, ALPHA, BIAS)
_RAW = (H_PRE_RAW, H_POST_RAW, H_RES_RAW)
KERNELS = (
    Kernel("mhc_coeffs_fwd", _plan_fwd, _INPUTS, _RAW, params={"eps": 1e-5}),
    Kernel("mhc_coeffs_bwd", _plan_bwd, _INPUTS, _INPUTS,
           grads=optional_grads(*_RAW), params={"eps": 1e-5}),
)
