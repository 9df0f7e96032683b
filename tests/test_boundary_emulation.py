"""mhc_boundary_fwd_kernel (kernels_cu/boundary.cu) emulated on the CPU thread by thread
(scripts/emulate_boundary.py): its index maths, x and y loads, phi's shared-memory layout, swizzle,
pipeline, MMA fragments, bf16 word packing and epilogue (with the overflow's re-sum from out) against
the references, without a GPU.  Also checks that the emulation catches each injected fault (it has
teeth): a wrong swizzle, lane channel, word packing or A fragment order, a too shallow cp.async wait,
a re-sum in another order or for the wrong lanes, a read-back of another thread's out."""

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


def _big_rows(dt, seed=2):
    """Inputs at T 65, n 2, C 72 whose tokens t % 3 == 0 have out ~ 2.2e18 everywhere: in split 0
    (64 channels) each lane's 32 squares stay finite in float32 (1.6e38), two lanes' too (3.2e38),
    the quad's overflow (6.4e38): the re-sum must run for every lane of the quad."""
    x, y, hp, hr, phi = emu.make_inputs(65, 2, 72, dt, seed=seed)
    x[::3] = np.asarray(2.236e18, x.dtype)  # H_res rows sum to 1 (paper convention): out_i ~ x
    y[::3] = 0
    return x, y, hp, hr, phi


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_overflow_of_the_quad_sum_alone_resums_every_lane(dt):
    x, y, hp, hr, phi = _big_rows(dt)
    out, part, lay = emu.emulate(x, y, hp, hr, phi, res_t=False, stages=3, sub=1)
    assert lay["c_split"] == 64 and lay["splits"] == 2
    sq = out[::3, :, :64].astype(np.float64) ** 2  # the premise: per lane (tq) finite, per quad inf
    lanes = sq.reshape(sq.shape[0], 2, 2, 4, 8).sum((1, 2, 4))  # [token, tq] over (stream, unit, e)
    big = float(np.finfo(np.float32).max)
    assert (lanes.max(1) < big).all() and (lanes[:, :2].sum(1) < big).all() and (lanes.sum(1) > big).all()
    over = np.zeros(65, bool)
    over[::3] = True
    assert ((part[0, :, -1] < 0) == over).all() and (part[1, :, -1] > 0).all()  # split 1: 16 squares, finite
    emu.check_arrays(x, y, hp, hr, phi, stages=3, sub=1)


def test_global_memory_checks_catch_a_foreign_read_back_and_a_load_across_rows():
    """out read back by a thread that did not store it; an 8-element float32 load (two 16-byte
    loads, each inside a row) that crosses a row."""
    out = emu.Global("out", np.zeros(64, np.float32), row=32)
    out.write(np.array([0]), np.ones((1, 4), np.float32), 4, np.array([5]))
    assert out.read_back(np.array([3]), np.array([5]), "test") == 1
    with pytest.raises(emu.EmulationError, match="not stored by the reading thread"):
        out.read_back(np.array([3]), np.array([6]), "test")
    with pytest.raises(emu.EmulationError, match="crosses a row"):
        out.load(np.array([28]), 8, "test")


def _swap_halves(lo, hi):
    return np.asarray(hi, np.uint32) | (np.asarray(lo, np.uint32) << 16)


