"""JAX adapter: the mHC operators as differentiable, jittable, vmappable JAX functions.

``mhc_cupy.jax`` exposes the seven operators of OPS.md sections 1-7 with the
arguments of the functional ``*_fwd`` API:

  ``sinkhorn_knopp``  ``rmsnorm``  ``stream_mix``  ``stream_aggregate``
  ``stream_distribute``  ``mhc_post_op``  ``mhc_pre_op``

Each is a ``jax.custom_vjp`` function that works eagerly and under
``jax.jit``, ``jax.grad`` / ``jax.vjp`` and ``jax.vmap`` (any number of
nested levels).  Needs jax >= 0.6.1 (``jax.experimental.buffer_callback``).

How it runs
-----------
Every kernel call is one ``jax.experimental.buffer_callback`` custom call:

* Trace time: the op's planner (``mhc_cupy.ops.<family>._plan_*``) sees the
  abstract shapes and dtypes (``ArrayInfo`` without pointers), validates them
  (``TypeError`` / ``ValueError`` at trace time, before anything runs) and
  returns the outputs and scratch buffers to allocate.  Outputs and scratch
  are declared as the custom call's results, so XLA allocates them.
* Run time on a GPU: the callback reads the raw device pointers of XLA's
  buffers and launches the CuPy/NVRTC kernels on XLA's own stream
  (``ctx.stream``) inside ``cupy.cuda.Device(ordinal)``: no copy, no host
  round trip, no synchronisation.  The Python callback runs on the host once
  per kernel call each time the compiled program runs (it only enqueues
  launches), never per element.
* Run time on the CPU (e.g. CI): the same callback runs the float64 NumPy
  reference (``mhc_cupy.reference``) on the host buffers and writes the
  rounded results in place.

Batching (``jax.vmap``) is explicit (``jax.custom_batching.custom_vmap``):
the ops accept any number of leading token dims, so a batch axis becomes one
more leading token dim and the kernel runs once for the whole batch, planned
for the batched shapes.  The exceptions are handled so that vmap equals a
per-example loop: a *shared* coefficient vector ``h`` ``[n]`` of
``stream_aggregate`` / ``stream_distribute`` that is batched itself, or whose
per-example gradient is needed, is expanded to per-token ``[..., n]`` and its
gradient summed per example; ``rmsnorm`` with a ``weight`` whose per-example
gradient is needed (or that is batched) runs sequentially over the batch
(``jax.lax.map``).

Sharding: every kernel call is per token, and (under ``jax.jit`` or eagerly: each
kernel call is a jitted function) with the token (leading) dims sharded over a mesh (``NamedSharding(mesh, P("data"))``
or any token dim, Shardy or GSPMD) each device runs it on its own tokens:
outputs and token gradients keep the token sharding, no activation is
gathered, and the gradient of a parameter shared by all tokens (phi, alpha,
bias, a shared ``h`` [n], the RMSNorm weight) is reduced across the mesh
(``psum``) once, inside the op, and comes back replicated
(``mhc_cupy._jax_shard.token_sharded``, a ``custom_partitioning`` rule).
A sharded C or n dim, or a sharded parameter, is replicated for the op
(correct, but that operand is gathered); so is a token dim whose size its
mesh axes do not divide.  Inside ``jax.shard_map`` (check_vma on or off) each
device runs the kernels on its block and results vary like their inputs; as for
jax.numpy ops, the gradient of an input that does not vary over a mesh axis is
summed over it (``psum``) with check_vma on, and left per device (each its own
partial sum) with check_vma off.

Gradients: the forward saves its inputs; the backward calls the op's ``_bwd``
kernels (statistics and Sinkhorn iterations are recomputed on chip).
Cotangents of unused outputs (symbolic zeros) give zero gradients; for
``mhc_pre_op`` and ``mhc_coeffs`` they are passed to the kernel as "absent"
(None) and cost nothing.

From the op table: every op's ``custom_vjp`` (forward, VJP, its jit with the
static parameters) comes from its ``<op>_fwd`` / ``<op>_bwd`` pair in
``mhc_cupy.ops.SPECS``, and its public function's signature is the functional
``<op>_bwd``'s less its gradients (:mod:`mhc_cupy._adapter`); Sinkhorn's and the
pre op's settings are resolved into one ``mhc_cupy._settings.LayerSettings``.
Written by hand, only what an op needs beyond that (the ``prepare`` hooks:
``_BY_HAND`` here, with ``mhc_cupy._adapter.BY_HAND``, shared with torch; each
gets the arguments by name and returns only the kernel parameters it changes):

===============  ==============================================================
op               by hand
===============  ==============================================================
``rmsnorm``      ``eps`` checked before the jit (a static argument)
``mhc_coeffs``   ``eps`` resolved per ``convention`` (not a kernel parameter)
``mhc_post_op``  ``convention`` checked
``mhc_head``     its parameters as one dict (DeepSeek-V4's names), the defaults
                 of its convention ("deepseek")
``mhc_layer``    the fused layer: one ``custom_vjp`` around the fused pieces and
                 the sublayer's VJP (OPS.md section 9)
``mhc_layer_in`` the layer's pre piece with layer_in for the next GEMM (normalised
                 and / or float8; OPS.md section 13), forward only
===============  ==============================================================

Notes:
    Reverse mode only, first order: forward mode (``jax.jvp``,
    ``jax.jacfwd``) of a custom_vjp function and gradients of these
    gradients are not supported (the backward kernels have no derivative
    rule of their own): forward mode raises JAX's TypeError, a gradient of
    a gradient a ValueError that says so.
    Non-array parameters (``num_iters``, ``eps``, ``grad_mode``) are static:
    each distinct value compiles its own program.  The ``buffer_callback``
    custom call is not marked command-buffer compatible (XLA does not capture
    it into CUDA graphs), and it is not side-effecting: XLA may remove it when
    its results are unused.
"""

