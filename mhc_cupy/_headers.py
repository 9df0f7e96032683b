"""Locate the CUDA headers our kernels include (``cuda_bf16.h``, ``cuda_fp16.h``).

NVRTC does not ship these headers; they come from the CUDA runtime pip wheels
or from a CUDA toolkit install.  Search order (first match wins, duplicates and
missing folders dropped):

1. ``$MHC_CUPY_INCLUDE_DIRS`` (``os.pathsep`` separated) -- explicit override.
2. The NVIDIA pip wheels found on ``sys.path``:
   * CUDA 12: ``nvidia-cuda-runtime-cu12``  -> ``nvidia/cuda_runtime/include``
   * CUDA 13: ``nvidia-cuda-runtime`` (13.x) -> ``nvidia/cu13/include``
     (``nvidia-cuda-crt`` adds ``crt/`` into that same folder).
   The wheel matching the installed CuPy (``cupy-cuda12x`` / ``cupy-cuda13x``)
   is searched first.
3. ``$CUDA_PATH/include``, ``$CUDA_HOME/include``, ``/usr/local/cuda/include``.

Nothing here needs a GPU or CuPy.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Iterable, Sequence

__all__ = [
    "ENV_INCLUDE_DIRS",
    "REQUIRED_HEADERS",
    "HEADER_PACKAGES",
    "include_dirs",
    "find_header",
    "header_version",
    "wheel_include_dirs",
    "nvidia_roots",
    "preferred_cuda_major",
]

ENV_INCLUDE_DIRS = "MHC_CUPY_INCLUDE_DIRS"

#: Headers the kernels in ``kernels_cu/`` include from the CUDA toolkit.
REQUIRED_HEADERS = ("cuda_bf16.h", "cuda_fp16.h")

#: pip package that provides the CUDA headers, by CUDA major version.
HEADER_PACKAGES = {
    12: "nvidia-cuda-runtime-cu12",
    13: "nvidia-cuda-runtime==13.*",
}

# Relative include folders inside an ``nvidia`` namespace root, by CUDA major.
_WHEEL_INCLUDE_SUBDIRS = {
    12: ("cuda_runtime", "include"),
    13: ("cu13", "include"),
}


def _dist_installed(name: str) -> bool:
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover
        return False
    try:
        metadata.distribution(name)
        return True
    except Exception:
        return False


def preferred_cuda_major() -> int | None:
    """CUDA major version of the installed CuPy wheel (13, 12) or None.

    Read from package metadata only: CuPy is not imported.
    """
    env = os.environ.get("MHC_CUPY_CUDA_MAJOR")
    if env and env.strip().isdigit():
        return int(env.strip())
    if _dist_installed("cupy-cuda13x"):
        return 13
    if _dist_installed("cupy-cuda12x"):
        return 12
    return None


def _major_order() -> list[int]:
    pref = preferred_cuda_major()
    order = [12, 13]
    if pref in order:
        order.remove(pref)
        order.insert(0, pref)
    return order


def nvidia_roots() -> list[str]:
    """Every existing ``<site-packages>/nvidia`` folder (namespace package roots)."""
    roots: list[str] = []
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
        if spec is not None and spec.submodule_search_locations:
            roots.extend(str(p) for p in spec.submodule_search_locations)
    except Exception:
        pass
    for entry in sys.path:
        if not entry:
            continue
        roots.append(os.path.join(entry, "nvidia"))
    return _unique_existing(roots)


def wheel_include_dirs(majors: Iterable[int] | None = None) -> list[str]:
    """Include folders from the NVIDIA CUDA runtime pip wheels."""
    majors = list(majors) if majors is not None else _major_order()
    out: list[str] = []
    roots = nvidia_roots()
    for major in majors:
        sub = _WHEEL_INCLUDE_SUBDIRS.get(major)
        if sub is None:
            continue
        for root in roots:
            out.append(os.path.join(root, *sub))
    return _unique_existing(out)


def _env_dirs() -> list[str]:
    raw = os.environ.get(ENV_INCLUDE_DIRS, "")
    return [p for p in raw.split(os.pathsep) if p.strip()]


def _toolkit_dirs() -> list[str]:
    out = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        base = os.environ.get(var)
        if base:
            out.append(os.path.join(base, "include"))
    out.append("/usr/local/cuda/include")
    return out


def _unique_existing(paths: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for p in paths:
        if not p:
            continue
        p = os.path.abspath(os.path.expanduser(p))
        if not os.path.isdir(p):
            continue
        key = os.path.realpath(p)
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
    return out


def include_dirs() -> list[str]:
    """Existing folders to pass to NVRTC as ``-I``, most specific first, no duplicates."""
    return _unique_existing([*_env_dirs(), *wheel_include_dirs(), *_toolkit_dirs()])


def find_header(name: str, dirs: Sequence[str] | None = None) -> str | None:
    """Path of header ``name`` in the first of ``dirs`` (default: :func:`include_dirs`) holding it."""
    if dirs is None:
        dirs = include_dirs()
    for d in dirs:
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
        path = os.path.join(include_dir, fname)
        try:
            with open(path, "r", errors="replace") as f:
                text = f.read(64 * 1024)
        except OSError:
            continue
        m = pat.search(text)
        if m:
            v = int(m.group(1))
            return f"{v // 1000}.{(v % 1000) // 10}"
    return None


def describe_dirs(dirs: Sequence[str], headers: Sequence[str] = REQUIRED_HEADERS) -> str:
    """Multi-line description of ``dirs``: which required headers each holds, and its CUDA version."""
    if not dirs:
        return "    (none)"
    lines = []
    for d in dirs:
        have = [h for h in headers if os.path.isfile(os.path.join(d, h))]
        ver = header_version(d)
        bits = []
        bits.append("has " + ", ".join(have) if have else "no " + "/".join(headers))
        bits.append(f"CUDA headers {ver}" if ver else "CUDA header version unknown")
        lines.append(f"    {d}  [{'; '.join(bits)}]")
    return "\n".join(lines)
