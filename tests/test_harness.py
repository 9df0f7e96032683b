"""The harness's checks can fail: each rejects what it must, and every tolerance row gives its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import TOL, assert_close, assert_close_uniform, assert_rounded


def test_assert_close_bound_is_tol_times_abs_ref_plus_rms():
    ref = np.array([3.0, -4.0, 0.0])  # rms 2.886...
    scale = float(np.sqrt(np.mean(ref**2)))
    assert_close(ref + 1e-3 * (np.abs(ref) + scale) * 0.99, ref, 1e-3)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(ref + 1e-3 * (np.abs(ref) + scale) * 1.01, ref, 1e-3)
    with pytest.raises(AssertionError, match="max error"):  # "max": scale 4 tolerates more than rms
        assert_close(ref + [0, 0, 1e-3 * 3.5], ref, 1e-3)
    assert_close(ref + [0, 0, 1e-3 * 3.5], ref, 1e-3, scale="max")


def test_assert_close_rejects_nan_shape_and_nonzero_on_zero_ref():
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(np.array([1.0, np.nan]), np.array([1.0, 1.0]), 1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros(3), np.zeros(4), 1.0)
    with pytest.raises(AssertionError):
        assert_close(np.array([0.0, 1e-200]), np.zeros(2), 1e-3)
    assert_close(torch.zeros(2, dtype=torch.bfloat16, requires_grad=True), np.zeros(2), 1e-3)


def test_assert_close_uniform_and_rounded():
    d = np.array([1.0, 100.0])
    assert_close_uniform(d + [0.9e-9, 0], d, 1e-11, dtype=np.float64)  # 0.9e-9 <= 1e-11 * 100
    with pytest.raises(AssertionError):
        assert_close_uniform(d + [2e-9, 0], d, 1e-11)
    with pytest.raises(AssertionError):
        assert_close_uniform(d.astype(np.float32), d, 1e-3, dtype=np.float64)
    assert_rounded(np.float32(1 / 3), 1 / 3, "float32")
    with pytest.raises(AssertionError):
        assert_rounded(np.float32(1 / 3) * (1 + 2.0**-21), 1 / 3, "float32")


def test_every_tolerance_row_gives_its_reason():
    for name, row in TOL.items():
        assert len(row.reason) > 40, name
        values = row.value.values() if isinstance(row.value, dict) else [row.value]
        assert all(0 < v < 0.1 for v in np.ravel(list(values))), name
    assert TOL["sinkhorn"].value <= TOL["sinkhorn_chain_grad"].value


def test_gpu_poison_fill_goes_on_the_allocating_threads_stream(monkeypatch):
    """tests/gpu/helpers.poisoned_allocations (the NaN fill of every CuPy allocation in the
    GPU tests), with a stand-in cupy: each fill is queued on the stream current in the
    thread that allocates (the stream the op then writes the buffer on), never on the
    legacy default stream, which a non-blocking stream is not ordered with (a late fill
    turned a correct 8-thread rmsnorm_bwd result into NaN)."""
    import sys
    import threading
    import types

    fills, allocators, local = [], [], threading.local()
    pool = types.SimpleNamespace(malloc=lambda size: types.SimpleNamespace(ptr=0x10000 + size))
    runtime = types.SimpleNamespace(
        memsetAsync=lambda ptr, value, size, stream: fills.append((ptr, value, size, stream)),
        memset=lambda ptr, value, size: fills.append((ptr, value, size, "legacy default stream")))
    cuda = types.SimpleNamespace(runtime=runtime, set_allocator=allocators.append,
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=getattr(local, "stream", 0)))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool))
    from gpu.helpers import poisoned_allocations

    def worker(stream, size):
        local.stream = stream
        assert alloc(size).ptr == 0x10000 + size

    with poisoned_allocations():
        alloc = allocators[-1]
        threads = [threading.Thread(target=worker, args=(0xA000 + k, 16 * (k + 1))) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alloc(0)  # nothing to fill
    assert allocators[-1] is pool.malloc  # restored
    assert sorted(fills) == [(0x10000 + 16 * (k + 1), 0xFF, 16 * (k + 1), 0xA000 + k) for k in range(4)]