from __future__ import annotations

import functools

import numpy as np

from ._deps import require

require("jax", "jax", "mhc_cupy.jax")  # missing: an ImportError naming the extra
import jax as _jax  # noqa: E402
import jax.numpy as _jnp  # noqa: E402

from . import _adapter, _checks, _convention, _layer_init  # noqa: E402
from ._convention import DEFAULT  # noqa: E402
from . import _jax_layer as _layer  # noqa: E402
from . import _jax_shard as _shard  # noqa: E402
from ._jax_stack import mhc_stack, mhc_stack_init  # noqa: E402,F401 - stacks of layers (OPS.md section 12)
from ._jax_layer_in import mhc_layer_in  # noqa: E402,F401 - layer_in for the next GEMM (OPS.md section 13)
from ._jax_kernels import _k  # noqa: E402 - one kernel entry point as a JAX function
from ._kernel_choice import current as _current_choice  # noqa: E402
from ._settings import LayerSettings  # noqa: E402
from . import ops as _ops  # noqa: E402

__all__ = [
    "sinkhorn_knopp", "rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute",
    "mhc_post_op", "mhc_pre_op", "mhc_coeffs", "mhc_init", "mhc_layer", "mhc_from_deepseek", "mhc_to_deepseek",
    "mhc_head", "mhc_head_init", "mhc_stack", "mhc_stack_init", "mhc_layer_in",
]


# ------------------------------------------------------- custom_vjp ops
def _value(p):
    """The value of a ``CustomVJPPrimal`` (symbolic-zeros mode), or p itself."""
    return getattr(p, "value", p)


