"""Argument handling of the JAX layer functions (:mod:`mhc_cupy.jax`): the sublayer as an
explicit function of what it closes over, and the checks of ``mhc_layer`` / ``mhc_init`` /
``mhc_head_init`` / ``mhc_from_deepseek`` arguments.

The sublayer ``f`` of ``mhc_layer`` runs inside one ``custom_vjp`` (its VJP inside the layer's
backward).  Values that ``f`` closes over and that JAX traces (weights under ``jax.grad``, a PRNG
key or an int carried by ``lax.scan``, anything under ``jit`` / ``vmap`` / ``checkpoint``)
must enter that ``custom_vjp`` as arguments: closed over, a traced value would be used outside
the trace that made it (``UnexpectedTracerError``), and a weight would get no gradient.
:func:`sublayer` traces ``f`` afresh at every call (no cache: a stateful sublayer, or one that
reads globals, is used as it is at that call) and hoists every traced value it closes over; for
:func:`mhc_cupy.jax.mhc_stack` it traces ``f(f_params_l, layer_in)`` once for all layers, with one
layer's ``f_params`` as explicit arguments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from . import _jax_shard as _shard
from ._layer_init import deepseek_sizes

__all__ = ["sublayer", "check_x", "deepseek_params"]


def sublayer(f, x, params, arg=None) -> tuple:
    """``(g, consts)`` with ``g(layer_in, *consts) == f(layer_in)``, traced now.

    Args:
        f: the sublayer, [..., C] -> [..., C]; None: the identity.
        x: the layer's input [..., n, C]; params: its phi, alpha and bias.  They give layer_in's
            type: x's dtype, shape [..., C], and under ``jax.shard_map`` the mesh axes over which
            one of them varies (f is traced for that type: JAX casts what it closes over to match).
        arg: None, or a pytree of arrays (or ``jax.ShapeDtypeStruct``) giving the type of an
            explicit first argument of f (one layer's ``f_params`` in :mod:`mhc_cupy._jax_stack`):
            f is then traced as ``f(arg, layer_in)``, and ``g(layer_in, *leaves, *consts) ==
            f(unflatten(leaves), layer_in)`` for the pytree leaves of a value of arg's type.

    Returns:
        g, and the traced values (``jax.core.Tracer``) that ``f`` closes over, in a list; concrete
        arrays that ``f`` closes over stay inside g.

    Raises:
        TypeError: f neither callable nor None; f returns something other than one array.
        ValueError: f's output has another shape than its input.
    """
    if f is None:
        return (lambda li: li), []
    if not callable(f):
        raise TypeError(f"f (the sublayer) must be callable [..., C] -> [..., C] or None (the identity), got "
                        f"{type(f).__name__} {f!r}")
    example = jax.eval_shape(lambda x, *ps: _shard.vary((x[..., 0, :],), (x, *ps))[0], x, *params)
    leaves, tree = jax.tree_util.tree_flatten(arg)
    # A new function object at every call: JAX's tracing caches key on the function, and a cached
    # trace would keep the values f closed over when it was first traced.
    traced = (lambda li: f(li)) if arg is None else (lambda li, *a: f(jax.tree_util.tree_unflatten(tree, a), li))
    closed, out = jax.make_jaxpr(traced, return_shape=True)(example, *leaves)
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(f"f (the sublayer) returned {_describe(out)}; mhc_layer needs one array [..., C] of its "
                        f"input's shape {tuple(example.shape)}")
    if tuple(out.shape) != tuple(example.shape):
        raise ValueError(f"f (the sublayer) returned an array of shape {tuple(out.shape)}; mhc_layer needs its "
                         f"input's shape {tuple(example.shape)} ([..., C] -> [..., C])")
    jaxpr, consts = closed.jaxpr, list(closed.consts)
    hoisted = [i for i, c in enumerate(consts) if isinstance(c, jax.core.Tracer)]
    n_args = len(leaves)

    def g(li, *values):
        full = list(consts)
        for i, v in zip(hoisted, values[n_args:]):
            full[i] = v
        return jax.core.eval_jaxpr(jaxpr, full, li, *values[:n_args])[0]

    return g, [consts[i] for i in hoisted]


def _describe(out) -> str:
    leaves = jax.tree_util.tree_leaves(out)
    return f"a {type(out).__name__} of {len(leaves)} array(s)" if leaves else f"{type(out).__name__} {out!r}"


def params_got(params) -> str:
    """What a wrong ``params`` is, for an error: a dict's keys (another function's parameters, or a
    framework's nesting such as {"params": ...}), else its type."""
    if isinstance(params, dict):
        return f"a dict with keys {sorted(map(str, params))}"
    return type(params).__name__


def check_params(params) -> None:
    """``params`` is the dict of :func:`mhc_cupy.jax.mhc_init` (phi, alpha, bias).  TypeError if not."""
    if not isinstance(params, dict) or any(k not in params for k in ("phi", "alpha", "bias")):
        raise TypeError(f"params must be the dict of mhc_init (phi, alpha, bias), got {params_got(params)}")


def check_x(params: dict, x) -> None:
    """``x`` is an array [..., n, C] with the n and C of ``params["phi"]`` [n*C, n*n + 2n].

    A phi of another shape is left to the kernels' checks (which name phi).

    Raises:
        TypeError: x is not an array.  ValueError: x's shape does not fit phi.
    """
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"x has type {type(x).__name__}; it needs an array [..., n, C]")
    if len(x.shape) < 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; it needs [..., n, C]")
    shape = tuple(getattr(params["phi"], "shape", ()))
    if len(shape) != 2:
        return
    D, m = shape
    n = math.isqrt(m + 1) - 1
    if n < 1 or n * n + 2 * n != m or D % n or D == 0:
        return
    if tuple(x.shape[-2:]) != (n, D // n):
        raise ValueError(f"x has shape {tuple(x.shape)}; these params (phi of shape {shape}) need x "
                         f"[..., n, C] = [..., {n}, {D // n}]")


def deepseek_params(hc_fn, hc_scale, hc_base) -> tuple:
    """``(hc_fn, hc_scale, hc_base)`` as float32 JAX arrays, with DeepSeek-V4 layer shapes
    (:func:`mhc_cupy._layer_init.deepseek_sizes`) and n = 1..32, C >= 1.

    Raises:
        TypeError: an argument is not an array, or not of a real floating-point dtype (complex, bool, integer;
        naming it).  ValueError: shapes, n or C.
    """
    arrays = []
    for name, a in (("hc_fn", hc_fn), ("hc_scale", hc_scale), ("hc_base", hc_base)):
        if a is None:
            raise TypeError(f"{name} is None; it needs an array")
        try:  # (NumPy's own error, naming no argument, for what it cannot read: a torch bfloat16 tensor)
            complex_ = np.iscomplexobj(a)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} has type {type(a).__name__}, which NumPy cannot read ({exc}); it needs an "
                            "array (a torch bfloat16 tensor: .float() it first)") from exc
        dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        floating = dtype.is_floating_point if hasattr(dtype, "is_floating_point") else jnp.issubdtype(
            dtype, jnp.floating)  # (a torch tensor's dtype, or NumPy's / JAX's)
        if complex_ or not floating:  # (the float32 cast would drop an imaginary part, or take a bool / integer
            # array's values for weights)
            raise TypeError(f"{name} has dtype {dtype}; it needs a real floating-point dtype")
        try:
            arrays.append(jnp.asarray(a, jnp.float32))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} has type {type(a).__name__}; it needs an array") from exc
    shape = tuple(arrays[0].shape)
    C, n = deepseek_sizes(shape, arrays[1].shape, arrays[2].shape, head=False)
    _checks.streams(n, f"hc_fn of shape {shape}")  # (deepseek_sizes refuses C < 1)
    return tuple(arrays)
