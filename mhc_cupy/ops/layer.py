"""The whole mHC layer in three fused pieces (OPS.md section 9): the coefficient path
and the pre op in one forward, the post op's backward without dx, and one backward
for everything before the sublayer that writes the layer's dx once.

    layer_in, H_pre, H_post, H_res, stats = mhc_layer_pre_fwd(x, phi, alpha, bias)
    y   = F(layer_in)                                  # the sublayer, any framework
    out = mhc_post_op_fwd(y, x, H_post, H_res)         # OPS.md section 6
    --- backward, g = d loss / d out ---
    dy, dH_post, dH_res = mhc_layer_post_bwd(g, y, x, H_post, H_res)
    g_layer_in = F's backward of dy
    dx, dphi, dalpha, dbias = mhc_layer_pre_bwd(g_layer_in, g, dH_post, dH_res, x, phi, alpha, bias,
                                                stats, H_pre, H_res)

dx is the sum of the three paths into x (the coefficients, the pre op's
aggregate and the post op's stream mix: dx_i = dH phi^T - c x_i + H_pre_i g_layer_in
+ sum_j H_res[j, i] g_j), accumulated in float32 and rounded once.  The layer adapters
pass the post op's part as g for n <= FOLD_MAX_N and, above, as the post op's own dx
(``mhc_post_op_bwd``, ``grad_x=``), which is rounded to x's dtype before it is added: dx
is then rounded twice (faster; see FOLD_MAX_N).  The forward
keeps ``stats`` (raw x~ phi and the sum of squares, float32 [..., n*n + 2n + 1])
so the backward does not redo the GEMM.  kernels_cu/coeffs_*.cu (tensor-core path)
and the pre / post op kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import _checks, reference
from .._convention import DEFAULT
from .._settings import LayerSettings, takes_settings
from .._dispatch import Plan, run
from .._kernel_choice import current as current_choice
from .coeffs import (backward_layout, check as _check_coeffs, launch_finish, launch_mma_gemm, launch_param_bwd,
                     launch_prep, mma_layout, padded_row, param_grad_plan)
from .coeffs.bwd import MmaBwd
from ._launch import KernelSpec, column_blocks, grid_for, vec_width
from .sinkhorn import bwd_history, fwd_group, launch_bwd, launch_fwd
from .stream import (check_grad, launch_aggregate_bwd, launch_aggregate_fwd, launch_layer_post_pre_bwd,
                     launch_mix_distribute_bwd)
from .post import _check as _check_post
from .spec import (ACTIVATION_PARAMS, ALPHA, BIAS, CONVENTION, GRAD_MODE, GRAD_X, H_POST, H_PRE, H_RES, LAYER_IN,
                   LAYER_OUT, PHI, SINKHORN_PARAMS, X, Arg, Kernel)


# The layer adapters (MHC, mhc_cupy.jax.mhc_layer) give mhc_layer_pre_bwd the post op's part of
# dx in one of two forms (OPS.md section 9): for n <= FOLD_MAX_N the output gradient g itself
# (grad_out: the dx kernel adds sum_j H_res[j, i] g_j, reading every g row n times), above it the
# post op's dx from mhc_post_op_bwd (grad_x: one more read and write of [n, C] per token, but
# each row read once), whichever measured faster (benchmarks/h200_layer.md).
FOLD_MAX_N = 4


def fold_post_dx(n: int) -> bool:
    """Whether the layer adapters pass the output gradient (grad_out) rather than the post op's dx
    (grad_x) to mhc_layer_pre_bwd, for n streams (FOLD_MAX_N)."""
    return n <= FOLD_MAX_N


def raw_coefficient_scratch(tokens: int, n: int) -> dict:
    """Scratch of :func:`launch_pre_from_sums`: the raw coefficients h_pre, h_post, h_res (float32)."""
    return {"h_pre": ((tokens, n), "float32"), "h_post": ((tokens, n), "float32"), "h_res": ((tokens, n, n), "float32")}


#: The pre piece after the GEMM in one launch, for a few tokens (sinkhorn.cu: it runs Sinkhorn's lanes)
PRE_TAIL = KernelSpec(
    "sinkhorn.cu", "mhc_layer_pre_tail_kernel", "typename T, int N, int G, bool DS, int E",
    "const float* part, const float* alpha, const float* bias, const T* x, float* stats, float* H_pre, "
    "float* H_post, float* H_res, T* layer_in, i64 tokens, int C, int splits, float rms_eps, int iters, float eps, "
    "float hc_eps, float post_mult")


def launch_pre_from_sums(dt, n, C, D, K, tokens, rms_eps, s: LayerSettings, *, x, part, splits, alpha, bias, outs, sc,
                         stream, tail: bool = False, aggregate=None):
    """The layer's pre piece from the forward GEMM's per-range sums part [splits, T, K+1]: the raw
    coefficients (and stats), Sinkhorn and the activations, then layer_in = sum_i H_pre_i x_i.
    ``outs``: (layer_in, H_pre, H_post, H_res, stats); ``sc``: :func:`raw_coefficient_scratch`.
    ``tail`` (a few tokens, the kernel choice ``small`` or ``tail``: MmaLayout.tail): all in one launch,
    mhc_layer_pre_tail_kernel, with the three kernels' bits; else three launches.  ``aggregate(H_pre)``:
    launches what replaces the aggregate (layer_in for the next GEMM, ``ops.layer_in``), after the tail
    kernel where ``tail`` (whose layer_in then goes to scratch)."""
    layer_in, H_pre, H_post, H_res, stats = outs
    if tail:
        E = vec_width(n, C, [(x, dt), (layer_in, dt)])  # (the aggregate kernel's)
        PRE_TAIL.bind(T=dt, N=n, G=fwd_group(n), DS=s.deepseek, E=E).launch(
            grid_for(tokens, column_blocks(tokens, C, E, 256)), (256, 1, 1), stream, part=part, alpha=alpha,
            bias=bias, x=x, stats=stats, H_pre=H_pre, H_post=H_post, H_res=H_res, layer_in=layer_in, tokens=tokens,
            C=C, splits=splits, rms_eps=rms_eps, iters=s.num_iters, eps=s.eps, hc_eps=s.hc_eps, post_mult=s.post_mult)
    else:
        launch_finish(tokens, D, n, K, rms_eps, part=part, splits=splits, alpha=alpha, bias=bias, h_pre=sc["h_pre"],
                      h_post=sc["h_post"], h_res=sc["h_res"], stats=stats, stream=stream)
        launch_fwd(n, tokens, s.num_iters, s.eps, logits=sc["h_res"], P=H_res, stream=stream, h_pre_raw=sc["h_pre"],
                   h_post_raw=sc["h_post"], H_pre=H_pre, H_post=H_post, ds=s.deepseek, hc_eps=s.hc_eps,
                   post_mult=s.post_mult)
        if aggregate is None:
            launch_aggregate_fwd(dt, n, C, tokens, x=x, h=H_pre, h_stride=n, out=layer_in, stream=stream)
    if aggregate is not None:
        aggregate(H_pre)


def pre_outputs(lead: tuple, n: int, C: int, K: int, dt: str) -> list:
    """(shape, dtype) of mhc_layer_pre_fwd's outputs: layer_in, H_pre, H_post, H_res, stats."""
    return [(lead + (C,), dt), (lead + (n,), "float32"), (lead + (n,), "float32"), (lead + (n, n), "float32"),
            (lead + (K + 1,), "float32")]


