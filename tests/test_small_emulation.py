"""The small-token forward's kernels, mhc_coeffs_gemv_fwd_kernel (kernels_cu/coeffs_gemv.cu) and
mhc_layer_pre_tail_kernel (kernels_cu/sinkhorn.cu), emulated on the CPU thread by thread
(scripts/emulate_small.py) on the launches the ops' real plans make under kernel_choice(small=True):
their index maths, shared-memory use, shuffles and writes against the references, without a GPU.
Also checks that the emulation catches a wrong output mapping, s_x row stride, H_res orientation,
shuffle width and shuffle mask (it has teeth)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "emulate_small.py"
_spec = importlib.util.spec_from_file_location("emulate_small", _PATH)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("case", emu.CASES, ids=lambda c: "-".join(map(str, c)))
def test_emulated_kernels_match_references(case):
    worst = emu.check(*case)
    assert worst["H"] < 1e-6 and worst["H_res"] < 1e-5


def test_gemv_layouts_of_the_cases():
    """The cases reach what gemv_layout can give: several token groups, the last partial, a partial
    last chunk of rows, one D range and many, up to GEMV_MAX_OUTS outputs a thread."""
    from mhc_cupy.ops.coeffs.fwd import gemv_layout

    lay = [(T, n * C, gemv_layout(T, n * C, n * n + 2 * n)) for _, T, n, C, *_ in emu.CASES]
    assert any(g.groups > 1 and T % g.tt for T, _, g in lay), "a partial last token group"
    assert any(g.groups > 1 and T % g.tt == 0 for T, _, g in lay)
    assert any(min(D - i * g.d_split, g.d_split) % g.rows for _, D, g in lay for i in range(g.splits)), \
        "a partial chunk of rows"
    assert any(g.d_split > g.rows for _, _, g in lay), "several chunks a range"
    assert {1, emu.GEMV_MAX_OUTS} <= {g.outs for _, _, g in lay} and min(g.splits for _, _, g in lay) == 1
    assert max(g.splits for _, _, g in lay) > 8


@pytest.mark.parametrize("T,chunks", [(1, 1), (8, 1), (64, 2)])
def test_gemv_stages_its_range_at_once_where_it_fits(T, chunks):
    """A decode-sized GEMV block (C 7168, n 4) stages its whole D range of phi in one chunk where shared memory
    holds it (each chunk a dependent HBM round trip: 32-row chunks made 4 at one token, 14 at 64 tokens), with
    the D ranges of before (the bits depend on them, not on the chunks)."""
    from mhc_cupy.ops.coeffs.fwd import _GEMV_SMEM_FLOATS, gemv_layout

    g = gemv_layout(T, 4 * 7168, 24)
    assert -(-g.d_split // g.rows) == chunks and g.rows * (24 + g.tt) <= _GEMV_SMEM_FLOATS
    assert (g.splits, g.d_split) == {1: (256, 112), 8: (256, 112), 64: (64, 448)}[T]


@pytest.mark.parametrize("n", range(1, 33))
def test_group_sum_shuffles_stay_on_the_first_g_lanes(n):
    """G = fwd_group(n), mask (1u << G) - 1 (all lanes at G = 32): every shuffle's source lane executes,
    is in the mask and is < G; each lane's sum has every lane's value exactly once."""
    assert emu.check_group_sum_lanes(n) == emu.fwd_group(n)


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", ["mhc_layer_pre_fwd", "mhc_boundary_fwd"])
def test_sum_of_squares_overflow_saves_the_scaled_sum(op, dt):
    inp = emu.make_inputs(3, 4, 72, dt, seed=1, scale=1e20)
    args = {a.name: inp[a.name] for a in emu.SPECS[op].args}
    outs, mem, ran = emu.plan_launches(op, args, "paper")
    splits = ran[0][2][0]
    part = mem[ran[0][3]["part"]].a[:splits * 3 * 25].reshape(splits, 3, 25)
    assert (part[:, :, -1] < 0).all() and (outs[-1].a.reshape(3, 25)[:, -1] < 0).all()  # minus the scaled sums
    emu.check(op, 3, 4, 72, dt, seed=1, scale=1e20)


@pytest.mark.parametrize("blocks", [1, 2])
def test_tail_grid_stride_over_tokens(blocks):
    """Fewer blocks than tokens (the host launches min(tokens, MAX_GRID)): each block's later tokens
    restage s_h and s_pre (a stale read of the previous token's would fail)."""
    emu.check("mhc_layer_pre_fwd", 5, 5, 8, "float16", True, tail_grid=blocks)


def test_fmaf_is_the_boundary_emulations():
    a, tiny = np.float32(1 + 2 ** -12), np.float32(2 ** -80)
    assert float(emu.fmaf(a, a, tiny)) == 1 + 2 ** -11 + 2 ** -23  # one rounding (a float64 sum rounds twice)


def test_tail_stages_of_the_cases():
    """The cases reach several stages of the tail's ranges (staged_split_sums), the last one partial."""
    from mhc_cupy.ops.coeffs.fwd import gemv_layout

    stages = [(gemv_layout(T, n * C, n * n + 2 * n).splits, emu.TAIL_STAGE_FLOATS // (n * n + 2 * n + 1))
              for _, T, n, C, *_ in emu.CASES]
    assert any(splits > chunk and splits % chunk for splits, chunk in stages), stages
    assert emu.TAIL_THREADS == 256 and emu.STAGE_LOADS >= 1


@pytest.mark.parametrize("fault,caught", [("output_mod_k", "s_gemv load outside"), ("sx_stride_nr", "part differs"),
                                          ("res_not_transposed", "out differs"),
                                          ("group_sum_32_lanes", "a shuffle reads a lane outside"),
                                          ("mask_drops_lane_0", "shuffle mask"),
                                          ("stage_range_stride_kw", "H~ differs from the float32 split sums")])
def test_emulation_catches_faults(monkeypatch, fault, caught):
    """Each fault is one wrong index a kernel edit could make; the emulation must reject it."""
    case = ("mhc_boundary_fwd", 3, 5, 7, "bfloat16", True)  # two D ranges, the second a partial chunk; G = 8
    if fault == "output_mod_k":
        monkeypatch.setattr(emu, "gemv_output", lambda o, KW: (o // (KW - 1), o % (KW - 1)))
    elif fault == "sx_stride_nr":
        monkeypatch.setattr(emu, "sx_index", lambda t, r, rows, nr: t * nr + r)
    elif fault == "res_not_transposed":
        monkeypatch.setattr(emu, "res_index", lambda si, j, n, res_t: si * n + j)
    elif fault == "group_sum_32_lanes":  # group_sum<32> where G = 8
        monkeypatch.setattr(emu, "group_width", lambda G: 32)
    elif fault == "stage_range_stride_kw":  # the stage's ranges K + 1 apart in part, not tokens (K + 1)
        monkeypatch.setattr(emu, "stage_source", lambda i, KW, stride, s0, t: s0 * stride + t * KW + i)
    else:
        monkeypatch.setattr(emu, "tail_mask", lambda G: (1 << G) - 2)
    with pytest.raises(emu.EmulationError, match=caught):
        emu.check(*case)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3, 64])
def test_emulated_kernels_grid(T):
    """Every 7th case of emulate_small.grid (both ops, n in (1, 2, 4, 5, 8, 16, 32), C in (7, 8, 72, 200),
    every dtype, the convention alternating), so that CI stays short; the whole grid (504 cases, minutes):
    ``python scripts/emulate_small.py --all``."""
    for case in list(emu.grid((T,)))[T % 7::7]:
        emu.check(*case)
