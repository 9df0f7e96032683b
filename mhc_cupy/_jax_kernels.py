"""One kernel entry point of the op table as a JAX function: planned at trace time, run as one
``jax.experimental.buffer_callback`` custom call on XLA's stream and buffers, batched by
``custom_vmap`` and token-sharded by :mod:`mhc_cupy._jax_shard` (how and why: the docstring of
:mod:`mhc_cupy.jax`, "How it runs").  :func:`_k` is what the JAX adapter calls.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import jax as _jax
import jax.numpy as _jnp

from . import _checks, _dispatch, _interop, _replay
from . import _jax_shard as _shard
from ._interop import ArrayInfo
from ._kernel_choice import KernelChoice, current as current_choice, kernel_choice
from . import ops as _ops

try:  # jax >= 0.6.1 (an experimental API)
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - depends on the installed jax
    _buffer_callback = None

#: Placeholder device of the trace-time ArrayInfo: planners read only shapes
#: and dtypes; the real device is known when the callback runs.
_TRACE_DEVICE = ("cuda", 0)
_KDL_CPU = 1


# ------------------------------------------------------------ kernel specs
@dataclass(frozen=True)
class _Spec:
    """One kernel entry point: its planner and how its inputs batch.

    ``ranks``: trailing (non-token) dims of each input; every input has the
    token dims in front.  ``ref``: the input whose leading dims are the token
    dims.  ``shared``: the input that may be shared by all tokens (``h`` of
    aggregate / distribute when it is ``[n]``, or the RMSNorm ``weight``);
    ``shared_grad``: the output that is its gradient (summed over tokens), or
    None.  ``shared_mode``: "expand" (an ``[..., n]`` per-token form exists)
    or "sequential".
    """

    name: str
    planner: object
    inputs: tuple
    ranks: tuple
    ref: str
    shared: str | None = None
    shared_grad: int | None = None
    shared_mode: str = "expand"
    #: Parameters without token dims (the coefficient path's phi, alpha, bias):
    #: they stay unbatched when only token inputs are batched; otherwise, or
    #: when their per-example gradient is computed, the kernel runs per example.
    fixed: tuple = ()
    #: Trailing rank of each output that carries the token dims; None for an
    #: output summed over tokens (a shared parameter's gradient).  A rank that
    #: does not match the output's dims (e.g. the gradient of a shared h [n])
    #: also means summed.
    out_ranks: tuple = ()

    def rank(self, name: str) -> int:
        return self.ranks[self.inputs.index(name)]

    def is_shared(self, shapes: dict) -> bool:
        """Whether the shared-capable input is given and shared, for unbatched ``shapes``."""
        s = self.shared
        if s is None or shapes.get(s) is None:
            return False
        if self.shared_mode == "sequential":
            return True
        ref = shapes[self.ref]
        return len(shapes[s]) == 1 and len(ref) > self.rank(self.ref)


def _spec(k) -> _Spec:
    """The JAX view of one op spec (``mhc_cupy.ops.SPECS``): ranks from the shape codes, the
    parameters without token dims fixed, and the first output that is the gradient of a
    shared or fixed input as ``shared_grad``."""
    fixed = tuple(a.name for a in k.inputs if not a.per_token and a.name != k.shared)
    shared_grad = next((i for i, o in enumerate(k.outputs)
                        if k.is_grad(o) and (o.name == k.shared or o.name in fixed)), None)
    return _Spec(k.name, k.planner, k.names, tuple(a.rank for a in k.args), k.ref.name, k.shared, shared_grad,
                 k.shared_mode, fixed, tuple(o.rank if o.per_token else None for o in k.outputs))


_SPECS = {name: _spec(k) for name, k in _ops.SPECS.items()}


# ------------------------------------------------------- buffer plumbing
def _ctx_stream(ctx) -> int:
    """XLA's CUDA stream (``ctx.stream``; a method on older jaxlib)."""
    s = ctx.stream
    return int(s() if callable(s) else s)


def _ctx_ordinal(ctx, buffers) -> int:
    """CUDA ordinal of the executing device: ``ctx.device_ordinal`` where jaxlib
    has it (attribute or method), else the DLPack device of XLA's buffers."""
    d = getattr(ctx, "device_ordinal", None)
    if d is not None:
        return int(d() if callable(d) else d)
    for b in buffers:
        return int(b.__dlpack_device__()[1])
    import cupy

    return cupy.cuda.runtime.getDevice()


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
#: Offsets inside DLPack structs (64-bit): DLTensor.byte_offset, and
#: DLManagedTensorVersioned.dl_tensor (after version, manager_ctx, deleter, flags).
_DLTENSOR_BYTE_OFFSET = 40
_VERSIONED_TENSOR_AT = 32


