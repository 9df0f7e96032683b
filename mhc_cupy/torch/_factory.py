"""The torch side of the op table (``mhc_cupy.ops.SPECS``), generated.

* :func:`register`: a kernel entry point as the ``torch.library`` custom operator
  ``torch.ops.mhc_cupy.<name>``: its schema (the spec's arrays and parameters, in the functional
  API's order, its keyword-only ones defaulted), its implementation (the functional API) and its
  fake function (the planner's checks, then outputs of the spec's shapes and dtypes).
* :func:`call`: one kernel, through that custom operator (torch.compile, tensor subclasses) or
  straight through its planner (eager: the dispatcher's per-call cost bypassed).
* :class:`Op`: a differentiable op ``<op>`` from its ``<op>_fwd`` / ``<op>_bwd`` pair: the
  custom operators with their autograd registration (compiled), an eager ``autograd.Function``
  and the body of the public function, which picks the route (:meth:`Op.body`).  The backward
  gets the saved inputs and the incoming gradients (None for an unused output of a multi-output
  op, whose backward kernel counts it as zero) and returns the gradient of each input.

The routes are described in :mod:`mhc_cupy.torch`; what an op needs beyond this is in
:mod:`mhc_cupy.torch.functions`.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import NamedTuple

import torch
from torch.autograd import forward_ad as _forward_ad
from torch import Tensor

from .. import _adapter, ops as _ops
from .._adapter import flat
from .._convention import DEFAULT
from .._dispatch import run as _run
from .._interop import ArrayInfo
from .._kernel_choice import current as _choice, restored as _restored
from ..ops.spec import shape_of as _shape_of
from ._transforms import active as _transform_active, refuse as _refuse_transform, refuse_dual as _refuse_dual
from ._transforms import refuse_batched as _refuse_batched

__all__ = ["NAMESPACE", "register", "call", "Op", "use_custom_op", "needs_autograd", "is_compiling", "eager_apply",
           "first_order"]

#: Namespace of the custom operators: ``torch.ops.mhc_cupy.<name>``.
NAMESPACE = "mhc_cupy"

_F32 = torch.float32
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}
is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state


# Both run on every eager call: plain loops (a generator in any() costs more).
def use_custom_op(*tensors) -> bool:
    """True inside torch.compile / export, while torch.jit.trace records (it sees the custom operators, not
    the kernels: the eager route's outputs were traced as constants), or for tensor subclasses (fake,
    functional, ...).  Every
    public op calls it before any autograd Function or kernel: under a torch.func transform, or given a
    forward-AD dual tensor, it raises NotImplementedError (:mod:`mhc_cupy.torch._transforms`)."""
    if is_compiling() or _tracing_state() is not None:
        return True
    if _transform_active():
        _refuse_transform()
    if _forward_ad._current_level >= 0:  # a dual level is open: tensors may carry tangents
        _refuse_dual(tensors)
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and isinstance(t, Tensor):
            return True
    return False  # non-tensors (a list, None for a tensor) go on to the functional API, which names them


def needs_autograd(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    except AttributeError:  # not a tensor: the functional API raises a TypeError naming it
        return False
    return False


def eager_apply(function):
    """``function.apply`` (an ``autograd.Function``) for the eager route only, where
    :func:`use_custom_op` is False (not compiling, plain tensors, no torch.func transform): the C++
    ``apply`` itself, without ``Function.apply``'s Python prologue, which binds default arguments
    (for a ``setup_context``-style Function only), asks whether a functorch transform is active and
    maps the arguments' pytree to unwrap dead functorch wrappers (none here: plain tensors).  That
    prologue took 2.5 of the 11.3 us of a tiny ``stream_mix`` with grad on a 2-core CPU host
    (launches stubbed out; ``torch.add`` with grad: 1.8 us)."""
    try:
        return super(torch.autograd.function._SingleLevelFunction, function).apply
    except AttributeError:  # another torch's layout: the public apply
        return function.apply


def first_order(backward):
    """``torch.autograd.function.once_differentiable`` for an eager Function's ``backward``, strict.

    The backward runs the functional API (no graph), so its gradients must not be differentiated.
    torch's decorator marks them (a second backward through them raises ``RuntimeError``) only when
    an incoming gradient requires grad; with ``create_graph=True`` from a loss linear in the op's
    outputs (``out.sum()``, a gradient penalty's usual start) none does, and the gradients came back
    as constants: their dependence on the saved inputs (M of ``stream_mix``'s dx = M^T g) silently
    dropped.  Here they are marked also when a saved input requires grad.

    The marking node's inputs are those differentiable tensors themselves (torch's decorator gives it
    only detached copies of the gradients): a backward that asks for the gradient of a saved input or
    of an incoming gradient only (``torch.autograd.grad(g.sum(), M)``, and so
    ``torch.autograd.functional.jvp`` / ``hvp`` / ``vhp`` / ``hessian``) runs only the nodes on a path
    to them, and without that path it never reached the node and returned None (zeros) silently."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not is_compiling():  # (Dynamo traces the fused pieces' backward; it cannot trace the check)
            _refuse_batched(grads)  # is_grads_batched: NotImplementedError, not a failure deep in the kernels' call
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # no create_graph
            return outputs
        anchors = [g for g in grads if isinstance(g, Tensor) and g.requires_grad]
        anchors += [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
        if not anchors:
            return outputs  # nothing the gradients depend on is differentiable: constants, rightly
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        err = torch._C._functions.DelayedError(
            b"trying to differentiate twice a function that was marked with @once_differentiable "
            b"(mhc_cupy.torch gradients are first order only)", len(outs) + len(anchors))
        marked = err(*[None if o is None else o.detach().requires_grad_() for o in outs], *anchors)
        return tuple(marked[:len(outs)])  # (the anchors' outputs only connect the node to the graph)
    return wrapper


# ------------------------------------------------------------ custom operators
def _validate(planner, tensors: dict, **params) -> None:
    """Run the functional API's own checks on fake tensors (static shapes only).

    Gives the same TypeError / ValueError at trace time as the eager call.
    With symbolic (dynamic) shapes the check is left to the real op at run time.
    """
    infos = {}
    for name, t in tensors.items():
        if t is None:
            infos[name] = None
            continue
        shape = tuple(t.shape)
        if not all(type(s) is int for s in shape):
            return
        dtype = _DTYPE_NAME.get(t.dtype) or str(t.dtype).replace("torch.", "")
        infos[name] = ArrayInfo(shape, dtype, ("cpu", 0))
    planner(infos, **params)


class Registered(NamedTuple):
    """A custom operator: its overload, the kernel it runs, its arguments (schema order), which of
    them are arrays and which parameters, and its definition (``torch.library.CustomOpDef``)."""
    op: object
    kernel: object
    names: tuple
    arrays: frozenset
    params: tuple
    definition: object


#: Every registered custom operator, by name.
REGISTERED: dict = {}

_TYPES = {bool: "bool", int: "SymInt", float: "float", str: "str"}  # as torch.library infers them


def register(name: str, kernel, signature=None, params: dict | None = None, without: str | None = None,
             given: str | None = None) -> Registered:
    """Register kernel ``kernel`` (an op spec) as the custom operator ``mhc_cupy::<name>``.

    Its schema: the arguments of ``signature`` (``inspect.Parameter``; default the functional
    API's, ``mhc_cupy.<kernel>``) that are the kernel's arrays (``Tensor`` / ``Tensor?``) or
    parameters (typed by ``params``, default the spec's), in that order; the keyword-only ones
    with a default (the spec's; None for an array).  Its implementation runs the functional API
    with the kernel's own.

    Args:
        without: an optional input left out (None for the kernel), with the output that is its
            gradient: a custom operator returns a fixed number of tensors.  given: an optional
            input that this operator requires (its variant with that gradient).
    """
    functional = getattr(_ops, kernel.name)
    if signature is None:
        signature = inspect.signature(functional).parameters.values()
    params = dict(kernel.params if params is None else params)
    arrays = {a.name: a for a in kernel.args if a.name != without}
    args, names = [], []
    by_convention = set()  # defaulted to the convention's value (DEFAULT): None in the schema
    for p in signature:
        default = p.kind is p.KEYWORD_ONLY  # the functional API's keyword-only ones: defaulted
        if p.name in arrays:
            opt = arrays[p.name].optional and p.name != given
            args.append(f"Tensor{'?' if opt else ''} {p.name}" + ("=None" if opt and default else ""))
        elif p.name in params:
            v = params[p.name]
            if default and p.default is DEFAULT:
                by_convention.add(p.name)
                args.append(f"{_TYPES[type(v)]}? {p.name}=None")
            else:
                args.append(f"{_TYPES[type(v)]} {p.name}" + (f"={json.dumps(v)}" if default else ""))
        else:
            continue  # not the kernel's (mhc_coeffs' convention: it resolves eps)
        names.append(p.name)
    assert set(arrays) | set(params) == set(names), (name, names)
    outputs = tuple(o for o in kernel.outputs if o.name != without or not kernel.is_grad(o))
    own = set(kernel.params)

    def bound(args) -> dict:  # the dispatcher passes the arguments given, not the defaults
        kw = dict(params, **dict.fromkeys(by_convention, DEFAULT))
        kw.update(zip(names, args))
        for k in by_convention:  # None (or not given): the convention's value (hc_eps 1e-6 under "deepseek")
            if kw[k] is None:
                kw[k] = DEFAULT
        return kw

    def impl(*args):
        kw = bound(args)
        return functional(**{k: kw.get(k) for k in arrays}, **{k: kw[k] for k in params if k in own})

    def fake(*args):
        """Run the functional API's checks (:func:`_validate`), then return empty outputs of the spec's
        shapes and dtypes: the gradient of an input shaped like that input (its dtype for an
        activation, else float32; none for an absent optional input), a new output over the token
        dims of the spec's reference input (x's dtype for an activation, float8_e4m3fn for "fp8", else
        float32)."""
        kw = bound(args)
        tensors = {a.name: kw.get(a.name) for a in kernel.args}
        _validate(kernel.planner, tensors, **{k: kw[k] for k in kernel.params})
        ref = tensors[kernel.ref.name]
        lead = tuple(ref.shape[:ref.dim() - kernel.ref.rank])
        sizes = kernel.sizes({k: None if t is None else tuple(t.shape) for k, t in tensors.items()})
        outs = []
        for o in outputs:
            t = tensors[o.name] if kernel.is_grad(o) else ref
            if t is None:
                continue
            shape = tuple(t.shape) if kernel.is_grad(o) else _shape_of(o, lead, sizes)
            dtype = {"activation": t.dtype, "fp8": torch.float8_e4m3fn}.get(o.kind, _F32)
            outs.append(t.new_empty(shape, dtype=dtype))
        return outs[0] if len(outs) == 1 else tuple(outs)

    returns = "Tensor" if len(outputs) == 1 else f"({', '.join(['Tensor'] * len(outputs))})"
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(),
                                 schema=f"({', '.join(args)}) -> {returns}")
    op.register_fake(fake)
    REGISTERED[name] = r = Registered(getattr(getattr(torch.ops, NAMESPACE), name).default, kernel, tuple(names),
                                      frozenset(arrays), tuple(n for n in names if n not in arrays), op)
    return r


def call(name: str, custom: bool, arrays: dict, kw: dict):
    """Custom operator ``name`` on ``arrays`` (by name; absent: None) with ``kw`` (the planner's keyword
    arguments, or the operator's parameters by name): through the operator when ``custom``, else
    straight through the planner (eager)."""
    r = REGISTERED[name]
    if custom:
        values = dict(zip(r.params, flat(r.params, kw)))
        return r.op(*[arrays.get(k) if k in r.arrays else values[k] for k in r.names])
    return _run(r.kernel.planner, arrays, **kw)


# ------------------------------------------------------------ differentiable ops
class Op:
    """The differentiable op ``name``: ``<name>_fwd`` with ``<name>_bwd`` as its gradient.

    Its public function (:meth:`body`) runs the custom operator ``<name>_fwd`` (torch.compile,
    tensor subclasses; its autograd registered), the eager ``autograd.Function`` (autograd
    records), or the forward's planner (no autograd), with ``kw``, the planner's keyword arguments.
    """

    def __init__(self, name: str):
        fwd, bwd = _ops.SPECS[f"{name}_fwd"], _ops.SPECS[f"{name}_bwd"]
        assert bwd.inputs == fwd.inputs, name  # the backward gets the forward's inputs, saved
        self.name, self.fwd, self.bwd = name, fwd, bwd
        self.names = tuple(a.name for a in fwd.inputs)
        # the forward operator takes the public function's arguments (the backward's parameters
        # too, so that its autograd sees them)
        self.custom = register(f"{name}_fwd", fwd, _adapter.parameters(name)[1], {**fwd.params, **bwd.params})
        # an optional input whose gradient is an output (RMSNorm's weight): one backward operator
        # without it, one with it (named <name>_<input>_bwd)
        varies = [a.name for a in fwd.inputs if a.optional and a in bwd.outputs]
        assert len(varies) <= 1, name
        self.varies = varies[0] if varies else None
        register(bwd.name, bwd, without=self.varies)
        if self.varies:
            register(f"{name}_{self.varies}_bwd", bwd, given=self.varies)
        # unused outputs' gradients arrive as None where the backward takes them as optional
        self.materialize = not all(g.optional for g in bwd.grads)
        self.bwd_names = tuple(a.name for a in bwd.args)
        # the backward's outputs: the gradients of the inputs, in order (an absent optional input's,
        # the last, left out)
        assert tuple(o.name for o in bwd.outputs) == self.names and self.varies in (None, self.names[-1]), name
        # the eager Function takes (*arrays, kw), or the arrays alone for an op without parameters
        self.kw = ("kw",) if self.custom.params else ()
        self.custom.definition.register_autograd(self._backward_compiled, setup_context=self._setup_compiled)
        self.function = self._eager()

    def body(self, arrays: tuple, kw: str) -> str:
        """The public function's body (:func:`mhc_cupy._adapter.public`): the route of a call."""
        a = ", ".join(arrays)
        return (f"    kw = {kw}\n"
                f"    if _use_custom_op({a}):\n"
                f"        return _call({self.fwd.name!r}, True, {_adapter.literal(arrays)}, kw)\n"
                f"    if _needs_autograd({a}):\n"
                f"        return _apply({', '.join(arrays + self.kw)})\n"
                f"    return _run(_planner, {_adapter.literal(arrays)}, **kw)\n")

    def namespace(self) -> dict:
        """The names :meth:`body` uses."""
        return {"_use_custom_op": use_custom_op, "_needs_autograd": needs_autograd, "_call": call,
                "_apply": eager_apply(self.function), "_run": _run, "_planner": self.fwd.planner}

    def _eager(self):
        """The eager ``autograd.Function``: ``apply(*arrays, kw)``, or ``apply(*arrays)`` for an op
        without parameters (closures over what they need: this route's per-call cost is the point)."""
        n, has_kw, materialize = len(self.names), bool(self.kw), self.materialize
        planner, names, nones = self.bwd.planner, self.bwd_names, (None,) * (len(self.names) + len(self.kw))
        forward = _adapter.define("forward", [*self.names, *self.kw], f"    return _run(_planner, "
                                  f"{_adapter.literal(self.names)}{', **kw' if has_kw else ''})\n", __name__,
                                  {"_run": _run, "_planner": self.fwd.planner})

        def setup(ctx, args, output):
            ctx.choice = _choice()  # (the backward plans under it: _kernel_choice.restored)
            if has_kw:
                ctx.save_for_backward(*args[:n])
                ctx.kw = args[n]
            else:
                ctx.save_for_backward(*args)
            if not materialize:
                ctx.set_materialize_grads(False)

        def backward(ctx, *grads):
            for g in grads:
                if g is not None:
                    break
            else:
                return nones
            arrays = dict(zip(names, grads + ctx.saved_tensors))
            with _restored(ctx.choice):
                out = _run(planner, arrays, **ctx.kw) if has_kw else _run(planner, arrays)
            if type(out) is not tuple:
                out = (out,)
            return out + nones[len(out):]  # an absent input's gradient and kw's: None

        return _function(f"_{self.name}_function", forward, setup, backward)

    # compiled: the custom operator's arguments
    def _setup_compiled(self, ctx, inputs, output):
        args = dict(zip(self.custom.names, inputs))
        ctx.save_for_backward(*[args[k] for k in self.names])
        ctx.kw = {k: args[k] for k in self.custom.params}
        if not self.materialize:
            ctx.set_materialize_grads(False)

    def _backward_compiled(self, ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * len(self.custom.names)
        arrays = dict(zip(self.bwd_names, grads + ctx.saved_tensors))
        name = self.bwd.name
        if self.varies and arrays[self.varies] is not None:
            name = f"{self.name}_{self.varies}_bwd"
        out = call(name, True, arrays, ctx.kw)
        got = dict(zip(self.names, out if isinstance(out, tuple) else (out,)))
        return tuple(got.get(k) for k in self.custom.names)


def _function(name: str, forward, setup_context, backward):
    """An eager ``autograd.Function``.

    Written in the classic ``forward(ctx, *args)`` style, which calls the same
    ``setup_context``: its ``apply`` costs about a third of the
    ``setup_context``-style one (5.9 vs 18.7 us per call measured on a 2-core
    CPU host), and this route exists to keep per-call host overhead low.
    """

    def fwd(ctx, *args):
        out = forward(*args)
        setup_context(ctx, args, out)
        return out

    # The backward runs the functional API on raw pointers: it records no graph,
    # so a second-order gradient through it would silently treat it as a
    # constant.  first_order makes double backward raise instead.
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(fwd),
        "backward": staticmethod(first_order(backward)),
    })