_H = r"^H(_total)?: relative error"
_FAULTS = {  # fault: (hook, replacement(original), the check that must catch it at 65 x 2 x 72, sub 2)
    "no_read_swizzle": ("lane_offsets", lambda f: lambda s, sub, SUB, g, tq, SWZ: f(s, sub, SUB, 0 * g, tq, SWZ), _H),
    "fill_swizzle_parity": ("swizzle", lambda f: lambda q, kk, SWZ: q ^ (((kk >> 1) & 1) * SWZ), _H),
    "lane_channel_without_sub": ("lane_offsets", lambda f: lambda s, sub, SUB, g, tq, SWZ: (
        f(s, sub, SUB, g, tq, SWZ)[0], s * SUB * 32 + tq * 8), "an x element not loaded exactly once"),
    "a_fragment_order": ("a_fragment", lambda f: lambda aw, pa, j: np.stack(
        [aw[:, pa, 0, 2 * j], aw[:, pa, 0, 2 * j + 1], aw[:, pa, 1, 2 * j], aw[:, pa, 1, 2 * j + 1]], axis=-1), _H),
    "word_halves_swapped": ("pack2", lambda f: _swap_halves, None),  # bf16: out's bits; float16: H
    "shallow_wait": ("wait_depth", lambda f: lambda stages: stages - 1, "in flight"),
}


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("fault", sorted(_FAULTS))
def test_emulation_catches_layout_faults(monkeypatch, fault, dt):
    """Each fault is one wrong index a kernel edit could make; the emulation must reject it, by the
    check named (bf16 and float16 take different paths: one conversion for every stream, or one stream
    at a time)."""
    hook, fake, check = _FAULTS[fault]
    if check is None:
        check = "out differs in bits" if dt == "bfloat16" else _H
    emu.check(65, 2, 72, dt, stages=3, sub=2)  # the case passes without the fault
    monkeypatch.setattr(emu, hook, fake(getattr(emu, hook)))
    with pytest.raises(emu.EmulationError, match=check):
        emu.check(65, 2, 72, dt, stages=3, sub=2)


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("fault", ["resum_in_the_other_order", "resum_where_the_lane_overflowed"])
def test_emulation_catches_overflow_faults(monkeypatch, fault, dt):
    """The epilogue's re-sum in the other order of (stream, channel) than ss (caught by the bitwise
    comparison with ss's order), or only for lanes whose own sum is inf (part's scaled sum short)."""
    if fault == "resum_in_the_other_order":  # (random values: equal ones sum alike in any order)
        args = emu.make_inputs(65, 2, 72, dt, seed=1, scale=1e20)
        orig = emu.resum_order
        hook, fake, check = "resum_order", lambda P, N: orig(2 if P == 1 else 1, N), "re-sum differs in bits"
    else:
        args = _big_rows(dt)
        hook, fake, check = "overflowed", lambda s_quad, s_lane: np.isinf(s_lane), r"^sumsq(_total)?: relative error"
    emu.check_arrays(*args, stages=3, sub=1)  # the case passes without the fault
    monkeypatch.setattr(emu, hook, fake)
    with pytest.raises(emu.EmulationError, match=check):
        emu.check_arrays(*args, stages=3, sub=1)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3, 65])
def test_emulated_kernel_grid(T):
    """emulate_boundary.grid: every n in (1, 2, 4, 5, 6), C in (8, 24, 64, 72, 200), dtype, with
    both conventions, both pipeline depths, SUB 1 and 2, boundary_layout's splits and a wider c_split."""
    for case in emu.grid((T,)):
        emu.check(*case)


