"""The CUDA header folders NVRTC gets as ``-I`` (``cuda_bf16.h``, ``cuda_fp16.h``).

NVRTC does not ship these headers; they come from the CUDA runtime pip wheel
(``nvidia-cuda-runtime-cu12`` / ``nvidia-cuda-runtime`` 13.x) or a CUDA toolkit.
``cuda.pathfinder`` (a dependency of CuPy) finds them: site-packages wheels,
then conda, ``$CUDA_PATH`` / ``$CUDA_HOME`` and the system install folders.
``$MHC_CUPY_INCLUDE_DIRS`` (``os.pathsep`` separated) is searched first.

:func:`digest` hashes the bytes of every header a source includes from these
folders, for the kernel-cache key.  Nothing here needs a GPU or CuPy.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from typing import Sequence

ENV_INCLUDE_DIRS = "MHC_CUPY_INCLUDE_DIRS"

#: Headers the kernels in ``kernels_cu/`` include from the CUDA toolkit.
REQUIRED_HEADERS = ("cuda_bf16.h", "cuda_fp16.h")

#: pip package that provides the CUDA headers, by CUDA major version.
HEADER_PACKAGES = {
    12: "nvidia-cuda-runtime-cu12",
    13: "nvidia-cuda-runtime==13.*",
}


def _unique_existing(paths) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for p in paths:
        if not p or not p.strip():
            continue
        p = os.path.abspath(os.path.expanduser(p))
        key = os.path.realpath(p)
        if os.path.isdir(p) and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def include_dirs() -> list[str]:
    """Existing folders to pass to NVRTC as ``-I``: ``$MHC_CUPY_INCLUDE_DIRS``, then the
    CUDA runtime headers ``cuda.pathfinder`` locates; no duplicates."""
    env = os.environ.get(ENV_INCLUDE_DIRS, "").split(os.pathsep)
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:  # no CuPy (it brings cuda-pathfinder): nothing can compile anyway
        return _unique_existing(env)
    return _unique_existing([*env, find_nvidia_header_directory("cudart")])


def find_header(name: str, dirs: Sequence[str] | None = None) -> str | None:
    """Path of header ``name`` in the first of ``dirs`` (default: :func:`include_dirs`) holding it."""
    for d in include_dirs() if dirs is None else dirs:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return None


_VERSION_PATTERNS = (
    ("cuda_runtime_api.h", re.compile(r"#\s*define\s+CUDART_VERSION\s+(\d+)")),
    ("cuda.h", re.compile(r"#\s*define\s+CUDA_VERSION\s+(\d+)")),
)


def header_version(include_dir: str) -> str | None:
    """CUDA version of the headers in ``include_dir`` ("12.9"), read from
    ``cuda_runtime_api.h`` / ``cuda.h``; None when it cannot be told."""
    for fname, pat in _VERSION_PATTERNS:
        try:
            with open(os.path.join(include_dir, fname), errors="replace") as f:
                m = pat.search(f.read(64 * 1024))
        except OSError:
            continue
        if m:
            v = int(m.group(1))
            return f"{v // 1000}.{(v % 1000) // 10}"
    return None


def describe_dirs(dirs: Sequence[str], headers: Sequence[str] = REQUIRED_HEADERS) -> str:
    """One line per folder of ``dirs``: which required headers it holds, and its CUDA version."""
    if not dirs:
        return "    (none)"
    lines = []
    for d in dirs:
        have = [h for h in headers if os.path.isfile(os.path.join(d, h))]
        ver = header_version(d)
        held = "has " + ", ".join(have) if have else "no " + "/".join(headers)
        lines.append(f"    {d}  [{held}; " + (f"CUDA headers {ver}]" if ver else "CUDA header version unknown]"))
    return "\n".join(lines)


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)


def _resolve(name: str, quoted_from: str | None, dirs: Sequence[str]) -> str | None:
    for d in ([quoted_from] if quoted_from else []) + list(dirs):
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return None


def digest(source: str, dirs: Sequence[str]) -> str:
    """SHA-256 over the bytes of every header ``source`` includes from ``dirs``, transitively.

    Every ``#include`` line is followed (whatever ``#if`` guards it: the set may be
    larger than what NVRTC reads, never smaller); an include found in no folder
    (NVRTC's built-in headers such as ``<utility>``) enters by its name.  So
    upgrading the runtime-headers wheel in place changes the digest.  Computed
    once per process for each (system includes of the source, folders).
    """
    return _digest(tuple(m.group(2).decode() for m in _INCLUDE.finditer(source.encode())
                         if m.group(1) == b"<"), tuple(dirs))


@functools.lru_cache(maxsize=64)
def _digest(roots: tuple, dirs: tuple) -> str:
    h = hashlib.sha256()
    seen: set[str] = set()
    todo = [(name, None) for name in roots]
    while todo:
        name, here = todo.pop()
        path = _resolve(name, here, dirs)
        if path is None:
            h.update(b"missing\0" + name.encode() + b"\0")
            continue
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        with open(real, "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        todo.extend((m.group(2).decode(), os.path.dirname(real) if m.group(1) == b'"' else None)
                    for m in _INCLUDE.finditer(data))
    return h.hexdigest()
