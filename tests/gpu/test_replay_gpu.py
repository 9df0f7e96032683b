"""The host fast path replays recorded launches (``mhc_cupy._replay``): repeated
calls with new data on the same shapes must match the float64 reference, the
replay must really be taken, and a misaligned view must take the planned path."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _dispatch
from mhc_cupy import reference as R

from harness import TOL

from .helpers import ACT_TOL, assert_close, poisoned_allocations, rounded, to_gpu

pytestmark = pytest.mark.gpu

T, n, C = 37, 4, 520
SINKHORN_TOL = TOL["sinkhorn"].value  # as the Sinkhorn GPU cases (tests/test_sinkhorn.py); >= COEF_TOL
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


# ------------------------------------------------- dynamic shared memory above 48 KiB

#: Weighted rmsnorm_bwd keeps the weight in C * 4 bytes of dynamic shared memory: the
#: middle size used to lower the kernel's limit, and the third launch then failed with
#: CUDA_ERROR_INVALID_VALUE (the same bf16 kernel for all three sizes).
_SMEM_SEQUENCE = (20000, 16384, 20000)

_SMEM_SCRIPT = r"""
import os
import sys
import numpy as np
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]  # tests/gpu (helpers) and tests/ (harness)
from helpers import ACT_TOL, COEF_TOL, assert_close, rounded, to_gpu
import mhc_cupy as m
from mhc_cupy import _dispatch
from mhc_cupy import reference as R

mode, rng = sys.argv[1], np.random.default_rng(0)
for call, C in enumerate(map(int, sys.argv[3].split(","))):
    g, x = rounded(rng, (3, C), "bfloat16"), rounded(rng, (3, C), "bfloat16")
    w = rng.standard_normal(C).astype(np.float32)
    if mode == "planned":
        _dispatch._fast.clear()  # every call plans and launches through _jit.launch
        dx, dw = m.rmsnorm_bwd(to_gpu(g), to_gpu(x), 1e-5, to_gpu(w))
    else:
        import torch
        t = lambda a: torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).cuda() if a.dtype != np.float32 \
            else torch.from_numpy(a).cuda()
        dx, dw = m.rmsnorm_bwd(t(g), t(x), 1e-5, t(w))
        dx, dw = dx.float().cpu().numpy(), dw.cpu().numpy()
        if call == 2:  # the third call repeats the first one's key: it must have been replayed
            entries = list(_dispatch._fast.values())
            assert entries and all(e.replay is not None for e in entries), "no replay recorded"
    rdx, rdw = R.rmsnorm_bwd(g, x, 1e-5, w)
    assert_close(dx, rdx, ACT_TOL["bfloat16"], f"dx at C {C}")
    assert_close(dw, rdw, COEF_TOL, f"d_weight at C {C}")
print("OK")
"""

#: C 12288 and 12250 need 49152 and 49000 bytes of dynamic shared memory: within 48 KiB,
#: but the kernels also hold 256 bytes of static shared memory, so a function allows only
#: 48896 until its limit is raised.  The first launch of each (two kernels: E = 8 and E = 2)
#: failed with CUDA_ERROR_INVALID_VALUE when no larger launch had raised the limit before
#: (thread 0 of test_shared_memory_sizes_from_many_threads, which starts at C 12288).
_SMEM_AT_48_KIB = (12288, 12250, 12288)


def _run_smem_sequence(mode, sizes=_SMEM_SEQUENCE):
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _SMEM_SCRIPT, mode, here, ",".join(map(str, sizes))],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_shared_memory_after_a_smaller_size_functional():
    """C 20000 -> 16384 -> 20000, each call planned (fresh process: no earlier launch
    of this kernel has raised its limit)."""
    _run_smem_sequence("planned")


def test_shared_memory_after_a_smaller_size_replayed():
    """The same with torch CUDA tensors: the third call takes the replayed fast path."""
    pytest.importorskip("torch")
    from .helpers import torch_cuda_ok

    if not torch_cuda_ok():
        pytest.skip("needs CUDA for both CuPy and torch")
    _run_smem_sequence("torch")


@pytest.mark.parametrize("mode", ["planned", "torch"])
def test_shared_memory_just_under_48_kib_first(mode):
    """C 12288 -> 12250 -> 12288 in a fresh process, planned or (torch) replayed: dynamic
    shared memory within 48 KiB but above 48 KiB less the kernels' static shared memory."""
    if mode == "torch":
        pytest.importorskip("torch")
        from .helpers import torch_cuda_ok

        if not torch_cuda_ok():
            pytest.skip("needs CUDA for both CuPy and torch")
    _run_smem_sequence(mode, _SMEM_AT_48_KIB)


