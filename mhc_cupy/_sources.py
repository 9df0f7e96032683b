"""Find and read the CUDA sources in ``kernels_cu/``.

The sources ship inside the wheel as the package ``mhc_cupy.kernels_cu``
(``pyproject.toml`` maps the top-level ``kernels_cu/`` folder onto it); in a
source checkout the folder beside the package is used directly.  Either way the
folder is found from this file's location, so the kernels always belong to the
imported package.

Local ``#include "x.cuh"`` lines are inlined, with ``#line`` directives so that
NVRTC messages still name the real file and line.  Inlining makes the text
handed to NVRTC contain every byte the kernel depends on, so a cache keyed on
that text can never serve a stale binary after a header changes.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` / ``.cuh`` files that belong to the imported package.

    Found from this module's own location, never through the import system: an installed
    wheel keeps them in ``mhc_cupy/kernels_cu/``, a source checkout (editable install or
    ``PYTHONPATH``) in ``kernels_cu/`` beside the package.  So Python code and kernels always
    come from the same tree, even with one checkout on ``PYTHONPATH`` and another installed.

    Raises:
        FileNotFoundError: neither folder holds ``common.cuh``.
    """
    package = Path(__file__).resolve().parent
    for d in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(
        f"mhc_cupy could not find its CUDA sources: neither {package / 'kernels_cu'} (an installed "
        f"wheel) nor {package.parent / 'kernels_cu'} (a source checkout) holds common.cuh; "
        "reinstall mhc-cupy"
    )


def kernel_files() -> list[str]:
    """Names of every ``.cu`` file (the compilation units)."""
    return sorted(p.name for p in kernel_dir().glob("*.cu"))


def _inline(path: Path, seen: set[str]) -> str:
    out = [f'#line 1 "{path.name}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            name = m.group(1)
            if name not in seen:
                seen.add(name)
                out.append(_inline(path.parent / name, seen))
            out.append(f'#line {lineno + 1} "{path.name}"')
        elif line.strip() == "#pragma once":
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def load_source(filename: str) -> str:
    """Text of ``kernels_cu/<filename>`` with its local includes inlined.

    Raises:
        FileNotFoundError: no such kernel file.
    """
    path = kernel_dir() / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {filename!r} not found in {kernel_dir()}")
    return _inline(path, set()) + "\n"