def _differentiable(op: str):
    """Op ``op`` (``<op>_fwd`` with ``<op>_bwd`` as its VJP) as a jitted ``custom_vjp`` function
    ``f(*arrays, params)`` of the forward's arrays, with ``params`` (the planner's keyword arguments
    as a tuple of pairs) static.  The backward gets the saved inputs and the output cotangents (an
    unused output's, of a multi-output op, as absent: a symbolic zero the kernel counts as zero) and
    returns the gradient of each input (None for an absent optional one)."""
    fwd, bwd = _ops.SPECS[f"{op}_fwd"], _ops.SPECS[f"{op}_bwd"]
    n, single = len(fwd.inputs), len(fwd.outputs) == 1
    names = tuple(a.name for a in fwd.inputs)

    @functools.partial(_jax.custom_vjp, nondiff_argnums=(n,))
    def f(*args):
        outs = _k(fwd.name, args[n], *args[:n])
        return outs[0] if single else outs

    def f_fwd(*args):
        args = tuple(_value(a) for a in args)
        return f(*args), args[:n]

    def f_bwd(params, res, cts):
        grads = (cts,) if single else tuple(None if isinstance(g, _jax.custom_derivatives.SymbolicZero) else g
                                            for g in cts)
        given = dict(zip(names, res))
        outs = _k(bwd.name, params, *grads, *res)
        got = dict(zip((o.name for o in bwd.outputs if given[o.name] is not None), outs))
        return _shard.like(tuple(got.get(k) for k in names), res)

    f.__name__ = op
    f.defvjp(f_fwd, f_bwd, symbolic_zeros=not single)

    # jitted: eager calls hit a compiled-program cache; inside an outer jit / grad / vmap they are
    # ordinary nested calls, whose traces JAX caches too.  The kernel choice in force (what _k plans
    # under when it traces) is a static argument, so a call under another choice traces afresh: a trace
    # made under one choice would otherwise serve every later call of those shapes, eager or in a new jit.
    def g(*args):
        return f(*args[:n + 1])

    g.__name__ = op
    jitted = _jax.jit(g, static_argnums=(n, n + 1))

    @functools.wraps(f)
    def call(*args):
        return jitted(*args, _current_choice())
    return call


def _conv(convention) -> tuple:
    return (("convention", convention),)


# ------------------------------------------------------------ what ops need by hand
def _eps_checked(eps, **_) -> dict:
    """``eps`` checked before the jit, where it is a static argument."""
    return {"eps": _checks.eps("eps", eps)}


#: The ``prepare`` hooks (:func:`mhc_cupy._adapter.public`) of the ops that need one, by op.
_BY_HAND = {**_adapter.BY_HAND, "rmsnorm": _eps_checked,
            "mhc_coeffs": lambda **given: _eps_checked(**_adapter.coeffs_eps(**given))}


def _public(op: str, doc: str):
    return _adapter.public(op, doc, __name__, lambda arrays, kw: f"    return _f({''.join(a + ', ' for a in arrays)}"
                           f"tuple({kw}.items()))\n", {"_f": _differentiable(op)}, _BY_HAND.get(op))


# ------------------------------------------------------------ public API
sinkhorn_knopp = _public("sinkhorn_knopp", """Project each n x n matrix of logits onto the doubly-stochastic matrices (JAX).

    K = exp(L - rowmax(L)); then ``num_iters`` times a row normalisation
    P <- P / (rowsum + eps) followed by a column normalisation
    P <- P / (colsum + eps) (OPS.md section 1; paper Eq. 9).  ``convention="deepseek"``
    (OPS.md "DeepSeek-V4 convention"): the first row step is the softmax plus eps.

    Args:
        logits: float32 [..., n, n], 1 <= n <= 32; any leading token dims.
        num_iters: Sinkhorn iterations (row + column step each), >= 0 (deepseek: >= 1). Static.
            default 20.
        eps: added to every row / column sum, >= 0. Static.  default 1e-8 (paper) / 1e-6
            (deepseek).
        grad_mode: gradient of the backward, "unrolled" (default; the exact
            vector-Jacobian product of the iteration as computed) or "implicit"
            (implicit-function gradient of the converged projection). Static.
        convention: "paper" (default) or "deepseek".  Static, keyword only.

    Returns:
        P: float32 [..., n, n].

    Raises:
        TypeError: logits not float32; num_iters not an int.  ValueError: not
        square, n out of range, bad num_iters / eps / grad_mode.  Raised at
        trace time.

    Notes:
        GPU: one buffer_callback custom call launching the kernel on XLA's
        stream, in place in XLA's buffers.  Backward recomputes the forward
        from the saved logits.  jit / grad / vjp / vmap supported.
    """)

