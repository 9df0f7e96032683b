"""Run-time specialisation, compilation and caching of the CUDA kernels.

A kernel is named by its source file and a C++ name expression, the template
instantiation with every baked-in constant (dtype, n, vector width, ...), e.g.
``("stream.cu", "mhc_stream_mix_distribute_fwd_kernel<__nv_bfloat16,4,8,true,true>")``.

Caches:
  * in process: one loaded function per (device, file, name expression);
  * on disk: one entry per key under ``$MHC_CUPY_CACHE_DIR`` (``~`` expanded, a
    relative path from the current folder; default ``~/.cache/mhc_cupy``); the key is the SHA-256 of the inlined kernel text,
    the NVRTC options, the include folders, the SHA-256 of every CUDA header the
    kernel includes from them (``_headers.digest``: ``cuda_bf16.h``,
    ``cuda_fp16.h``, their ``.hpp`` and what they include), the target
    architecture, the NVRTC version and the name expression.  A warm process
    loads the binary and never calls NVRTC (``stats["compiles"]`` stays 0).

The disk cache runs code on the GPU, so it trusts only what the user alone can
write: the folder is created 0700 and is used only when it is a real folder
(not a symlink) owned by the user and not writable by group or others (else a
warning, once, and no disk cache); entries are opened without following
symlinks and must pass the same ownership test.  Each entry stores the binary's
size and SHA-256: a bad entry (truncated, empty, bad metadata, a header
nested too deep to parse, digest mismatch, a folder or other non-file in its
place) is a miss, dropped (an empty folder removed; a folder with files in it
stays) and recompiled.  Writes go to a temporary file in
the folder, renamed into place (removed if the write fails).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from . import _headers, _nvrtc, _replay, _sources

#: Options handed to NVRTC for every kernel (besides -I and the architecture).
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)

#: Counters for tests and ``python -m mhc_cupy info``.
stats = {"compiles": 0, "disk_hits": 0, "loads": 0}

_lock = threading.Lock()
_functions: dict = {}
_SPACES = re.compile(r"\s*([<>,()])\s*")
_ENTRY_FORMAT = "mhc_cupy kernel cache entry 2"


def normalise(name_expression: str) -> str:
    """Canonical spelling of a name expression (no blanks around ``<>,()``)."""
    return _SPACES.sub(r"\1", name_expression.strip())


def cache_dir() -> Path:
    """The disk cache's folder, absolute: ``$MHC_CUPY_CACHE_DIR`` with ``~`` expanded (the shell does not
    when the value is quoted, or set by a Dockerfile's ENV: a folder named "~" in the current one, before)
    and a relative path taken from the current folder; unset or empty: ``~/.cache/mhc_cupy``."""
    d = os.environ.get("MHC_CUPY_CACHE_DIR")
    return Path(os.path.abspath(os.path.expanduser(d))) if d else Path.home() / ".cache" / "mhc_cupy"


def nvrtc_version() -> tuple[int, int]:
    return _nvrtc.version()


def target_arch(compute_capability: str) -> str:
    """NVRTC's ``--gpu-architecture`` for a device: its own cubin (``sm_80``, ...; for sm_90 ``sm_90a``,
    whose arch-specific instructions the wgmma kernels use) when this NVRTC supports it, else PTX of the
    newest architecture it supports (the driver compiles that for the device)."""
    cc, supported = int(compute_capability), _nvrtc.supported_archs()
    if cc == 90 and cc in supported:
        return "sm_90a"  # Hopper's own instructions too (wgmma: kernels_cu/wgmma.cuh); runs on sm_90 only
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a < cc]
    if not older:
        raise RuntimeError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot compile for this GPU (sm_{cc}); "
                           f"it supports {', '.join(f'sm_{a}' for a in supported)}")
    return f"compute_{max(older)}"


def _key(source: str, include_dirs, target: str, expr: str) -> str:
    h = hashlib.sha256()
    for part in (_ENTRY_FORMAT, source, "\0".join(NVRTC_OPTIONS), "\0".join(include_dirs),
                 _headers.digest(source, include_dirs), target, repr(nvrtc_version()), expr):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _trusted(st) -> str | None:
    """Why a file or folder with lstat result ``st`` may not be trusted, or None."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _usable_cache_dir() -> Path | None:
    """The cache folder, created 0700 if missing; None (one warning) if it cannot be trusted."""
    d = cache_dir()
    try:
        if not os.path.lexists(d):
            d.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:  # another process made it meanwhile
                pass
        st = os.lstat(d)
    except OSError as e:
        _warn_once(f"mhc_cupy: kernel cache {d} unusable ({e}); compiling without a disk cache")
        return None
    why = "a symlink" if stat.S_ISLNK(st.st_mode) else None if stat.S_ISDIR(st.st_mode) else "not a folder"
    why = why or _trusted(st)
    if why:
        _warn_once(f"mhc_cupy: ignoring kernel cache {d}: {why}; compiling without a disk cache "
                   "(set $MHC_CUPY_CACHE_DIR to a folder only you can write)")
        return None
    return d


