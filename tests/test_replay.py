"""The launch replay of the host fast path (``mhc_cupy._replay``), without a GPU:
which recordings are accepted, and the parameter bytes a replay hands to
cuLaunchKernel (read back through a stand-in for the driver call)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mhc_cupy import _replay

pytest.importorskip("cupy_backends.cuda.api.driver")
from cupy_backends.cuda.api import driver  # noqa: E402

BASE = 0x7F00_0000_0000  # a device-like address (above 2**32, 16-byte aligned)


class FakeFunction:
    ptr = 0x1234


def _launches(args, grid=(3, 1, 1), block=(64, 1, 1), smem=0):
    with _replay.recording() as launched:
        _replay.note(FakeFunction(), grid, block, args, smem)
    return launched


@pytest.fixture
def driver_calls(monkeypatch):
    calls = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = calls_nargs[0]
        addrs = (ctypes.c_void_p * n).from_address(params)
        values = [ctypes.c_uint64.from_address(a).value for a in addrs]
        calls.append(dict(f=f, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream, values=values))

    calls_nargs = [0]
    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    return calls, calls_nargs


def test_replay_substitutes_pointers_and_packs_scalars(driver_calls):
    calls, nargs = driver_calls
    x, out, scratch = BASE, BASE + 4096, BASE + 8192
    args = (x, None, out, np.int64(5), np.int32(-7), np.float32(1.5), scratch)
    rp = _replay.record(_launches(args, smem=256), [x, out, scratch])
    assert rp is not None
    nargs[0] = len(args)
    x2, out2, scratch2 = BASE + (1 << 20), BASE + (2 << 20), BASE + (3 << 20)
    rp.launch([x2, out2, scratch2], stream=99)
    (c,) = calls
    assert c["f"] == FakeFunction.ptr and c["grid"] == (3, 1, 1) and c["block"] == (64, 1, 1)
    assert c["smem"] == 256 and c["stream"] == 99
    v = c["values"]
    assert v[0] == x2 and v[1] == 0 and v[2] == out2 and v[6] == scratch2
    assert v[3] == 5
    assert v[4] & 0xFFFFFFFF == np.array(-7, np.int32).view(np.uint32)
    assert v[5] & 0xFFFFFFFF == np.array(1.5, np.float32).view(np.uint32)


@pytest.mark.parametrize("why", ["derived pointer", "aliased pointers", "misaligned", "low address", "float arg",
                                 "bare int"])
def test_unsafe_recordings_are_refused(why):
    x, out = BASE, BASE + 4096
    args, ptrs = (x, out, np.int64(3)), [x, out]
    if why == "derived pointer":
        args = (x + 64, out, np.int64(3))
    elif why == "aliased pointers":
        ptrs = [x, x]
    elif why == "misaligned":
        args, ptrs = (x + 2, out, np.int64(3)), [x + 2, out]
    elif why == "low address":
        args, ptrs = (4096, out, np.int64(3)), [4096, out]
    elif why == "float arg":
        args = (x, out, 3.0)
    elif why == "bare int":  # not one of the call's pointers, and a scalar's width must be explicit
        args = (x, out, 3)
    assert _replay.record(_launches(args), ptrs) is None


def test_nested_recording_reaches_the_outer_one():
    with _replay.recording() as outer:
        _replay.note(FakeFunction(), (1, 1, 1), (32, 1, 1), (BASE,), 0)
        with _replay.recording() as inner:
            _replay.note(FakeFunction(), (2, 1, 1), (32, 1, 1), (BASE,), 0)
        _replay.note(FakeFunction(), (3, 1, 1), (32, 1, 1), (BASE,), 0)
    assert [g[0] for _, g, *_ in inner] == [2]
    assert [g[0] for _, g, *_ in outer] == [1, 2, 3]
    _replay.note(FakeFunction(), (4, 1, 1), (32, 1, 1), (BASE,), 0)  # outside any recording: dropped
    assert len(outer) == 3


# --------------------------------------------------------------------------- dynamic shared memory

class FakeSetter:
    """Stands in for cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES): records the
    calls and the attribute per function, and notices two calls at once."""

    def __init__(self, delay=0.0):
        self.calls, self.value, self.busy, self.overlaps, self.delay = [], {}, False, 0, delay

    def __call__(self, fn_ptr, size):
        import time

        self.overlaps += self.busy
        self.busy = True
        time.sleep(self.delay)
        self.calls.append((fn_ptr, size))
        self.value[fn_ptr] = size
        self.busy = False

    def allows(self, fn_ptr, size):
        return size <= max(self.value.get(fn_ptr, 0), 48 * 1024)


def test_shared_limit_only_grows():
    """Weighted rmsnorm_bwd at C 20000, 16384, 20000 (bf16: C * 4 bytes): the third
    launch must still be allowed (the attribute was lowered to 64 KiB before)."""
    from mhc_cupy._jit import DynamicSharedLimit

    setter = FakeSetter()
    limit = DynamicSharedLimit(setter)
    fn, other = 0xA, 0xB
    for C in (20000, 16384, 20000):
        limit.ensure(fn, C * 4)
        assert setter.allows(fn, C * 4), f"launch at C {C} refused"
    assert setter.calls == [(fn, 80000)]
    limit.ensure(other, 1024)
    limit.ensure(other, 48 * 1024)  # within the default: no call
    limit.ensure(fn, 90000)
    assert setter.calls == [(fn, 80000), (fn, 90000)]


def test_shared_limit_threads():
    import random
    import threading

    from mhc_cupy._jit import DynamicSharedLimit

    setter = FakeSetter(delay=0.001)
    limit = DynamicSharedLimit(setter)
    sizes = [random.Random(k).randrange(40_000, 200_000) for k in range(64)]
    refused = []

    def worker(k):
        for s in sizes[k::8]:
            limit.ensure(0xC, s)
            if not setter.allows(0xC, s):
                refused.append(s)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not refused and setter.overlaps == 0
    values = [s for _, s in setter.calls]
    assert values == sorted(set(values)) and values[-1] == max(sizes)


def test_replay_ensures_shared_memory(driver_calls, monkeypatch):
    """A replayed launch needing more than 48 KiB sets the limit before launching."""
    from mhc_cupy import _jit

    calls, nargs = driver_calls
    setter = FakeSetter()
    monkeypatch.setattr(_jit, "shared_limit", _jit.DynamicSharedLimit(setter))
    x = BASE
    rp = _replay.record(_launches((x, np.int32(20000)), smem=80000), [x])
    nargs[0] = 2
    rp.launch([x + 4096], stream=1)
    assert setter.calls == [(FakeFunction.ptr, 80000)] and calls[0]["smem"] == 80000


# --------------------------------------------------------------------------- launch arguments

@pytest.mark.parametrize("bad", [3, 1, -1, 65535, 2.5, True, np.float64(1.0), np.int16(2), "7", [BASE]])
def test_launch_refuses_scalars_without_an_explicit_width(bad):
    """A bare int used to reach the kernel as 8 bytes whatever its parameter's type."""
    from mhc_cupy import _jit

    with _jit.dry_run() as launches:
        with pytest.raises(TypeError, match=r"argument 1 of kernel k<float, 4> is "):
            _jit.launch("stream_ops.cu", "k<float, 4>", (1, 1, 1), (32, 1, 1), (BASE, bad), 0)
    assert launches == []


