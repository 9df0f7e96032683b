"""mhc_stream_aggregate_out_kernel (kernels_cu/stream.cu: layer_in for the next GEMM, OPS.md section 13)
emulated on the CPU thread by thread (scripts/emulate_layer_in.py) on the launches the real plans of
mhc_layer_pre_norm_fwd / mhc_layer_pre_fp8_fwd make: its index maths, kept row, reductions, to_e4m3 and
writes against the references, without a GPU.  Also checks that the emulation catches a wrong kept-row
cell, a truncating e4m3 rounding and an amax that drops NaN (it has teeth)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mhc_cupy import _reference_layer_in as rli
from mhc_cupy.ops import layer_in

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "emulate_layer_in.py"
_spec = importlib.util.spec_from_file_location("emulate_layer_in", _PATH)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN / inf inputs, as in the kernel


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("case", emu.CASES, ids=lambda c: "-".join(map(str, c)))
def test_emulated_kernel_matches_references(monkeypatch, case, keep):
    """Every case with the row kept in shared memory and recomputed from x (KEEP_MAX_BYTES 0)."""
    if not keep:
        monkeypatch.setattr(layer_in, "KEEP_MAX_BYTES", 0)
    emu.check(*case)


@pytest.mark.parametrize("op", ["mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"])
def test_sum_of_squares_overflow_and_grid_stride(op):
    """|x| ~ 1e20: the float32 sum of squares overflows and is summed again scaled; two blocks for five
    tokens: each block's later tokens restage s_h (a stale read would fail)."""
    emu.check(op, 3, 4, 72, "float32", True, scale=1e20)
    emu.check(op, 5, 3, 40, "bfloat16", True, blocks=2)


def test_long_rows_are_recomputed_not_kept():
    """C = 16384 bf16 is the longest kept row (32 KiB); one more element and the passes recompute."""
    assert layer_in.keeps_row(16384, "bfloat16") and not layer_in.keeps_row(16385, "bfloat16")
    assert layer_in.keeps_row(8192, "float32") and not layer_in.keeps_row(8193, "float32")
    _, _, _, _, a, _ = emu.plan_launch("mhc_layer_pre_fp8_fwd", emu.make_inputs(1, 1, 16392, "bfloat16", norm=False),
                                       np.ones((1, 1), np.float32))
    assert a["keep"] == 0


