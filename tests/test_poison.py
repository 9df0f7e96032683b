"""``mhc_cupy._dispatch.POISON`` (on in every GPU test: conftest.py): each output and temporary of a GPU call
filled with 0xFF bytes (NaN) on the launch stream before the kernels, on every route: a plan's launch (the
general route, a fast-path call that cannot replay, JAX's callback), a fast-path replay (torch / CuPy, the
no-grad lane) and JAX's replayed callback.  Without a GPU: cudaMemsetAsync and the launches are recorded in
one list, so the order is checked too."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from mhc_cupy import _dispatch

cupy = pytest.importorskip("cupy")

BASE = 0x7F00_0000_0000
OUTPUTS = [((3, 5), "bfloat16"), ((3, 4), "float32"), ((7,), "float8_e4m3fn"), ((0, 4), "float32")]
SCRATCH = {"part": ((2, 3, 9), "float32"), "planes": ((3, 8), "bfloat16")}
#: bytes of each: 3 * 5 * 2, 3 * 4 * 4, 7, 0 (not filled), then 2 * 3 * 9 * 4, 3 * 8 * 2
SIZES = [30, 48, 7, 0, 216, 48]


@pytest.fixture
def events(monkeypatch):
    got = []
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, value, size, stream: got.append(
        ("fill", ptr, value, size, stream)))
    monkeypatch.setattr(_dispatch, "POISON", True)
    return got


def _plan(events):
    return _dispatch.Plan(list(OUTPUTS), lambda ptrs, outs, scratch, stream: events.append(("kernels", stream)),
                          reference=None, scratch=dict(SCRATCH))


def _fills(ptrs, stream):
    return [("fill", p, 0xFF, s, stream) for p, s in zip(ptrs, SIZES) if s]


PTRS = [BASE + 0x1000 * k for k in range(len(SIZES))]


def test_a_plans_launch_fills_its_outputs_and_temporaries_first(events):
    _plan(events).launch({"x": BASE}, PTRS[:4], PTRS[4:], 5)
    assert events == _fills(PTRS, 5) + [("kernels", 5)]


def test_a_dry_run_fills_nothing(events):
    """Inside _jit.dry_run (planned launches on fake pointers: warmup, the layout tests) nothing is filled."""
    from mhc_cupy import _jit

    with _jit.dry_run():
        _plan(events).launch({"x": BASE}, PTRS[:4], PTRS[4:], 5)
    assert events == [("kernels", 5)]


def test_off_fills_nothing(events, monkeypatch):
    monkeypatch.setattr(_dispatch, "POISON", False)
    _plan(events).launch({"x": BASE}, PTRS[:4], PTRS[4:], 5)
    assert events == [("kernels", 5)]


def test_a_fast_path_replay_fills_them_first(events, monkeypatch):
    class Replay:
        @staticmethod
        def launch(ptrs, stream):
            events.append(("replay", tuple(ptrs), stream))

    monkeypatch.setattr(_dispatch._replay, "ensure_context", lambda dev: None)
    entry = _dispatch._Entry(_plan(events), None, 0, Replay())
    _dispatch.launch(entry, {"x": 1, "g": None}, [BASE - 0x100], PTRS[:4], PTRS[4:], 9)
    assert events == _fills(PTRS, 9) + [("replay", (BASE - 0x100, *PTRS), 9)]
    events.clear()  # a misaligned pointer: the plan instead, filled as well
    _dispatch.launch(entry, {"x": 1, "g": None}, [BASE - 0x102], PTRS[:4], PTRS[4:], 9)
    assert events == _fills(PTRS, 9) + [("kernels", 9)]


def test_jax_callback_fills_them_on_both_routes(events, monkeypatch):
    """XLA's buffers (outputs, then temporaries) filled on XLA's stream, at the first call (the plan) and
    at a replayed one (mhc_cupy._jax_kernels.REPLAY)."""
    pytest.importorskip("jax")
    from mhc_cupy import _jax_kernels, _replay

    from test_jax_replay import BASE as JBASE, Buffer, Ctx, FakeFunction

    def kernels(ptrs, outs, scratch, stream):
        events.append(("kernels", stream))
        _replay.note(FakeFunction(), (1, 1, 1), (32, 1, 1), (ptrs["x"], outs[0], np.int32(1)), 0)

    replayed = []
    monkeypatch.setattr(_replay, "_driver_launch", lambda: lambda *a: replayed.append(a[8]) or events.append(
        ("replay", a[8])))
    monkeypatch.setattr(_jax_kernels, "REPLAY", True)
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev: contextlib.nullcontext())
    plan = _dispatch.Plan(list(OUTPUTS), kernels, reference=None, scratch=dict(SCRATCH))
    cb = _jax_kernels._make_callback(plan, ("x",), ("x",))
    shapes = [s for s, _ in OUTPUTS] + [s for s, _ in SCRATCH.values()]
    for call in range(2):
        events.clear()
        ptrs = [JBASE + (call << 24) + 0x1000 * (k + 1) for k in range(len(shapes))]
        cb(Ctx(), [Buffer(p, s) for p, s in zip(ptrs, shapes)], Buffer(JBASE + (call << 24)))
        assert events == _fills(ptrs, Ctx.stream) + [("kernels" if call == 0 else "replay", Ctx.stream)], call
    assert replayed == [Ctx.stream]
