"""mHC post op, the residual update of paper Eq. 3 (OPS.md section 6)."""

from __future__ import annotations

from .. import _convention, reference
from .._dispatch import Plan, run
from ._launch import tokens_of
from .._kernel_choice import current as current_choice
from .coeffs.fwd import few_tokens
from .stream import check_grad, check_h, check_matrix, check_x, check_y, launch_mix_distribute_bwd, launch_mix_distribute_fwd
from .spec import CONVENTION, GRAD_X, H_POST, H_RES, LAYER_OUT, X, Arg, Kernel


def _check(infos, convention):
    """(dtype, lead, n, C, tokens, res_t): res_t = H_res transposed (convention="deepseek")."""
    dt, lead, n, C = check_x("x", infos["x"])
    check_y("layer_out", infos["layer_out"], lead, C, dt)
    check_h("H_post", infos["H_post"], lead, n, False, infos["x"].shape)
    check_matrix("H_res", infos["H_res"], lead, n, infos["x"].shape)
    return dt, lead, n, C, tokens_of(lead), _convention.check(convention) == "deepseek"


def _plan_fwd(infos, convention):
    dt, lead, n, C, tokens, res_t = _check(infos, convention)
    split = few_tokens(tokens)  # (a few tokens under small or tail: a token's columns over several blocks)

    def run_kernels(p, outs, sc, stream):
        launch_mix_distribute_fwd(dt, n, C, tokens, x=p["x"], M=p["H_res"], y=p["layer_out"], h=p["H_post"],
                                  h_stride=n, out=outs[0], stream=stream, res_t=res_t, split=split)

    return Plan([(infos["x"].shape, dt)], run_kernels,
                lambda a: (reference.mhc_post_op_fwd(a["layer_out"], a["x"], a["H_post"], a["H_res"], convention),),
                single=True, empty=tokens * C == 0)


def _plan_bwd(infos, convention):
    dt, lead, n, C, tokens, res_t = _check(infos, convention)
    tg = check_grad("grad", infos["grad"], infos["x"].shape, dt)

    pipe = current_choice().runs("post_pipe")

    def run_kernels(p, outs, sc, stream):
        dy, dx, dh, dM = outs
        launch_mix_distribute_bwd(dt, tg, n, C, tokens, g=p["grad"], x=p["x"], M=p["H_res"], y=p["layer_out"],
                                  h=p["H_post"], h_stride=n, dx=dx, dy=dy, dh=dh, dM=dM, stream=stream, res_t=res_t,
                                  pipe=pipe)

    return Plan([(infos["layer_out"].shape, dt), (infos["x"].shape, dt), (infos["H_post"].shape, "float32"),
                 (infos["H_res"].shape, "float32")], run_kernels,
                lambda a: reference.mhc_post_op_bwd(a["grad"], a["layer_out"], a["x"], a["H_post"], a["H_res"],
                                                    convention),
                empty=tokens == 0)


def mhc_post_op_fwd(layer_out, x, H_post, H_res, *, convention="paper"):
    """Residual update: out_i = sum_j H_res_ij x_j + H_post_i y (OPS.md section 6, paper Eq. 3).

    One pass over x and y, one rounding per output element.  ``convention="deepseek"``
    (OPS.md "DeepSeek-V4 convention"): H_res transposed, out_j = sum_i H_res_ij x_i + H_post_j y
    (the same kernel and speed: only the index of H_res changes).

    Args:
        layer_out: y, [..., C] activations (bfloat16 / float16 / float32).
        x: [..., n, C], same dtype, 1 <= n <= 32.
        H_post: float32 [..., n] (already activated, 2 sigmoid, from the pre op).
        H_res: float32 [..., n, n] (doubly stochastic, from the pre op).
        convention: "paper" (default) or "deepseek"; keyword only.

    Returns:
        out: [..., n, C], dtype of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes / devices disagree, n out of range, bad convention.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_post_op`` for gradients.
    """
    return run(_plan_fwd, {"layer_out": layer_out, "x": x, "H_post": H_post, "H_res": H_res}, convention=convention)


def mhc_post_op_bwd(grad, layer_out, x, H_post, H_res, *, convention="paper"):
    """Gradient of :func:`mhc_post_op_fwd` (OPS.md section 6).

    dy = sum_i H_post_i g_i;  dx_j = sum_i H_res_ij g_i;  dH_post_i = sum_c g_ic y_c;
    dH_res_ij = sum_c g_ic x_jc.  Under ``convention="deepseek"`` (H_res transposed):
    dx_i = sum_j H_res_ij g_j and dH_res_ij = sum_c x_ic g_jc.  No atomics: bitwise reproducible.

    Args:
        grad: [..., n, C], dtype of x or float32.
        layer_out, x, H_post, H_res, convention: as given to the forward.

    Returns:
        (d_layer_out [..., C], dx [..., n, C], dH_post float32 [..., n], dH_res float32 [..., n, n]).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_post_op`` for gradients.
    """
    return run(_plan_bwd, {"grad": grad, "layer_out": layer_out, "x": x, "H_post": H_post, "H_res": H_res},
               convention=convention)


# ------------------------------------------------------------------ op spec
_INPUTS = (LAYER_OUT, X, H_POST, H_RES)
KERNELS = (
    Kernel("mhc_post_op_fwd", _plan_fwd, _INPUTS, (Arg("out", "...nC", "activation"),), params=CONVENTION),
    Kernel("mhc_post_op_bwd", _plan_bwd, _INPUTS, _INPUTS, grads=(GRAD_X,), params=CONVENTION),
)
