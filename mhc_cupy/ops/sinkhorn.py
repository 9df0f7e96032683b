"""Sinkhorn-Knopp projection onto doubly-stochastic matrices (OPS.md section 1).

One launch for all tokens (``kernels_cu/sinkhorn.cu``): a group of lanes per matrix (forward,
unrolled backward), one thread per matrix (implicit backward, n <= 8) or one warp (n > 8).
Every kernel has a ``DS`` template flag: the DeepSeek-V4 softmax start (OPS.md "DeepSeek-V4
convention").
"""

from __future__ import annotations

from .. import _checks, reference
from .._convention import DEFAULT
from .._settings import LayerSettings, takes_settings
from .._dispatch import Plan, run
from ._launch import f32, i32, i64, launch, tokens_of
from .spec import GRAD_MODE, SINKHORN_PARAMS, Arg, Kernel

_FILE = "sinkhorn.cu"
_THREADS = 64  # lanes per block of the forward / unrolled backward
_IMPLICIT_THREADS = 64  # one matrix per thread
#: Above this n the implicit backward runs one warp per matrix with P and the
#: Schur complement in shared memory (``IMPLICIT_WARPS`` = 4 matrices per
#: block of 128 threads): one thread per matrix would keep three n x n arrays
#: in local memory (12 KB of stack per thread at n = 32).
_IMPLICIT_WARP_N = 8
_IMPLICIT_WARPS = 4
_SMEM_LIMIT = 48 * 1024


def check_logits(name: str, info) -> int:
    """n of a float32 [..., n, n] tensor."""
    _checks.coefficient(name, info)
    _checks.min_ndim(name, info, 2, "[..., n, n]")
    n = info.shape[-1]
    if info.shape[-2] != n:
        raise ValueError(f"{name} has shape {info.shape}; it needs square matrices [..., n, n]")
    return _checks.streams(n, name)


def fwd_group(n: int) -> int:
    """Lanes per matrix G of the forward (measured on an H200 at 32768 tokens,
    n = 4: G = 1 / 2 / 4 took 9.7 / 6.1 / 8.4 us): two lanes for n <= 4, else
    one row per lane."""
    return 2 if 1 < n <= 4 else 1 << (n - 1).bit_length()


