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
program registers the callbacks of the wrapped function when it is lowered (a
no-op "anchor" on the op's outputs), and the per-device function's
``buffer_callback`` custom calls use those indices (this module's lowering of
``buffer_callback`` for callbacks marked with :data:`HOST_ATTR`; any other
``buffer_callback`` lowers as before).
"""

from __future__ import annotations

import collections
import functools
import sys

import jax as _jax
import numpy as np
from jax._src import core as _core
from jax._src import ffi as _ffi
from jax._src.interpreters import mlir as _mlir
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

try:  # jax >= 0.6.1, as mhc_cupy.jax needs
    from jax._src import buffer_callback as _bc
except ImportError:  # pragma: no cover - depends on the installed jax
    _bc = None

__all__ = ["token_sharded", "HOST_ATTR", "varying", "vary", "like"]

#: Attribute of a ``buffer_callback`` callback: ``(key, host)``, the kernel's
#: family (hashable, the same for every shape) and its callback in XLA's FFI
#: protocol, ``host(exec_ctx, *inputs, *outputs)``, planning from the buffers'
#: shapes.  Only marked callbacks can run inside :func:`token_sharded`.
HOST_ATTR = "_mhc_token_sharded_host"

# ------------------------------------------------ host-callback bookkeeping
#: id of a program's host-callback list -> (the list, {key: index of the key's callback in it}),
#: for the most recently lowered programs (a program is compiled right after it is lowered).
_INDEX: collections.OrderedDict = collections.OrderedDict()
_INDEX_PROGRAMS = 256
_FFI_TARGET = {"cpu": "xla_buffer_python_cpu_callback", "cuda": "xla_buffer_python_gpu_callback",
               "rocm": "xla_buffer_python_gpu_callback"}


def _partitioning_callbacks():
    """While JAX's partition hook runs (it traces and lowers the per-device
    function), the host-callback list of the program being compiled, else None.

    The hook keeps the lowering context of the custom call in its ``info``
    local; the list is shared by every copy of that context.
    """
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_custom_partitioning_partition":
            info = f.f_locals.get("info")
            if info is None or not hasattr(info, "module_context"):
                raise RuntimeError("mhc_cupy.jax: cannot find the program being partitioned "
                                   "(jax.experimental.custom_partitioning internals changed)")
            return info.module_context.host_callbacks
        f = f.f_back
    return None


def _buffer_callback_lowering(ctx, *args, callback, has_side_effect, input_output_aliases,
                              command_buffer_compatible, **params):
    """``buffer_callback`` as before, except a marked callback in a per-device
    function: a custom call to the callback that the program registered."""
    marked = getattr(callback, HOST_ATTR, None)
    callbacks = _partitioning_callbacks() if marked is not None else None
    if callbacks is None:
        return _bc._buffer_callback_lowering(ctx, *args, callback=callback, has_side_effect=has_side_effect,
                                             input_output_aliases=input_output_aliases,
                                             command_buffer_compatible=command_buffer_compatible, **params)
    entry = _INDEX.get(id(callbacks))
    index = entry[1].get(marked[0]) if entry is not None and entry[0] is callbacks else None
    if index is None:
        raise RuntimeError(f"mhc_cupy.jax: host callback {marked[0]!r} is not registered in the program being "
                           "partitioned (only mhc_cupy._jax_shard.token_sharded registers them)")
    platform = ctx.module_context.platforms[0]
    target = _FFI_TARGET.get(platform)
    if target is None:
        raise ValueError(f"mhc_cupy.jax: buffer_callback is not supported on the {platform} backend")
    if command_buffer_compatible and platform in ("cuda", "rocm"):
        target += "_cmd_buffer"
    rule = _ffi.ffi_lowering(target, has_side_effect=has_side_effect,
                             operand_output_aliases=dict(input_output_aliases))
    return rule(ctx, *args, index=np.uint64(index))


if _bc is not None:
    _mlir.register_lowering(_bc.buffer_callback_p, _buffer_callback_lowering)

#: Identity on the op's outputs whose lowering registers the wrapped
#: function's host callbacks in the program (params: ``hosts``, tuple of (key, host)).
_anchor_p = _core.Primitive("mhc_register_host_callbacks")
_anchor_p.multiple_results = True
_anchor_p.def_impl(lambda *args, hosts: args)
_anchor_p.def_abstract_eval(lambda *args, hosts: args)


def _anchor_lowering(ctx, *args, hosts):
    mc = ctx.module_context
    entry = _INDEX.get(id(mc.host_callbacks))
    if entry is None or entry[0] is not mc.host_callbacks:
        entry = _INDEX[id(mc.host_callbacks)] = (mc.host_callbacks, {})
        while len(_INDEX) > _INDEX_PROGRAMS:
            _INDEX.popitem(last=False)
    for key, host in hosts:
        if key not in entry[1]:
            mc.add_host_callback(host)
            entry[1][key] = len(mc.host_callbacks) - 1
    return args


_mlir.register_lowering(_anchor_p, _anchor_lowering)


def _marked_hosts(jaxpr, found: dict) -> dict:
    """(key, host) of every marked buffer_callback in ``jaxpr`` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is _bc.buffer_callback_p:
            marked = getattr(eqn.params["callback"], HOST_ATTR, None)
            if marked is not None:
                found.setdefault(*marked)
        for sub in _core.jaxprs_in_params(eqn.params):
            _marked_hosts(sub, found)
    return found


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
def _partitioned(fn, nlead: int, in_kinds: tuple, out_kinds: tuple, in_ndims: tuple, out_ndims: tuple, ref: int):
    """custom_partitioning of ``fn`` over the present inputs.

    ``in_kinds`` / ``out_kinds``: per array, its trailing rank if it carries
    the token dims, else None (an input shared by all tokens / an output
    summed over tokens); ``*_ndims``: their numbers of dims.
    """

    def shardings(mesh, tok):
        def one(kind):
            return NamedSharding(mesh, PartitionSpec(*tok, *(None,) * kind) if kind is not None else PartitionSpec())
        return [one(k) for k in in_kinds], [one(k) for k in out_kinds]

    def partition(mesh, arg_shapes, result_shape):
        tok = _token_spec(mesh, arg_shapes[ref], nlead)
        arg_sh, out_sh = shardings(mesh, tok)
        axes = _axes(tok)

        def lower_fn(*arrays):
            outs = fn(*arrays)
            return tuple(_jax.lax.psum(o, axes) if k is None and axes else o for o, k in zip(outs, out_kinds))

        return mesh, lower_fn, tuple(out_sh), tuple(arg_sh)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (non-Shardy) propagation
        return tuple(shardings(mesh, _token_spec(mesh, arg_shapes[ref], nlead))[1])

    def propagate(mesh, user_shape):  # GSPMD: the result keeps its own sharding
        return tuple(getattr(s, "sharding", None) for s in user_shape)

    # Shardy: the token dims are pass-through factors shared by every token
    # array; every other dim has its own factor that must stay replicated.
    terms, replicated = [], []
    for side, kinds, ndims in (("i", in_kinds, in_ndims), ("o", out_kinds, out_ndims)):
        side_terms = []
        for i, (kind, ndim) in enumerate(zip(kinds, ndims)):
            lead = [f"t{d}" for d in range(nlead)] if kind is not None else []
            trail = [f"{side}{i}_{j}" for j in range(ndim - len(lead))]
            replicated += trail
            side_terms.append(" ".join(lead + trail))
        terms.append(", ".join(side_terms))
    rule = " -> ".join(terms)

    cp = custom_partitioning(fn)
    cp.def_partition(partition, infer_sharding_from_operands=infer, propagate_user_sharding=propagate,
                     sharding_rule=rule, need_replication_factors=tuple(replicated))
    return cp