def _dlpack_ptr(buf) -> int:
    """Data pointer of a buffer from its DLPack capsule (not consumed)."""
    cap = buf.__dlpack__()
    name = _capsule_get_name(cap)
    managed = _capsule_get_pointer(cap, name)
    tensor = managed + (_VERSIONED_TENSOR_AT if name == b"dltensor_versioned" else 0)
    data = ctypes.c_void_p.from_address(tensor).value or 0
    return data + ctypes.c_uint64.from_address(tensor + _DLTENSOR_BYTE_OFFSET).value


def _device_ptr(buf) -> int:
    """Raw device pointer of an XLA ``Buffer`` (CUDA array interface, else DLPack:
    some jaxlib versions refuse the interface for some dtypes)."""
    try:
        return int(buf.__cuda_array_interface__["data"][0])
    except Exception:  # noqa: BLE001 - any refusal: fall back to DLPack
        return _dlpack_ptr(buf)


def _jnp_dtype(name: str):
    return _jnp.dtype(_interop.numpy_dtype(name))


def _buffer_dtype(name: str):
    """The dtype XLA allocates an output of dtype ``name`` as: float8 as its bits (``_interop.BITS_OF``:
    the callback then sees plain bytes on any jaxlib), viewed as float8 after the call."""
    return _jnp_dtype(_interop.BITS_OF.get(name, name))


#: Replay a plan's recorded launches in the GPU callback (:mod:`mhc_cupy._replay`, the torch / CuPy fast
#: path's mechanism: the first call on a device records its launches, later calls with 16-byte aligned
#: buffers repeat them through cuLaunchKernel with XLA's new pointers, skipping the plan's Python and
#: CuPy's argument conversion).  Off until a GPU run has checked it under XLA (read at each call).
REPLAY = False


def _make_callback(plan, names: tuple, present: tuple):
    """The buffer_callback body for one plan.

    ``names``: every input of the op, in planner order; ``present``: the names
    that are given (absent ones, e.g. pre-op gradients, stay None).
    """
    n_out = len(plan.outputs)
    shapes = [tuple(s) for s, _ in plan.outputs + list(plan.scratch.values())]
    replays = {}  # device ordinal -> the Replay recorded there, or False (not replayable)

    def callback(ctx, outs, *ins):
        for b, shape in zip(outs, shapes):  # guard: the plan fits what XLA allocated
            if tuple(b.shape) != shape:
                raise RuntimeError(f"mhc_cupy.jax: buffer of shape {tuple(b.shape)} where the plan "
                                   f"expects {shape}")
        first = ins[0] if ins else outs[0]
        if int(first.__dlpack_device__()[0]) == _KDL_CPU:
            arrays = dict.fromkeys(names)
            arrays.update({k: np.asarray(b) for k, b in zip(present, ins)})
            with np.errstate(all="ignore"):  # as _dispatch's CPU path: no RuntimeWarning, no np.seterr error
                results = plan.reference(arrays)
                for b, r, (shape, dt) in zip(outs[:n_out], results, plan.outputs):
                    host = np.asarray(b)
                    host[...] = np.asarray(r).astype(_interop.numpy_dtype(dt)).reshape(shape).view(host.dtype)
            return
        import cupy

        stream = _ctx_stream(ctx)
        in_ptrs = [_device_ptr(b) for b in ins]
        out_ptrs = [_device_ptr(b) for b in outs]
        dev = _ctx_ordinal(ctx, ins or outs)
        replay = replays.get(dev) if REPLAY else None
        with cupy.cuda.Device(dev):
            if replay and _replay.aligned(in_ptrs) and _replay.aligned(out_ptrs):
                if _dispatch.POISON:
                    _dispatch.poison(plan, out_ptrs[:n_out], out_ptrs[n_out:], stream)
                replay.launch(in_ptrs + out_ptrs, stream)
                return
            ptrs = dict.fromkeys(names)
            ptrs.update(zip(present, in_ptrs))
            if not REPLAY or dev in replays:
                plan.launch(ptrs, out_ptrs[:n_out], out_ptrs[n_out:], stream)
                return
            with _replay.recording() as launched:
                plan.launch(ptrs, out_ptrs[:n_out], out_ptrs[n_out:], stream)
            replays[dev] = _replay.record(launched, in_ptrs + out_ptrs) or False

    return callback


