"""``mhc_cupy.jax.mhc_stack``: L mHC layers over per-layer parameters stacked on a leading axis,
with stream recompute (paper section 4.3, docs/OPS.md section 12).

x_{l+1} = H_res,l x_l + H_post,l^T f_l(H_pre,l x_l) for l = 0 .. L-1 (paper Eq. 3): the values
and gradients, bitwise on the CPU path, of ``mhc_layer(params_l, x, partial(f, f_params_l))``
applied for l = 0 .. L-1.

* Without recompute: a ``lax.scan`` over the layers of :func:`mhc_cupy.jax.mhc_layer`'s fused
  ``custom_vjp`` (each layer saves its input streams x_l [..., n, C] for backward).
* With ``recompute = L_r``: a ``lax.scan`` over the first ceil(L / L_r) - 1 blocks of L_r layers,
  then the last block (the 1 .. L_r last layers), each one ``custom_vjp`` (:func:`_block`) whose
  forward runs its layers with the single layer's forward (``_layer_fwd``) and keeps, of the
  streams, only its input x_b; per layer it keeps what the layer saves anyway (the sublayer
  output y_j, the coefficient tensors stats, H_pre, H_post, H_res, f's VJP residuals).  Its
  backward first rebuilds x_{b+1} .. with the post op's forward (the same kernel on the same
  inputs as in the forward: bitwise the same streams), then runs each layer's backward
  (``_fused_layer_bwd``) in reverse.  Same kernels in the same order: gradients bitwise those
  without recompute.
* ``fuse_boundaries=True``: the same blocks (of one layer without recompute), layer 0's pre piece
  before the scan, and each layer's residual update run with the next layer's pre piece as one
  op, ``mhc_boundary_fwd`` (OPS.md section 12), whose outputs (the next streams and that
  layer's layer_in, H_pre, H_post, H_res, stats) go where the next pre piece's would; the
  scanned blocks end with the next block's first pre piece, the last layer with the post op
  alone.  The backward is unchanged (the boundary's streams have the post op's bits, so the
  rebuilt ones are the forward's; the coefficients are the saved ones).

f is traced once per call as ``f(f_params_l, layer_in)`` with one layer's f_params as explicit
arguments (:func:`mhc_cupy._jax_layer.sublayer`); traced values that it closes over (weights
shared by all layers, keys) enter every layer as explicit arguments and get their gradient.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _convention
from . import _jax_layer as _layer
from . import _jax_shard as _shard
from ._kernel_choice import current as current_choice, kernel_choice
from ._convention import DEFAULT
from ._stack import recompute_blocks
from .ops.layer import fold_post_dx

__all__ = ["mhc_stack", "mhc_stack_init"]

#: The per-layer parameters and their ranks once stacked: phi [L, n*C, m], alpha [L, 3], bias [L, m].
_RANKS = {"phi": 3, "alpha": 2, "bias": 2}
#: Where _layer_fwd (mhc_cupy.jax) keeps x, y, H_post and H_res in its residuals
#: (phi, alpha, bias, x, stats, H_pre, H_post, H_res, y, f_vjp).
_X, _H_POST, _H_RES, _Y = 3, 6, 7, 8


def _mj():
    """mhc_cupy.jax (imported on use: it imports this module to re-export mhc_stack)."""
    from . import jax as mj

    return mj


# ------------------------------------------------------------------ arguments
def _layers(params) -> int:
    """L of stacked layer parameters; TypeError / ValueError naming the argument otherwise."""
    if not isinstance(params, dict) or any(k not in params for k in _RANKS):
        raise TypeError(f"params must be the dict of mhc_stack_init (phi [L, n*C, m], alpha [L, 3], bias [L, m]), "
                        f"got {_layer.params_got(params)}")
    for k, rank in _RANKS.items():
        a = params[k]
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"params['{k}'] has type {type(a).__name__}; it needs an array")
        if len(a.shape) != rank:
            raise ValueError(f"params['{k}'] has shape {tuple(a.shape)}; mhc_stack needs the layers' parameters "
                             f"stacked on a leading axis L (rank {rank}: mhc_stack_init, or "
                             f"jax.tree.map(lambda *a: jnp.stack(a), *layers))")
    sizes = {k: params[k].shape[0] for k in _RANKS}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"params hold different numbers of layers (leading axes {sizes}); they need one L")
    L = sizes["phi"]
    if L == 0:
        raise ValueError("params hold L = 0 layers (leading axes of size 0); mhc_stack needs L >= 1")
    return L


def _check_stacked_shapes(params, L: int, n: int, C: int) -> None:
    """ValueError naming params['phi'] / ['alpha'] / ['bias'] and its whole stacked shape where it is not
    the L layers' parameters for x [..., n, C] (a layer's kernel would name one layer's slice)."""
    m = n * n + 2 * n
    for k, want, what in (("phi", (L, n * C, m), "[L, n*C, n*n + 2n]"), ("alpha", (L, 3), "[L, 3]"),
                          ("bias", (L, m), "[L, n*n + 2n]")):
        if tuple(params[k].shape) != want:
            raise ValueError(f"params['{k}'] has shape {tuple(params[k].shape)}; mhc_stack needs {what} = {want} "
                             f"for x [..., n, C] = [..., {n}, {C}]")


