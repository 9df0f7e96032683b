"""The mHC head: the n residual streams merged into one hidden state at the end of the
network (OPS.md section 11; DeepSeek-V4's ``hc_head``), kernels in ``kernels_cu/head.cu`` and
``coeffs_dphi.cu``.

Per token, with x~ = vec(x) (D = n*C values): H~ = x~ hc_fn^T, r = sqrt(mean(x~^2) + rms_eps),
w = sigmoid(H~ / r * hc_scale + hc_base) + hc_eps, out = sum_i w_i x_i.  It is the coefficient
path (section 8) with K = n columns: the forward GEMM and the sum of squares are the
coefficient path's tensor-core kernel (on phi = hc_fn^T), then one kernel computes w and the
weighted sum.  The launch layout depends only on shapes and dtypes: bitwise reproducible results.
"""

from __future__ import annotations

from .. import _checks, reference
from .._dispatch import Plan, run
from .coeffs import bwd as coeffs_bwd, common, fwd as coeffs_fwd
from .coeffs.split_bwd import BWD_DPHI
from ._launch import KernelSpec, column_sum, grid_for, threads_for, tokens_of, vec_width
from .spec import X, Arg, Kernel
from .stream import check_grad

_FILE = "head.cu"
_NT = 256
#: DeepSeek-V4's defaults (its ``hc_head``): eps inside the square root, and the floor added to w.
PARAMS = {"rms_eps": 1e-6, "hc_eps": 1e-6}


# The CUDA-core dphi kernel (mhc_coeffs_bwd_dphi_kernel) for dhc_fn^T: columns per chunk, D positions
# per thread, and the block count its token splits aim for (a constant, not the SM count, so the
# summation order, hence every bit, is the same on every GPU).
_KC = 24
_DPHI_E = 2
_TARGET_BLOCKS = 512

TRANSPOSE = KernelSpec(_FILE, "mhc_head_transpose_kernel", "", "const float* src, float* dst, int rows, i64 cols")
HEAD_FWD = KernelSpec(_FILE, "mhc_head_fwd_kernel", "typename T, int E",
                      "const T* x, const float* part, const float* hc_scale, const float* hc_base, T* out, i64 tokens, "
                      "int n, int C, int splits, float rms_eps, float hc_eps")
HEAD_BWD_PREP = KernelSpec(
    _FILE, "mhc_head_bwd_prep_kernel", "typename T, typename TG, int E, int NB",
    "const TG* g, const T* x, const float* part, const float* hc_scale, const float* hc_base, float* dH, "
    "float* w_out, float* gz_out, float* qs_out, i64 tokens, int n, int C, int KP, int splits, float rms_eps, "
    "float hc_eps")
HEAD_BWD_DX = KernelSpec(_FILE, "mhc_head_bwd_dx_kernel", "typename T, typename TG, int E",
                         "const TG* g, const T* x, const float* hc_fn, const float* dH, const float* w, T* dx, "
                         "i64 tokens, int n, int C, int KP")