class PrePiece(NamedTuple):
    """The forward of the pre piece for checked inputs: shapes, the GEMM's layout and the scratch it needs."""

    dt: str
    lead: tuple
    n: int
    C: int
    D: int
    K: int
    tokens: int
    rms_eps: float
    mma: object  # ops.coeffs.mma_layout's

    @property
    def tail(self) -> bool:
        """The pre piece after the GEMM in one launch, mhc_layer_pre_tail_kernel (a few tokens, the kernel
        choice ``small``, after its GEMV, or ``tail``, after the tensor-core GEMM)."""
        return self.mma.tail

    def scratch(self) -> dict:
        return {"part": ((self.mma.splits, self.tokens, self.K + 1), "float32"), "planes": self.mma.planes_shape,
                **raw_coefficient_scratch(self.tokens, self.n)}

    def launch(self, s: LayerSettings, p: dict, outs, sc: dict, stream, aggregate=None):
        """The GEMM, then :func:`launch_pre_from_sums` (``outs``, ``aggregate``: as there)."""
        launch_mma_gemm(self.dt, self.D, self.K, self.tokens, x=p["x"], phi=p["phi"], part=sc["part"],
                        planes=sc["planes"], mma=self.mma, stream=stream)
        launch_pre_from_sums(self.dt, self.n, self.C, self.D, self.K, self.tokens, self.rms_eps, s, x=p["x"],
                             part=sc["part"], splits=self.mma.splits, alpha=p["alpha"], bias=p["bias"], outs=outs,
                             sc=sc, stream=stream, tail=self.tail, aggregate=aggregate)


