"""Replay of recorded kernel launches: the host fast path of repeated calls.

A call's plan decides its launches from shapes, dtypes, parameters and the
16-byte alignment of its pointers (``ops._launch.vec_width``).  For the next
call with the same key and all pointers 16-byte aligned, those decisions are
the same; only the pointers differ.  ``record`` captures the launches of one
call; ``Replay.launch`` repeats them through ``cuLaunchKernel`` with the new
pointers written into a pre-packed parameter buffer, skipping the planning
code and CuPy's per-argument conversion (about half of the host cost of a
tiny call).

A recording is refused (``record`` returns None) unless every kernel argument
is either one of the call's pointers, matched exactly, or a NumPy scalar
constant: any other pointer (a derived address such as ``ptr + offset``), or
two call pointers that are equal, keep the general path.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np

_POINTER_MIN = 1 << 32  # device addresses under unified addressing lie above this
_ALIGN = 16

_local = threading.local()


def aligned(ptrs) -> bool:
    acc = 0
    for p in ptrs:
        acc |= p
    return not acc & (_ALIGN - 1)


@contextlib.contextmanager
def thread_list(local: threading.local, name: str, nested_into_outer: bool = False):
    """For the block, ``local.<name>`` is a fresh list (yielded); the outer one (or None) is
    restored after it, and with ``nested_into_outer`` receives the block's items too."""
    items, outer = [], getattr(local, name, None)
    setattr(local, name, items)
    try:
        yield items
    finally:
        setattr(local, name, outer)
        if nested_into_outer and outer is not None:
            outer.extend(items)


def recording():
    """Collect the launches this thread makes: yields the list they go to (a nested
    recording's launches belong to the outer one too)."""
    return thread_list(_local, "launches", nested_into_outer=True)


def note(fn, grid, block, args, shared_mem) -> None:
    """Called by ``_jit.launch`` after each launch."""
    launches = getattr(_local, "launches", None)
    if launches is not None:
        launches.append((fn, grid, block, args, shared_mem))


class _Launch:
    """One kernel launch with its parameters packed in 8-byte slots."""

    __slots__ = ("fn", "grid", "block", "shared_mem", "values", "params", "params_ptr", "slots")

    def __init__(self, fn, grid, block, shared_mem, args, slot_of):
        self.fn, self.grid, self.block, self.shared_mem = fn.ptr, grid, block, shared_mem
        self.values = (ctypes.c_uint64 * max(len(args), 1))()
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * max(len(args), 1))(*[base + 8 * i for i in range(len(args))])
        self.params_ptr = ctypes.addressof(self.params)
        self.slots = []  # (parameter index, index into the call's pointer list)
        for i, a in enumerate(args):
            if a is None:
                continue
            if type(a) is int:  # a pointer (scalars are NumPy scalars: _jit.check_args)
                if a not in slot_of:
                    raise _NotReplayable
                self.slots.append((i, slot_of[a]))
            elif isinstance(a, (np.int32, np.uint32, np.float32)):
                self.values[i] = int(np.asarray(a).view(np.uint32))
            elif isinstance(a, (np.int64, np.uint64)):
                self.values[i] = int(a) & 0xFFFFFFFFFFFFFFFF
            else:
                raise _NotReplayable


class _NotReplayable(Exception):
    pass


class Replay:
    """The recorded launches of one plan, replayable with new pointers."""

    __slots__ = ("launches", "lock", "shared")

    def __init__(self, launches):
        self.launches = launches
        self.lock = threading.Lock()  # the parameter buffers are shared
        self.shared = [(ln.fn, ln.shared_mem) for ln in launches if ln.shared_mem]

    def launch(self, ptrs, stream: int) -> None:
        launch_kernel = _driver_launch()
        if self.shared:  # each kernel's dynamic shared memory limit (see _jit.DynamicSharedLimit)
            from ._jit import shared_limit

            for fn, size in self.shared:
                shared_limit.ensure(fn, size)
        with self.lock:
            for ln in self.launches:
                v = ln.values
                for i, k in ln.slots:
                    v[i] = ptrs[k]
                g, b = ln.grid, ln.block
                launch_kernel(ln.fn, g[0], g[1], g[2], b[0], b[1], b[2], ln.shared_mem, stream, ln.params_ptr, 0)


_driver = None


def _driver_launch():
    """CuPy's binding of cuLaunchKernel (its module imported once; the attribute
    is looked up at each call, so tests can replace it)."""
    global _driver
    if _driver is None:
        from cupy_backends.cuda.api import driver

        _driver = driver
    return _driver.launchKernel


def record(launches, ptrs) -> Replay | None:
    """A Replay of ``launches`` (from ``recording``) made with the call's
    pointer list ``ptrs`` (inputs in order, then outputs, then scratch), or
    None when it cannot be replayed safely (see the module doc)."""
    if not launches or not aligned(ptrs) or any(p < _POINTER_MIN for p in ptrs) or len(set(ptrs)) != len(ptrs):
        return None
    slot_of = {p: k for k, p in enumerate(ptrs)}
    try:
        return Replay([_Launch(fn, tuple(grid), tuple(block), shared_mem, args, slot_of)
                       for fn, grid, block, args, shared_mem in launches])
    except _NotReplayable:
        return None

