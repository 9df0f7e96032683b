"""Zero-copy interop: read any framework's arrays, allocate outputs in it.

Every array handed to the functional API goes through a *front end* chosen by
its type (without importing any framework that the caller has not imported):

  ``torch``  torch.Tensor: pointer, shape and strides read directly (fast
             path); outputs ``torch.empty`` on the tensor's device; launches on
             ``torch.cuda.current_stream``.
  ``cupy``   cupy.ndarray: likewise; launches on CuPy's current stream.
  ``jax``    jax.Array (eager): imported through DLPack into CuPy (JAX orders
             its stream before ours), outputs exported back to JAX.
  ``numpy``  numpy.ndarray (CPU): the reference path.
  ``dlpack`` anything else with ``__dlpack__`` / ``__cuda_array_interface__``:
             imported through CuPy (GPU) or NumPy (CPU); outputs are CuPy (GPU)
             or NumPy (CPU) arrays.

An ``ArrayInfo`` (shape, dtype name, device, pointer, element strides) is all
the checks and the launch plans see.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from ._deps import install_hint, require_cupy


class ArrayInfo(NamedTuple):
    """What the checks and launch plans see of an array (a tuple: cheap to build)."""

    shape: tuple
    dtype: str  # canonical name: "float32", "bfloat16", "float16", "int8", ...
    device: tuple  # ("cpu", 0) or ("cuda", ordinal)
    ptr: int | None = None
    strides: tuple | None = None  # in elements


def is_contiguous(shape, strides) -> bool:
    """C-contiguous, ignoring the strides of size-1 dims (and of empty arrays)."""
    if strides is None:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 0:
            return True
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def numpy_dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


#: Output dtypes some frameworks cannot hold, and what holds their bits there: CuPy (which has no
#: float8 dtype, nor its DLPack code) returns a float8 e4m3fn output as uint8 bits, and the JAX
#: kernel calls (mhc_cupy._jax_kernels) let XLA allocate it as uint8, viewed as float8 after the call.
BITS_OF = {"float8_e4m3fn": "uint8"}


_NAMES: dict = {}


def _np_name(dtype) -> str:
    """np.dtype(...).name, memoised (the property is slow for a per-call path)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = np.dtype(dtype).name
    return name