def pre_piece(infos, s: LayerSettings) -> PrePiece:
    """:class:`PrePiece` of mhc_layer_pre_fwd's inputs x, phi, alpha, bias (TypeError / ValueError: as it)."""
    dt, lead, n, C, D, K, tokens, rms_eps = _check_coeffs(infos, s.rms_eps, False, eps_name="rms_eps")
    return PrePiece(dt, lead, n, C, D, K, tokens, rms_eps, mma_layout(tokens, D, K, dt))


@takes_settings
def _plan_pre_fwd(infos, s: LayerSettings):
    pp = pre_piece(infos, s)
    dt, lead, n, C, K, rms_eps = pp.dt, pp.lead, pp.n, pp.C, pp.K, pp.rms_eps
    iters, eps, hc_eps, post_mult = s.num_iters, s.eps, s.hc_eps, s.post_mult

    def run_kernels(p, outs, sc, stream):
        pp.launch(s, p, outs, sc, stream)

    return Plan(pre_outputs(lead, n, C, K, dt), run_kernels,
                lambda a: reference.mhc_layer_pre_fwd(a["x"], a["phi"], a["alpha"], a["bias"], iters, eps, rms_eps,
                                                      s.convention, hc_eps, post_mult),
                scratch=pp.scratch(), empty=pp.tokens == 0)


def mhc_layer_pre_fwd(x, phi, alpha, bias, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, *, convention="paper",
                      hc_eps=DEFAULT, post_mult=DEFAULT):
    """Coefficients, activations and layer input of an mHC layer in one call (OPS.md sections 7-9).

    mhc_coeffs_fwd (paper Eqs. 14-18) followed by mhc_pre_op_fwd (Eq. 8): the
    coefficient GEMM runs on tensor cores, float32-accurate (OPS.md section 8).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32, C >= 1.
        phi: float32 [n*C, n*n + 2n] (columns pre | post | res);  alpha: float32 [3];
        bias: float32 [n*n + 2n].
        num_iters: Sinkhorn iterations (default 20);  eps: Sinkhorn eps (default 1e-8);
        rms_eps: eps of r = sqrt(mean(x~^2) + rms_eps) (default 1e-5).
        convention: "paper" (default) or "deepseek" (OPS.md "DeepSeek-V4 convention": Sinkhorn
            softmax start, H_pre + hc_eps; the defaults of num_iters / eps / rms_eps become
            20 / 1e-6 / 1e-6);  hc_eps, post_mult: as mhc_pre_op_fwd.  Keyword only.

    Returns:
        (layer_in [..., C] dtype of x, H_pre float32 [..., n], H_post float32 [..., n],
        H_res float32 [..., n, n], stats float32 [..., n*n + 2n + 1]): stats holds each
        token's raw x~ phi and sum of squares, for :func:`mhc_layer_pre_bwd` (on the GPU a sum
        of squares that overflowed float32 is kept as minus its 2^-100-scaled value, OPS.md).

    Raises:
        TypeError / ValueError: as mhc_coeffs_fwd and mhc_pre_op_fwd.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_layer_pre`` for gradients.
    """
    return run(_plan_pre_fwd, {"x": x, "phi": phi, "alpha": alpha, "bias": bias}, num_iters=num_iters, eps=eps,
               rms_eps=rms_eps, convention=convention, hc_eps=hc_eps, post_mult=post_mult)


