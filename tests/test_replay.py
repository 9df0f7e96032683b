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
    from mhc_cupy import _jit

    monkeypatch.setattr(_jit, "shared_limit", FakeSetter().limit())  # no cuFuncGetAttribute either
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
    """Stands in for cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) (called) and for
    reading what a function allows before that (``initial``): records the calls and the
    attribute per function, and notices two calls at once.  As on the GPU, a function
    with ``static`` bytes of static shared memory allows 48 KiB less those until set."""

    def __init__(self, delay=0.0, static=0):
        self.calls, self.value, self.busy, self.overlaps, self.delay = [], {}, False, 0, delay
        self.static, self.reads = static, []

    def __call__(self, fn_ptr, size):
        import time

        self.overlaps += self.busy
        self.busy = True
        time.sleep(self.delay)
        self.calls.append((fn_ptr, size))
        self.value[fn_ptr] = size
        self.busy = False

    def initial(self, fn_ptr):
        self.reads.append(fn_ptr)
        return self.value.get(fn_ptr, 48 * 1024 - self.static)

    def allows(self, fn_ptr, size):
        return size <= self.value.get(fn_ptr, 48 * 1024 - self.static)

    def limit(self):
        from mhc_cupy._jit import DynamicSharedLimit

        return DynamicSharedLimit(self, self.initial)


def _in_threads(worker, n):
    """Run worker(0) ... worker(n - 1), each in its own thread, and wait for all."""
    import threading

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_shared_limit_only_grows():
    """Weighted rmsnorm_bwd at C 20000, 16384, 20000 (bf16: C * 4 bytes): the third
    launch must still be allowed (the attribute was lowered to 64 KiB before)."""
    setter = FakeSetter()
    limit = setter.limit()
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

    setter = FakeSetter(delay=0.001)
    limit = setter.limit()
    sizes = [random.Random(k).randrange(40_000, 200_000) for k in range(64)]
    refused = []

    def worker(k):
        for s in sizes[k::8]:
            limit.ensure(0xC, s)
            if not setter.allows(0xC, s):
                refused.append(s)

    _in_threads(worker, 8)
    assert not refused and setter.overlaps == 0
    values = [s for _, s in setter.calls]
    assert values == sorted(set(values)) and values[-1] == max(sizes)


def test_replay_ensures_shared_memory(driver_calls, monkeypatch):
    """A replayed launch needing more than 48 KiB sets the limit before launching."""
    from mhc_cupy import _jit

    calls, nargs = driver_calls
    setter = FakeSetter()
    monkeypatch.setattr(_jit, "shared_limit", setter.limit())
    x = BASE
    rp = _replay.record(_launches((x, np.int32(20000)), smem=80000), [x])
    nargs[0] = 2
    rp.launch([x + 4096], stream=1)
    assert setter.calls == [(FakeFunction.ptr, 80000)] and calls[0]["smem"] == 80000



def test_shared_limit_counts_static_shared_memory():
    """The weighted rmsnorm_bwd kernels also hold ``red[2 * 32]`` floats (256 bytes) of static
    shared memory, so C = 12288 (exactly 48 KiB of dynamic) needs the attribute raised: it
    was refused with CUDA_ERROR_INVALID_VALUE when no larger launch had raised it first."""
    setter = FakeSetter(static=256)
    limit = setter.limit()
    fn, other = 0xA, 0xB
    limit.ensure(fn, 12288 * 4)
    assert setter.allows(fn, 12288 * 4) and setter.calls == [(fn, 49152)]
    limit.ensure(fn, 48 * 1024 - 256)  # within what is set: no call, no read
    assert setter.calls == [(fn, 49152)] and setter.reads == [fn]
    limit.ensure(other, 0)  # no dynamic shared memory: no driver call at all
    assert setter.reads == [fn]
    for _ in range(2):
        limit.ensure(other, 48 * 1024 - 256)  # within the initial limit: read once, never set
    assert setter.reads == [fn, other] and setter.calls == [(fn, 49152)]


def test_shared_limit_refused_size_changes_nothing():
    """A size the device cannot give raises and leaves the limit as it was."""
    calls = []

    def setter(fn_ptr, size):
        if size > 100_000:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        calls.append(size)

    from mhc_cupy._jit import DynamicSharedLimit

    limit = DynamicSharedLimit(setter, lambda fn_ptr: 48 * 1024)
    limit.ensure(0xA, 60_000)
    with pytest.raises(RuntimeError):
        limit.ensure(0xA, 200_000)
    limit.ensure(0xA, 80_000)
    limit.ensure(0xA, 70_000)
    assert calls == [60_000, 80_000]


def test_shared_limit_threads_like_the_gpu_test():
    """tests/gpu/test_replay_gpu.py::test_shared_memory_sizes_from_many_threads on fake
    functions: eight threads, C 12288 ... 19456 in rotated orders, three rounds, kernels with
    256 bytes of static shared memory (one kernel up to C 14336, another above)."""
    setter = FakeSetter(delay=0.0005, static=256)
    limit = setter.limit()
    sizes = [12288 + 1024 * k for k in range(8)]
    refused = []

    def worker(k):
        for C in (sizes[k:] + sizes[:k]) * 3:
            fn = 0xA if C <= 14336 else 0xB
            limit.ensure(fn, C * 4)
            if not setter.allows(fn, C * 4):
                refused.append((k, C))

    _in_threads(worker, 8)
    assert not refused and setter.overlaps == 0
    for fn in (0xA, 0xB):
        values = [s for f, s in setter.calls if f == fn]
        assert values == sorted(set(values))
    assert setter.value == {0xA: 14336 * 4, 0xB: 19456 * 4}