def _bits_patterns():
    """float32 bit patterns: every high half (sign, exponent, 7 mantissa bits) with low halves at and
    around the e4m3 rounding points (a half ulp of e4m3 normals is bit 19) and some random ones."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], np.uint32)
    normal_ties = np.array([(1 << 19) - 1, 1 << 19, (1 << 19) + 1, (1 << 20) - 1, 0xFFFFF], np.uint32)
    rng = np.random.default_rng(0)
    parts = [(hi[:, None] | lows).ravel(), (hi[:, None] & ~np.uint32(0xFFFFF) | normal_ties).ravel(),
             rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)]
    return np.concatenate(parts)


def test_to_e4m3_is_ml_dtypes_cast_saturated():
    """The kernel's integer to_e4m3 (as emulated) equals ml_dtypes' float8_e4m3fn cast of the value clipped
    to +-448 for every float32 pattern tried (including every subnormal rounding tie): nearest even,
    saturating, NaN kept (with its sign)."""
    f = _bits_patterns().view(np.float32)
    got = emu.to_e4m3_bits(f)
    want = rli.to_e4m3(f).view(np.uint8)
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(got[nan], np.where(np.signbit(f[nan]), 0xFF, 0x7F).astype(np.uint8))
    # the ties of the subnormal range (multiples of 2^-10) and of the normal range go to even
    ties = (np.arange(1, 17) * 2.0**-10).astype(np.float32)
    assert np.array_equal(emu.to_e4m3_bits(ties), ties.astype(F8).view(np.uint8))
    edge = np.array([447.9, 448, 463.9, 464, 465, 1e30, np.inf, -np.inf, 2.0**-6, 2.0**-6 * (1 - 2**-4)], np.float32)
    assert np.array_equal(emu.to_e4m3_bits(edge), rli.to_e4m3(edge).view(np.uint8))
    assert rli.to_e4m3(np.float32(np.inf)).astype(np.float32) == 448


@pytest.mark.parametrize("op,norm", [("mhc_layer_pre_fp8_fwd", False), ("mhc_layer_pre_fp8_fwd", True),
                                     ("mhc_layer_pre_norm_fwd", True)])
def test_nan_zero_and_inf_rows(op, norm):
    """Token 0 holds a NaN, token 1 is zero, token 2 an inf: the emulated kernel as the reference (bitwise),
    and the documented policy: a NaN row has rstd / scale NaN and every output NaN; a zero row scale 1
    (rstd 1/sqrt(eps)) and zeros; an inf row rstd 0 or scale inf, NaN at the inf and 0 elsewhere (the
    quantised RMSNorm of it: a row holding a NaN)."""
    _, (row, stat) = emu.check(op, 3, 2, 24, "float32", norm, special=True)
    fp8 = op.endswith("fp8_fwd")
    vals = row.view(F8).astype(np.float32) if fp8 else row
    assert np.isnan(stat[0]) and np.isnan(vals[0]).all()
    assert stat[1] == (1 if fp8 else np.float32(1 / np.sqrt(np.float32(1e-6)))) and (vals[1] == 0).all()
    if fp8 and norm:
        assert np.isnan(stat[2]) and np.isnan(vals[2]).all()
    else:
        assert stat[2] == (np.inf if fp8 else 0) and np.isnan(vals[2, 0]) and (vals[2, 1:] == 0).all()


@pytest.mark.parametrize("fault,caught", [("keep_cell_without_e", "two stores to one s_row cell"),
                                          ("e4m3_truncates", "q differs in bits"),
                                          ("amax_drops_nan", "q differs in bits")])
def test_emulation_catches_faults(monkeypatch, fault, caught):
    """Each fault is one wrong line a kernel edit could make; the emulation must reject it."""
    special = False
    if fault == "keep_cell_without_e":
        monkeypatch.setattr(emu, "keep_cell", lambda e, vi, V: vi + 0 * e)
        case = ("mhc_layer_pre_fp8_fwd", 3, 4, 1000, "float16", True, False)  # E = 8
    elif fault == "e4m3_truncates":
        real = emu.to_e4m3_bits
        monkeypatch.setattr(emu, "to_e4m3_bits", lambda f: real(
            (np.asarray(f, np.float32).view(np.uint32) & ~np.uint32(0xFFFFF)).view(np.float32)))
        case = ("mhc_layer_pre_fp8_fwd", 3, 4, 72, "float32", False, False)
    else:
        monkeypatch.setattr(emu, "amax_of", lambda a, b: np.fmax(a, b).astype(np.float32))
        case, special = ("mhc_layer_pre_fp8_fwd", 3, 2, 24, "float32", False, False), True
    with pytest.raises(emu.EmulationError, match=caught):
        emu.check(*case, special=special)


@pytest.mark.parametrize("n,C,dt", [(1, 24, "float32"), (3, 4096, "float32"), (4, 4096, "float32"),
                                    (4, 1000, "bfloat16"), (8, 72, "float16")])
def test_fp8_of_the_normed_row_quantises_the_norm_ops_bits(n, C, dt):
    """mhc_layer_pre_fp8_fwd with norm_weight quantises the row mhc_layer_pre_norm_fwd returns, bit for bit:
    both launches take the same vector width, so the sum of squares has one order and rstd one value.  The
    float8 output's 1-byte elements had allowed twice the width (float32 x: E 8 against 4), and the H200
    found scales one float32 unit off the quantised normed row's."""
    inp = emu.make_inputs(3, n, C, dt, seed=n + C)
    norm_outs, norm_targs, *_, (_, rstd_norm) = emu.plan_launch("mhc_layer_pre_norm_fwd", inp, inp["H_pre"])
    fp8_outs, fp8_targs, *_, (_, rstd_fp8) = emu.plan_launch("mhc_layer_pre_fp8_fwd", inp, inp["H_pre"])
    assert norm_targs[2] == fp8_targs[2], "vector width E"
    assert np.array_equal(rstd_norm.view(np.uint32), rstd_fp8.view(np.uint32))
    normed = norm_outs[0].a.reshape(3, C).astype(np.float32)
    q, scale = rli.quantise_e4m3(normed)
    assert np.array_equal(fp8_outs[1].a.reshape(3), scale[:, 0])
    assert np.array_equal(fp8_outs[0].a.reshape(3, C).view(np.uint8), q.view(np.uint8))
