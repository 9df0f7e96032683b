"""mHC pre op: coefficient activations and the layer input (OPS.md section 7, paper Eq. 8)."""

from __future__ import annotations

from .. import _checks, reference
from .._convention import DEFAULT
from .._settings import LayerSettings, takes_settings
from .._dispatch import Plan, run
from ._launch import tokens_of
from .sinkhorn import bwd_history, launch_bwd, launch_fwd
from .stream import check_grad, check_h, check_matrix, check_x, launch_aggregate_bwd, launch_aggregate_fwd
from .spec import (ACTIVATION_PARAMS, GRAD_MODE, H_POST, H_POST_RAW, H_PRE, H_PRE_RAW, H_RES, H_RES_RAW, LAYER_IN,
                   SINKHORN_PARAMS, X, Kernel, optional_grads)


def _check(infos):
    dt, lead, n, C = check_x("x", infos["x"])
    check_h("h_pre_raw", infos["h_pre_raw"], lead, n, False, infos["x"].shape)
    check_h("h_post_raw", infos["h_post_raw"], lead, n, False, infos["x"].shape)
    check_matrix("h_res_raw", infos["h_res_raw"], lead, n, infos["x"].shape)
    return dt, lead, n, C, tokens_of(lead)


@takes_settings
def _plan_fwd(infos, s: LayerSettings):
    dt, lead, n, C, tokens = _check(infos)
    iters, eps, ds, hc_eps, post_mult = s.num_iters, s.eps, s.deepseek, s.hc_eps, s.post_mult

    def run_kernels(p, outs, sc, stream):
        layer_in, H_pre, H_post, H_res = outs
        launch_fwd(n, tokens, iters, eps, logits=p["h_res_raw"], P=H_res, stream=stream, h_pre_raw=p["h_pre_raw"],
                   h_post_raw=p["h_post_raw"], H_pre=H_pre, H_post=H_post, ds=ds, hc_eps=hc_eps, post_mult=post_mult)
        if C:
            launch_aggregate_fwd(dt, n, C, tokens, x=p["x"], h=H_pre, h_stride=n, out=layer_in, stream=stream)

    return Plan([(lead + (C,), dt), (lead + (n,), "float32"), (lead + (n,), "float32"), (lead + (n, n), "float32")],
                run_kernels,
                lambda a: reference.mhc_pre_op_fwd(a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"], iters, eps,
                                                   s.convention, hc_eps, post_mult),
                empty=tokens == 0)


@takes_settings
def _plan_bwd(infos, s: LayerSettings):
    dt, lead, n, C, tokens = _check(infos)
    iters, eps, ds, hc_eps, post_mult, mode = s.num_iters, s.eps, s.deepseek, s.hc_eps, s.post_mult, s.grad_mode
    g = infos["grad_layer_in"]
    tg = check_grad("grad_layer_in", g, lead + (C,), dt) if g is not None else dt
    for name, shape in (("grad_H_pre", lead + (n,)), ("grad_H_post", lead + (n,)), ("grad_H_res", lead + (n, n))):
        if infos[name] is not None:
            _checks.coefficient(name, infos[name])
            _checks.expect_shape(name, infos[name].shape, shape, "the shape of the forward output")
    hist = bwd_history(n, tokens, iters, mode)[2] if infos["grad_H_res"] is not None else 0
    scratch = {"hist": ((hist,), "float32")} if hist else {}

    def run_kernels(p, outs, sc, stream):
        dx, dh_pre, dh_post, dh_res = outs
        launch_bwd(n, tokens, iters, eps, mode, grad_P=p["grad_H_res"], logits=p["h_res_raw"], d_logits=dh_res,
                   hist=sc.get("hist"), stream=stream, g_post=p["grad_H_post"], h_post_raw=p["h_post_raw"],
                   d_post_raw=dh_post, ds=ds, post_mult=post_mult)
        launch_aggregate_bwd(dt, tg, n, C, tokens, g=p["grad_layer_in"], x=p["x"], h=p["h_pre_raw"], h_stride=n, dx=dx,
                             dh=dh_pre, stream=stream, act=1, gh=p["grad_H_pre"], shift=hc_eps)  # null g: zero

    def ref(a):
        return reference.mhc_pre_op_bwd(a["grad_layer_in"], a["grad_H_pre"], a["grad_H_post"], a["grad_H_res"],
                                        a["x"], a["h_pre_raw"], a["h_post_raw"], a["h_res_raw"], iters, eps, mode,
                                        s.convention, hc_eps, post_mult)

    return Plan([(infos["x"].shape, dt), (lead + (n,), "float32"), (lead + (n,), "float32"),
                 (lead + (n, n), "float32")], run_kernels, ref, scratch=scratch, empty=tokens == 0)


