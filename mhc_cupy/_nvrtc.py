"""Minimal ctypes binding to NVRTC (the CUDA runtime compiler).

Needs neither a GPU nor CuPy: it loads ``libnvrtc`` from the NVIDIA pip wheels
(``nvidia-cuda-nvrtc-cu12`` / ``nvidia-cuda-nvrtc`` 13.x) or a CUDA toolkit and
compiles CUDA C++ to CUBIN (``arch="sm_XX"``) or PTX (``arch="compute_XX"``).

Used by the CPU test-suite to compile every kernel specialisation, and by the
JIT layer to build readable compile-error messages (:class:`NVRTCCompileError`,
:func:`format_compile_error`).  Importing this module never loads the library;
that happens on first use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import sys
import threading
from typing import Iterable, Sequence

from . import _headers

__all__ = [
    "NVRTCError",
    "NVRTCNotFoundError",
    "NVRTCCompileError",
    "ENV_NVRTC_LIB",
    "library_path",
    "load",
    "version",
    "supported_archs",
    "compile",
    "format_compile_error",
    "missing_headers_in_log",
]

ENV_NVRTC_LIB = "MHC_CUPY_NVRTC_LIB"

#: pip package that provides libnvrtc, by CUDA major version.
NVRTC_PACKAGES = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc==13.*"}

# Inside an ``nvidia`` namespace root: (lib folder, glob of the library), by CUDA major.
_WHEEL_LIBS = {
    12: [("cuda_nvrtc", "lib", "libnvrtc.so.12"), ("cuda_nvrtc", "bin", "nvrtc64_12*.dll")],
    13: [("cu13", "lib", "libnvrtc.so.13"), ("cu13", "bin", "nvrtc64_13*.dll"),
         ("cu13", "bin", "x86_64", "nvrtc64_13*.dll")],
}


class NVRTCError(RuntimeError):
    """An NVRTC API call failed (other than a compilation error)."""


class NVRTCNotFoundError(NVRTCError):
    """libnvrtc could not be located or loaded."""


class NVRTCCompileError(RuntimeError):
    """NVRTC rejected a source file.

    The message names the file, the NVRTC version, the include folders searched
    (with the CUDA version of the headers in each) and the full NVRTC log; when
    a CUDA header such as ``cuda_bf16.h`` is missing it also says which pip
    package provides it.  Attributes hold the same facts for programs.
    """

    def __init__(self, message: str, *, name: str | None = None, log: str = "",
                 nvrtc_version: tuple[int, int] | None = None,
                 include_dirs: Sequence[str] = (), options: Sequence[str] = (),
                 arch: str | None = None, missing_headers: Sequence[str] = ()):
        super().__init__(message)
        self.name = name
        self.log = log
        self.nvrtc_version = nvrtc_version
        self.include_dirs = list(include_dirs)
        self.options = list(options)
        self.arch = arch
        self.missing_headers = list(missing_headers)

    @classmethod
    def from_log(cls, name: str, log: str, *, include_dirs: Sequence[str] = (),
                 options: Sequence[str] = (), arch: str | None = None,
                 nvrtc_version: tuple[int, int] | None = None) -> "NVRTCCompileError":
        """Build the error from a compile log (e.g. one CuPy's CompileException carries)."""
        if nvrtc_version is None:
            try:
                nvrtc_version = version()
            except Exception:
                nvrtc_version = None
        msg = format_compile_error(name, log, include_dirs=include_dirs, options=options,
                                   arch=arch, nvrtc_version=nvrtc_version)
        return cls(msg, name=name, log=log, nvrtc_version=nvrtc_version,
                   include_dirs=include_dirs, options=options, arch=arch,
                   missing_headers=missing_headers_in_log(log))


# --------------------------------------------------------------------------- library

_lock = threading.Lock()
_lib = None
_lib_path: str | None = None


def _candidate_paths() -> list[str]:
    cands: list[str] = []
    env = os.environ.get(ENV_NVRTC_LIB)
    if env:
        cands.append(env)
    roots = _headers.nvidia_roots()
    for major in _headers._major_order():
        for parts in _WHEEL_LIBS.get(major, ()):
            for root in roots:
                cands.extend(sorted(glob.glob(os.path.join(root, *parts))))
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        base = os.environ.get(var)
        if base:
            for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
                cands.extend(sorted(glob.glob(os.path.join(base, sub, "libnvrtc.so*")),
                                    key=len))
            cands.extend(sorted(glob.glob(os.path.join(base, "bin", "nvrtc64_*.dll"))))
    cands.extend(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"), key=len))
    out, seen = [], set()
    for c in cands:
        if c and c not in seen and "builtins" not in os.path.basename(c):
            seen.add(c)
            out.append(c)
    return out


def _declare(lib) -> None:
    c_int, c_size_t, c_char_p, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p
    P = ctypes.POINTER
    sig = {
        "nvrtcGetErrorString": (c_char_p, [c_int]),
        "nvrtcVersion": (c_int, [P(c_int), P(c_int)]),
        "nvrtcCreateProgram": (c_int, [P(c_void_p), c_char_p, c_char_p, c_int,
                                       P(c_char_p), P(c_char_p)]),
        "nvrtcDestroyProgram": (c_int, [P(c_void_p)]),
        "nvrtcAddNameExpression": (c_int, [c_void_p, c_char_p]),
        "nvrtcCompileProgram": (c_int, [c_void_p, c_int, P(c_char_p)]),
        "nvrtcGetProgramLogSize": (c_int, [c_void_p, P(c_size_t)]),
        "nvrtcGetProgramLog": (c_int, [c_void_p, c_char_p]),
        "nvrtcGetPTXSize": (c_int, [c_void_p, P(c_size_t)]),
        "nvrtcGetPTX": (c_int, [c_void_p, c_char_p]),
        "nvrtcGetLoweredName": (c_int, [c_void_p, c_char_p, P(c_char_p)]),
    }
    optional = {
        "nvrtcGetCUBINSize": (c_int, [c_void_p, P(c_size_t)]),
        "nvrtcGetCUBIN": (c_int, [c_void_p, c_char_p]),
        "nvrtcGetNumSupportedArchs": (c_int, [P(c_int)]),
        "nvrtcGetSupportedArchs": (c_int, [P(c_int)]),
    }
    for fname, (res, args) in sig.items():
        fn = getattr(lib, fname)
        fn.restype, fn.argtypes = res, args
    for fname, (res, args) in optional.items():
        fn = getattr(lib, fname, None)
        if fn is not None:
            fn.restype, fn.argtypes = res, args


def load():
    """Load libnvrtc (once) and return the ctypes handle."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidate_paths():
            try:
                lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0))
                _declare(lib)
            except (OSError, AttributeError) as exc:
                tried.append(f"    {path}: {exc}")
                continue
            _lib, _lib_path = lib, path
            return lib
        raise NVRTCNotFoundError(
            "could not load libnvrtc. Install it with `pip install nvidia-cuda-nvrtc-cu12` "
            "(CUDA 12) or `pip install 'nvidia-cuda-nvrtc==13.*'` (CUDA 13), set "
            f"${ENV_NVRTC_LIB} to the library file, or set $CUDA_PATH to a CUDA toolkit.\n"
            "Tried:\n" + ("\n".join(tried) if tried else "    (no candidate found)"))


def library_path() -> str:
    """Path of the loaded libnvrtc."""
    load()
    assert _lib_path is not None
    return _lib_path


def _err(code: int) -> str:
    try:
        s = load().nvrtcGetErrorString(code)
        return s.decode() if s else f"NVRTC error {code}"
    except Exception:
        return f"NVRTC error {code}"


def _check(code: int, what: str) -> None:
    if code != 0:
        raise NVRTCError(f"{what} failed: {_err(code)} ({code})")


def version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC."""
    lib = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> list[int]:
    """SM numbers this NVRTC can target (e.g. [75, 80, 86, 89, 90, ...])."""
    lib = load()
    if getattr(lib, "nvrtcGetNumSupportedArchs", None) is None:
        return []
    n = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * n.value)()
    _check(lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    return list(arr)


# --------------------------------------------------------------------------- errors

_MISSING_RE = re.compile(r'cannot open source file\s+"([^"]+)"')
_LOG_FILE_RE = re.compile(r'^(.+?\.(?:h|hpp|cuh|inl))\((\d+)\)', re.MULTILINE)


def missing_headers_in_log(log: str) -> list[str]:
    """Header names NVRTC could not open, as written in the ``#include``."""
    out: list[str] = []
    for m in _MISSING_RE.finditer(log or ""):
        if m.group(1) not in out:
            out.append(m.group(1))
    return out


def _headers_in_log(log: str) -> list[str]:
    out: list[str] = []
    for m in _LOG_FILE_RE.finditer(log or ""):
        p = m.group(1).strip()
        if p not in out:
            out.append(p)
    return out


def _package_hint(header: str, major: int | None) -> str:
    base = os.path.basename(header)
    if base.startswith("crt/") or "/crt/" in header or header.startswith("crt"):
        pkgs = {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-crt==13.*"}
    else:
        pkgs = _headers.HEADER_PACKAGES
    if major in pkgs:
        pkg = pkgs[major]
        other = ""
    else:
        pkg = pkgs[12]
        other = f" (or {pkgs[13]} for CUDA 13)"
    return (f"'{header}' was not found in any include dir. It is provided by the pip package "
            f"{pkg}{other}: `pip install '{pkg}'` (matching NVRTC "
            f"{major if major is not None else '?'}.x), or point ${_headers.ENV_INCLUDE_DIRS} "
            "(or $CUDA_PATH) at a CUDA include folder that holds it.")


def format_compile_error(name: str, log: str, *, include_dirs: Sequence[str] = (),
                         options: Sequence[str] = (), arch: str | None = None,
                         nvrtc_version: tuple[int, int] | None = None,
                         lib_path: str | None = None) -> str:
    """The message of :class:`NVRTCCompileError` (usable with CuPy's compile logs too)."""
    ver = f"{nvrtc_version[0]}.{nvrtc_version[1]}" if nvrtc_version else "unknown"
    if lib_path is None:
        lib_path = _lib_path
    head = f"NVRTC failed to compile '{name}'"
    if arch:
        head += f" for {arch}"
    head += f" (NVRTC {ver}"
    if lib_path:
        head += f", {lib_path}"
    head += ")"
    lines = [head]
    if options:
        lines.append("Options: " + " ".join(options))
    lines.append("Include dirs searched, in order:")
    lines.append(_headers.describe_dirs(list(include_dirs)))
    missing = missing_headers_in_log(log)
    major = nvrtc_version[0] if nvrtc_version else None
    for d in include_dirs:
        hv = _headers.header_version(d)
        if hv and major is not None and int(hv.split(".")[0]) > major:
            lines.append(f"Warning: the headers in {d} are CUDA {hv}, newer than NVRTC {ver}; "
                         "use headers of the same CUDA major version as NVRTC.")
    for h in missing:
        lines.append(_package_hint(h, major))
    involved = [h for h in _headers_in_log(log) if os.path.isabs(h) or os.sep in h]
    for h in involved:
        d = os.path.dirname(h)
        hv = _headers.header_version(d) if d else None
        lines.append(f"Header in the log: {h} (CUDA header version: {hv or 'unknown'})")
    lines.append("NVRTC log:")
    lines.append((log or "(empty)").rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- compile

def _cstr_array(items: Sequence[str]):
    arr = (ctypes.c_char_p * max(len(items), 1))()
    for i, s in enumerate(items):
        arr[i] = s.encode()
    return arr


def _program_log(lib, prog) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetProgramLog(prog, buf) != 0:
        return ""
    return buf.value.decode(errors="replace")


def compile(source: str, name: str, name_expressions: Iterable[str] = (),
            arch: str = "sm_90", options: Sequence[str] = (),
            include_dirs: Sequence[str] | None = None) -> dict:
    """Compile ``source`` with NVRTC.

    ``arch`` ``"sm_XX"`` produces CUBIN (key ``"cubin"``), ``"compute_XX"`` PTX
    (key ``"ptx"``).  ``include_dirs=None`` uses :func:`mhc_cupy._headers.include_dirs`;
    pass a list to search exactly those folders.

    Returns ``{"cubin" or "ptx": bytes, "lowered_names": {expr: mangled}, "log": str}``;
    raises :class:`NVRTCCompileError` when NVRTC rejects the source.
    """
    lib = load()
    nvver = version()
    exprs = list(dict.fromkeys(name_expressions))
    dirs = list(_headers.include_dirs() if include_dirs is None else include_dirs)
    arch = arch.strip()
    want_cubin = arch.startswith("sm_")
    if not (want_cubin or arch.startswith("compute_")):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', got {arch!r}")
    if want_cubin and getattr(lib, "nvrtcGetCUBIN", None) is None:
        raise NVRTCError(f"NVRTC {nvver[0]}.{nvver[1]} cannot emit CUBIN; use arch='compute_XX'")
    opts = [f"--gpu-architecture={arch}", *options, *[f"-I{d}" for d in dirs]]

    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                  0, None, None), "nvrtcCreateProgram")
    try:
        for e in exprs:
            _check(lib.nvrtcAddNameExpression(prog, e.encode()), f"nvrtcAddNameExpression({e!r})")
        copts = _cstr_array(opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
        log = _program_log(lib, prog)
        if rc != 0:
            if rc == 6 or log:  # NVRTC_ERROR_COMPILATION, or anything with a log
                text = log if log else f"{_err(rc)} ({rc})"
                raise NVRTCCompileError(
                    format_compile_error(name, text, include_dirs=dirs, options=opts,
                                         arch=arch, nvrtc_version=nvver),
                    name=name, log=text, nvrtc_version=nvver, include_dirs=dirs,
                    options=opts, arch=arch, missing_headers=missing_headers_in_log(text))
            _check(rc, "nvrtcCompileProgram")
        size = ctypes.c_size_t()
        if want_cubin:
            _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            key = "cubin"
        else:
            _check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            buf = ctypes.create_string_buffer(size.value)
            _check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            key = "ptx"
        code = buf.raw[: size.value]
        if key == "ptx":
            code = code.rstrip(b"\0")
        lowered = {}
        for e in exprs:
            out = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(out)),
                   f"nvrtcGetLoweredName({e!r})")
            lowered[e] = out.value.decode()
        return {key: code, "lowered_names": lowered, "log": log}
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


if __name__ == "__main__":  # pragma: no cover - tiny smoke check
    print("libnvrtc:", library_path())
    print("version:", version())
    print("archs:", supported_archs())
    print("include dirs:", _headers.include_dirs())
    sys.exit(0)