# ---------------------------------------------------------- post backward
def _plan_post_bwd(infos, convention):
    dt, lead, n, C, tokens, res_t = _check_post(infos, convention)
    tg = check_grad("grad", infos["grad"], infos["x"].shape, dt)

    pipe = current_choice().runs("post_pipe")

    def run_kernels(p, outs, sc, stream):
        dy, d_post, d_res = outs
        launch_mix_distribute_bwd(dt, tg, n, C, tokens, g=p["grad"], x=p["x"], M=p["H_res"], y=p["layer_out"],
                                  h=p["H_post"], h_stride=n, dy=dy, dh=d_post, dM=d_res, stream=stream, res_t=res_t,
                                  pipe=pipe)

    def ref(a):
        dy, _, d_post, d_res = reference.mhc_post_op_bwd(a["grad"], a["layer_out"], a["x"], a["H_post"], a["H_res"],
                                                         convention)
        return dy, d_post, d_res

    return Plan([(infos["layer_out"].shape, dt), (infos["H_post"].shape, "float32"), (infos["H_res"].shape, "float32")],
                run_kernels, ref, empty=tokens == 0)


def mhc_layer_post_bwd(grad, layer_out, x, H_post, H_res, *, convention="paper"):
    """mhc_post_op_bwd without dx (OPS.md sections 6, 9): (d_layer_out, dH_post, dH_res).

    The post op's dx (sum_i H_res_ij g_i) is added by :func:`mhc_layer_pre_bwd`,
    which receives ``grad`` too, so the layer's dx is written and rounded once.

    Args:
        grad: [..., n, C], dtype of x or float32.  layer_out, x, H_post, H_res, convention: as
            mhc_post_op_fwd (keyword only).

    Returns:
        (d_layer_out [..., C] dtype of x, dH_post float32 [..., n], dH_res float32 [..., n, n]).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_layer_post`` for gradients.
    """
    return run(_plan_post_bwd, {"grad": grad, "layer_out": layer_out, "x": x, "H_post": H_post, "H_res": H_res},
               convention=convention)