def _f_params(f, f_params, L: int) -> tuple:
    """(leaves [L, ...] of f_params, one layer's type as ShapeDtypeStructs or None)."""
    if f_params is None:
        return (), None
    if f is None:
        raise TypeError("f_params is given but f is None (the identity sublayer takes no parameters)")
    for path, a in jax.tree_util.tree_flatten_with_path(f_params)[0]:
        where = f"f_params{jax.tree_util.keystr(path)}"
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{where} has type {type(a).__name__}; it needs an array [L, ...] = [{L}, ...]")
        if len(a.shape) == 0 or a.shape[0] != L:
            raise ValueError(f"{where} has shape {tuple(a.shape)}; it needs a leading axis of the L = {L} layers "
                             f"[{L}, ...] (one slice per layer)")
    one = jax.eval_shape(lambda t: jax.tree.map(lambda a: a[0], t), f_params)
    return tuple(jax.tree_util.tree_leaves(f_params)), one


# ------------------------------------------------------------ a recompute block
def _add(acc, d):
    """acc + d (a float0 cotangent, of an int or key input, stays as it is)."""
    return acc if acc.dtype == jax.dtypes.float0 else acc + d


def _stack(ds):
    """Per-layer cotangents stacked on a leading axis (float0 ones as float0 zeros)."""
    if ds[0].dtype == jax.dtypes.float0:
        return np.zeros((len(ds),) + tuple(ds[0].shape), jax.dtypes.float0)
    return jnp.stack(ds)


