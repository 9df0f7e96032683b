"""The host fast path replays recorded launches (``mhc_cupy._replay``): repeated
calls with new data on the same shapes must match the float64 reference, the
replay must really be taken, and a misaligned view must take the planned path."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _dispatch
from mhc_cupy import reference as R

from .helpers import ACT_TOL, assert_close, poisoned_allocations, rounded, to_gpu

pytestmark = pytest.mark.gpu

T, n, C = 37, 4, 520
SINKHORN_TOL = 2e-4  # as test_ops_gpu; >= COEF_TOL
DT = "bfloat16"


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_allocations():
        yield


def _cases(rng):
    """(name, call, reference) with fresh data each time it is called."""
    x, g = rounded(rng, (T, n, C), DT), rounded(rng, (T, n, C), DT)
    y, gy = rounded(rng, (T, C), DT), rounded(rng, (T, C), DT)
    M, h = rng.standard_normal((T, n, n)).astype(np.float32), rng.standard_normal((T, n)).astype(np.float32)
    w = rng.standard_normal(C).astype(np.float32)
    return [
        ("mix fwd", lambda: m.stream_mix_fwd(to_gpu(x), to_gpu(M)), lambda: R.stream_mix_fwd(x, M)),
        ("mix bwd", lambda: m.stream_mix_bwd(to_gpu(g), to_gpu(x), to_gpu(M)), lambda: R.stream_mix_bwd(g, x, M)),
        ("rmsnorm bwd weighted", lambda: m.rmsnorm_bwd(to_gpu(gy), to_gpu(y), 1e-5, to_gpu(w)),
         lambda: R.rmsnorm_bwd(gy, y, 1e-5, w)),
        ("sinkhorn bwd, global history", lambda: m.sinkhorn_knopp_bwd(to_gpu(M), to_gpu(M * 0.5), num_iters=300),
         lambda: R.sinkhorn_knopp_bwd(M, M * 0.5, num_iters=300)),
        ("pre fwd", lambda: m.mhc_pre_op_fwd(to_gpu(x), to_gpu(h), to_gpu(h * 2), to_gpu(M)),
         lambda: R.mhc_pre_op_fwd(x, h, h * 2, M)),
    ]


def _check(name, got, ref):
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(got) == len(ref), name
    for k, (a, b) in enumerate(zip(got, ref)):
        # float32 outputs: coefficient sums, or Sinkhorn's (2e-4 through its iterations)
        tol = SINKHORN_TOL if a.dtype == np.float32 else ACT_TOL[DT]
        assert_close(a, b, tol, f"{name} output {k}")


def test_repeated_calls_replay_and_match_the_reference(rng):
    _dispatch._fast.clear()
    for rep in range(3):  # the first call plans and records, the next two replay
        for name, call, ref in _cases(rng):
            _check(f"{name} (call {rep})", call(), ref())
    replays = [e.replay for e in _dispatch._fast.values()]
    assert replays and all(r is not None for r in replays), "a fast-path entry has no replay"


def test_misaligned_view_after_a_replay(rng):
    import cupy as cp

    x = rounded(rng, (T, n, C), DT)
    M = rng.standard_normal((T, n, n)).astype(np.float32)
    m.stream_mix_fwd(to_gpu(x), to_gpu(M))  # records (aligned)
    buf = cp.empty(x.size + 1, dtype=to_gpu(x).dtype)
    view = buf[1:].reshape(x.shape)  # 2-byte offset: contiguous, not 16-byte aligned
    view[...] = to_gpu(x)
    assert_close(m.stream_mix_fwd(view, to_gpu(M)), R.stream_mix_fwd(x, M), ACT_TOL[DT], "misaligned view")
