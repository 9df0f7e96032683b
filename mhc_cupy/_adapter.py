"""What the framework adapters (:mod:`mhc_cupy.torch`, :mod:`mhc_cupy.jax`) derive from the op table.

A differentiable op ``<op>`` of an adapter is the pair of kernel entry points ``<op>_fwd`` /
``<op>_bwd`` of ``mhc_cupy.ops.SPECS``.  Its public function takes what the functional backward
``mhc_cupy.<op>_bwd`` takes, less the incoming gradients: the op's arrays and parameters, in its
order and with its defaults (e.g. Sinkhorn's ``grad_mode``, used by the backward only).
:func:`public` writes that function (a ``def`` with exactly that signature, so a parameter added
to an op's functional API and spec entry reaches both adapters) around the adapter's body (its
routes), which gets ``kw``, the planner's keyword arguments: the parameters as given, or, where
the op's planner takes the layer's settings (:func:`mhc_cupy._settings.takes_settings`),
``{"settings": LayerSettings.resolve(**parameters)}``, resolved once here.  An op that needs
something else before the call (a check, a parameter that is not the kernel's) gives a
``prepare`` hook: it gets every argument by name and returns only the kernel parameters it
changes, so a parameter added to the op reaches the planner through it untouched.  The hooks
both adapters need are :data:`BY_HAND`; each adapter lists its own in its module docstring.

:func:`flat` is where a ``kw`` becomes the primitive values of a ``torch.library`` custom
operator's arguments (the settings flattened), in one place.  No framework is imported here.
"""

from __future__ import annotations

import inspect

from . import _convention, ops as _ops
from ._settings import LayerSettings

__all__ = ["parameters", "public", "define", "literal", "flat", "BY_HAND"]

#: ``kw`` of an op without parameters (shared, never written to).
NO_PARAMS: dict = {}


def parameters(op: str) -> tuple:
    """(array names, parameters) of op ``op``'s public function: the names of its arrays (the forward's
    inputs, in order), and ``mhc_cupy.<op>_bwd``'s signature without its incoming gradients (a list of
    ``inspect.Parameter``: the arrays and the op's parameters, as the functional API orders them)."""
    fwd, bwd = _ops.SPECS[f"{op}_fwd"], _ops.SPECS[f"{op}_bwd"]
    grads = {a.name for a in bwd.grads}
    params = [p for p in inspect.signature(getattr(_ops, bwd.name)).parameters.values() if p.name not in grads]
    return tuple(a.name for a in fwd.inputs), params


def resolve_settings(**given) -> dict:
    """``kw`` of an op whose planner takes the layer's settings: ``{"settings": LayerSettings}``."""
    return {"settings": LayerSettings.resolve(**given)}


# ------------------------------------------------ what ops need by hand, in both adapters
def coeffs_eps(eps, convention, **_) -> dict:
    """``mhc_coeffs``: its ``eps`` resolved per ``convention`` (DEFAULT: the convention's rms_eps);
    the convention is not a kernel parameter.  ValueError for a bad convention."""
    return {"eps": _convention.resolve(convention, rms_eps=eps)}


def post_convention(convention, **_) -> dict:
    """``mhc_post_op``: ``convention`` checked before anything runs (ValueError naming it)."""
    return {"convention": _convention.check(convention)}


#: ``prepare`` hooks of :func:`public` (by op) that both adapters use; an adapter adds its own.
BY_HAND = {"mhc_coeffs": coeffs_eps, "mhc_post_op": post_convention}


def public(op: str, doc: str, module: str, body, namespace: dict, prepare=None, settings=resolve_settings):
    """The public function of op ``op``, with the signature of :func:`parameters`.

    Args:
        op: the op's name (``"stream_mix"``); the function gets it as its name.
        doc: its docstring.  module: its ``__module__``.
        body: ``body(arrays, kw) -> str``, the adapter's source of the function's body, given the
            names of the op's arrays (the forward's order) and the expression of ``kw``, the
            planner's keyword arguments; it runs in ``namespace`` (the adapter's names).
        prepare: ``prepare(**arguments) -> dict``, for an op that needs more than its parameters
            as given before the call: it gets every argument of the function by name (write it
            ``def hook(x, eps, **_)``) and returns the kernel parameters it changes (checked,
            resolved); ``kw`` is the kernel's parameters (the spec's) as given, updated with those.
            An argument that is neither an array nor a kernel parameter reaches only ``prepare``.
            None: the parameters as given (or the settings resolved).
        settings: ``settings(**parameters) -> kw`` of an op whose planner takes the layer's settings
            (default :func:`resolve_settings`).
    """
    arrays, params = parameters(op)
    names = [p.name for p in params if p.name not in arrays]
    fwd, bwd = _ops.SPECS[f"{op}_fwd"], _ops.SPECS[f"{op}_bwd"]
    if prepare is not None:
        assert not getattr(fwd.planner, "takes_settings", False), op  # its settings: resolved by `settings`
        kernel = [k for k in names if k in fwd.params or k in bwd.params]
        kw = "{" + "".join(f"{k!r}: {k}, " for k in kernel) + "**_prepare(" + ", ".join(
            f"{p.name}={p.name}" for p in params) + ")}"
    elif not names:
        kw = "_NO_PARAMS"
    elif getattr(fwd.planner, "takes_settings", False):
        prepare, kw = settings, "_prepare(" + ", ".join(f"{k}={k}" for k in names) + ")"
    else:
        kw = literal(names)
    signature, star = [], False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            signature.append("*")
            star = True
        signature.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}=_defaults[{i}]")
    fn = define(op, signature, body(arrays, kw), module, {
        **namespace, "_prepare": prepare, "_NO_PARAMS": NO_PARAMS, "_defaults": [p.default for p in params]})
    fn.__doc__ = doc
    return fn


def define(name: str, params: list, body: str, module: str, namespace: dict):
    """``def name(*params): body`` compiled in ``namespace`` (as :mod:`dataclasses` writes its methods):
    a plain function with that signature, as fast as written by hand; a wrong call raises Python's
    own TypeError."""
    source = f"def {name}({', '.join(params)}):\n{body}"
    exec(compile(source, f"<mhc_cupy {module}.{name}>", "exec"), namespace)  # noqa: S102 - our own source
    fn = namespace[name]
    fn.__module__, fn.__qualname__ = module, name
    return fn


def literal(names) -> str:
    """Source of the dict ``{name: name, ...}``."""
    return "{" + ", ".join(f"{k!r}: {k}" for k in names) + "}"


def flat(names: tuple, kw: dict) -> tuple:
    """The values of the parameters ``names`` from ``kw``: a planner's keyword arguments (the layer's
    settings flattened) or the parameters by name."""
    settings = kw.get("settings")
    return settings.values(names) if settings is not None else tuple(kw[k] for k in names)