# ---------------------------------------------------------------- front ends
class _Torch:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self.to_name = {
            torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
            torch.float64: "float64", torch.float8_e4m3fn: "float8_e4m3fn",
            torch.uint8: "uint8",  # the temporaries' buffer (_dispatch.Plan.scratch_ptrs)
        }
        self.from_name = {v: k for k, v in self.to_name.items()}

    def info(self, x) -> ArrayInfo:
        dtype = self.to_name.get(x.dtype) or str(x.dtype).replace("torch.", "")
        if x.is_cuda:
            return ArrayInfo(tuple(x.shape), dtype, ("cuda", x.get_device()), x.data_ptr(), x.stride())
        d = x.device
        return ArrayInfo(tuple(x.shape), dtype, (d.type, d.index or 0))

    def contiguous(self, x):
        return x.detach().contiguous()

    def empty(self, shape, dtype: str, like):
        return like.new_empty(shape, dtype=self.from_name[dtype])  # like's device; cheaper than device=like.device

    @staticmethod
    def ptr(x) -> int:
        return x.data_ptr()

    def stream(self, device: int) -> int:
        raw = getattr(self.torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x cheaper
        if raw is not None:
            return raw(device)
        return self.torch.cuda.current_stream(device).cuda_stream

    def to_numpy(self, x):
        # Through DLPack, not Tensor.numpy(): numpy() marks the tensor's storage
        # as not resizable for good, and FSDP2 frees its unsharded parameters
        # by resizing their storage to 0 after each forward.
        x = x.detach()
        if x.dtype == self.torch.bfloat16:
            return np.from_dlpack(x.view(self.torch.int16)).view(numpy_dtype("bfloat16"))
        return np.from_dlpack(x)

    def from_numpy(self, a, like):
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(self.torch.bfloat16)
        if a.dtype.name == "float8_e4m3fn":
            return self.torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(self.torch.float8_e4m3fn)
        return self.torch.from_numpy(np.ascontiguousarray(a))


class _Cupy:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def info(self, x) -> ArrayInfo:
        isz = x.itemsize
        strides = tuple(s // isz if s % isz == 0 else None for s in x.strides)
        if None in strides:
            strides = (-1,) * x.ndim  # not expressible in elements: forces a copy
        return ArrayInfo(tuple(x.shape), _np_name(x.dtype), ("cuda", x.device.id), x.data.ptr, strides)

    def contiguous(self, x):
        return self.cupy.ascontiguousarray(x)

    def empty(self, shape, dtype: str, like=None):
        """On the current device (the caller enters the right one); float8: its bits (``BITS_OF``)."""
        return self.cupy.empty(shape, dtype=numpy_dtype(BITS_OF.get(dtype, dtype)))

    @staticmethod
    def ptr(x) -> int:
        return x.data.ptr

    def stream(self, device: int) -> int:
        return self.cupy.cuda.get_current_stream(device).ptr


class _Numpy:
    name = "numpy"

    def info(self, x) -> ArrayInfo:
        return ArrayInfo(tuple(x.shape), _np_name(x.dtype), ("cpu", 0))

    def to_numpy(self, x):
        return x

    def from_numpy(self, a, like):
        return a


class _Jax:
    """Eager jax.Array.  (Inside jit use mhc_cupy.jax, which runs on XLA's buffers.)"""

    name = "jax"

    def __init__(self):
        import jax

        self.jax = jax

    def _device(self, x):
        devs = x.devices()
        if len(devs) != 1:
            raise ValueError(f"is a jax array on {len(devs)} devices ({x.sharding}); the functional API takes "
                             "single-device arrays: under jax.jit, mhc_cupy.jax partitions its ops over sharded "
                             "token dims")
        return next(iter(devs))

    @staticmethod
    def _ordinal(d) -> int:
        return getattr(d, "local_hardware_id", d.id)

    def info(self, x) -> ArrayInfo:
        d = self._device(x)
        if d.platform == "cpu":
            return ArrayInfo(tuple(x.shape), _np_name(x.dtype), ("cpu", 0))
        return ArrayInfo(tuple(x.shape), _np_name(x.dtype), ("cuda", self._ordinal(d)))

    def to_cupy(self, x):
        """A CuPy view of x; JAX orders its pending writes of x before CuPy's
        current stream of x's device (hence the device switch)."""
        cupy = require_cupy("a JAX array on a GPU")

        with cupy.cuda.Device(self._ordinal(self._device(x))):
            return cupy.from_dlpack(x)

    def from_cupy(self, a, dtype: str | None = None):
        """A JAX view of CuPy array ``a``; ``dtype``: the output's dtype, of which ``a`` may hold the bits
        (``BITS_OF``)."""
        import jax.dlpack

        out = jax.dlpack.from_dlpack(a)
        if dtype in BITS_OF:
            out = self.jax.lax.bitcast_convert_type(out, numpy_dtype(dtype))
        return out

    def to_numpy(self, x):
        return np.asarray(x)

    def from_numpy(self, a, like):
        import jax.numpy as jnp

        return self.jax.device_put(jnp.asarray(a), self._device(like))


_frontends: dict = {}


def _get(name):
    fe = _frontends.get(name)
    if fe is None:
        fe = _frontends[name] = {"torch": _Torch, "cupy": _Cupy, "numpy": _Numpy, "jax": _Jax}[name]()
    return fe


def framework_of(x) -> str:
    """'torch', 'cupy', 'jax', 'numpy' or 'dlpack'.  Raises TypeError for non-arrays."""
    root = type(x).__module__.partition(".")[0]
    torch = sys.modules.get("torch")
    # By isinstance, not by the type's module alone: a subclass (a user's torch.Tensor or np.ndarray
    # subclass, defined in their own module) is still that framework's array. Read as a generic DLPack
    # producer, a torch subclass came back as NumPy, lost its negative bit (every value's sign wrong)
    # and raised BufferError when it required grad; a masked-array subclass had its mask ignored.
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if root == "cupy":
        return "cupy"
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):  # the kernels and the reference would read the masked cells
            raise TypeError("got a NumPy masked array, whose mask would be ignored; pass x.filled(value) "
                            "or np.asarray(x) (its data, masked cells included)")
        return "numpy"
    if root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.core.Tracer):
            raise TypeError(
                "got a JAX tracer: inside jax.jit / grad / vmap use the mhc_cupy.jax functions, "
                "not the functional *_fwd/*_bwd API"
            )
        return "jax"
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        return "dlpack"
    raise TypeError(f"expected an array (torch, jax, cupy, numpy or any DLPack producer), got {type(x).__name__}")


def frontend(name: str):
    return _get(name)


def _cpu_dlpack_via_torch(x, exc):
    """A CPU DLPack array NumPy cannot import (bfloat16) as a NumPy (ml_dtypes) array, via torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise TypeError(f"NumPy cannot import this CPU DLPack array ({exc}); bfloat16 needs torch installed "
                        f"({install_hint('torch', 'torch')}) or pass a NumPy ml_dtypes.bfloat16 array") from None
    import torch

    try:
        return _get("torch").to_numpy(torch.from_dlpack(x))
    except (RuntimeError, BufferError, ValueError, TypeError) as exc2:  # what the producer refuses to export
        said = f"{exc}" if str(exc2) == str(exc) else f"NumPy: {exc}; torch: {exc2}"
        raise TypeError(f"this CPU DLPack array ({type(x).__name__}) could not be imported ({said})") from None


def import_foreign(x):
    """A generic DLPack / CUDA-array-interface object as a CuPy (GPU) or NumPy (CPU) array."""
    if hasattr(x, "__dlpack_device__"):
        dev_type, _ = x.__dlpack_device__()
        if int(dev_type) in (1, 3):  # kDLCPU, kDLCUDAHost
            try:
                return np.from_dlpack(x)
            except (RuntimeError, BufferError) as exc:  # NumPy has no bfloat16: read it through torch
                return _cpu_dlpack_via_torch(x, exc)
    elif not hasattr(x, "__cuda_array_interface__"):  # every importer asks the device first
        raise TypeError(f"got a {type(x).__name__} with __dlpack__ but no __dlpack_device__, which the DLPack "
                        "protocol requires beside it")
    cupy = require_cupy(f"a {type(x).__name__} on a GPU (DLPack / CUDA array interface)")

    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    return cupy.asarray(x)