rmsnorm = _public("rmsnorm", """RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) (* weight) (JAX; OPS.md section 2).

    For the mHC coefficient path normalise vec(x): pass x reshaped to [..., n*C].

    Args:
        x: [..., C], bfloat16 / float16 / float32.
        eps: >= 0, added to the mean square. Static. Default 1e-5.
        weight: optional float32 [C], shared by all tokens.

    Returns:
        y: [..., C], dtype of x (statistics in float32, one rounding).

    Raises:
        TypeError: bad dtypes.  ValueError: weight shape, eps.  At trace time.

    Notes:
        Backward recomputes the statistics from x; d_weight is summed over
        tokens in a fixed order.  Under vmap with a weight, the per-example
        weight gradient is computed one example at a time.
    """)

stream_mix = _public("stream_mix", """Mix the n residual streams of each token: out_i = sum_j M_ij x_j (JAX; OPS.md section 3).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32.
        M: float32 [..., n, n], one mixing matrix per token.

    Returns:
        out: [..., n, C], dtype of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range.

    Notes:
        Backward: dx_j = sum_i M_ij g_i, dM_ij = sum_c g_ic x_jc (float32,
        bitwise reproducible).
    """)

stream_aggregate = _public("stream_aggregate", """Weighted sum of the streams: out = sum_i h_i x_i (JAX; OPS.md section 4).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32).
        h: float32, per token [..., n] or shared by all tokens [n].

    Returns:
        out: [..., C], dtype of x.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range.

    Notes:
        Backward: dx_i = h_i g; dh_i = sum_c g_c x_ic, for a shared h summed
        over all tokens (deterministically).  Under vmap a shared h stays
        shared per example: its gradient is per example.
    """)

stream_distribute = _public("stream_distribute", """Write one layer output to every stream, scaled: out_i = h_i y (JAX; OPS.md section 5).

    Args:
        y: [..., C] activations (bfloat16 / float16 / float32).
        h: float32, per token [..., n] or shared [n].

    Returns:
        out: [..., n, C], dtype of y.

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range.

    Notes:
        Backward: dy = sum_i h_i g_i; dh_i = sum_c g_ic y_c (summed over tokens
        for a shared h).
    """)

mhc_post_op = _public("mhc_post_op", """mHC residual update: out_i = sum_j H_res_ij x_j + H_post_i y (JAX; OPS.md section 6, Eq. 3).

    ``convention="deepseek"`` (OPS.md "DeepSeek-V4 convention"): H_res transposed,
    out_j = sum_i H_res_ij x_i + H_post_j y.

    Args:
        layer_out: y, [..., C] activations (bfloat16 / float16 / float32).
        x: [..., n, C], same dtype, 1 <= n <= 32.
        H_post: float32 [..., n] (already activated, 2 sigmoid).
        H_res: float32 [..., n, n].
        convention: "paper" (default) or "deepseek".  Static, keyword only.

    Returns:
        out: [..., n, C], dtype of x (one rounding per element).

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range.

    Notes:
        Backward (dy, dx, dH_post, dH_res) in one kernel, no atomics: bitwise
        reproducible.
    """)

