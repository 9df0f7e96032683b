"""Shared test fixtures: the ``gpu`` marker and per-test random generators."""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest


# tests/ on the path whatever pytest's import mode: the harness (``import harness``), the
# multi-device runners (``import multidevice``) and the CPU adapter tests that the GPU tests
# reuse (``import test_jax_adapter``) are then plain imports, each module loaded once.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

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


def pytest_runtest_logreport(report):
    """With MHC_TEST_FAILURES=<file>, append each failure's report to that file as it happens (the
    controller's view under pytest-xdist): a run cut by a time limit keeps its tracebacks, which
    pytest only prints at the end (scripts/gpu_check.sh sets it)."""
    path = os.environ.get("MHC_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test id: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def jax_on_cpu():
    """Run the test with JAX's default device the CPU, GPU present or not: the CPU adapter
    tests check the reference path (float64, rounded once) that runs on CPU buffers, which
    the float32 GPU kernels (and TF32 matmuls of a jnp oracle) would not meet."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def _poisoned_outputs(request, monkeypatch):
    """In every GPU test, each output and temporary of an mhc_cupy call (torch, CuPy or JAX's buffers, every
    route) starts as 0xFF bytes, NaN (``mhc_cupy._dispatch.POISON``): an element no kernel writes fails the
    comparison, whichever allocator gave the memory."""
    if request.node.get_closest_marker("gpu") is not None:
        from mhc_cupy import _dispatch

        monkeypatch.setattr(_dispatch, "POISON", True)


@pytest.fixture
def nan_poison():
    """Every CuPy allocation of the test starts as 0xFF bytes (NaN): see harness.gpu_test."""
    from gpu.helpers import poisoned_allocations

    with poisoned_allocations():
        yield
