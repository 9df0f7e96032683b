"""Compile CUDA C++ with NVRTC, with readable errors; no GPU needed.

The binding is CuPy's (``cupy_backends.cuda.libs.nvrtc``, which works without
a GPU); ``cuda.pathfinder`` locates libnvrtc (pip wheel ``nvidia-cuda-nvrtc-cu12``
/ ``nvidia-cuda-nvrtc`` 13.x, conda, ``$CUDA_PATH``, system) and the headers
(:mod:`mhc_cupy._headers`).  Used by the JIT layer (``_jit``) and by the CPU
test-suite, which compiles every kernel specialisation for sm_80 and sm_90a.

:class:`KernelCompileError` is the one error class for a rejected kernel.
Importing this module imports neither CuPy nor NVRTC.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Sequence

from . import _headers
from ._deps import install_hint

__all__ = ["KernelCompileError", "NVRTCNotFoundError", "compile", "format_compile_error", "library_path",
           "missing_headers_in_log", "supported_archs", "version"]


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel (exported as ``mhc_cupy.KernelCompileError``).

    The message names the kernel file (and name expression when compiled by
    the JIT), the target architecture, the NVRTC version, the include folders
    searched (with the CUDA version of the headers in each), the full NVRTC log,
    and when a CUDA header such as ``cuda_bf16.h`` is missing, the pip package
    that provides it.  The attributes hold the same facts for programs.
    """

    def __init__(self, message: str, *, name: str | None = None, log: str = "",
                 nvrtc_version: tuple[int, int] | None = None, include_dirs: Sequence[str] = (),
                 options: Sequence[str] = (), arch: str | None = None):
        super().__init__(message)
        self.name, self.log, self.nvrtc_version, self.arch = name, log, nvrtc_version, arch
        self.include_dirs, self.options = list(include_dirs), list(options)
        self.missing_headers = missing_headers_in_log(log)

    @classmethod
    def from_log(cls, name: str, log: str, *, include_dirs: Sequence[str] = (), options: Sequence[str] = (),
                 arch: str | None = None, nvrtc_version: tuple[int, int] | None = None,
                 heading: str = "") -> "KernelCompileError":
        """The error for NVRTC's compile ``log`` of ``name``; ``heading`` goes first in the message."""
        msg = format_compile_error(name, log, include_dirs=include_dirs, options=options, arch=arch,
                                   nvrtc_version=nvrtc_version)
        return cls(heading + msg, name=name, log=log, nvrtc_version=nvrtc_version, include_dirs=include_dirs,
                   options=options, arch=arch)


class NVRTCNotFoundError(RuntimeError):
    """libnvrtc (or CuPy's binding of it) could not be loaded."""


def _binding():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # no CuPy, or CuPy found no libnvrtc
        raise NVRTCNotFoundError(
            f"could not load NVRTC through CuPy ({exc}). Install CuPy with NVRTC for your CUDA: "
            f"{install_hint('cuda12', 'cupy-cuda12x nvidia-cuda-nvrtc-cu12')}, or for CUDA 13 "
            f"{install_hint('cuda13', 'cupy-cuda13x nvidia-cuda-nvrtc')}; or set $CUDA_PATH to a CUDA "
            "toolkit.") from exc
    return nvrtc


def version() -> tuple[int, int]:
    """(major, minor) of the NVRTC CuPy loaded."""
    return tuple(_binding().getVersion())


def library_path() -> str:
    """Path of libnvrtc as ``cuda.pathfinder`` locates it (the one CuPy loads)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return load_nvidia_dynamic_lib("nvrtc").abs_path


def supported_archs() -> list[int]:
    """SM numbers this NVRTC can target (e.g. [75, 80, 86, 89, 90, ...])."""
    return list(_binding().getSupportedArchs())


# --------------------------------------------------------------------------- errors

_MISSING_RE = re.compile(r'cannot open source file\s+"([^"]+)"')
_LOG_FILE_RE = re.compile(r'^(.+?\.(?:h|hpp|cuh|inl))\((\d+)\)', re.MULTILINE)


def missing_headers_in_log(log: str) -> list[str]:
    """Header names NVRTC could not open, as written in the ``#include``."""
    return list(dict.fromkeys(m.group(1) for m in _MISSING_RE.finditer(log or "")))