mhc_pre_op = _public("mhc_pre_op", """mHC coefficient activations and layer input (JAX; OPS.md section 7, paper Eq. 8).

    H_pre = sigmoid(h_pre_raw) + hc_eps;  H_post = post_mult sigmoid(h_post_raw);
    H_res = sinkhorn_knopp(h_res_raw, num_iters, eps, convention=convention);  layer_in = sum_i H_pre_i x_i.

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32.
        h_pre_raw, h_post_raw: float32 [..., n] per token.
        h_res_raw: float32 [..., n, n] per token.
        num_iters: Sinkhorn iterations, static; default 20.
        eps: Sinkhorn eps, static; default 1e-8 (paper) / 1e-6 (deepseek).
        grad_mode: Sinkhorn gradient, "unrolled" (default) or "implicit". Static.
        convention: "paper" (default) or "deepseek" (OPS.md "DeepSeek-V4 convention").  Static,
            keyword only, as hc_eps (default 0 paper / 1e-6 deepseek) and post_mult (default 2).

    Returns:
        (layer_in [..., C] dtype of x, H_pre float32 [..., n], H_post float32
        [..., n], H_res float32 [..., n, n]).

    Raises:
        TypeError: bad dtypes.  ValueError: shapes disagree, n out of range,
        bad num_iters / eps / grad_mode.  At trace time.

    Notes:
        The cotangent of an output that is not used is a symbolic zero and is
        passed to the backward kernel as absent (it contributes nothing and
        costs nothing); everything else is recomputed from the saved inputs.
    """)

mhc_coeffs = _public("mhc_coeffs", """Per-token mHC coefficients from the residual stream (JAX; OPS.md section 8, paper Eqs. 14-18).

    With x~ = vec(x) (length n*C), r = sqrt(mean(x~^2) + eps) and Ht = x~ phi:
    h_pre_raw = alpha[0] Ht_pre / r + bias_pre, h_post_raw = alpha[1] Ht_post / r + bias_post,
    h_res_raw = alpha[2] mat(Ht_res) / r + bias_res (columns of phi ordered pre | post | res).

    Args:
        x: [..., n, C] activations (bfloat16 / float16 / float32), 1 <= n <= 32.
        phi: float32 [n*C, n*n + 2n].  alpha: float32 [3].  bias: float32 [n*n + 2n].
        eps: added to the mean square, >= 0. Static.  default 1e-5 (paper) / 1e-6 (deepseek).
        convention: "paper" (default) or "deepseek": the same maths (DeepSeek-V4's hc_fn is phi^T,
            hc_scale alpha, hc_base bias: OPS.md "DeepSeek-V4 convention"), only the default eps
            differs.  Static, keyword only.

    Returns:
        (h_pre_raw [..., n], h_post_raw [..., n], h_res_raw [..., n, n]), float32.

    Raises:
        TypeError / ValueError at trace time: bad dtypes or shapes.

    Notes:
        Differentiable in x, phi, alpha and bias (custom_vjp; unused outputs
        are symbolic zeros); jit / grad / vmap supported (a batched phi, alpha
        or bias, or their per-example gradients, run once per example).
    """)

_head = _differentiable("mhc_head")


# ------------------------------------------------------------ the mHC layer
def mhc_init(key, dim: int, n_streams: int = 4, alpha_init: float = 0.01, convention: str = "paper") -> dict:
    """Parameters of one mHC layer for :func:`mhc_layer` (the paper's initialisation).

    phi [n*C, n*n + 2n] small normal (std 1/sqrt(n*C)); alpha [3] = ``alpha_init``
    (small, paper section 4); bias from :func:`mhc_cupy._layer_init.identity_bias`,
    so that the layer starts close to a plain residual connection (H_pre = 1/n,
    H_post = 1, H_res = 0.95 on the diagonal).  All float32 (under jax_enable_x64 too).
    ``convention`` ("paper" or "deepseek") is checked only: both conventions use the same
    parameters and start (pass the same convention to :func:`mhc_layer`; DeepSeek-V4 weights:
    :func:`mhc_from_deepseek`).

    Raises:
        TypeError / ValueError: dim not an int >= 1, n_streams not in 1..32, alpha_init not a finite
        float, bad convention.
    """
    from ._layer_init import identity_bias

    _convention.check(convention)
    dim, n_streams = _checks.layer_size(dim, n_streams)
    alpha_init = _layer_init.init_value("alpha_init", alpha_init)
    n, D = n_streams, n_streams * dim
    phi = _jax.random.normal(key, (D, n * n + 2 * n), _jnp.float32) * np.float32(1 / np.sqrt(D))  # f32 under x64 too
    return {"phi": phi, "alpha": _jnp.full((3,), alpha_init, _jnp.float32),
            "bias": _jnp.asarray(identity_bias(n), _jnp.float32)}