def _drop(path: Path, folder: bool = False) -> str:
    """Remove a bad entry (an empty folder in its place too); "" or why it stays."""
    try:
        (os.rmdir if folder else os.unlink)(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # a folder with files in it, a read-only cache...
        return f" (could not remove it: {e.strerror}; this kernel compiles on every first use)"
    return ""


def _read_cache(key: str):
    """(mangled name, binary) of a good entry, else None (a bad entry is removed where it can be)."""
    d = _usable_cache_dir()
    if d is None:
        return None
    path = d / f"{key}.bin"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:  # missing, or a symlink (ELOOP)
        if os.path.islink(path):
            _drop(path)
        return None
    try:
        st = os.fstat(fd)
        why = None if stat.S_ISREG(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        why = why or _trusted(st)
        if why:
            os.close(fd)
            kept = _drop(path, folder=stat.S_ISDIR(st.st_mode))
            _warn_once(f"mhc_cupy: dropping kernel cache entry {path}: {why}{kept}")
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError:  # unreadable (EIO, ...): a miss
        return None
    try:
        head, code = data.split(b"\n", 1)
        meta = json.loads(head)
        good = (isinstance(meta, dict) and meta.get("format") == _ENTRY_FORMAT and isinstance(meta.get("mangled"), str)
                and meta["mangled"] and meta.get("size") == len(code) > 0
                and meta.get("sha256") == hashlib.sha256(code).hexdigest())
    except (ValueError, RecursionError):  # no header line, bad JSON or UTF-8, JSON nested too deep to parse
        good = False
    if not good:
        _drop(path)
        return None
    return meta["mangled"], code


def _write_cache(key: str, mangled: str, code: bytes) -> None:
    d = _usable_cache_dir()
    if d is None:
        return
    meta = {"format": _ENTRY_FORMAT, "mangled": mangled, "size": len(code),
            "sha256": hashlib.sha256(code).hexdigest()}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}.", suffix=".tmp")  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(meta).encode() + b"\n" + code)
        os.replace(tmp, d / f"{key}.bin")
        tmp = None
    except OSError:
        pass  # a read-only or full cache only costs a recompile next time
    finally:
        if tmp is not None:
            _drop(Path(tmp))


def kernel_binary(filename: str, expr: str, target: str) -> tuple[str, bytes]:
    """(mangled name, CUBIN or PTX) of kernel ``expr`` in ``kernels_cu/<filename>`` for
    NVRTC's ``target`` (``sm_90``), from the disk cache or compiled (and cached).
    Needs no GPU.

    Raises:
        KernelCompileError: NVRTC rejected the kernel.
    """
    include_dirs = _headers.include_dirs()
    source = _sources.load_source(filename)
    key = _key(source, include_dirs, target, expr)
    cached = _read_cache(key)
    if cached is not None:
        stats["disk_hits"] += 1
        return cached
    stats["compiles"] += 1
    res = _nvrtc.compile(source, filename, [expr], arch=target, options=NVRTC_OPTIONS, include_dirs=include_dirs,
                         heading=f"{expr} from kernels_cu/{filename}:\n")
    mangled, code = res["lowered_names"][expr], res["cubin" if target.startswith("sm_") else "ptx"]
    _write_cache(key, mangled, code)
    return mangled, code


def get_function(filename: str, name_expression: str):
    """The loaded kernel for the current CUDA device (compiled or cached)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    entry = _functions.get((dev, filename, name_expression))
    if entry is not None:
        return entry[0]
    with _lock:
        expr = normalise(name_expression)
        entry = _functions.get((dev, filename, expr))
        if entry is None:
            entry = _load(dev, filename, expr)
            _functions[(dev, filename, expr)] = entry
        _functions[(dev, filename, name_expression)] = entry
        return entry[0]


def _load(dev: int, filename: str, expr: str):
    import cupy

    mangled, code = kernel_binary(filename, expr, target_arch(cupy.cuda.Device(dev).compute_capability))
    module = cupy.cuda.function.Module()
    module.load(code)
    stats["loads"] += 1
    return module.get_function(mangled), module  # the module must outlive the function


_max_threads: dict = {}


def max_threads(filename: str, name_expression: str) -> int:
    """The largest block the compiled kernel can launch with (its registers
    per thread decide it) on the current device; compiles it if needed.
    1024 inside :func:`dry_run`."""
    if getattr(_local, "dry_run", None) is not None:
        return 1024
    fn = get_function(filename, name_expression)
    v = _max_threads.get(fn.ptr)
    if v is None:
        from cupy_backends.cuda.api import driver

        _driver_context()
        v = _max_threads[fn.ptr] = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn.ptr)
    return v


class DynamicSharedLimit:
    """Per kernel function, the largest dynamic shared memory its launches may use.

    A launch with more dynamic shared memory than the function's
    MAX_DYNAMIC_SHARED_SIZE_BYTES attribute is refused (CUDA_ERROR_INVALID_VALUE).
    That attribute starts at 48 KiB *less the function's static shared memory*
    (a kernel with ``__shared__ float red[64]`` cannot take 48 KiB of dynamic
    shared memory without raising it), so the first launch of a function that
    needs dynamic shared memory reads what it allows (``initial(fn_ptr)``),
    and a launch needing more sets the attribute (``set_attribute(fn_ptr,
    size)``).  The value set only ever grows (a smaller launch never lowers it,
    so a recorded launch stays valid for every later replay); reading and
    setting happen under a lock, and the limit is published only once set.
    """

    DEFAULT = 48 * 1024

    def __init__(self, set_attribute, initial):
        self._set_attribute, self._initial = set_attribute, initial
        self._max: dict = {}
        self._lock = threading.Lock()

    def ensure(self, fn_ptr: int, size: int) -> None:
        if size <= self._max.get(fn_ptr, 0):  # the common case (and every launch without any): no lock
            return
        with self._lock:
            allowed = self._max.get(fn_ptr)
            if allowed is None:
                allowed = self._initial(fn_ptr)
            if size > allowed:
                self._set_attribute(fn_ptr, size)  # raises if the device cannot give that much
                allowed = size
            self._max[fn_ptr] = allowed


def _initial_dynamic_shared(fn_ptr: int) -> int:
    """The dynamic shared memory function ``fn_ptr`` allows before its attribute is
    set: its MAX_DYNAMIC_SHARED_SIZE_BYTES, and never more than 48 KiB less its
    static shared memory."""
    from cupy_backends.cuda.api import driver

    _driver_context()
    get = driver.funcGetAttribute
    return min(get(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, fn_ptr),
               DynamicSharedLimit.DEFAULT - get(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn_ptr))


def _set_max_dynamic_shared(fn_ptr: int, size: int) -> None:
    from cupy_backends.cuda.api import driver

    _driver_context()
    driver.funcSetAttribute(fn_ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size)


def _driver_context() -> None:
    """The current device's context made current on this thread, for a direct driver call."""
    import cupy

    _replay.ensure_context(cupy.cuda.runtime.getDevice())


#: The dynamic shared memory bookkeeping of every loaded kernel (also used by ``_replay``).
shared_limit = DynamicSharedLimit(_set_max_dynamic_shared, _initial_dynamic_shared)

_local = threading.local()


_wgmma: dict = {}


def uses_wgmma() -> bool:
    """Whether kernels compiled for the current device may use wgmma (NVRTC targets it as sm_90a).
    Inside :func:`dry_run`, what :func:`assume_wgmma` set (default False)."""
    if getattr(_local, "dry_run", None) is not None:
        return getattr(_local, "wgmma", False)
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    v = _wgmma.get(dev)
    if v is None:
        v = _wgmma[dev] = target_arch(cupy.cuda.Device(dev).compute_capability) == "sm_90a"
    return v


@contextlib.contextmanager
def assume_wgmma(flag: bool):
    """Within the block, :func:`dry_run` plans as for a device with (True) or without wgmma."""
    old = getattr(_local, "wgmma", False)
    _local.wgmma = flag
    try:
        yield
    finally:
        _local.wgmma = old


def dry_run():
    """Within the block, this thread's :func:`launch` touches no GPU: it checks the
    arguments and appends ``(file, normalised name expression, grid, block, args,
    shared_mem)`` to the list the block gets; :func:`max_threads` answers 1024.
    Lists the kernels calls would compile, and their launch configurations."""
    return _replay.thread_list(_local, "dry_run")


#: NumPy scalar types a kernel scalar may be passed as (its C type: int, unsigned, long long, ...).
SCALAR_TYPES = frozenset((np.int32, np.uint32, np.int64, np.uint64, np.float32))
#: No device pointer lies below this address: a smaller Python int is a scalar left bare.
_LOWEST_POINTER = 1 << 16


def check_args(name_expression: str, args) -> None:
    """Kernel arguments: device pointers as Python ints, null pointers as None, and
    every scalar as a NumPy scalar of its C type (:data:`SCALAR_TYPES`), so that no
    scalar's width is guessed (a bare int would reach the kernel as 8 bytes).

    0 is a null pointer too (an empty buffer has address 0).

    Raises:
        TypeError: a bool, float, other type, or a nonzero int below 65536 (a bare scalar).
    """
    for i, a in enumerate(args):
        t = type(a)
        if (a is not None and t not in SCALAR_TYPES) and (t is not int or (a < _LOWEST_POINTER and a != 0)):
            raise TypeError(
                f"argument {i} of kernel {name_expression} is {a!r} ({t.__name__}): pass device pointers as "
                "Python ints, null pointers as None and scalars as np.int32 / np.int64 / np.uint32 / np.uint64 / "
                "np.float32 matching the kernel's parameter")


_streams: dict = {}


def launch(filename, name_expression, grid, block, args, stream_ptr, shared_mem=0):
    """Launch a kernel on the raw CUDA stream ``stream_ptr`` of the current device.

    ``args``: as :func:`check_args` says, matching the kernel signature.

    Raises:
        TypeError: a bad argument (:func:`check_args`).
        cupy.cuda.driver.CUDADriverError: the launch is refused.
    """
    check_args(name_expression, args)
    dry = getattr(_local, "dry_run", None)
    if dry is not None:
        dry.append((filename, normalise(name_expression), grid, block, args, shared_mem))
        return
    import cupy

    fn = get_function(filename, name_expression)
    shared_limit.ensure(fn.ptr, shared_mem)
    stream = _streams.get(stream_ptr)
    if stream is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external(obj), which needs an object
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr)
    fn(grid, block, args, shared_mem=shared_mem, stream=stream)
    _replay.note(fn, grid, block, args, shared_mem)