def _package_hint(header: str, major: int | None) -> str:
    crt = {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-crt==13.*"}
    pkgs = crt if header.startswith("crt") or "/crt/" in header else _headers.HEADER_PACKAGES
    pkg, other = (pkgs[major], "") if major in pkgs else (pkgs[12], f" (or {pkgs[13]} for CUDA 13)")
    return (f"'{header}' was not found in any include dir. It is provided by the pip package "
            f"{pkg}{other}: `pip install '{pkg}'` (matching NVRTC {major if major is not None else '?'}.x), "
            f"or point ${_headers.ENV_INCLUDE_DIRS} (or $CUDA_PATH) at a CUDA include folder that holds it.")


def format_compile_error(name: str, log: str, *, include_dirs: Sequence[str] = (), options: Sequence[str] = (),
                         arch: str | None = None, nvrtc_version: tuple[int, int] | None = None) -> str:
    """The message of :class:`KernelCompileError` for NVRTC's compile ``log`` of ``name``."""
    ver = f"{nvrtc_version[0]}.{nvrtc_version[1]}" if nvrtc_version else "unknown"
    lines = [f"NVRTC failed to compile '{name}'" + (f" for {arch}" if arch else "") + f" (NVRTC {ver})"]
    if options:
        lines.append("Options: " + " ".join(options))
    lines += ["Include dirs searched, in order:", _headers.describe_dirs(list(include_dirs))]
    major = nvrtc_version[0] if nvrtc_version else None
    for d in include_dirs:
        hv = _headers.header_version(d)
        if hv and major is not None and int(hv.split(".")[0]) > major:
            lines.append(f"Warning: the headers in {d} are CUDA {hv}, newer than NVRTC {ver}; "
                         "use headers of the same CUDA major version as NVRTC.")
    lines += [_package_hint(h, major) for h in missing_headers_in_log(log)]
    for h in dict.fromkeys(m.group(1).strip() for m in _LOG_FILE_RE.finditer(log or "")):
        if os.path.isabs(h) or os.sep in h:
            hv = _headers.header_version(os.path.dirname(h))
            lines.append(f"Header in the log: {h} (CUDA header version: {hv or 'unknown'})")
    lines += ["NVRTC log:", (log or "(empty)").rstrip()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- compile

def compile(source: str, name: str, name_expressions: Iterable[str] = (), arch: str = "sm_90",
            options: Sequence[str] = (), include_dirs: Sequence[str] | None = None, heading: str = "") -> dict:
    """Compile ``source`` (named ``name`` in messages) with NVRTC.

    ``arch`` ``"sm_XX"`` produces CUBIN (key ``"cubin"``), ``"compute_XX"`` PTX
    (key ``"ptx"``).  ``include_dirs=None`` uses :func:`mhc_cupy._headers.include_dirs`;
    pass a list to search exactly those folders.

    Returns ``{"cubin" or "ptx": bytes, "lowered_names": {expr: mangled}, "log": str}``.

    Raises:
        KernelCompileError: NVRTC rejected the source (``heading`` starts the message).
        NVRTCNotFoundError: no NVRTC.
        ValueError: ``arch`` is neither ``sm_XX`` nor ``compute_XX``.
    """
    nvrtc = _binding()
    arch = arch.strip()
    if not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', got {arch!r}")
    exprs = list(dict.fromkeys(name_expressions))
    dirs = list(_headers.include_dirs() if include_dirs is None else include_dirs)
    opts = [f"--gpu-architecture={arch}", *options, *[f"-I{d}" for d in dirs]]
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog) or str(exc)
            raise KernelCompileError.from_log(name, log, include_dirs=dirs, options=opts, arch=arch,
                                              nvrtc_version=version(), heading=heading) from None
        code = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog).rstrip(b"\0")
        return {"cubin" if arch.startswith("sm_") else "ptx": code,
                "lowered_names": {e: nvrtc.getLoweredName(prog, e) for e in exprs},
                "log": nvrtc.getProgramLog(prog)}
    finally:
        nvrtc.destroyProgram(prog)