# ----------------------------------------------------------- pre backward
@takes_settings
def _plan_pre_bwd(infos, s: LayerSettings):
    dt, lead, n, C, D, K, tokens, rms_eps = _check_coeffs(infos, s.rms_eps, False, eps_name="rms_eps")
    iters, eps, ds, hc_eps, post_mult, mode = s.num_iters, s.eps, s.deepseek, s.hc_eps, s.post_mult, s.grad_mode
    tgs = []
    for name, shape, what in (("grad_layer_in", lead + (C,), "the shape of layer_in"),
                              ("grad_out", lead + (n, C), "the shape of the layer's output"),
                              ("grad_x", lead + (n, C), "the shape of x")):
        if infos[name] is not None:
            tgs.append((name, check_grad(name, infos[name], shape, dt, what)))
    if len({tg for _, tg in tgs}) > 1:
        raise TypeError(", ".join(f"{name} is {tg}" for name, tg in tgs) + "; mhc_layer_pre_bwd needs its activation "
                        "gradients in one dtype (the activation dtype or float32)")
    tg = tgs[0][1] if tgs else dt
    for name, shape in (("grad_H_post", lead + (n,)), ("grad_H_res", lead + (n, n)), ("stats", lead + (K + 1,)),
                        ("H_pre", lead + (n,)), ("H_res", lead + (n, n)), ("H_post_prev", lead + (n,))):
        if infos.get(name) is not None or name in ("stats", "H_pre", "H_res"):
            _checks.coefficient(name, infos[name])
            _checks.expect_shape(name, infos[name].shape, shape, "the shape mhc_layer_pre_fwd / the post op gave")
    # layer_out: the post op's coefficient gradients from grad_out here (OPS.md section 12)
    post = infos.get("layer_out") is not None
    if post:
        _checks.activation("layer_out", infos["layer_out"], dt)
        _checks.expect_shape("layer_out", infos["layer_out"].shape, lead + (C,), "the shape of layer_in")
        if infos["grad_out"] is None:
            raise ValueError("layer_out is given but grad_out is None: the post op's coefficient gradients that "
                             "layer_out serves are sums over grad_out, the layer output's gradient (give it)")
    prev = "H_post_prev" in infos  # mhc_boundary_bwd: also the previous layer's dy
    KP = padded_row(K)
    b = backward_layout(tokens, n, C, K, dt)
    hist = bwd_history(n, tokens, iters, mode)[2] if infos["grad_H_res"] is not None or post else 0
    scratch = {**raw_coefficient_scratch(tokens, n), "dh_pre": ((tokens, n), "float32"),
               "dh_post": ((tokens, n), "float32"), "dh_res": ((tokens, n, n), "float32"),
               "dH": ((tokens, KP), "float32"), "qa": ((tokens, 3), "float32"), **b.scratch()}
    if hist:
        scratch["hist"] = ((hist,), "float32")
    if post:  # the post op's dH_post, dH_res (+ the given ones)
        scratch.update(g_post=((tokens, n), "float32"), g_res=((tokens, n, n), "float32"))
    # dy_prev in the dx kernel's epilogue (mhc_coeffs_mma_bwd_dy_kernel: a layer term), else from dx afterwards
    dy_epilogue = isinstance(b, MmaBwd) and any(infos[k] is not None for k in ("grad_out", "grad_layer_in", "grad_x"))
    gpu_ok = not (post or prev) or current_choice().runs("boundary_bwd")

    def body(p, outs, sc, stream):
        if not gpu_ok:
            raise NotImplementedError(
                f"{'mhc_boundary_bwd' if prev else 'mhc_layer_pre_bwd with layer_out'} on a GPU: its kernels "
                "(mhc_layer_post_pre_bwd_kernel, mhc_coeffs_mma_bwd_dy_kernel) have not been checked on a GPU yet, "
                "so they run only under mhc_cupy._kernel_choice.kernel_choice(boundary_bwd=True); CPU inputs run the "
                "reference")
        dx, dphi, dalpha, dbias = outs[:4]
        stats = p["stats"]
        # raw coefficients from the saved sums (no second GEMM)
        launch_finish(tokens, D, n, K, rms_eps, part=stats, splits=1, alpha=p["alpha"], bias=p["bias"],
                      h_pre=sc["h_pre"], h_post=sc["h_post"], h_res=sc["h_res"], stats=None, stream=stream)
        if post:  # one pass for the post op's dH_post, dH_res and the pre op's dh_pre_raw
            g_post, g_res = sc["g_post"], sc["g_res"]
            launch_layer_post_pre_bwd(dt, tg, n, C, tokens, g=p["grad_out"], x=p["x"], y=p["layer_out"],
                                      g_li=p["grad_layer_in"], h_pre_raw=sc["h_pre"], g_post=p["grad_H_post"],
                                      g_res=p["grad_H_res"], d_pre=sc["dh_pre"], d_post=g_post, d_res=g_res,
                                      stream=stream, res_t=ds)
        else:
            g_post, g_res = p["grad_H_post"], p["grad_H_res"]
        # Sinkhorn and H_post activation backward (null incoming gradients read as zero)
        launch_bwd(n, tokens, iters, eps, mode, grad_P=g_res, logits=sc["h_res"], d_logits=sc["dh_res"],
                   hist=sc.get("hist"), stream=stream, g_post=g_post, h_post_raw=sc["h_post"],
                   d_post_raw=sc["dh_post"], ds=ds, post_mult=post_mult)
        if not post:  # dh_pre_raw = (sum_c g_c x_ic) s (1 - s), s = sigmoid(h_pre_raw); no dx here
            launch_aggregate_bwd(dt, tg, n, C, tokens, g=p["grad_layer_in"], x=p["x"], h=sc["h_pre"], h_stride=n,
                                 dx=None, dh=sc["dh_pre"], stream=stream, act=1)
        launch_prep(tokens, D, n, K, KP, rms_eps, part=stats, splits=1,
                    grads=(sc["dh_pre"], sc["dh_post"], sc["dh_res"]), alpha=p["alpha"], dH=sc["dH"], qa=sc["qa"],
                    dalpha=dalpha, dbias=dbias, stream=stream)
        dy = {"H_post_prev": p["H_post_prev"], "dy_prev": outs[4]} if prev and dy_epilogue else {}
        launch_param_bwd(b, dt, x=p["x"], phi=p["phi"], dH=sc["dH"], KP=KP, dx=dx, dphi=dphi, sc=sc, stream=stream,
                         tg=tg, g=p["grad_out"], g_li=p["grad_layer_in"], H_pre=p["H_pre"], H_res=p["H_res"],
                         gx=p["grad_x"], res_t=ds, **dy)
        if prev and not dy_epilogue:  # dy_prev = sum_i H_post_prev_i dx_i (the post op's dy: its bits)
            launch_aggregate_fwd(dt, n, C, tokens, x=dx, h=p["H_post_prev"], h_stride=n, out=outs[4], stream=stream)

    def ref(a):
        args = (a["grad_layer_in"], a["grad_out"], a["grad_H_post"], a["grad_H_res"], a["x"], a["phi"], a["alpha"],
                a["bias"], a["stats"], a["H_pre"], a["H_res"], iters, eps, rms_eps, mode, s.convention, hc_eps,
                post_mult, a["grad_x"], a.get("layer_out"))
        if prev:
            return reference.mhc_boundary_bwd(*args, a["H_post_prev"])
        return reference.mhc_layer_pre_bwd(*args)

    plan = param_grad_plan(infos["x"].shape, dt, tokens, D, K, scratch, body, ref)
    if prev:
        plan.outputs.append((lead + (C,), dt))
    return plan


