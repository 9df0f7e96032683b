"""Launch layouts chosen on the host (no GPU needed): RMSNorm's register-cached
kernels and the Sinkhorn backward's shared-memory history."""

from __future__ import annotations

import pytest

from mhc_cupy.ops import rmsnorm, sinkhorn


@pytest.mark.parametrize("direction,C,E,dtypes,expect", [
    ("fwd", 4096, 8, ("bfloat16",), (256, 2)),
    ("bwd", 4096, 8, ("bfloat16", "bfloat16"), (512, 1)),
    ("fwd", 16384, 8, ("bfloat16",), (512, 4)),
    ("bwd", 16384, 8, ("bfloat16", "bfloat16"), (512, 4)),  # K = 2 would need 1024 threads
    ("fwd", 28672, 8, ("bfloat16",), (448, 8)),
    ("bwd", 28672, 8, ("bfloat16", "float32"), (896, 4)),
    ("fwd", 49152, 8, ("bfloat16",), None),  # 768 threads at K = 8: two-pass
    ("bwd", 57352, 8, ("bfloat16", "bfloat16"), None),
    ("fwd", 7, 1, ("bfloat16",), None),  # a 2-byte vector is not a whole 32-bit word
    ("fwd", 7, 1, ("float32",), (32, 2)),
    ("fwd", 0, 8, ("bfloat16",), None),
])
def test_rmsnorm_cached_layout(direction, C, E, dtypes, expect):
    got = rmsnorm.cached_layout(direction, C, E, dtypes)
    assert got == expect
    if got is not None:
        threads, K = got
        assert threads % 32 == 0 and threads * K * E >= C


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 17, 32])
def test_sinkhorn_history_is_two_slots_per_row_of_a_lane(n):
    g = sinkhorn.bwd_group(n)
    assert sinkhorn.history_slots(n) == 2 * -(-n // g)


def test_sinkhorn_history_of_n4_fits_one_wave_on_an_h200():
    """At n = 4, 20 iterations, 32768 tokens every block is resident at once
    (228 KB of shared memory per SM, 132 SMs): the layout that recorded every
    column in every lane needed a second wave."""
    threads, smem, scratch = sinkhorn.bwd_history(4, 32768, 20, "unrolled")
    assert scratch == 0 and smem > 0
    blocks = -(-32768 * sinkhorn.bwd_group(4) // threads)
    per_sm = (228 * 1024) // (smem + 1024)  # 1 KB reserved per block
    assert blocks <= per_sm * 132


def test_rmsnorm_bwd_static_shared_memory_matches_the_kernels():
    """The weighted backward's C limit counts the kernels' static shared memory
    (``rmsnorm._BWD_STATIC_SMEM``): it must be what kernels_cu/rmsnorm.cu declares."""
    import re

    from mhc_cupy import _sources

    src = _sources.load_source("rmsnorm.cu")
    bodies = re.findall(r"__global__ void mhc_rmsnorm_bwd\w*\(.*?(?=\ntemplate|\Z)", src, re.S)
    assert len(bodies) == 2
    for body in bodies:
        arrays = re.findall(r"(?<!extern )__shared__ float \w+\[([0-9 *]+)\];", body)
        assert arrays and sum(4 * eval(a) for a in arrays) == rmsnorm._BWD_STATIC_SMEM


def test_rmsnorm_bwd_weight_limit_leaves_room_for_static_shared_memory():
    """C floats of dynamic shared memory plus the static ones fit in 227 KiB (an H100 /
    H200 block): the largest C is accepted, one more is a clear ValueError (it used to
    reach cuFuncSetAttribute and fail there with CUDA_ERROR_INVALID_VALUE)."""
    import numpy as np

    import mhc_cupy as m

    C = (227 * 1024 - rmsnorm._BWD_STATIC_SMEM) // 4
    assert C * 4 + rmsnorm._BWD_STATIC_SMEM <= 227 * 1024
    ones = np.ones((1, C), np.float32)
    dx, dw = m.rmsnorm_bwd(ones, ones, 1e-5, np.ones(C, np.float32))
    assert dx.shape == (1, C) and dw.shape == (C,)
    ones = np.ones((1, C + 1), np.float32)
    with pytest.raises(ValueError, match=rf"supports C <= {C}; x has C = {C + 1}"):
        m.rmsnorm_bwd(ones, ones, 1e-5, np.ones(C + 1, np.float32))
