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
