"""Optional dependencies: a missing one raises an ImportError that says which
extra of ``mhc-cupy`` installs it, not a bare ``No module named 'torch'``."""

from __future__ import annotations

import importlib


def install_hint(extra: str, packages: str) -> str:
    """What to run for a missing optional dependency: the PyPI packages themselves, or the extra
    of an mhc-cupy checkout that pulls them in (mhc-cupy installs from its checkout, not from PyPI)."""
    return f"pip install {packages} (or, in the mhc_cupy checkout, pip install -e \".[{extra}]\")"


def require(module: str, extra: str, user: str):
    """``importlib.import_module(module)``; if it is not installed, a
    ``ModuleNotFoundError`` (an ImportError) naming ``user`` and the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:
            raise  # the module is there but one of its own imports failed: keep that error
        raise ModuleNotFoundError(f"{user} needs {module}, which is not installed: {install_hint(extra, module)}",
                                  name=exc.name) from exc


def require_cupy(what: str):
    """``import cupy``; if CuPy is not installed, a ``ModuleNotFoundError`` saying that ``what`` (GPU
    inputs) needs it and which package of which extra installs it (the bare ``No module named 'cupy'``
    came from deep inside the dispatch, and ``pip install cupy`` would build it from source)."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":
            raise  # CuPy is there but one of its own imports failed: keep that error
        raise missing_cupy(what) from exc
    return cupy


def missing_cupy(what: str) -> ModuleNotFoundError:
    """What ``require_cupy`` raises where CuPy is not installed."""
    return ModuleNotFoundError(
        f"{what} needs CuPy, which is not installed: for CUDA 12 {install_hint('cuda12', 'cupy-cuda12x')}, "
        f"for CUDA 13 {install_hint('cuda13', 'cupy-cuda13x')}", name="cupy")