def test_initial_dynamic_shared_reads_the_function(monkeypatch):
    """What a function allows before its attribute is set: its attribute, and at most 48 KiB
    less its static shared memory; read with the context made current."""
    import cupy

    from mhc_cupy import _jit

    events = []
    attrs = {driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 49152,
             driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: 256}

    def get(attr, fn_ptr):
        events.append("get")
        return attrs[attr]

    monkeypatch.setattr(driver, "funcGetAttribute", get)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: events.append("context"))
    monkeypatch.setattr(_replay._local, "contexts", set(), raising=False)
    assert _jit._initial_dynamic_shared(0xA) == 48 * 1024 - 256
    attrs[driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES] = 1000
    assert _jit._initial_dynamic_shared(0xA) == 1000
    assert events == ["context", "get", "get", "get", "get"]


# --------------------------------------------------------------------------- CUDA context per thread

def _in_a_new_thread(fn):
    box = []
    _in_threads(lambda k: box.append(fn()), 1)
    return box[0]


def test_ensure_context_once_per_thread_and_device(monkeypatch):
    import cupy

    made = []
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: made.append(1))

    def work():
        for dev in (0, 0, 1, 0, 1):
            _replay.ensure_context(dev)
        return len(made)

    assert _in_a_new_thread(work) == 2
    assert _in_a_new_thread(work) == 4  # another thread makes its own current


def test_fast_path_makes_the_context_current_before_a_replay(driver_calls, monkeypatch):
    """A thread whose first CUDA work is a replayed call (outputs from a memory pool, no
    CuPy launch before) must not reach cuLaunchKernel without a current context."""
    import cupy

    from mhc_cupy import _dispatch

    calls, nargs = driver_calls
    events = []
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: events.append("context"))
    monkeypatch.setattr(driver, "launchKernel", lambda *a: events.append("launch"))
    monkeypatch.setattr(_dispatch, "_get_device", lambda: 0)

    class FrontEnd:
        @staticmethod
        def empty(shape, dt, like):
            return BASE + 4096

        @staticmethod
        def ptr(o):
            return o

        @staticmethod
        def stream(dev):
            return 7

    x = BASE
    rp = _replay.record(_launches((x, x + 4096, np.int32(3))), [x, x + 4096])
    plan = _dispatch.Plan([((4,), "float32")], kernels=None, reference=None, single=True)
    entry = _dispatch._Entry(plan, FrontEnd, 0, rp)

    def two_calls():
        for _ in range(2):
            _dispatch._run_fast(entry, [BASE + (1 << 20)], None, {"x": None})
        return list(events)

    assert _in_a_new_thread(two_calls) == ["context", "launch", "launch"]

# --------------------------------------------------------------------------- launch arguments

@pytest.mark.parametrize("bad", [3, 1, -1, 65535, 2.5, True, np.float64(1.0), np.int16(2), "7", [BASE]])
def test_launch_refuses_scalars_without_an_explicit_width(bad):
    """A bare int used to reach the kernel as 8 bytes whatever its parameter's type."""
    from mhc_cupy import _jit

    with _jit.dry_run() as launches:
        with pytest.raises(TypeError, match=r"argument 1 of kernel k<float, 4> is "):
            _jit.launch("stream.cu", "k<float, 4>", (1, 1, 1), (32, 1, 1), (BASE, bad), 0)
    assert launches == []


def test_launch_accepts_pointers_none_and_numpy_scalars():
    from mhc_cupy import _jit

    # 0 is a null pointer: the address of an empty buffer (a zero-token scratch on the GPU)
    args = (BASE, None, 0, np.int32(-1), np.uint32(2), np.int64(3), np.uint64(4), np.float32(0.5))
    with _jit.dry_run() as launches:
        _jit.launch("stream.cu", "k<float, 4>", (1, 1, 1), (32, 1, 1), args, 0, shared_mem=64)
    assert launches == [("stream.cu", "k<float,4>", (1, 1, 1), (32, 1, 1), args, 64)]


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


def test_scratch_is_one_allocation_of_aligned_disjoint_pieces():
    """A plan's temporaries come from one buffer (one allocation per call, not one per temporary):
    each piece at a multiple of SCRATCH_ALIGN, large enough for its shape and dtype, none overlapping,
    in the plan's order, zero-sized ones included (a distinct pointer each, as a replay needs)."""
    from mhc_cupy import _dispatch

    scratch = {"a": ((3, 5), "bfloat16"), "empty": ((0, 4), "float32"), "b": ((7,), "float32"),
               "c": ((2, 129), "float16"), "d": ((1,), "int64")}
    plan = _dispatch.Plan([], kernels=None, reference=None, scratch=scratch)
    size, offsets = plan.scratch_layout
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}
    ends = [o + max(int(np.prod(shape)) * itemsize[dt], 1) for o, (shape, dt) in zip(offsets, scratch.values())]
    assert all(o % _dispatch.SCRATCH_ALIGN == 0 for o in offsets)
    assert list(offsets) == sorted(set(offsets)) and offsets[0] == 0
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:])) and ends[-1] <= size
    assert size % _dispatch.SCRATCH_ALIGN == 0 and size < ends[-1] + _dispatch.SCRATCH_ALIGN

    made = []

    class FrontEnd:
        @staticmethod
        def empty(shape, dt, like):
            made.append((shape, dt, like))
            return BASE + (1 << 20)

        @staticmethod
        def ptr(o):
            return o

    buf, ptrs = plan.scratch_ptrs(FrontEnd, "like")
    assert made == [((size,), "uint8", "like")] and buf == BASE + (1 << 20)
    assert ptrs == [BASE + (1 << 20) + o for o in offsets]
    assert _dispatch.Plan([], None, None).scratch_ptrs(FrontEnd, None) == (None, []) and len(made) == 1