# ------------------------------------------------------- many threads, own streams

def test_poison_is_ordered_on_the_allocating_stream():
    """The NaN poisoning of the tests' CuPy allocations (helpers.poisoned_allocations) is
    ordered before the work of a non-blocking stream that allocates: with the legacy default
    stream held busy, a fill queued there (a plain cudaMemset) landed after the buffer had
    been written, so a correct result read back as NaN (the flaky unwritten d_weight of
    test_shared_memory_sizes_from_many_threads)."""
    import cupy as cp

    from .test_gpu_defects_gpu import _spin

    s = cp.cuda.Stream(non_blocking=True)
    with s:  # warm up: the fill kernel compiled, and memory for s in the pool (no cudaMalloc below)
        cp.empty(4099, cp.float32).fill(1.0)
    cp.cuda.Device().synchronize()
    _spin(cp.cuda.Stream.null)  # the legacy default stream busy for ~0.1 s
    with s:
        a = cp.empty(4099, cp.float32)  # poisoned by the autouse fixture
        a.fill(1.0)
    s.synchronize()
    cp.cuda.Device().synchronize()  # a fill still queued on the default stream has run by now
    assert bool((a == 1).all()), "the poison fill landed after the stream had written the buffer"


#: The weighted backward keeps the weight in C * 4 bytes of dynamic shared memory: eight sizes
#: from 48 KiB up (the kernels' limit raised concurrently), then odd token counts (one row;
#: more rows than the backward's 1024 blocks, so each block sums several), with and without
#: a weight.
_THREAD_CASES = ([(3, 12288 + 1024 * k, True) for k in range(8)]
                 + [(3, 12288 + 1024 * k + 7, False) for k in (0, 3, 6)]
                 + [(T_, C_, w_) for T_, C_ in ((1, 4096), (37, 520), (1100, 520), (5, 1023)) for w_ in (True, False)])


def test_shared_memory_sizes_from_many_threads(rng):
    """Eight threads, each on its own non-blocking CuPy stream, call the backward in
    different orders (planned and replayed calls mixed, four rounds), while another thread
    keeps the legacy default stream busy (so any work queued there, by the library or the
    tests' poisoning, lands late): every result matches the float64 reference."""
    import threading

    import cupy as cp

    from .test_gpu_defects_gpu import _spin

    data = []
    for T_, C_, weighted in _THREAD_CASES:
        g, x = rounded(rng, (T_, C_), DT), rounded(rng, (T_, C_), DT)
        w = rng.standard_normal(C_).astype(np.float32) if weighted else None
        args = (to_gpu(g), to_gpu(x), 1e-5) + ((to_gpu(w),) if weighted else ())
        data.append((f"T {T_}, C {C_}, weight {weighted}", args, R.rmsnorm_bwd(g, x, 1e-5, w)))
    cp.cuda.Device().synchronize()  # the copies ran on the default stream; the workers use their own
    errors, stop = [], threading.Event()

    def worker(k):
        try:
            with cp.cuda.Stream(non_blocking=True) as s:
                for name, args, ref in (data[k:] + data[:k]) * 4:
                    got = m.rmsnorm_bwd(*args)
                    s.synchronize()
                    _check(f"thread {k}, {name}", got, ref)
        except Exception as e:  # noqa: BLE001 - reported below with the thread
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    def noise():
        null, last = cp.cuda.Stream.null, None
        while not stop.is_set():  # always one spin (~0.1 s) queued on the legacy default stream
            _spin(null)
            ev = null.record()
            if last is not None:
                last.synchronize()
            last = ev

    busy = threading.Thread(target=noise)
    busy.start()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        busy.join()
        cp.cuda.Device().synchronize()
    assert not errors, "\n".join(errors[:20])
