"""Optional dependencies: a missing one raises an ImportError that says which
extra of ``mhc-cupy`` installs it, not a bare ``No module named 'torch'``."""

from __future__ import annotations

import importlib


def require(module: str, extra: str, user: str):
    """``importlib.import_module(module)``; if it is not installed, a
    ``ModuleNotFoundError`` (an ImportError) naming ``user`` and the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:
            raise  # the module is there but one of its own imports failed: keep that error
        raise ModuleNotFoundError(f"{user} needs {module}, which is not installed: "
                                  f"pip install \"mhc-cupy[{extra}]\"", name=exc.name) from exc