def test_launch_accepts_pointers_none_and_numpy_scalars():
    from mhc_cupy import _jit

    # 0 is a null pointer: the address of an empty buffer (a zero-token scratch on the GPU)
    args = (BASE, None, 0, np.int32(-1), np.uint32(2), np.int64(3), np.uint64(4), np.float32(0.5))
    with _jit.dry_run() as launches:
        _jit.launch("stream_ops.cu", "k<float, 4>", (1, 1, 1), (32, 1, 1), args, 0, shared_mem=64)
    assert launches == [("stream_ops.cu", "k<float,4>", (1, 1, 1), (32, 1, 1), args, 64)]


def test_every_op_launch_scalar_carries_its_width():
    """All op plans (every dtype, n from 1 to 32, odd and even C, aligned or not): each
    argument is None, a NumPy scalar of a C type, or a pointer at or above the fake base."""
    from mhc_cupy import _jit, _kernels

    launches = _kernels.dry_launches() + _kernels.dry_launches(dtypes=("bfloat16",), ns=(1, 3, 17, 32))
    assert len(launches) > 100
    for filename, expr, grid, block, args, smem in launches:
        for i, a in enumerate(args):
            ok = a is None or type(a) in _jit.SCALAR_TYPES or (type(a) is int and a >= _kernels._ALIGNED)
            assert ok, f"{expr} argument {i}: {a!r} ({type(a).__name__})"


def test_dry_run_is_per_thread():
    """Listing specialisations (``_jit.dry_run``) in one thread leaves another's launches alone
    (it replaced the module's launch function before, for every thread)."""
    import threading

    from mhc_cupy import _jit, _kernels

    seen = []

    def other():
        seen.append(getattr(_jit._local, "dry_run", None))

    with _jit.dry_run():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert _kernels.specialisations(dtypes=("float32",), Cs=(7,))
    assert seen == [None] and getattr(_jit._local, "dry_run", None) is None