@functools.lru_cache(maxsize=4096)
def _planned(name: str, params: tuple, signature: tuple, choice: KernelChoice):
    """(plan, callback) for one op, static parameters, input signature and kernel choice
    (:mod:`mhc_cupy._kernel_choice`: the one in force at trace time, which the planner reads).

    Cached so that identical calls bind an identical callback (JAX's caches
    then hit).  A planner error propagates and is not cached.
    """
    spec = _SPECS[name]
    infos = {k: None if sig is None else ArrayInfo(sig[0], sig[1], _TRACE_DEVICE)
             for k, sig in zip(spec.inputs, signature)}
    with kernel_choice(choice):
        plan = spec.planner(infos, **dict(params))
    present = tuple(k for k, sig in zip(spec.inputs, signature) if sig is not None)
    callback = _make_callback(plan, spec.inputs, present)
    # A token-sharded program runs the kernel per device through a callback
    # planned from the local buffers (mhc_cupy._jax_shard), under the same choice.
    mask = tuple(sig is not None for sig in signature)
    setattr(callback, _shard.HOST_ATTR, ((name, params, mask, choice), _host(name, params, mask, choice)))
    return plan, callback


def _dtype_name(a) -> str:
    return np.dtype(a.dtype).name


def _check_arrays(name: str, arrays: tuple) -> None:
    """None (where the op needs an array) or a list for an array: an error naming the argument."""
    for k, a in zip(_SPECS[name].inputs, arrays):
        if a is None:
            _checks.absent(k, _SPECS[name].planner)
        elif not hasattr(a, "dtype"):
            raise TypeError(f"{k} has type {type(a).__name__}; it needs an array")


def _bind(name: str, params: tuple, arrays: tuple) -> tuple:
    """Plan at trace time and emit the buffer_callback custom call."""
    _check_arrays(name, arrays)
    signature = tuple(None if a is None else (tuple(a.shape), _dtype_name(a)) for a in arrays)
    plan, callback = _planned(name, params, signature, current_choice())
    if plan.empty:
        return tuple(_jnp.zeros(shape, _jnp_dtype(dt)) for shape, dt in plan.outputs)
    if _buffer_callback is None:  # pragma: no cover - depends on the installed jax
        raise ImportError(f"mhc_cupy.jax needs jax.experimental.buffer_callback (jax >= 0.6.1); "
                          f"this is jax {_jax.__version__}")
    results = [_jax.ShapeDtypeStruct(tuple(shape), _buffer_dtype(dt))
               for shape, dt in plan.outputs + list(plan.scratch.values())]
    # vmap never reaches this primitive (custom_vmap above it batches by
    # re-planning); "sequential" is the safe statement should it ever do.
    # Not command-buffer compatible (the default): the callback may compile
    # kernels on first use, and jaxlib's command-buffer target name has varied.
    call = _buffer_callback(callback, results, vmap_method="sequential")
    outs = call(*[a for a in arrays if a is not None])
    return tuple(o if dt not in _interop.BITS_OF else _jax.lax.bitcast_convert_type(o, _jnp_dtype(dt))
                 for o, (_, dt) in zip(outs, plan.outputs))


@functools.lru_cache(maxsize=None)
def _host(name: str, params: tuple, present: tuple, choice: KernelChoice):
    """Kernel ``name`` as a host callback in XLA's FFI protocol, planned from
    the buffers it gets (under ``choice``, the trace's kernel choice): the
    per-device program of a token-sharded op (``mhc_cupy._jax_shard``) calls it
    with its local shapes.  ``present``: per input, whether it is given."""
    n_in = sum(present)

    def host(ctx, *buffers):
        ins, outs = buffers[:n_in], buffers[n_in:]
        given = iter(ins)
        full = [next(given) if p else None for p in present]
        signature = tuple(None if b is None else (tuple(b.shape), _dtype_name(b)) for b in full)
        plan, callback = _planned(name, params, signature, choice)
        callback(ctx, outs, *ins)

    return host


# ------------------------------------------------------------------ vmap
def _broadcast_front(a, size: int):
    return _jnp.broadcast_to(a, (size,) + tuple(a.shape))


