"""Shared test fixtures: the ``gpu`` marker and per-test random generators."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest


# JAX would otherwise preallocate 75% of the GPU in every test process (and in
# every pytest-xdist worker), starving CuPy and PyTorch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test id: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