def mhc_layer_pre_bwd(grad_layer_in, grad_out, grad_H_post, grad_H_res, x, phi, alpha, bias, stats, H_pre, H_res,
                      num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled", *, convention="paper",
                      hc_eps=DEFAULT, post_mult=DEFAULT, grad_x=None, layer_out=None):
    """Gradient of everything before the sublayer, with the post op's dx folded in (OPS.md section 9).

    dx_i = H_pre_i g_layer_in + sum_j H_res[j, i] grad_out_j + grad_x_i + (coefficient path's dx_i)
    (convention="deepseek": sum_j H_res[i, j] grad_out_j, the post op's H_res being transposed),
    summed in float32 and rounded once; dphi, dalpha, dbias as mhc_coeffs_bwd, of the
    raw-coefficient gradients that mhc_pre_op_bwd gives for (grad_layer_in, grad_H_post,
    grad_H_res).  Sums over tokens have a fixed order (no atomics).

    Args:
        grad_layer_in: [..., C] gradient of layer_in (the sublayer's input gradient), or None.
        grad_out: [..., n, C] gradient of the layer's output (what mhc_layer_post_bwd got), or None;
            same dtype as grad_layer_in (the activation dtype or float32).
        grad_x: [..., n, C] another gradient of x added before the rounding, or None (keyword
            only; same dtype as grad_layer_in): e.g. the post op's dx from mhc_post_op_bwd, given
            instead of grad_out, which reads each row of it once where grad_out's sum reads it
            n times (faster for n > 4 on the H200, ``FOLD_MAX_N``), but is itself rounded to
            x's dtype first (cast it to float32 where the other gradients are float32).
        grad_H_post, grad_H_res: float32 [..., n], [..., n, n] from mhc_layer_post_bwd, or None.
        x, phi, alpha, bias, num_iters, eps, rms_eps, convention, hc_eps, post_mult: as given to
            mhc_layer_pre_fwd.
        stats, H_pre, H_res: its outputs.
        grad_mode: Sinkhorn gradient, "unrolled" (default) or "implicit".
        layer_out: [..., C] the sublayer's output y (dtype of x), or None (default; keyword only).
            Given, this call also computes the post op's coefficient gradients from grad_out
            (mhc_layer_post_bwd's dH_post_i = sum_c grad_out_ic y_c and dH_res, added to grad_H_post /
            grad_H_res where given): the post op's backward then needs only its dy (OPS.md section 12,
            "Fused boundary backward": one pass over the streams less per layer, in a stack).

    Returns:
        (dx [..., n, C] dtype of x, dphi float32 [n*C, n*n + 2n], dalpha float32 [3],
        dbias float32 [n*n + 2n]).

    Raises:
        TypeError / ValueError: bad dtypes or shapes; layer_out given without grad_out.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_layer_pre`` for gradients.
    """
    return run(_plan_pre_bwd, {"grad_layer_in": grad_layer_in, "grad_out": grad_out, "grad_H_post": grad_H_post,
                               "grad_H_res": grad_H_res, "grad_x": grad_x, "x": x, "phi": phi, "alpha": alpha, "bias": bias,
                               "stats": stats, "H_pre": H_pre, "H_res": H_res, "layer_out": layer_out},
               num_iters=num_iters, eps=eps, rms_eps=rms_eps, grad_mode=grad_mode, convention=convention, hc_eps=hc_eps,
               post_mult=post_mult)