def _dphi_layout(tokens: int, D: int, n: int) -> tuple[int, int, int, int]:
    """(columns per chunk, chunks, token splits, tokens per split) of the dphi reduction: n columns
    in ceil(n / _KC) nearly equal chunks; enough blocks to fill the GPU, partials [splits, D, n] of at
    most common._MAX_PARTIAL_FLOATS floats."""
    cdiv = common._cdiv
    kc = cdiv(n, cdiv(n, _KC))
    ncc = cdiv(n, kc)
    splits = cdiv(_TARGET_BLOCKS, cdiv(D, _NT * _DPHI_E) * ncc)
    splits = max(1, min(splits, cdiv(tokens, common._MIN_TOKENS_PER_SPLIT), common._MAX_SPLITS,
                        common._MAX_PARTIAL_FLOATS // (D * n)))
    per = cdiv(max(tokens, 1), splits)
    return kc, ncc, cdiv(max(tokens, 1), per), per


def _slots(n: int) -> int:
    """The power of two >= n (1..32): per-thread accumulators of the backward's g . x_i sums."""
    return 1 << max(0, (n - 1).bit_length())


def _check(infos, rms_eps, hc_eps, with_grad: bool):
    dt, lead, n, C, D = common.check_vec_x(infos["x"], "mhc_head")
    for name, shape, why in (("hc_fn", (n, D), "[n, n*C] with n, C of x (DeepSeek's layout: phi transposed)"),
                             ("hc_scale", (1,), "one scalar"), ("hc_base", (n,), "[n]")):
        _checks.coefficient(name, infos[name])
        _checks.expect_shape(name, infos[name].shape, shape, why)
    tg = check_grad("grad", infos["grad"], lead + (C,), dt) if with_grad else None
    return (dt, tg, lead, n, C, D, tokens_of(lead), _checks.eps("rms_eps", rms_eps),
            _checks.eps("hc_eps", hc_eps))


def _transpose(src, dst, rows: int, cols: int, stream) -> None:
    """dst [cols, rows] = src [rows, cols]^T (float32; rows = n is small)."""
    TRANSPOSE.launch_grid_stride(rows * cols, stream, src=src, dst=dst, rows=rows, cols=cols)


def _gemm_scratch(dt: str, tokens: int, D: int, n: int):
    """The forward GEMM's layout and its scratch: part [splits, T, n+1], phi [D, n], bf16 planes."""
    mma = coeffs_fwd.mma_layout(tokens, D, n, dt)
    return mma, {"part": ((mma.splits, tokens, n + 1), "float32"), "phi": ((D, n), "float32"),
                 "planes": mma.planes_shape}


def _launch_gemm(dt, D, n, tokens, x, hc_fn, sc: dict, mma, stream) -> None:
    """Raw H~ and sums of squares per D range into sc["part"] (the coefficient path's GEMM)."""
    _transpose(hc_fn, sc["phi"], n, D, stream)
    coeffs_fwd.launch_mma_gemm(dt, D, n, tokens, x=x, phi=sc["phi"], part=sc["part"], planes=sc["planes"], mma=mma,
                               stream=stream)


def _plan_fwd(infos, rms_eps, hc_eps):
    dt, _, lead, n, C, D, tokens, rms_eps, hc_eps = _check(infos, rms_eps, hc_eps, False)
    mma, scratch = _gemm_scratch(dt, tokens, D, n)

    def run_kernels(p, outs, sc, stream):
        _launch_gemm(dt, D, n, tokens, p["x"], p["hc_fn"], sc, mma, stream)
        E = vec_width(n, C, [(p["x"], dt), (outs[0], dt)])
        HEAD_FWD.bind(T=dt, E=E).launch(grid_for(tokens), (threads_for(C, E), 1, 1), stream, x=p["x"],
                                        part=sc["part"], hc_scale=p["hc_scale"], hc_base=p["hc_base"], out=outs[0],
                                        tokens=tokens, n=n, C=C, splits=mma.splits, rms_eps=rms_eps, hc_eps=hc_eps)

    def ref(a):
        return (reference.mhc_head_fwd(a["x"], a["hc_fn"], a["hc_scale"], a["hc_base"], rms_eps, hc_eps),)

    return Plan([(lead + (C,), dt)], run_kernels, ref, scratch=scratch, single=True,
                empty=tokens == 0)


def _plan_bwd(infos, rms_eps, hc_eps):
    dt, tg, lead, n, C, D, tokens, rms_eps, hc_eps = _check(infos, rms_eps, hc_eps, True)
    mma, scratch = _gemm_scratch(dt, tokens, D, n)
    KP = common.padded_row(n)
    kc, ncc, t_splits, t_split = _dphi_layout(tokens, D, n)
    scratch.update({"dH": ((tokens, KP), "float32"),  # dH | c
                    "w": ((tokens, n), "float32"), "gz": ((tokens, n), "float32"),  # w; dbase terms
                    "qs": ((tokens, 1), "float32"),  # dscale terms
                    "dphi": ((D, n), "float32")})  # dhc_fn^T
    if t_splits > 1:
        scratch["dphi_part"] = ((t_splits, D, n), "float32")

    def run_kernels(p, outs, sc, stream):
        dx, dhc_fn, dscale, dbase = outs
        if tokens == 0:
            for ptr, count in ((dhc_fn, n * D), (dscale, 1), (dbase, n)):
                coeffs_bwd.zero(ptr, count, stream)
            return
        x, g = p["x"], p["grad"]
        _launch_gemm(dt, D, n, tokens, x, p["hc_fn"], sc, mma, stream)
        E = vec_width(n, C, [(x, dt), (g, tg)])
        HEAD_BWD_PREP.bind(T=dt, TG=tg, E=E, NB=_slots(n)).launch(
            grid_for(tokens), (threads_for(C, E), 1, 1), stream, g=g, x=x, part=sc["part"], hc_scale=p["hc_scale"],
            hc_base=p["hc_base"], dH=sc["dH"], w_out=sc["w"], gz_out=sc["gz"], qs_out=sc["qs"], tokens=tokens, n=n,
            C=C, KP=KP, splits=mma.splits, rms_eps=rms_eps, hc_eps=hc_eps)
        column_sum(sc["qs"], dscale, tokens, 1, stream)
        column_sum(sc["gz"], dbase, tokens, n, stream)
        E = vec_width(1, C, [(x, dt), (dx, dt), (g, tg), (p["hc_fn"], "float32")])
        HEAD_BWD_DX.bind(T=dt, TG=tg, E=E).launch(grid_for(tokens), (threads_for(D, E), 1, 1), stream, g=g, x=x,
                                                  hc_fn=p["hc_fn"], dH=sc["dH"], w=sc["w"], dx=dx, tokens=tokens, n=n,
                                                  C=C, KP=KP)
        # dhc_fn^T = sum_t x~^T dH: the coefficient path's CUDA-core dphi kernel with K = n
        E = vec_width(1, D, [(x, dt)], budget=_DPHI_E)
        dblocks = -(-D // (_NT * E))
        out = sc.get("dphi_part", sc["dphi"])
        BWD_DPHI.bind(T=dt, E=E, KC=kc).launch((ncc * dblocks * t_splits, 1, 1), (_NT, 1, 1), stream, x=x,
                                               dH=sc["dH"], dphi=out, tokens=tokens, D=D, K=n, KP=KP, ncc=ncc,
                                               dblocks=dblocks, t_split=t_split)
        if t_splits > 1:
            column_sum(out, sc["dphi"], t_splits, D * n, stream)
        _transpose(sc["dphi"], dhc_fn, D, n, stream)

    def ref(a):
        return reference.mhc_head_bwd(a["grad"], a["x"], a["hc_fn"], a["hc_scale"], a["hc_base"], rms_eps, hc_eps)

    return Plan([(infos["x"].shape, dt), ((n, D), "float32"), ((1,), "float32"), ((n,), "float32")], run_kernels,
                ref, scratch=scratch, empty=False)


# ------------------------------------------------------------------ public
def mhc_head_fwd(x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """The mHC head: merge the n residual streams into one hidden state (OPS.md section 11).

    DeepSeek-V4's ``hc_head``.  Per token, with x~ = vec(x) (D = n*C):
    w = sigmoid((x~ hc_fn^T) / sqrt(mean(x~^2) + rms_eps) * hc_scale + hc_base) + hc_eps;
    out = sum_i w_i x_i, accumulated in float32 and rounded once.

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32, C >= 1.
        hc_fn: float32 [n, n*C] (DeepSeek's layout: row i gives stream weight i).
        hc_scale: float32 [1].  hc_base: float32 [n].
        rms_eps: >= 0, inside the square root. Default 1e-6 (DeepSeek's).
        hc_eps: >= 0, added to every weight. Default 1e-6 (DeepSeek's).

    Returns:
        out [..., C], dtype of x.

    Raises:
        TypeError: x not an activation dtype, or hc_fn / hc_scale / hc_base not float32.
        ValueError: shapes disagree, n out of range, C = 0, n*C > 2^30, arrays on different devices.

    Notes:
        The GEMM x~ hc_fn^T and the sum of squares run in one read of x (the coefficient
        path's tensor-core kernel), the weighted sum in a second.  Deterministic; zero
        tokens launch nothing.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_head`` / ``MHCHead``
    (or ``mhc_cupy.jax.mhc_head``) for gradients.
    """
    return run(_plan_fwd, {"x": x, "hc_fn": hc_fn, "hc_scale": hc_scale, "hc_base": hc_base}, rms_eps=rms_eps,
               hc_eps=hc_eps)


def mhc_head_bwd(grad, x, hc_fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6):
    """Gradient of :func:`mhc_head_fwd` (OPS.md section 11).

    With gw_i = sum_c g_c x_ic, s = sigmoid(z), gz = gw s (1 - s), dH = gz hc_scale / r:
    dx~ = vec(w_i g) + dH hc_fn - c x~ with c = sum_k gz_k hc_scale H~_k / (D r^3);
    dhc_fn = sum_tokens dH^T x~;  dhc_scale = sum_tokens sum_k gz_k H~_k / r;  dhc_base = sum_tokens gz.

    Args:
        grad: [..., C], the activation dtype or float32.
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps: as given to the forward.

    Returns:
        (dx [..., n, C] dtype of x, dhc_fn float32 [n, n*C], dhc_scale float32 [1], dhc_base float32 [n]).

    Raises:
        TypeError / ValueError: as the forward; grad of the wrong dtype or shape.

    Notes:
        dx is accumulated in float32 and rounded once.  The sums over tokens are
        per-block partials added in a fixed order (no atomics): bitwise reproducible.
        Zero tokens give an empty dx and zero parameter gradients.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.mhc_head`` for gradients.
    """
    return run(_plan_bwd, {"grad": grad, "x": x, "hc_fn": hc_fn, "hc_scale": hc_scale, "hc_base": hc_base},
               rms_eps=rms_eps, hc_eps=hc_eps)


# ------------------------------------------------------------------ op spec
_INPUTS = (X, Arg("hc_fn", "n,nC", "parameter"), Arg("hc_scale", "1", "parameter"), Arg("hc_base", "n", "parameter"))
KERNELS = (
    Kernel("mhc_head_fwd", _plan_fwd, _INPUTS, (Arg("out", "...C", "activation"),), params=dict(PARAMS)),
    Kernel("mhc_head_bwd", _plan_bwd, _INPUTS, _INPUTS, grads=(Arg("grad", "...C", "activation"),),
           params=dict(PARAMS)),
)