def _vmap_rule(name: str, params: tuple, choice: KernelChoice, axis_size: int, in_batched, *arrays):
    """custom_vmap rule of kernel ``name``: batched inputs arrive with the batch
    axis first; the result equals running the kernel once per example."""
    spec = _SPECS[name]
    batched = [bool(b) if a is not None else False for a, b in zip(arrays, in_batched)]
    call = _kernel(name, params, choice)

    def per_example():
        """One kernel call per example (lax.map over the batched inputs)."""
        idx = [i for i, b in enumerate(batched) if b]

        def one(sliced):
            merged = list(arrays)
            for i, v in zip(idx, sliced):
                merged[i] = v
            return tuple(call(*merged))

        outs = _jax.lax.map(one, tuple(arrays[i] for i in idx))
        return tuple(outs), tuple(True for _ in outs)

    def per_token(a, b):
        return a if a is None or b else _broadcast_front(a, axis_size)

    if spec.fixed:
        fixed = [k in spec.fixed for k in spec.inputs]
        if spec.shared_grad is None and not any(b for b, f in zip(batched, fixed) if f):
            # the batch axis is one more token dim; the parameters stay as they are
            outs = call(*[a if f else per_token(a, b) for a, b, f in zip(arrays, batched, fixed)])
            return tuple(outs), tuple(True for _ in outs)
        return per_example()  # batched parameters, or their per-example gradients
    shapes = {k: None if a is None else (tuple(a.shape[1:]) if b else tuple(a.shape))
              for k, a, b in zip(spec.inputs, arrays, batched)}
    shared = spec.is_shared(shapes)
    si = spec.inputs.index(spec.shared) if shared else None

    if not shared or (not batched[si] and spec.shared_grad is None):
        # One more leading token dim; an unbatched shared input stays shared.
        new = [a if i == si else per_token(a, b) for i, (a, b) in enumerate(zip(arrays, batched))]
        outs = call(*new)
        return tuple(outs), tuple(True for _ in outs)

    if spec.shared_mode == "sequential":
        return per_example()  # a per-example weight gradient (or a batched weight)

    # "expand": shared h [n] (batched or not) becomes per-token [B, ..., n]; its
    # gradient, then per token, is summed over each example's tokens.
    lead = shapes[spec.ref][:len(shapes[spec.ref]) - spec.rank(spec.ref)]
    h = arrays[si]
    n = h.shape[-1]
    hb = h if batched[si] else _broadcast_front(h, axis_size)
    h_tok = _jnp.broadcast_to(hb.reshape((axis_size,) + (1,) * len(lead) + (n,)), (axis_size,) + lead + (n,))
    new = [h_tok if i == si else per_token(a, b) for i, (a, b) in enumerate(zip(arrays, batched))]
    outs = list(call(*new))
    if spec.shared_grad is not None:
        outs[spec.shared_grad] = _jnp.sum(outs[spec.shared_grad], axis=tuple(range(1, 1 + len(lead))))
    return tuple(outs), tuple(True for _ in outs)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, params: tuple, choice: KernelChoice):
    """The custom_vmap function running kernel ``name`` with static ``params`` under ``choice`` (the
    kernel choice of the trace that called it: a token-sharded op's per-device function is traced
    again in XLA's compile thread, which does not see the caller's choice)."""

    spec = _SPECS[name]

    def run(*arrays):
        with kernel_choice(choice):
            return _bind(name, params, arrays)

    run.__name__ = f"mhc_{name}"
    # Per token: under jit with the token dims sharded, each device runs the
    # kernel on its own tokens (see mhc_cupy._jax_shard).
    run = _shard.token_sharded(run, spec.ranks, spec.out_ranks, spec.inputs.index(spec.ref))
    f = _jax.custom_batching.custom_vmap(run)
    f.def_vmap(functools.partial(_vmap_rule, name, params, choice))
    # jitted: eager calls too run the token-sharded kernel per device (outside jit, the sharding wrapper ran once
    # on the whole arrays: an eager mhc_layer on token-sharded x returned its output replicated)
    return _jax.jit(f)


def _k(name: str, params: tuple, *arrays) -> tuple:
    _check_arrays(name, arrays)  # before the vmap and sharding wrappers look at shapes
    return _no_derivative(name, params, *arrays)


@functools.partial(_jax.custom_jvp, nondiff_argnums=(0, 1))
def _no_derivative(name: str, params: tuple, *arrays) -> tuple:
    """The kernel call, with a JVP rule that says why there is none.  Forward kernels run inside the
    ops' custom_vjp (whose own refusal of jax.jvp comes first), so this is reached by a derivative of
    a backward: jax.grad of jax.grad, or forward mode over it, where JAX's own error names buffer
    callbacks and suggests jax.custom_jvp.  Without tangents (all symbolic zeros) JAX never calls it."""
    return _shard.vary(_kernel(name, params, current_choice())(*arrays), arrays)  # typed for jax.shard_map


@_no_derivative.defjvp
def _no_derivative_jvp(name, params, primals, tangents):
    raise ValueError(f"mhc_cupy.jax: a derivative of the kernel {name} was asked for (a gradient of a gradient: "
                     f"jax.grad / jax.jvp / jax.hessian over the backward of an mhc_cupy.jax function); the JAX "
                     f"functions are differentiable once, in reverse mode (jax.grad / jax.vjp / jax.jacrev), "
                     f"not twice (their backward kernels have no derivative rule)")
