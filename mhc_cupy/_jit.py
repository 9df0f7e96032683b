"""Run-time specialisation, compilation and caching of the CUDA kernels.

A kernel is named by its source file and a C++ name expression, the template
instantiation with every baked-in constant (dtype, n, vector width, ...), e.g.
``("stream_ops.cu", "mhc_post_op_fwd_kernel<__nv_bfloat16,4,8,true,true>")``.

Caches:
  * in process: one loaded function per (device, file, name expression);
  * on disk: one cubin per key = SHA-256 of (inlined source text, options,
    include directories, target architecture, NVRTC version, name
    expression), under ``$MHC_CUPY_CACHE_DIR`` (default
    ``~/.cache/mhc_cupy``).  A warm process loads the cubin and never calls
    NVRTC (``stats["compiles"]`` stays 0).

The source text is inlined (``_sources.load_source``), so editing a header
changes the key: a stale binary is never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

from . import _headers, _replay, _sources

#: Options handed to NVRTC for every kernel (besides -I and the architecture).
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)

#: Counters for tests and ``python -m mhc_cupy info``.
stats = {"compiles": 0, "disk_hits": 0, "loads": 0}

_lock = threading.Lock()
_functions: dict = {}
_SPACES = re.compile(r"\s*([<>,()])\s*")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries everything needed to report it."""


def normalise(name_expression: str) -> str:
    """Canonical spelling of a name expression (no blanks around ``<>,()``)."""
    return _SPACES.sub(r"\1", name_expression.strip())


def cache_dir() -> Path:
    d = os.environ.get("MHC_CUPY_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "mhc_cupy"


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def _options(include_dirs: list[str]) -> tuple[str, ...]:
    return NVRTC_OPTIONS + tuple(f"-I{d}" for d in include_dirs)


def _key(source: str, options, arch: str, expr: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch, repr(nvrtc_version()), expr):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def _read_cache(key: str):
    path = cache_dir() / f"{key}.cubin"
    meta = cache_dir() / f"{key}.json"
    try:
        mangled = json.loads(meta.read_text())["mangled"]
        return mangled, path.read_bytes()
    except (OSError, ValueError, KeyError):
        return None


def _write_cache(key: str, mangled: str, binary: bytes) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        for suffix, data in ((".cubin", binary), (".json", json.dumps({"mangled": mangled}).encode())):
            fd, tmp = tempfile.mkstemp(dir=d)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, d / f"{key}{suffix}")
    except OSError:
        pass  # a read-only cache only costs a recompile next time


def _compile(filename: str, source: str, options, arch: str, expr: str, include_dirs):
    from cupy.cuda import compiler

    stats["compiles"] += 1
    try:
        binary, mapping = compiler.compile_using_nvrtc(
            source, options, arch, filename, name_expressions=[expr], cache_in_memory=True
        )
    except compiler.CompileException as e:
        from ._nvrtc import format_compile_error

        raise KernelCompileError(
            f"{expr} from kernels_cu/{filename}:\n"
            + format_compile_error(filename, str(e), include_dirs=include_dirs, options=options, arch=f"sm_{arch}",
                                   nvrtc_version=nvrtc_version(), lib_path="")
        ) from None
    return mapping[expr], binary


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

    arch = cupy.cuda.Device(dev).compute_capability
    include_dirs = _headers.include_dirs()
    options = _options(include_dirs)
    source = _sources.load_source(filename)
    key = _key(source, options, arch, expr)
    cached = _read_cache(key)
    if cached is not None:
        stats["disk_hits"] += 1
        mangled, binary = cached
    else:
        mangled, binary = _compile(filename, source, options, arch, expr, include_dirs)
        _write_cache(key, mangled, binary)
    module = cupy.cuda.function.Module()
    module.load(binary)
    stats["loads"] += 1
    return module.get_function(mangled), module  # the module must outlive the function


_max_threads: dict = {}


def max_threads(filename: str, name_expression: str) -> int:
    """The largest block the compiled kernel can launch with (its registers
    per thread decide it) on the current device; compiles it if needed."""
    fn = get_function(filename, name_expression)
    v = _max_threads.get(fn.ptr)
    if v is None:
        from cupy_backends.cuda.api import driver

        v = _max_threads[fn.ptr] = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn.ptr)
    return v


_streams: dict = {}
_big_smem: set = set()


def launch(filename, name_expression, grid, block, args, stream_ptr, shared_mem=0):
    """Launch a kernel on the raw CUDA stream ``stream_ptr`` of the current device.

    ``args``: Python ints (pointers, 64-bit integers), None (null pointers),
    or numpy scalars (np.int32 / np.float32) matching the kernel signature.
    Raises ``cupy.cuda.driver.CUDADriverError`` if the launch is refused.
    """
    import cupy

    fn = get_function(filename, name_expression)
    if shared_mem > 48 * 1024 and (fn.ptr, shared_mem) not in _big_smem:
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
        _big_smem.add((fn.ptr, shared_mem))
    stream = _streams.get(stream_ptr)
    if stream is None:
        import warnings

        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external(obj), which needs an object
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr)
    fn(grid, block, args, shared_mem=shared_mem, stream=stream)
    _replay.note(fn, grid, block, args, shared_mem)
