"""Token sharding for the JAX adapter: per-token ops that partition without gathering.

Every mHC operator is per token: each token's outputs depend only on that
token's inputs, and a parameter shared by all tokens (the coefficient path's
phi / alpha / bias, a shared ``h`` [n], the RMSNorm ``weight``) gets a gradient
that is a sum over tokens.  :func:`token_sharded` wraps such a function so
that, under ``jax.jit`` with the token (leading) dims sharded over a mesh, each
device runs it on its own tokens, token outputs stay sharded like the tokens,
and every output summed over tokens is reduced across the mesh (``psum``)
once, inside the wrapped op.  Without a sharded mesh nothing changes.

How: ``jax.experimental.custom_partitioning`` with a Shardy sharding rule
(``sharding_rule``: token dims are pass-through factors shared by all token
arrays; every other dim must be replicated) and GSPMD callbacks for programs
that use the older partitioner.  A dim of the token axes whose size is not a
multiple of its mesh axes' size is replicated (gathered) instead, so the
local shapes are always exact.  Sharding a trailing dim (C or n) or a shared
parameter is allowed: the partitioner replicates it before the op (the op then
gathers that operand), and the result is correct.

One complication: the kernels run as host callbacks (``buffer_callback``),
which XLA finds by an index into the callbacks of the program being compiled.
The per-device function of a custom partitioning is lowered into a separate
module while XLA compiles, too late to add callbacks to the program.  So the
program registers the callbacks when it is lowered (a no-op "anchor" on the
op's outputs) and the per-device function emits its custom calls with those
indices (:func:`emit`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import jax as _jax
import numpy as np
from jax._src import core as _core
from jax._src import ffi as _ffi
from jax._src.interpreters import mlir as _mlir
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["token_sharded", "emit"]

_state = threading.local()

# ------------------------------------------------ host-callback bookkeeping
#: (id of a program's host-callback list, key) -> index of the key's callback in it.
_INDEX: dict = {}
_FFI_TARGET = {"cpu": "xla_buffer_python_cpu_callback", "cuda": "xla_buffer_python_gpu_callback",
               "rocm": "xla_buffer_python_gpu_callback"}


def _recorders() -> list:
    if not hasattr(_state, "recorders"):
        _state.recorders = []
    return _state.recorders


def emit(key, host, arrays, results, default):
    """Run a host-callback kernel, partition-aware.

    Args:
        key: hashable name of the kernel family (the same for every shape).
        host: its callback in XLA's FFI protocol, ``host(exec_ctx, *inputs, *outputs)``
            (XLA buffers; it plans from their shapes).
        arrays: the input arrays (no None).
        results: ``jax.ShapeDtypeStruct`` of every result (outputs and scratch).
        default: ``default()`` emits the ordinary ``buffer_callback`` and returns its results.

    Outside :func:`token_sharded` this is ``default()``.  While a token-sharded
    function is traced at global shapes, ``host`` is recorded so that the
    program registers it; in the per-device function it becomes a custom call
    to that registered callback.
    """
    for rec in _recorders():
        rec.setdefault(key, host)
    inner = getattr(_state, "inner", None)
    if inner is None:
        return default()
    index = inner.get(key)
    if index is None:
        raise RuntimeError(f"mhc_cupy.jax: host callback {key!r} was not registered by the program "
                           "being compiled (lowered and compiled in a different order?)")
    avals = tuple(_core.ShapedArray(tuple(r.shape), r.dtype) for r in results)
    return _local_p.bind(*arrays, index=index, results=avals)


_local_p = _core.Primitive("mhc_local_host_callback")
_local_p.multiple_results = True
_local_p.def_abstract_eval(lambda *args, index, results: results)


def _local_lowering(ctx, *args, index, results):
    platform = ctx.module_context.platforms[0]
    target = _FFI_TARGET.get(platform)
    if target is None:
        raise ValueError(f"mhc_cupy.jax: no host callbacks on the {platform} backend")
    return _ffi.ffi_lowering(target, has_side_effect=False)(ctx, *args, index=np.uint64(index))


_mlir.register_lowering(_local_p, _local_lowering)

#: Identity on the op's outputs whose lowering registers the recorded host
#: callbacks in the program (params: ``hosts``, tuple of (key, host)).
_anchor_p = _core.Primitive("mhc_register_host_callbacks")
_anchor_p.multiple_results = True
_anchor_p.def_impl(lambda *args, hosts: args)
_anchor_p.def_abstract_eval(lambda *args, hosts: args)


def _anchor_lowering(ctx, *args, hosts):
    mc = ctx.module_context
    for key, host in hosts:
        slot = (id(mc.host_callbacks), key)
        if slot not in _INDEX or _INDEX[slot][0] is not mc.host_callbacks:
            mc.add_host_callback(host)
            _INDEX[slot] = (mc.host_callbacks, len(mc.host_callbacks) - 1)
    return args


_mlir.register_lowering(_anchor_p, _anchor_lowering)


def _compiling_callbacks():
    """The host-callback list of the program whose custom partitioning runs now.

    JAX's partition hook keeps the lowering context of the custom call in its
    ``info`` local; the list is shared by every copy of that context.
    """
    f = sys._getframe(1)
    while f is not None:
        info = f.f_locals.get("info") if f.f_code.co_name == "_custom_partitioning_partition" else None
        if info is not None and hasattr(info, "module_context"):
            return info.module_context.host_callbacks
        f = f.f_back
    raise RuntimeError("mhc_cupy.jax: cannot find the program being partitioned "
                       "(jax.experimental.custom_partitioning internals changed)")


class _Indices:
    """key -> index of the key's host callback in one program's list."""

    def __init__(self, callbacks):
        self.callbacks = callbacks

    def get(self, key):
        entry = _INDEX.get((id(self.callbacks), key))
        return entry[1] if entry is not None and entry[0] is self.callbacks else None


@contextlib.contextmanager
def _per_device(indices):
    prev = getattr(_state, "inner", None)
    _state.inner = indices
    try:
        with _jax.disable_jit():
            yield
    finally:
        _state.inner = prev


# ------------------------------------------------------------ partitioning
def _mesh_size(mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([mesh.shape[a] for a in names]))


def _axes(entries) -> tuple:
    out = []
    for e in entries:
        if e is not None:
            out.extend(e if isinstance(e, tuple) else (e,))
    return tuple(out)


def _token_spec(mesh, ref_shape, nlead: int) -> tuple:
    """Sharding of the token dims, from the reference input: kept where it
    divides the dim exactly, else replicated."""
    spec = tuple(getattr(ref_shape.sharding, "spec", ())) if ref_shape.sharding is not None else ()
    spec = spec + (None,) * (nlead - len(spec))
    return tuple(e if e is not None and ref_shape.shape[d] % _mesh_size(mesh, e) == 0 else None
                 for d, e in enumerate(spec[:nlead]))


@functools.lru_cache(maxsize=None)
def _partitioned(fn, nlead: int, in_kinds: tuple, out_kinds: tuple, ref: int):
    """custom_partitioning of ``fn`` over the present inputs.

    ``in_kinds`` / ``out_kinds``: per array, its trailing rank if it carries
    the token dims, else None (an input shared by all tokens / an output
    summed over tokens).
    """

    def shardings(mesh, tok):
        def one(kind):
            return NamedSharding(mesh, PartitionSpec(*tok, *(None,) * kind) if kind is not None else PartitionSpec())
        return [one(k) for k in in_kinds], [one(k) for k in out_kinds]

    def partition(mesh, arg_shapes, result_shape):
        tok = _token_spec(mesh, arg_shapes[ref], nlead)
        arg_sh, out_sh = shardings(mesh, tok)
        axes = _axes(tok)
        indices = _Indices(_compiling_callbacks())

        def lower_fn(*arrays):
            with _per_device(indices):
                outs = fn(*arrays)
            return tuple(_jax.lax.psum(o, axes) if k is None and axes else o for o, k in zip(outs, out_kinds))

        return mesh, lower_fn, tuple(out_sh), tuple(arg_sh)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (non-Shardy) propagation
        return tuple(shardings(mesh, _token_spec(mesh, arg_shapes[ref], nlead))[1])

    def propagate(mesh, user_shape):  # GSPMD: the result keeps its own sharding
        return tuple(getattr(s, "sharding", None) for s in user_shape)

    def rule_terms(kinds, prefix):
        terms, rep = [], []
        for i, kind in enumerate(kinds):
            lead = [f"t{d}" for d in range(nlead)] if kind is not None else []
            trail = [f"{prefix}{i}_{j}" for j in range(kind if kind is not None else _ndims[prefix][i])]
            rep += trail
            terms.append(" ".join(lead + trail) or "")
        return terms, rep

    _ndims = {}

    def sharding_rule(mesh, value_types, result_types):
        _ndims["i"] = [len(t.shape) for t in value_types]
        _ndims["o"] = [len(t.shape) for t in result_types]
        ins, rep_i = rule_terms(in_kinds, "i")
        outs, rep_o = rule_terms(out_kinds, "o")
        return ", ".join(ins) + " -> " + ", ".join(outs), {"need_replication_factors": tuple(rep_i + rep_o)}

    cp = custom_partitioning(fn)
    cp.def_partition(partition, infer_sharding_from_operands=infer, propagate_user_sharding=propagate,
                     sharding_rule=sharding_rule)
    return cp


def token_sharded(fn, in_ranks: tuple, out_ranks: tuple, ref: int = 0):
    """Make a per-token function transparent to sharding of its token dims.

    Args:
        fn: ``fn(*arrays) -> tuple of arrays``; inputs may be None (absent).
            Every array either carries the token dims in front (the leading
            dims of input ``ref``) followed by a fixed number of trailing dims,
            or has no token dims: an input shared by all tokens, or an output
            that is a sum over tokens.  Its host-callback kernels must go
            through :func:`emit`.
        in_ranks: per input, its trailing rank when it carries the token dims,
            or None if it never does.  An input whose rank does not match
            ``token dims + rank`` is taken as shared.
        out_ranks: the same for the outputs; an output that does not carry the
            token dims is summed over tokens (and is psum-reduced across the
            mesh axes of the token dims).
        ref: the input whose leading dims are the token dims.

    Returns:
        The wrapped function, same signature; under ``jax.jit`` over a mesh
        it runs per device on the local tokens.
    """

    def run(*arrays):
        if getattr(_state, "inner", None) is not None:  # already per device
            return fn(*arrays)
        nlead = arrays[ref].ndim - in_ranks[ref]
        if nlead <= 0:
            return fn(*arrays)
        present = tuple(i for i, a in enumerate(arrays) if a is not None)

        def kind(a, rank):
            return rank if rank is not None and a.ndim == nlead + rank else None

        in_kinds = tuple(kind(arrays[i], in_ranks[i]) for i in present)
        out_shapes = _jax.eval_shape(lambda *a: tuple(fn(*a)), *arrays)
        out_kinds = tuple(kind(o, r) for o, r in zip(out_shapes, out_ranks))
        if all(k is None for k in out_kinds):
            return fn(*arrays)  # no token output to carry the sharding

        def local(*given):
            full = [None] * len(arrays)
            for i, a in zip(present, given):
                full[i] = a
            return tuple(fn(*full))

        local = _Hashable(local, (fn, len(arrays), present))
        cp = _partitioned(local, nlead, in_kinds, out_kinds, present.index(ref))
        recorded: dict = {}
        _recorders().append(recorded)
        try:
            outs = cp(*[arrays[i] for i in present])
        finally:
            _recorders().pop()
        for rec in _recorders():  # an enclosing token_sharded registers them too
            for k, h in recorded.items():
                rec.setdefault(k, h)
        if recorded:
            outs = _anchor_p.bind(*outs, hosts=tuple(recorded.items()))
        return tuple(outs)

    return functools.wraps(fn)(run)


class _Hashable:
    """A callable compared by a key, so that the custom_partitioning cache hits."""

    def __init__(self, f, key):
        self.f, self.key = f, key
        self.__name__ = getattr(key[0], "__name__", "mhc_token_sharded")

    def __call__(self, *args):
        return self.f(*args)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self.key == other.key
