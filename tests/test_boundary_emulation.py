"""mhc_boundary_fwd_kernel (kernels_cu/boundary.cu) emulated on the CPU thread by thread
(scripts/emulate_boundary.py): its index maths, shared-memory layout, swizzle, pipeline, MMA
fragments and epilogue against the references, without a GPU.  Also checks that the emulation
catches a wrong swizzle, a wrong A fragment order and a too shallow cp.async wait (it has teeth)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "emulate_boundary.py"
_spec = importlib.util.spec_from_file_location("emulate_boundary", _PATH)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)


@pytest.mark.parametrize("case", emu.CASES, ids=lambda c: "-".join(map(str, c)))
def test_emulated_kernel_matches_references(case):
    worst = emu.check(*case)
    assert worst["H_total"] < 1e-6 and worst["sumsq_total"] < 1e-6


@pytest.mark.parametrize("dt", sorted(emu.NP_DTYPE))
@pytest.mark.parametrize("n", [1, 3, 6])
def test_host_pipelines(dt, n):
    """The (STAGES, SUB) that boundary_pipeline picks for the portable and the sm_90 shared memory."""
    from mhc_cupy.ops.boundary import _SMEM_SM90, boundary_layout, boundary_pipeline
    from mhc_cupy.ops.coeffs.common import _SMEM_PORTABLE

    T, C = 65, 72
    pipes = {boundary_pipeline(dt, n, boundary_layout(T, n, C).ntile, lim) for lim in (_SMEM_PORTABLE, _SMEM_SM90)}
    for pipe in pipes - {None}:
        emu.check(T, n, C, dt, n % 2 == 0, *pipe)


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_sum_of_squares_overflow_saves_the_scaled_sum(dt):
    x, y, hp, hr, phi = emu.make_inputs(65, 2, 72, dt, seed=1, scale=1e20)
    _, part, _ = emu.emulate(x, y, hp, hr, phi, res_t=False, stages=2, sub=2 if dt != "float32" else 1)
    assert (part[:, :, -1] < 0).all()  # every token's float32 sum overflowed: minus the scaled sum
    emu.check(65, 2, 72, dt, stages=2, sub=1, seed=1, scale=1e20)


def test_fmaf_rounds_once():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 tie; + 2^-80 is lost in a float64 sum (which
    # then rounds to even, down), but the exact value is above the tie: fmaf rounds up
    a, tiny = np.float32(1 + 2 ** -12), np.float32(2 ** -80)
    assert float(np.float32(np.float64(a) * np.float64(a) + np.float64(tiny))) == 1 + 2 ** -11  # double rounding
    assert float(emu.fmaf(a, a, tiny)) == 1 + 2 ** -11 + 2 ** -23
    assert float(emu.fmaf(a, a, -tiny)) == 1 + 2 ** -11
    assert float(emu.fmaf(-a, a, tiny)) == -(1 + 2 ** -11)
    assert float(emu.fmaf(-a, a, -tiny)) == -(1 + 2 ** -11 + 2 ** -23)
    big = np.float32(2e19)
    assert np.isinf(emu.fmaf(big, big, np.float32(0)))


@pytest.mark.parametrize("fault", ["no_read_swizzle", "fill_swizzle_parity", "a_fragment_order", "shallow_wait"])
def test_emulation_catches_layout_faults(monkeypatch, fault):
    """Each fault is one wrong index a kernel edit could make; the emulation must reject it."""
    if fault == "no_read_swizzle":
        orig = emu.lane_offsets
        monkeypatch.setattr(emu, "lane_offsets", lambda sub, g, tq, SWZ, isz: orig(sub, 0 * g, tq, SWZ, isz))
    elif fault == "fill_swizzle_parity":
        monkeypatch.setattr(emu, "swizzle", lambda q, r, SWZ: q ^ (((r >> 1) & 1) * SWZ))
    elif fault == "a_fragment_order":
        monkeypatch.setattr(emu, "a_fragment", lambda aw, pa, j: np.stack(
            [aw[:, pa, 0, 2 * j], aw[:, pa, 0, 2 * j + 1], aw[:, pa, 1, 2 * j], aw[:, pa, 1, 2 * j + 1]], axis=-1))
    else:
        monkeypatch.setattr(emu, "wait_depth", lambda stages: stages - 1)
    with pytest.raises(emu.EmulationError):
        emu.check(65, 2, 72, "bfloat16", stages=3, sub=2)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3, 65])
def test_emulated_kernel_grid(T):
    """emulate_boundary.grid: every n in (1, 2, 4, 5, 6), C in (8, 24, 64, 72, 200), dtype, with
    both conventions, both pipeline depths, SUB 1 and 2, boundary_layout's splits and a wider c_split."""
    for case in emu.grid((T,)):
        emu.check(*case)