def _host_launches(T, n, C, dt, convention, wgmma):
    """The launches mhc_boundary_fwd's real plan makes (kernel_choice(boundary=True), _jit.dry_run, 256-byte
    aligned fake pointers) as [(kernel name, template args, grid, args by name)], the plan's scratch
    {name: (size, pointer)}."""
    from mhc_cupy import _jit
    from mhc_cupy._interop import ArrayInfo
    from mhc_cupy._kernel_choice import kernel_choice
    from mhc_cupy._settings import LayerSettings
    from mhc_cupy.ops import SPECS
    from mhc_cupy.ops.boundary import BOUNDARY_FWD
    from mhc_cupy.ops.coeffs.fwd import SPLIT_PHI_FWD
    from mhc_cupy.ops.spec import shape_of

    spec = SPECS["mhc_boundary_fwd"]
    ptr = iter(range(1 << 32, 1 << 48, 1 << 32))
    sizes = {"n": n, "C": C, "K": n * n + 2 * n}
    infos = {a.name: ArrayInfo(shape_of(a, (T,), sizes), dt if a.kind == "activation" else "float32", ("cuda", 0),
                               next(ptr), None) for a in spec.args}
    with kernel_choice(boundary=True), _jit.assume_wgmma(wgmma), _jit.dry_run() as launches:
        plan = spec.planner(infos, settings=LayerSettings.resolve(convention))
        outs = [next(ptr) for _ in plan.outputs]
        scratch = {name: (int(np.prod(shape)), next(ptr)) for name, (shape, _) in plan.scratch.items()}
        plan.launch({k: v.ptr for k, v in infos.items()}, outs, [p for _, p in scratch.values()], 0)
    params = {"mhc_boundary_fwd_kernel": BOUNDARY_FWD.params, "mhc_coeffs_split_phi_fwd_kernel": SPLIT_PHI_FWD.params}
    ran = []
    for _, expr, grid, _, args, _ in launches:
        name = expr.split("<")[0]
        targs = [s.strip() for s in expr.split("<", 1)[1].rstrip(">").split(",")] if "<" in expr else []
        ran.append((name, targs, tuple(grid), dict(zip([p for _, p in params[name]], args)) if name in params else {}))
    return ran, scratch, {k: v.ptr for k, v in infos.items()}, outs


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("T,n,C,dt,convention", [(3, 2, 24, "float16", "deepseek"), (65, 4, 200, "bfloat16", "paper"),
                                                 (65, 5, 72, "float32", "deepseek"), (1, 1, 8, "bfloat16", "paper"),
                                                 (3, 4, 24, "float32", "paper")])
def test_emulated_launch_is_the_host_plans(T, n, C, dt, convention, wgmma):
    """emulate() rebuilds the launch from boundary_layout and its own res_t, STAGES, SUB: here the launch
    the host's real plan makes (launch_boundary_gemm, _plan_fwd) is checked against it (res_t from the
    convention, Dp, Kp, c_split, the planes and part buffers big enough and shared by the two kernels),
    then emulated with the plan's res_t, STAGES and SUB.  (A host res_t of 0 under the DeepSeek
    convention, a planes buffer sized for the other GEMM only, or split_phi's Dp off by a step passed
    every CPU test before.)"""
    from mhc_cupy.ops.boundary import _SMEM_SM90, boundary_layout, boundary_pipeline
    from mhc_cupy.ops.coeffs.common import _SMEM_PORTABLE

    ran, scratch, ptrs, outs = _host_launches(T, n, C, dt, convention, wgmma)
    by = {name: (targs, grid, args) for name, targs, grid, args in ran}
    assert "mhc_boundary_fwd_kernel" in by and "mhc_coeffs_split_phi_fwd_kernel" in by, [r[0] for r in ran]
    K = n * n + 2 * n
    b = boundary_layout(T, n, C)
    stages, sub = boundary_pipeline(dt, n, b.ntile, _SMEM_SM90 if wgmma else _SMEM_PORTABLE)
    targs, grid, a = by["mhc_boundary_fwd_kernel"]
    assert targs[1:] == [str(n), str(b.ntile), str(stages), str(sub)] and grid[0] == b.tiles * b.splits
    assert (a["tokens"], a["C"], a["Dp"], a["K"], a["tiles"], a["c_split"]) == (T, C, b.Dp, K, b.tiles, b.c_split)
    assert a["res_t"] == (convention == "deepseek")
    assert (a["x"], a["y"], a["h_post"], a["h_res"], a["out"]) == (
        ptrs["x"], ptrs["layer_out"], ptrs["H_post"], ptrs["H_res"], outs[0])
    _, _, s = by["mhc_coeffs_split_phi_fwd_kernel"]
    assert (s["phi"], s["D"], s["K"], s["Dp"], s["Kp"]) == (ptrs["phi"], n * C, K, b.Dp, b.ntile * 8)
    assert s["planes"] == a["planes"] == scratch["planes"][1] and scratch["planes"][0] >= 3 * b.ntile * 8 * b.Dp
    assert a["part"] == scratch["part"][1] and scratch["part"][0] >= b.splits * T * (K + 1)
    emu.check(T, n, C, dt, bool(a["res_t"]), stages, sub)
