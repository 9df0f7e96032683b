"""The launch replay in ``mhc_cupy.jax``'s GPU callback (``mhc_cupy._jax_kernels.REPLAY``), without a GPU:
XLA's buffers stand in as objects with a CUDA array interface, the plan's launches as notes to
``mhc_cupy._replay`` and cuLaunchKernel as a function that reads back the parameters it is handed."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from mhc_cupy import _dispatch, _replay

pytest.importorskip("jax")
cupy = pytest.importorskip("cupy")
pytest.importorskip("cupy_backends.cuda.api.driver")
from cupy_backends.cuda.api import driver  # noqa: E402

from mhc_cupy import _jax_kernels  # noqa: E402

BASE = 0x7F00_0000_0000  # a device-like address (above 2**32, 16-byte aligned)


class FakeFunction:
    ptr = 0x1234


class Buffer:
    """An XLA buffer as the callback sees it on a GPU."""

    def __init__(self, ptr, shape=(4,)):
        self.shape = shape
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<f4", "version": 3}

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


class Ctx:
    stream = 77
    device_ordinal = 0


@pytest.fixture
def gpu(monkeypatch):
    """(plan runs, driver launches): the plan's kernels note one launch of (x, g or None, out, scratch, 3)."""
    runs, launches = [], []

    def kernels(ptrs, outs, scratch, stream):
        runs.append((dict(ptrs), list(outs), dict(scratch), stream))
        _replay.note(FakeFunction(), (2, 1, 1), (64, 1, 1), (ptrs["x"], ptrs["g"], outs[0], scratch["tmp"],
                                                             np.int32(3)), 0)

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        addrs = (ctypes.c_void_p * 5).from_address(params)
        launches.append(([ctypes.c_uint64.from_address(a).value for a in addrs], stream))

    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev: contextlib.nullcontext())
    plan = _dispatch.Plan([((4,), "float32")], kernels, reference=None, scratch={"tmp": ((4,), "float32")})
    return plan, runs, launches


def _call(callback, x, g, out, tmp):
    ins = [Buffer(x)] + ([] if g is None else [Buffer(g)])
    callback(Ctx(), [Buffer(out), Buffer(tmp)], *ins)


@pytest.mark.parametrize("with_g", [True, False])
def test_replay_repeats_the_recorded_launches_with_xla_pointers(gpu, monkeypatch, with_g):
    plan, runs, launches = gpu
    monkeypatch.setattr(_jax_kernels, "REPLAY", True)
    present = ("x", "g") if with_g else ("x",)
    cb = _jax_kernels._make_callback(plan, ("x", "g"), present)
    g0 = BASE + 0x100 if with_g else None
    _call(cb, BASE, g0, BASE + 0x200, BASE + 0x300)  # recorded (the plan runs)
    assert len(runs) == 1 and launches == []
    assert runs[0][0] == {"x": BASE, "g": g0}
    x, g, out, tmp = (BASE + (k << 20) for k in (1, 2, 3, 4))
    _call(cb, x, g if with_g else None, out, tmp)  # replayed: the driver gets the new pointers
    assert len(runs) == 1
    assert launches == [([x, g if with_g else 0, out, tmp, 3], Ctx.stream)]


def test_misaligned_buffers_take_the_plan(gpu, monkeypatch):
    plan, runs, launches = gpu
    monkeypatch.setattr(_jax_kernels, "REPLAY", True)
    cb = _jax_kernels._make_callback(plan, ("x", "g"), ("x", "g"))
    _call(cb, BASE, BASE + 0x100, BASE + 0x200, BASE + 0x300)
    _call(cb, BASE + 8, BASE + 0x100, BASE + 0x200, BASE + 0x300)  # x 8-byte aligned: the plan decides again
    assert len(runs) == 2 and launches == []
    assert runs[1][0]["x"] == BASE + 8


def test_a_refused_recording_is_not_retried(gpu, monkeypatch):
    """x and g the same buffer when recorded (record refuses equal pointers): the plan runs each time."""
    plan, runs, launches = gpu
    monkeypatch.setattr(_jax_kernels, "REPLAY", True)
    cb = _jax_kernels._make_callback(plan, ("x", "g"), ("x", "g"))
    for k in range(3):
        _call(cb, BASE + (k << 20), BASE + (k << 20), BASE + 0x200, BASE + 0x300)
    assert len(runs) == 3 and launches == []


def test_off_by_default_runs_the_plan_each_call(gpu):
    plan, runs, launches = gpu
    assert _jax_kernels.REPLAY is False
    cb = _jax_kernels._make_callback(plan, ("x", "g"), ("x", "g"))
    for k in range(3):
        _call(cb, BASE + (k << 20), BASE + 0x100, BASE + 0x200, BASE + 0x300)
    assert len(runs) == 3 and launches == []
    assert [r[0]["x"] for r in runs] == [BASE, BASE + (1 << 20), BASE + (2 << 20)]