# ------------------------------------------------------------------ op spec
_PRE_INPUTS = (X, PHI, ALPHA, BIAS)
_POST_INPUTS = (LAYER_OUT, X, H_POST, H_RES)
_PARAMS = {**SINKHORN_PARAMS, "rms_eps": 1e-5, **ACTIVATION_PARAMS}
_STATS = Arg("stats", "...K+1", "coefficient")
#: mhc_layer_pre_bwd's arrays besides the gradients (layer_out: OPS.md section 12, "Fused boundary backward")
PRE_BWD_INPUTS = _PRE_INPUTS + (_STATS, H_PRE, H_RES, Arg("layer_out", "...C", "activation", optional=True))
#: its incoming gradients
PRE_BWD_GRADS = tuple(Arg(n, a.shape, a.kind, optional=True) for n, a in (
    ("grad_layer_in", LAYER_IN), ("grad_out", X), ("grad_H_post", H_POST), ("grad_H_res", H_RES), ("grad_x", X)))
PRE_BWD_PARAMS = {**_PARAMS, **GRAD_MODE}
KERNELS = (
    Kernel("mhc_layer_pre_fwd", _plan_pre_fwd, _PRE_INPUTS, (LAYER_IN, H_PRE, H_POST, H_RES, _STATS),
           params=_PARAMS),
    Kernel("mhc_layer_post_bwd", _plan_post_bwd, _POST_INPUTS, (LAYER_OUT, H_POST, H_RES), grads=(GRAD_X,),
           params=CONVENTION),
    Kernel("mhc_layer_pre_bwd", _plan_pre_bwd, PRE_BWD_INPUTS, _PRE_INPUTS, grads=PRE_BWD_GRADS,
           params=PRE_BWD_PARAMS),
)