def _linked_layer_bwd(settings, res, g, dy, H_post_prev) -> tuple:
    """One layer's backward inside a block with the fused boundary backward (OPS.md section 12): the
    post op's dy handed over by the next layer's (``dy``; None for the block's last layer, whose post op
    runs its own backward), its dH_post, dH_res then computed by the pre piece's backward from
    ``layer_out``; and with the previous layer's ``H_post_prev`` (None for the block's first layer)
    that layer's dy from this layer's dx (``mhc_boundary_bwd``).  n <= 4 (g is the output gradient).

    Returns (dphi, dalpha, dbias, dx, dy_prev or None, *d_consts)."""
    mj = _mj()
    phi, alpha, bias, x, stats, H_pre, H_post, H_res, y, f_vjp = res
    layer_out = y
    if dy is None:
        dy, dH_post, dH_res = mj._k("mhc_layer_post_bwd", mj._conv(settings.convention), g, y, x, H_post, H_res)
        layer_out = None
    else:
        dH_post = dH_res = None
    g_li, *d_consts = f_vjp(dy)
    if g_li.dtype != g.dtype:
        g_li = g_li.astype(g.dtype)
    args = (g_li, g, dH_post, dH_res, None, x, phi, alpha, bias, stats, H_pre, H_res, layer_out)
    st = (("settings", settings),)
    # the fused ops under the choice of the forward that linked the block (this backward may be traced
    # outside its kernel_choice block: a jax.vjp function called after it)
    with kernel_choice(boundary_bwd=True) if layer_out is not None or H_post_prev is not None else \
            contextlib.nullcontext():
        if H_post_prev is None:
            (dx, dphi, dalpha, dbias), dy_prev = mj._k("mhc_layer_pre_bwd", st, *args), None
        else:
            dx, dphi, dalpha, dbias, dy_prev = mj._k("mhc_boundary_bwd", st, *args, H_post_prev)
    return (*_shard.like((dphi, dalpha, dbias, dx), (phi, alpha, bias, x)), dy_prev, *d_consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block(f, settings, mode, phi, alpha, bias, leaves, x, consts, acc, pre, nxt):
    """L_r layers (phi [L_r, n*C, m], alpha [L_r, 3], bias [L_r, m], f's per-layer arguments
    ``leaves`` [L_r, ...]) on x [..., n, C]; f(layer_in, *leaves_j, *consts) is the sublayer.
    ``mode`` = (fold, linked, keep): ``ops.layer.fold_post_dx``; whether the backward hands each layer's
    dy from the next layer's (:func:`_linked_layer_bwd`: fused boundaries under the kernel choice
    ``boundary_bwd``, n <= 4); whether the block keeps every layer's input streams (no recompute: a
    block of several layers only so that its backward is linked) instead of rebuilding them.

    ``pre``: None (each layer runs its own pre piece), or the outputs of the first layer's pre piece
    for x (layer_in, H_pre, H_post, H_res, stats): fused boundaries, each layer's residual update
    runs with the next layer's pre piece (``mhc_boundary_fwd``), the last one's with ``nxt`` (phi,
    alpha, bias of the next block's first layer), or alone where ``nxt`` is None.  Those outputs
    are the layers' pre pieces: their gradients are the layers' backward's (pre and nxt get no
    cotangent from here, and the returned pre's is ignored).

    Returns (x_out, pre_out, acc): pre_out the next block's first layer's pre-piece outputs, or None
    (unfused, or nxt None).  ``acc`` holds the values of ``consts`` (what f closes over, the same
    for every layer) and passes through unchanged: its cotangent carries the sum of the later
    layers' contributions to the consts' gradient, to which the backward adds this block's one
    layer at a time, in the order of the layer-by-layer backward (a per-block sum added to it
    would round differently); ``consts`` itself gets no cotangent from here.
    """
    return _block_fwd(f, settings, mode, phi, alpha, bias, leaves, x, consts, acc, pre, nxt)[0]


def _block_fwd(f, settings, mode, phi, alpha, bias, leaves, x, consts, acc, pre, nxt):
    mj, x0, saved, fused, L_b = _mj(), x, [], pre is not None, phi.shape[0]
    for j in range(L_b):
        following = (phi[j + 1], alpha[j + 1], bias[j + 1]) if j + 1 < L_b else nxt
        out, pre, res = mj._layer_fwd(f, settings, phi[j], alpha[j], bias[j], x, (*(a[j] for a in leaves), *consts),
                                      pre, following if fused else None)
        assert res[_X] is x, "mhc_cupy.jax._layer_fwd's residuals changed: update mhc_cupy._jax_stack._X"
        saved.append(res if mode[2] else res[:_X] + (None,) + res[_X + 1:])  # (else rebuilt in backward)
        x = out
    return (x, pre, acc), (x0, saved)


def _block_bwd(f, settings, mode, res, cts):
    mj = _mj()
    (fold, linked, keep), (x0, saved) = mode, res
    g, _, acc = cts
    if keep:  # the block's streams, kept
        xs = [r[_X] for r in saved]
    else:  # rebuilt by the post op's forward (a fused boundary's out has its bits)
        xs = [x0]
        for r in saved[:-1]:
            xs.append(mj._k("mhc_post_op_fwd", mj._conv(settings.convention), r[_Y], xs[-1], r[_H_POST],
                            r[_H_RES])[0])
    acc, per_layer, dy = list(acc), [], None
    for j in reversed(range(len(saved))):
        r = saved[j][:_X] + (xs[j],) + saved[j][_X + 1:]
        if linked:
            dphi, dalpha, dbias, g, dy, *d = _linked_layer_bwd(settings, r, g, dy, saved[j - 1][_H_POST] if j else None)
        else:
            dphi, dalpha, dbias, g, *d = mj._fused_layer_bwd(f, settings, fold, r, g)
        d_leaves, d_consts = d[:len(d) - len(acc)], d[len(d) - len(acc):]
        acc = [_add(a, b) for a, b in zip(acc, d_consts)]
        per_layer.append((dphi, dalpha, dbias, *d_leaves))
    dphi, dalpha, dbias, *d_leaves = (_stack(ds[::-1]) for ds in zip(*per_layer))
    return dphi, dalpha, dbias, tuple(d_leaves), g, None, tuple(acc), None, None


_block.defvjp(_block_fwd, _block_bwd)


# ------------------------------------------------------------------ public API
def _python_loop(body, carry, xs):
    """``jax.lax.scan(body, carry, xs)`` for a body whose outputs are (carry, None), unrolled in Python:
    (final carry, None)."""
    for i in range(jax.tree_util.tree_leaves(xs)[0].shape[0]):
        carry, _ = body(carry, jax.tree.map(lambda a: a[i], xs))
    return carry, None


def mhc_stack(params: dict, x, f, f_params=None, *, recompute=None, fuse_boundaries: bool = False,
              unroll: bool = False, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode: str = "unrolled",
              convention: str = "paper", hc_eps=DEFAULT, post_mult=DEFAULT):
    """L mHC layers applied in order, with optional stream recompute (JAX; paper section 4.3,
    docs/OPS.md section 12): x_{l+1} = H_res,l x_l + H_post,l^T f_l(H_pre,l x_l), l = 0 .. L-1.

    Equals ``for l in range(L): x = mhc_layer(params_l, x, partial(f, f_params_l), ...)`` with
    ``params_l = jax.tree.map(lambda a: a[l], params)`` (and likewise ``f_params_l``), in value and
    gradient, bitwise with or without recompute (the same kernels on the same inputs; f's own jnp
    ops as XLA compiles them: compare with the loop under ``jax.jit``).  One exception: the
    gradient of a value that f closes over, shared by all layers, is summed over the layers in
    the same order, but XLA may fuse an addition of that sum with f's last gradient op (into an
    FMA on the CPU) differently in another program: there it can differ by a rounding of the sum.
    On the GPU, XLA also compiles and autotunes f's own matmuls per program, so the gradients of f's
    parameters may differ in rounding from another program's (seen: 2.4e-7 of their max on the H200,
    with the output and the gradients of x and the mHC parameters bitwise).
    A ``lax.scan`` over the layers (or recompute blocks): one trace of the layer whatever L; usable under
    ``jax.jit``, ``jax.grad``, ``jax.checkpoint``, inside an outer ``lax.scan``, and under ``jax.vmap`` (of x
    or of the parameters; batched parameters run the kernels once per example).  ``unroll=True``: a
    Python loop instead, the same values and gradients.

    Args:
        params: {"phi" [L, n*C, n*n + 2n], "alpha" [L, 3], "bias" [L, n*n + 2n]}, float32: L layers'
            :func:`mhc_cupy.jax.mhc_init` parameters stacked on a leading axis
            (:func:`mhc_stack_init`, or ``jax.tree.map(lambda *a: jnp.stack(a), *layers)``).
        x: [..., n, C] residual streams (bfloat16 / float16 / float32).
        f: the sublayer: ``f(f_params_l, layer_in)`` -> [..., C] (layer_in [..., C], dtype of x; the
            output is cast to x's dtype); with ``f_params=None``, ``f(layer_in)`` for every layer;
            None: the identity.  Traced once per call, as it is then; traced values it closes over
            (weights shared by all layers, keys) get their gradients.
        f_params: None (default), or a pytree of arrays each with a leading axis L: layer l's
            sublayer gets the slices [l].  Their gradients come back stacked the same way.
        recompute: None (default: every layer saves its input streams for backward), an int
            L_r >= 1 (keep the streams at every L_r-th layer only, rebuild the others in backward;
            1: no recompute), or "auto" (the paper's L_r* = round(sqrt(n L / (n + 2))), at least
            1).  L_r > L: one block.  Static, keyword only.  The sublayers are not recomputed
            (wrap f in ``jax.checkpoint`` for that).
        fuse_boundaries: run each layer's residual update and the next layer's pre piece
            (coefficients, Sinkhorn, aggregate) as one op, ``mhc_boundary_fwd`` (OPS.md section 12:
            the streams are read once less per boundary), layers 1 .. L-1 taking its outputs instead
            of running their own pre piece.  Each residual update's output (bitwise the post op's
            of the same inputs) and the gradients' formulas are the same; on the GPU the next
            layer's coefficients may differ in the last float32 bits (its sums run over other
            channel ranges), and the later streams, the output and the gradients by what that
            propagates.  The fused kernel itself runs only where the kernel choice in force at trace time says
            ``boundary=True`` (``mhc_cupy._kernel_choice.kernel_choice``; off by default, OPS.md section 12
            gives its status); otherwise the boundary op runs the two ops' kernels (the unfused stack's
            bits, as on the CPU).  Under ``boundary_bwd=True`` (n <= 4, off by default: slower on the
            H200) the backward inside each recompute block (without recompute, blocks of
            the paper's L_r* layers that keep their streams) is fused too: a layer's dx
            kernel also writes the previous layer's d layer_out, and each layer's pre-piece backward
            computes its residual update's coefficient gradients (``mhc_boundary_bwd``, OPS.md section 12,
            "Fused boundary backward"; bitwise the unfused stack on the CPU).  Default False; a bool,
            static, keyword only.
        unroll: False (default): a ``lax.scan`` over the layers (recompute blocks), traced once.  True:
            a Python loop, traced L times (compile time grows with L, f's too), without what XLA's
            while loop adds to every layer: it writes each layer's saved streams into a stacked
            [L, ..., n, C] array (and reads them back in backward) and copies the loop-carried streams
            and their gradient: in the CPU's compiled jit(vjp) of an 8-layer bf16 stack, ~7 writes of
            [..., n, C] a layer (as many reads) besides the kernels', which move ~9 (fwd+bwd); the
            GPU's time: ``python -m mhc_cupy.bench --stack``'s unroll rows.  A bool, static, keyword only.
        num_iters, eps, rms_eps, grad_mode, convention, hc_eps, post_mult: as
            :func:`mhc_cupy.jax.mhc_layer` (the same for every layer), keyword only; left out, the
            convention's defaults (paper: 20, 1e-8, 1e-5, "unrolled", hc_eps 0, post_mult 2).

    Returns:
        x_L: [..., n, C], dtype of x.

    Raises:
        TypeError: params not a dict of phi / alpha / bias arrays; f neither callable nor None;
            f_params given with f None, or holding a non-array; recompute neither None, an int nor
            a str; fuse_boundaries or unroll not a bool.
        ValueError: params not stacked (phi of rank 3, alpha and bias of rank 2) or of different
            L, L = 0, or not [L, n*C, n*n + 2n] / [L, 3] / [L, n*n + 2n] for x (named, whole shape);
            x not [..., n, C] for phi; an f_params leaf without the leading L axis;
            recompute < 1 or a str other than "auto"; f's output not of its input's shape; the
            layer settings (as mhc_layer).  All at trace time.

    Notes:
        With recompute the stack saves ceil(L / L_r) copies of the streams instead of L (the
        other per-layer residuals are [..., C] and per-token coefficients), at the cost of
        L - ceil(L / L_r) post-op forwards in backward.  fuse_boundaries changes neither.
    """
    mj = _mj()
    L = _layers(params)
    fuse_boundaries = _checks.flag("fuse_boundaries", fuse_boundaries)
    scan = _python_loop if _checks.flag("unroll", unroll) else jax.lax.scan
    settings = mj._layer_settings(num_iters, eps, rms_eps, grad_mode, _convention.check(convention), hc_eps,
                                  post_mult)
    _layer.check_x({"phi": jax.ShapeDtypeStruct(params["phi"].shape[1:], params["phi"].dtype)}, x)
    n, C = x.shape[-2:]
    _check_stacked_shapes(params, L, n, C)
    L_r = recompute_blocks(recompute, n, L)
    leaves, one = _f_params(f, f_params, L)
    stacked = (params["phi"], params["alpha"], params["bias"])
    g, consts = _layer.sublayer(f, x, stacked, arg=one)
    consts = tuple(consts)
    fold = fold_post_dx(n)
    linked = fuse_boundaries and fold and current_choice().runs("boundary_bwd")
    # no recompute with a linked backward: blocks of the paper's L_r* layers that keep every layer's streams
    keep = linked and L_r is None
    mode = (fold, linked, keep)
    if L_r is None and not fuse_boundaries:
        def layer(x, p):
            phi, alpha, bias, leaves_l = p
            return mj._fused_layer(g, settings, fold, phi, alpha, bias, x, *leaves_l, *consts), None

        return scan(layer, x, (*stacked, leaves))[0]

    # Blocks of L_r layers (fused boundaries without recompute: of one layer, each saving its input
    # streams; with a linked backward, of L_r* layers keeping theirs): the first ceil(L / L_r) - 1 in a
    # lax.scan, each ending with the next block's first pre piece where boundaries fuse, then the last
    # block (1 .. L_r layers), which ends the stack.
    L_r = min(L_r or ((recompute_blocks("auto", n, L) or 1) if keep else 1), L)
    head = (L - 1) // L_r * L_r
    per_layer = (*stacked, leaves)
    pre = None
    if fuse_boundaries:  # layer 0's pre piece, as a value: its gradient is layer 0's backward's (_block)
        pre = mj._layer_pre(settings, *jax.lax.stop_gradient((x, *(a[0] for a in stacked))))

    def block(carry, p):
        (x, pre, acc), (phi, alpha, bias, leaves_b, nxt) = carry, p
        x, pre, acc = _block(g, settings, mode, phi, alpha, bias, leaves_b, x, consts, acc, pre, nxt)
        return (x, jax.lax.stop_gradient(pre), acc), None  # (pre: no tangent, no cotangent carried)

    carry = (x, pre, consts)
    if head:
        blocks = jax.tree.map(lambda a: a[:head].reshape((head // L_r, L_r) + a.shape[1:]), per_layer)
        nxts = jax.tree.map(lambda a: a[L_r:head + 1:L_r], stacked) if fuse_boundaries else None
        carry = scan(block, carry, (*blocks, nxts))[0]
    x, pre, acc = carry
    phi, alpha, bias, leaves_b = jax.tree.map(lambda a: a[head:], per_layer)
    return _block(g, settings, mode, phi, alpha, bias, leaves_b, x, consts, acc, pre, None)[0]


def mhc_stack_init(key, L: int, dim: int, n_streams: int = 4, alpha_init: float = 0.01,
                   convention: str = "paper") -> dict:
    """Parameters of L mHC layers for :func:`mhc_stack`: layer l is
    ``mhc_init(jax.random.split(key, L)[l], dim, n_streams, alpha_init, convention)``, stacked:
    {"phi" [L, n*C, n*n + 2n], "alpha" [L, 3], "bias" [L, n*n + 2n]}, float32.

    Raises:
        TypeError / ValueError: L not an int >= 1; as :func:`mhc_cupy.jax.mhc_init` for the rest.
    """
    L = _checks._int("L", L)
    if L < 1:
        raise ValueError(f"L must be >= 1, got {L}")
    mj = _mj()
    layers = [mj.mhc_init(k, dim, n_streams, alpha_init, convention) for k in jax.random.split(key, L)]
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)