def mhc_from_deepseek(hc_fn, hc_scale, hc_base) -> dict:
    """:func:`mhc_layer` parameters from DeepSeek-V4's layout (docs/DEEPSEEK.md): ``hc_fn``
    [n*n + 2n, n*C] (a checkpoint's ``hc_attn_fn`` / ``hc_ffn_fn``, rows pre | post | res) ->
    phi = hc_fn^T; ``hc_scale`` [3] -> alpha; ``hc_base`` [n*n + 2n] -> bias.  float32.
    Use with ``mhc_layer(..., convention="deepseek")``.

    Raises:
        TypeError: an argument that is not an array (None included), or not of a real
        floating-point dtype (complex, bool, integer).  ValueError: shapes that are
        not a DeepSeek layer's, or n outside 1..32 (the argument named).
    """
    hc_fn, hc_scale, hc_base = _layer.deepseek_params(hc_fn, hc_scale, hc_base)
    return {"phi": hc_fn.T, "alpha": hc_scale, "bias": hc_base}


def mhc_to_deepseek(params: dict) -> tuple:
    """(hc_fn [n*n + 2n, n*C], hc_scale [3], hc_base [n*n + 2n]) of :func:`mhc_layer` parameters:
    the inverse of :func:`mhc_from_deepseek`.  TypeError (naming params) for anything but that dict
    with an array phi."""
    _layer.check_params(params)
    if not hasattr(params["phi"], "T"):
        raise TypeError(f"params['phi'] has type {type(params['phi']).__name__}; it needs an array [n*C, n*n + 2n]")
    return params["phi"].T, params["alpha"], params["bias"]


# ------------------------------------------------------- fused layer (OPS.md section 9)
def _layer_settings(num_iters, eps, rms_eps, grad_mode, convention="paper", hc_eps=DEFAULT,
                    post_mult=DEFAULT) -> LayerSettings:
    """The fused layer's static settings, resolved (DEFAULT: the convention's) and checked."""
    return LayerSettings.resolve(convention, num_iters=num_iters, eps=eps, rms_eps=rms_eps, grad_mode=grad_mode,
                                 hc_eps=hc_eps, post_mult=post_mult)