def token_sharded(fn, in_ranks: tuple, out_ranks: tuple, ref: int = 0):
    """Make a per-token function transparent to sharding of its token dims.

    Args:
        fn: ``fn(*arrays) -> tuple of arrays``; inputs may be None (absent).
            Every array either carries the token dims in front (the leading
            dims of input ``ref``) followed by a fixed number of trailing dims,
            or has no token dims: an input shared by all tokens, or an output
            that is a sum over tokens.  Its ``buffer_callback`` kernels
            must carry :data:`HOST_ATTR`.
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
        nlead = arrays[ref].ndim - in_ranks[ref]
        if nlead <= 0 or _bc is None or _jax.device_count() < 2 or _partitioning_callbacks() is not None:
            return fn(*arrays)  # no token dims, nothing to shard over, or already per device
        present = tuple(i for i, a in enumerate(arrays) if a is not None)

        def local(*given):
            full = [None] * len(arrays)
            for i, a in zip(present, given):
                full[i] = a
            return tuple(fn(*full))

        given = [arrays[i] for i in present]
        traced = _jax.make_jaxpr(local)(*given)  # output shapes, and the host callbacks to register

        def kind(ndim, rank):
            return rank if rank is not None and ndim == nlead + rank else None

        in_kinds = tuple(kind(arrays[i].ndim, in_ranks[i]) for i in present)
        out_ndims = tuple(len(a.shape) for a in traced.out_avals)
        out_kinds = tuple(kind(d, r) for d, r in zip(out_ndims, out_ranks))
        if all(k is None for k in out_kinds):
            return fn(*arrays)  # no token output to carry the sharding
        cp = _partitioned(_Hashable(local, (fn, len(arrays), present)), nlead, in_kinds, out_kinds,
                          tuple(a.ndim for a in given), out_ndims, present.index(ref))
        outs = cp(*given)
        hosts = _marked_hosts(traced.jaxpr, {})
        if hosts:
            outs = _anchor_p.bind(*outs, hosts=tuple(hosts.items()))
        return tuple(outs)

    return functools.wraps(fn)(run)


# ------------------------------------------------ jax.shard_map with check_vma
# Inside ``jax.shard_map`` (check_vma=True, the default) every value's type says over which
# manual mesh axes it varies.  ``buffer_callback`` declares its results invariant, and a
# custom_vjp's backward must give each input's gradient that input's type.  So a kernel's
# results are typed as varying over every axis one of its inputs varies over (:func:`vary`), and
# each gradient is brought to its primal's type (:func:`like`): summed (psum) over the axes where
# only the gradient varies, which is the transpose of JAX's implicit cast of an invariant
# operand to varying, as for any jax.numpy op.  Outside shard_map both are no-ops.
def varying(a) -> frozenset:
    """The manual mesh axes over which ``a`` varies (empty outside ``jax.shard_map``, with
    check_vma=False, or for None)."""
    if a is None:
        return frozenset()
    t = _jax.typeof(a)
    for name in ("mat", "manual_axis_type", "manual_type"):  # jax >= 0.10: a ManualAxisType
        mat = getattr(t, name, None)
        if mat is not None:
            return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))  # jax < 0.10: the set itself


def _axes_tuple(names) -> tuple:
    return tuple(sorted(names, key=str))


def _cast(a, want: frozenset):
    """``a`` summed over the axes it varies over outside ``want``, cast to varying over the rest."""
    if a is None:
        return a
    have = varying(a)
    if have - want:
        a = _jax.lax.psum(a, _axes_tuple(have - want))
    if want - have:
        axes = _axes_tuple(want - have)
        pcast = getattr(_jax.lax, "pcast", None)
        a = pcast(a, axes, to="varying") if pcast is not None else _jax.lax.pvary(a, axes)  # pvary: jax < 0.8.2
    return a


def vary(outs, ins) -> tuple:
    """A kernel's results ``outs``, typed as varying over every axis that one of ``ins`` varies over."""
    want = frozenset().union(*(varying(a) for a in ins))
    return tuple(_cast(o, want) for o in outs) if want else tuple(outs)


def like(grads, primals) -> tuple:
    """Each gradient (None: absent) with the type of its primal under ``jax.shard_map``."""
    return tuple(_cast(g, varying(p)) for g, p in zip(grads, primals))


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