def bwd_group(n: int) -> int:
    """Lanes per matrix G of the unrolled backward (H200, 32768 tokens, n = 4:
    G = 1 / 2 / 4 took 13.3 / 13.4 / 19.1 us): two lanes for n <= 4, else the
    smallest power of two that leaves each lane at most 32 matrix elements."""
    if 1 < n <= 4:
        return 2
    g = 1
    while -(-n // g) * n > 32:
        g *= 2
    return g


def history_slots(n: int) -> int:
    """Denominators each lane of the backward records per iteration: those of
    its R rows and of R columns (see ``Layout`` in sinkhorn.cu)."""
    return 2 * -(-n // bwd_group(n))


def _b(v: bool) -> str:
    return "true" if v else "false"


def launch_fwd(n, tokens, iters, eps, *, logits, P, stream, h_pre_raw=None, h_post_raw=None, H_pre=None, H_post=None,
               ds=False, hc_eps=0.0, post_mult=2.0):
    """Sinkhorn forward (and optionally the pre-op sigmoids H_pre = sigmoid + hc_eps,
    H_post = post_mult sigmoid) for every token; ``ds``: the DeepSeek softmax start."""
    g = fwd_group(n)
    launch(_FILE, f"mhc_sinkhorn_knopp_fwd_kernel<{n},{g},{_b(ds)}>", (-(-tokens * g // _THREADS), 1, 1),
           (_THREADS, 1, 1), (logits, P, h_pre_raw, h_post_raw, H_pre, H_post, i64(tokens), i32(iters), f32(eps),
                              f32(hc_eps), f32(post_mult)), stream)


def bwd_history(n: int, tokens: int, iters: int, grad_mode: str):
    """(threads per block, dynamic shared bytes, global scratch floats) of the backward.

    The unrolled backward keeps ``history_slots(n) * iters`` denominators per
    lane: in shared memory when they fit in 48 KB for a block of at least 32
    lanes, else in a global scratch buffer.
    """
    if grad_mode == "implicit":
        return _IMPLICIT_THREADS, 0, 0
    per_lane = history_slots(n) * iters * 4
    for threads in (_THREADS, 64, 32):
        if per_lane * threads <= _SMEM_LIMIT:
            return threads, per_lane * threads, 0
    blocks = -(-tokens * bwd_group(n) // _THREADS)
    return _THREADS, 0, history_slots(n) * iters * blocks * _THREADS


def launch_bwd(n, tokens, iters, eps, grad_mode, *, grad_P, logits, d_logits, hist, stream,
               g_post=None, h_post_raw=None, d_post_raw=None, ds=False, post_mult=2.0):
    """Sinkhorn backward (and optionally the pre op's dh_post_raw of H_post = post_mult sigmoid)
    for every token; ``ds``: of the DeepSeek forward (softmax start)."""
    threads, smem, _ = bwd_history(n, tokens, iters, grad_mode)
    if grad_mode == "implicit":
        args = (grad_P, logits, d_logits, g_post, h_post_raw, d_post_raw, i64(tokens), i32(iters), f32(eps),
                f32(post_mult))
        if n > _IMPLICIT_WARP_N:
            launch(_FILE, f"mhc_sinkhorn_knopp_implicit_bwd_warp_kernel<{n},{_b(ds)}>",
                   (-(-tokens // _IMPLICIT_WARPS), 1, 1), (32 * _IMPLICIT_WARPS, 1, 1), args, stream)
        else:
            launch(_FILE, f"mhc_sinkhorn_knopp_implicit_bwd_kernel<{n},{_b(ds)}>", (-(-tokens // threads), 1, 1),
                   (threads, 1, 1), args, stream)
        return
    g = bwd_group(n)
    launch(_FILE, f"mhc_sinkhorn_knopp_bwd_kernel<{n},{g},{_b(ds)}>", (-(-tokens * g // threads), 1, 1),
           (threads, 1, 1), (grad_P, logits, d_logits, hist, i32(1 if smem else 0), g_post, h_post_raw, d_post_raw,
                             i64(tokens), i32(iters), f32(eps), f32(post_mult)), stream, shared_mem=smem)


@takes_settings
def _plan_fwd(infos, s: LayerSettings):
    L = infos["logits"]
    n = check_logits("logits", L)
    iters, eps, ds = s.num_iters, s.eps, s.deepseek
    tokens = tokens_of(L.shape[:-2])

    def run_kernels(p, outs, sc, stream):
        launch_fwd(n, tokens, iters, eps, logits=p["logits"], P=outs[0], stream=stream, ds=ds)

    return Plan([(L.shape, "float32")], run_kernels,
                lambda a: (reference.sinkhorn_knopp_fwd(a["logits"], iters, eps, s.convention),),
                single=True, empty=tokens == 0)


@takes_settings
def _plan_bwd(infos, s: LayerSettings):
    L, G = infos["logits"], infos["grad_P"]
    n = check_logits("logits", L)
    _checks.coefficient("grad_P", G)
    _checks.same_shape("grad_P", G.shape, "logits", L.shape)
    iters, eps, ds, mode = s.num_iters, s.eps, s.deepseek, s.grad_mode
    tokens = tokens_of(L.shape[:-2])
    hist = bwd_history(n, tokens, iters, mode)[2]

    def run_kernels(p, outs, sc, stream):
        launch_bwd(n, tokens, iters, eps, mode, grad_P=p["grad_P"], logits=p["logits"], d_logits=outs[0],
                   hist=sc.get("hist"), stream=stream, ds=ds)

    return Plan([(L.shape, "float32")], run_kernels,
                lambda a: (reference.sinkhorn_knopp_bwd(a["grad_P"], a["logits"], iters, eps, mode, s.convention),),
                scratch={"hist": ((hist,), "float32")} if hist else {}, single=True, empty=tokens == 0)


def sinkhorn_knopp_fwd(logits, num_iters=DEFAULT, eps=DEFAULT, *, convention="paper"):
    """Project each n x n matrix of logits onto the doubly-stochastic matrices.

    K = exp(L - rowmax(L)); then ``num_iters`` times a row normalisation
    P <- P / (rowsum + eps) followed by a column normalisation
    P <- P / (colsum + eps) (OPS.md section 1; paper Eq. 9).  The row-max shift
    never changes the result beyond rounding but keeps exp from overflowing.
    ``convention="deepseek"`` (OPS.md "DeepSeek-V4 convention"): the first row step is
    the softmax plus eps, P <- K / rowsum(K) + eps; num_iters counts it.

    Args:
        logits: float32 [..., n, n], 1 <= n <= 32; any leading token dims.
        num_iters: Sinkhorn iterations (row + column step each), >= 0 (deepseek: >= 1).
            default 20.
        eps: added to every row / column sum, >= 0.  default 1e-8 (paper), 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek"; keyword only.

    Returns:
        P: float32 [..., n, n]; columns sum to 1 up to rounding, rows approximately.

    Raises:
        TypeError: logits not float32.  ValueError: not square, n out of range,
        bad num_iters / eps / convention.

    Notes:
        GPU: one launch for all tokens on the caller's current stream.  CPU
        inputs run the NumPy reference.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.sinkhorn_knopp`` for gradients.
    """
    return run(_plan_fwd, {"logits": logits}, num_iters=num_iters, eps=eps, convention=convention)


def sinkhorn_knopp_bwd(grad_P, logits, num_iters=DEFAULT, eps=DEFAULT, grad_mode="unrolled", *, convention="paper"):
    """Gradient of :func:`sinkhorn_knopp_fwd` with respect to the logits.

    ``grad_mode="unrolled"`` (default): the exact vector-Jacobian product of
    the forward as computed (every row and column step, the exp and its
    row-max shift), recomputing the forward on chip from the logits.
    ``grad_mode="implicit"``: the gradient of the converged projection by the
    implicit function theorem, dL = P * (G - a 1^T - 1 b^T) with (a, b) from
    the n x n Schur-complement system solved directly; its cost does not
    depend on num_iters, and it differs from "unrolled" as far as the forward
    is not converged (OPS.md section 1).  Every row of d_logits sums to 0.
    Under ``convention="deepseek"`` "unrolled" differentiates the deepseek forward,
    softmax start included; "implicit" is the same formula at its P.

    Args:
        grad_P: float32 [..., n, n], gradient of the loss w.r.t. P.
        logits, num_iters, eps, convention: as given to the forward.
        grad_mode: "unrolled" or "implicit".

    Returns:
        d_logits: float32 [..., n, n].

    Raises:
        TypeError / ValueError: as the forward; grad_P shape differs; bad grad_mode.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.sinkhorn_knopp`` for gradients.
    """
    return run(_plan_bwd, {"grad_P": grad_P, "logits": logits}, num_iters=num_iters, eps=eps, grad_mode=grad_mode,
               convention=convention)


# ------------------------------------------------------------------ op spec
LOGITS = Arg("logits", "...nn", "coefficient")
KERNELS = (
    Kernel("sinkhorn_knopp_fwd", _plan_fwd, (LOGITS,), (Arg("P", "...nn", "coefficient"),), params=SINKHORN_PARAMS),
    Kernel("sinkhorn_knopp_bwd", _plan_bwd, (LOGITS,), (LOGITS,), grads=(Arg("grad_P", "...nn", "coefficient"),),
           params={**SINKHORN_PARAMS, **GRAD_MODE}),
)