@functools.partial(_jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_layer(f, settings, fold, phi, alpha, bias, x, *consts):
    return _fused_layer_fwd(f, settings, fold, phi, alpha, bias, x, *consts)[0]


def _fused_layer_fwd(f, settings, fold, phi, alpha, bias, x, *consts):
    out, _, res = _layer_fwd(f, settings, phi, alpha, bias, x, consts)
    return out, res


def _layer_pre(settings, x, phi, alpha, bias) -> tuple:
    """The layer's pre piece (OPS.md section 9): (layer_in, H_pre, H_post, H_res, stats)."""
    return _k("mhc_layer_pre_fwd", (("settings", settings),), x, phi, alpha, bias)


def _layer_fwd(f, settings, phi, alpha, bias, x, consts, pre=None, nxt=None) -> tuple:
    """One layer's forward: its pre piece (``pre``: its outputs for x, already computed), the sublayer
    ``f(layer_in, *consts)``, the residual update; with ``nxt`` (the next layer's phi, alpha, bias) the
    residual update and the next layer's pre piece as one op (``mhc_boundary_fwd``, OPS.md section 12:
    ``out`` bitwise the post op's).  Returns (out, the next layer's pre-piece outputs or None, the
    residuals of :func:`_fused_layer_bwd`)."""
    layer_in, H_pre, H_post, H_res, stats = _layer_pre(settings, x, phi, alpha, bias) if pre is None else pre
    y, f_vjp = _jax.vjp(lambda li, *c: f(li, *c).astype(x.dtype), layer_in, *consts)
    res = (phi, alpha, bias, x, stats, H_pre, H_post, H_res, y, f_vjp)
    if nxt is None:
        return _k("mhc_post_op_fwd", _conv(settings.convention), y, x, H_post, H_res)[0], None, res
    out, *pre_next = _k("mhc_boundary_fwd", (("settings", settings),), y, x, H_post, H_res, *nxt)
    return out, tuple(pre_next), res


def _fused_layer_bwd(f, settings, fold, res, g):
    """The post op's part of dx goes into mhc_layer_pre_bwd's one rounding of dx as g (fold: the
    pre backward computes H_res^T g) or as the post op's dx from its own backward (grad_x;
    mhc_cupy.ops.layer.fold_post_dx)."""
    phi, alpha, bias, x, stats, H_pre, H_post, H_res, y, f_vjp = res
    if fold:
        dy, dH_post, dH_res = _k("mhc_layer_post_bwd", _conv(settings.convention), g, y, x, H_post, H_res)
    else:
        dy, dx_post, dH_post, dH_res = _k("mhc_post_op_bwd", _conv(settings.convention), g, y, x, H_post, H_res)
    g_li, *d_consts = f_vjp(dy)
    if g_li.dtype != g.dtype:
        g_li = g_li.astype(g.dtype)
    dx, dphi, dalpha, dbias = _k("mhc_layer_pre_bwd", (("settings", settings),), g_li, g if fold else None, dH_post, dH_res,
                                 None if fold else dx_post, x, phi, alpha, bias, stats, H_pre, H_res)
    return (*_shard.like((dphi, dalpha, dbias, dx), (phi, alpha, bias, x)), *d_consts)


_fused_layer.defvjp(_fused_layer_fwd, _fused_layer_bwd)


def mhc_layer(params: dict, x, f, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode: str = "unrolled", *,
              convention: str = "paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """One mHC layer, functional (paper Eq. 3): x_{l+1} = H_res x_l + H_post^T f(H_pre x_l).

    The per-token coefficients come from the coefficient path (:func:`mhc_coeffs`,
    OPS.md section 8), then :func:`mhc_pre_op` and :func:`mhc_post_op`, as one ``custom_vjp``
    over the fused pieces (OPS.md section 9: the coefficients and the pre op in one forward)
    with f's VJP inside; the backward writes dx once (for n > 4 with the post op's dx from its own
    backward, rounded to x's dtype, added before the final rounding:
    ``mhc_cupy.ops.layer.fold_post_dx``).

    Args:
        params: {"phi", "alpha", "bias"} from :func:`mhc_init` (or :func:`mhc_from_deepseek`).
        x: [..., n, C] residual streams (bfloat16 / float16 / float32).
        f: the sublayer, [..., C] -> [..., C] (its output is cast to x's dtype); None: the identity.
            Traced at every call, as it is then (a stateful sublayer, or one reading globals,
            is used with its current state); what it closes over may be traced values (weights,
            PRNG keys, ints: under jit / grad / vmap / lax.scan / checkpoint / shard_map), and
            closed-over weights get their gradients.
        num_iters, eps, grad_mode: Sinkhorn-Knopp settings; rms_eps: the coefficient path's eps.
            left out: the convention's default (20, 1e-8, 1e-5; "deepseek": 20, 1e-6, 1e-6).
        convention: "paper" (default) or "deepseek" (the DeepSeek-V4 maths, OPS.md
            "DeepSeek-V4 convention": softmax-start Sinkhorn, H_pre = sigmoid + hc_eps,
            H_post = post_mult sigmoid, the post op with H_res transposed).  Keyword only.
        hc_eps: added to H_pre (default 0, "deepseek" 1e-6).  post_mult: H_post's factor (default 2).

    Returns:
        x_{l+1}: [..., n, C], dtype of x.  Differentiable (jit / grad / vmap).

    Raises:
        TypeError / ValueError: bad num_iters (an int in 0..10000, >= 1 under "deepseek"), eps,
        rms_eps, hc_eps, post_mult, grad_mode or convention, or shapes (x's n and C must match
        params["phi"]); f neither callable nor None, or not returning one array of its input's shape.
    """
    _layer.check_params(params)
    settings = _layer_settings(num_iters, eps, rms_eps, grad_mode, convention, hc_eps, post_mult)
    _layer.check_x(params, x)
    # the fused pieces (OPS.md section 9), one custom_vjp around the whole layer with f's VJP inside
    # (f's closed-over traced values become explicit arguments: they get their gradients, and no
    # tracer is used outside the trace that made it)
    coefficients = (params["phi"], params["alpha"], params["bias"])
    f_conv, consts = _layer.sublayer(f, x, coefficients)
    return _fused_layer(f_conv, settings, _ops.layer.fold_post_dx(x.shape[-2]), *coefficients, x, *consts)


# ------------------------------------------------------------------ the head (OPS.md section 11)
def mhc_head_init(key, dim: int, n_streams: int = 4, scale_init: float = 0.01) -> dict:
    """Parameters of the mHC head for :func:`mhc_head`, in DeepSeek-V4's layout and names:
    hc_fn [n, n*C] small normal (std 1/sqrt(n*C)), hc_scale [1] = ``scale_init``, hc_base [n] =
    logit(1/n) (0.99 for n = 1: the head starts as the stream mean).  All float32 (under
    jax_enable_x64 too).

    Raises:
        TypeError / ValueError: dim not an int >= 1, n_streams not in 1..32, scale_init not a finite
        float.
    """
    from ._layer_init import logit

    dim, n = _checks.layer_size(dim, n_streams)
    scale_init = _layer_init.init_value("scale_init", scale_init)
    D = n * dim
    return {"hc_fn": _jax.random.normal(key, (n, D), _jnp.float32) * np.float32(1 / np.sqrt(D)),
            "hc_scale": _jnp.full((1,), scale_init, _jnp.float32),
            "hc_base": _jnp.full((n,), logit(1.0 / n if n > 1 else 0.99), _jnp.float32)}


def mhc_head(params: dict, x, rms_eps=DEFAULT, hc_eps=DEFAULT, *, convention: str = "deepseek"):
    """The mHC head: n streams -> one hidden state (JAX; OPS.md section 11, DeepSeek-V4 ``hc_head``).

    Per token, with x~ = vec(x): w = sigmoid((x~ hc_fn^T) / sqrt(mean(x~^2) + rms_eps) * hc_scale
    + hc_base) + hc_eps; out = sum_i w_i x_i.

    Args:
        params: {"hc_fn" [n, n*C], "hc_scale" [1], "hc_base" [n]} (float32), from
            :func:`mhc_head_init` or a V4 checkpoint's ``hc_head_fn`` / ``hc_head_scale`` /
            ``hc_head_base`` as they are.
        x: [..., n, C] (bfloat16 / float16 / float32).
        rms_eps, hc_eps: left out, the convention's defaults ("deepseek": 1e-6, 1e-6; "paper":
            1e-5, 0).  Static.
        convention: "deepseek" (default) or "paper"; keyword only.

    Returns:
        out [..., C], dtype of x; differentiable in x and the parameters (custom_vjp);
        jit / grad / vmap supported.

    Raises:
        TypeError / ValueError (at trace time): params not that dict, bad dtypes or shapes,
        bad rms_eps / hc_eps / convention.
    """
    if not isinstance(params, dict) or any(k not in params for k in ("hc_fn", "hc_scale", "hc_base")):
        raise TypeError(f"params must be the dict of mhc_head_init (hc_fn, hc_scale, hc_base), "
                        f"got {_layer.params_got(params)}")
    return _head(x, params["hc_fn"], params["hc_scale"], params["hc_base"], (
        ("rms_eps", _convention.rms_eps(convention, rms_eps)),
        ("hc_eps", _checks.eps("hc_eps", _convention.resolve(convention, hc_eps=hc_eps)))))