def mhc_pre_op_fwd(x, h_pre_raw, h_post_raw, h_res_raw, num_iters=DEFAULT, eps=DEFAULT, *, convention="paper",
                   hc_eps=DEFAULT, post_mult=DEFAULT):
    """Coefficient activations and layer input of an mHC layer (OPS.md section 7, paper Eq. 8).

    H_pre = sigmoid(h_pre_raw) + hc_eps;  H_post = post_mult sigmoid(h_post_raw);
    H_res = sinkhorn_knopp(h_res_raw, num_iters, eps, convention);  layer_in = sum_i H_pre_i x_i.
    The paper's activations are hc_eps = 0, post_mult = 2; DeepSeek-V4's hc_eps = 1e-6, post_mult = 2
    (OPS.md "DeepSeek-V4 convention").

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32.
        h_pre_raw, h_post_raw: float32 [..., n] per token.
        h_res_raw: float32 [..., n, n] per token.
        num_iters: Sinkhorn iterations; default 20.
        eps: Sinkhorn eps; default 1e-8 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek"; keyword only, as the rest.
        hc_eps: added to H_pre, finite >= 0; default 0 (paper) / 1e-6 (deepseek).
        post_mult: scale of H_post, finite >= 0; default 2.

    Returns:
        (layer_in [..., C] dtype of x, H_pre float32 [..., n], H_post float32 [..., n],
        H_res float32 [..., n, n]).

    Notes:
        Two launches on the caller's stream: the per-token coefficients (one
        thread per token), then the weighted stream sum.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_pre_op`` for gradients.
    """
    return run(_plan_fwd, {"x": x, "h_pre_raw": h_pre_raw, "h_post_raw": h_post_raw, "h_res_raw": h_res_raw},
               num_iters=num_iters, eps=eps, convention=convention, hc_eps=hc_eps, post_mult=post_mult)


def mhc_pre_op_bwd(grad_layer_in, grad_H_pre, grad_H_post, grad_H_res, x, h_pre_raw, h_post_raw, h_res_raw,
                   num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", *, convention="paper", hc_eps=DEFAULT,
                   post_mult=DEFAULT):
    """Gradient of :func:`mhc_pre_op_fwd` (OPS.md section 7).

    With s = sigmoid(h_pre_raw), s' = sigmoid(h_post_raw):
    dx_i = H_pre_i g;  dh_pre_raw_i = (sum_c g_c x_ic + gH_pre_i) s_i (1 - s_i);
    dh_post_raw_i = gH_post_i post_mult s'_i (1 - s'_i);
    dh_res_raw = sinkhorn_knopp_bwd(gH_res, h_res_raw, num_iters, eps, grad_mode, convention).
    Any of the four incoming gradients may be None (= zero).  Everything is
    recomputed from x and the raw coefficients.

    Args:
        grad_layer_in: [..., C], dtype of x or float32, or None.
        grad_H_pre, grad_H_post: float32 [..., n] or None.
        grad_H_res: float32 [..., n, n] or None.
        x, h_pre_raw, h_post_raw, h_res_raw, num_iters, eps, convention, hc_eps, post_mult: as given
            to the forward.
        grad_mode: Sinkhorn gradient, "unrolled" (default) or "implicit".

    Returns:
        (dx [..., n, C] dtype of x, dh_pre_raw, dh_post_raw float32 [..., n], dh_res_raw float32 [..., n, n]).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_pre_op`` for gradients.
    """
    return run(_plan_bwd, {"grad_layer_in": grad_layer_in, "grad_H_pre": grad_H_pre, "grad_H_post": grad_H_post,
                           "grad_H_res": grad_H_res, "x": x, "h_pre_raw": h_pre_raw, "h_post_raw": h_post_raw,
                           "h_res_raw": h_res_raw},
               num_iters=num_iters, eps=eps, grad_mode=grad_mode, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult)


# ------------------------------------------------------------------ op spec
_INPUTS = (X, H_PRE_RAW, H_POST_RAW, H_RES_RAW)
KERNELS = (
    Kernel("mhc_pre_op_fwd", _plan_fwd, _INPUTS, (LAYER_IN, H_PRE, H_POST, H_RES),
           params={**SINKHORN_PARAMS, **ACTIVATION_PARAMS}),
    Kernel("mhc_pre_op_bwd", _plan_bwd, _INPUTS, _INPUTS,
           grads=optional_grads(LAYER_IN, H_PRE, H_POST, H_RES),
           params={**SINKHORN_PARAMS, **GRAD_MODE, **ACTIVATION_PARAMS}),
)
