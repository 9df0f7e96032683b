"""Launch layouts chosen on the host (no GPU needed): RMSNorm's kernel and block per row
width (register-cached or two-pass), the Sinkhorn backward's shared-memory history, and the
typed launch descriptions (ops._launch.KernelSpec) against the kernels they describe."""

from __future__ import annotations

import pytest

from mhc_cupy.ops import rmsnorm, sinkhorn


@pytest.mark.parametrize("direction,C,E,dtypes,expect", [
    ("fwd", 4096, 8, ("bfloat16",), (256, 2)),
    ("bwd", 4096, 8, ("bfloat16", "bfloat16"), (512, 1)),
    ("fwd", 8184, 8, ("bfloat16",), (512, 2)),  # 1023 vectors: the widest cached row
    ("bwd", 8184, 8, ("bfloat16", "float32"), (512, 2)),  # K = 1 would need 1024 threads
    ("fwd", 8192, 8, ("bfloat16",), None),  # 1024 vectors: two-pass
    ("bwd", 10240, 8, ("bfloat16", "bfloat16"), None),
    ("fwd", 28672, 8, ("bfloat16",), None),
    ("bwd", 57352, 8, ("bfloat16", "bfloat16"), None),
    ("fwd", 1023, 1, ("float32",), (512, 2)),
    ("fwd", 1024, 1, ("float32",), None),
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


@pytest.mark.parametrize("direction,C,E,expect", [
    ("fwd", 8192, 8, 256),  # 1024 vectors, 4 a thread
    ("fwd", 10240, 8, 320),
    ("fwd", 28672, 8, 896),
    ("fwd", 32768, 8, 1024),
    ("fwd", 57352, 8, 1024),  # 7169 vectors: at most 1024 threads
    ("bwd", 8192, 8, 1024),
    ("fwd", 16383, 1, 1024),
    ("fwd", 4096, 8, 256),  # rows under 1024 vectors (those of the general path, E = 1): threads_for
    ("bwd", 1023, 1, 256),
    ("fwd", 33, 1, 64),
])
def test_rmsnorm_two_pass_threads(direction, C, E, expect):
    assert rmsnorm.two_pass_threads(direction, C, E) == expect


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
    kernels = re.findall(r"__global__ void mhc_rmsnorm_bwd\w*\(.*?(?=\ntemplate|\Z)", src, re.S)
    assert len(kernels) == 2 and all("bwd_rows<" in k for k in kernels)  # their body, which declares it
    body = re.search(r"void bwd_rows\(.*?(?=\ntemplate|\n}  // namespace)", src, re.S).group(0)
    arrays = re.findall(r"(?<!extern )__shared__ float \w+\[([0-9 *]+)\];", body)
    assert arrays and sum(4 * eval(a) for a in arrays) == rmsnorm._BWD_STATIC_SMEM


def test_rmsnorm_bwd_weight_limit_leaves_room_for_static_shared_memory():
    """C floats of dynamic shared memory plus the static ones fit in 227 KiB (an H100 /
    H200 block): the largest C is accepted, one more is a clear ValueError from the planner of a
    GPU call (it used to reach cuFuncSetAttribute and fail there with CUDA_ERROR_INVALID_VALUE);
    the CPU reference takes both (OPS.md section 2)."""
    import numpy as np

    import mhc_cupy as m

    C = (227 * 1024 - rmsnorm._BWD_STATIC_SMEM) // 4
    assert C * 4 + rmsnorm._BWD_STATIC_SMEM <= 227 * 1024
    for c in (C, C + 1):
        ones = np.ones((1, c), np.float32)
        dx, dw = m.rmsnorm_bwd(ones, ones, 1e-5, np.ones(c, np.float32))
        assert dx.shape == (1, c) and dw.shape == (c,)
    gpu, params = ("cuda", 0), m.ops.SPECS["rmsnorm_bwd"].params  # whatever parameters rmsnorm takes
    for c in (C, C + 1):
        x = m._interop.ArrayInfo((1, c), "float32", gpu, 1 << 20, (c, 1))
        w = m._interop.ArrayInfo((c,), "float32", gpu, 1 << 20, (1,))
        if c == C:
            rmsnorm._plan_bwd({"grad": x, "x": x, "weight": w}, **params)
        else:
            with pytest.raises(ValueError, match=rf"supports C <= {C}; x has C = {C + 1}"):
                rmsnorm._plan_bwd({"grad": x, "x": x, "weight": w}, **params)


def test_every_plan_launches_with_any_optional_inputs_absent_and_any_token_count():
    """Every op plan, each subset of its optional inputs absent (dry_launches only tries all or
    none), tokens 0 / 1 / 300 / 70000, n 1 / 4 / 32, shared inputs, both grad dtypes: planning
    and launching (on fake pointers, no GPU) raise nothing.  Compared against 6480eb2 on 80,000
    random such cases with distinct pointers per buffer, the launches were identical (review3)."""
    import itertools

    from mhc_cupy import _jit, _kernels
    from mhc_cupy._kernel_choice import kernel_choice
    from mhc_cupy.ops import SPECS, coeffs

    count = 0
    for k in SPECS.values():
        optional = [a.name for a in k.args if a.optional]
        subsets = [s for r in range(len(optional) + 1) for s in itertools.combinations(optional, r)]
        shared = (False, True) if k.shared and k.shared_mode == "expand" else (False,)
        for absent, sh, n, lead, (dt, tg) in itertools.product(
                subsets, shared, (1, 4, 32), ((0,), (1,), (300,), (70000,)),
                (("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32"))):
            infos = _kernels._infos(k, lead, {"n": n, "C": 33, "K": coeffs.columns(n)}, dt, tg,
                                    _kernels._MISALIGNED, sh)
            infos.update(dict.fromkeys(absent))
            if infos.get("layer_out") is not None and infos.get("grad_out") is None:
                continue  # (a ValueError: layer_out's sums are over grad_out; tests/test_boundary_bwd.py)
            with _jit.dry_run() as launches, kernel_choice(layer_in=True, boundary_bwd=True):  # (opt-in kernels)
                plan = k.planner(infos, **k.params)
                if not plan.empty:
                    plan.launch({a: (None if v is None else v.ptr) for a, v in infos.items()},
                                [_kernels._ALIGNED] * len(plan.outputs), [_kernels._ALIGNED] * len(plan.scratch), 0)
            assert plan.empty == (not launches), (k.name, absent, lead)
            count += 1
    assert count > 1000


@pytest.mark.parametrize("kind,types,C,E", [("fwd", "__nv_bfloat16", 28672, 8), ("bwd", "__nv_bfloat16,float", 16384, 8),
                                            ("fwd", "__nv_bfloat16", 4096, 8)])  # the last: cached (256, 2)
def test_rmsnorm_blocks_within_the_compiled_kernels_limit(monkeypatch, kind, types, C, E):
    """A kernel compiled with more registers than the chosen block allows (another GPU, another
    compiler) gets the block it can launch: the two-pass kernels' is clamped, and a cached
    layout that does not fit falls back to the two-pass kernel."""
    from mhc_cupy import _jit

    monkeypatch.setattr(_jit, "max_threads", lambda f, expr: 128)
    layout = rmsnorm.cached_layout(kind, C, E, ("bfloat16",) if kind == "fwd" else ("bfloat16", "float32"))
    expr, threads = rmsnorm._kernel(kind, types, E, C, False, layout)
    assert threads == 128 and "_cached_" not in expr
    monkeypatch.setattr(_jit, "max_threads", lambda f, expr: 1024)
    assert rmsnorm._kernel(kind, types, E, C, False, layout)[1] == (
        layout[0] if layout else rmsnorm.two_pass_threads(kind, C, E))


# ------------------------------------------------------------------ typed launch descriptions
_GLOBAL = (r"(?:template\s*<([^>]*)>\s*)?__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?"
           r"(\w+)\s*\(([^)]*)\)")


def _kernels_declared() -> dict:
    """{kernel name: (file, template declarations, parameter declarations)} of every __global__
    function in kernels_cu/, as KernelSpec normalises declarations."""
    import re

    from mhc_cupy import _sources
    from mhc_cupy.ops._launch import _decls

    out = {}
    for f in _sources.kernel_files():
        text = re.sub(r"//[^\n]*", "", (_sources.kernel_dir() / f).read_text())
        for template, name, params in re.findall(_GLOBAL, text):
            out[name] = (f, _decls(template), _decls(params))
    return out


def test_kernel_specs_are_the_kernels_declarations():
    """Every kernel of the coefficient path's units (coeffs_*.cu, head.cu) has a KernelSpec whose file,
    template parameters (kinds, names, order) and parameters (C types, names, order) are the
    kernel's own: a launch packs its arguments in the kernel's order with the kernel's widths."""
    import mhc_cupy.ops  # noqa: F401 - declares every KernelSpec
    from mhc_cupy.ops._launch import KERNEL_SPECS

    declared = _kernels_declared()
    units = {k for k, (f, *_) in declared.items() if f.startswith("coeffs_") or f == "head.cu"}
    assert len(units) == 21 and units <= set(KERNEL_SPECS), sorted(units - set(KERNEL_SPECS))
    for name, spec in KERNEL_SPECS.items():
        assert (spec.file, spec.template, spec.params) == declared[name], name


def test_kernel_spec_refuses_bad_launches():
    """Arguments by name: a missing, unknown or mis-typed one (or template parameter) is a Python
    error naming it, before anything reaches the GPU."""
    from mhc_cupy import _jit
    from mhc_cupy.ops.coeffs import bwd, fwd

    k = fwd.MMA_FWD.bind(T="bfloat16", VEC=True, MT=2, NTILE=3, STAGES=2, SUB=2)
    assert k.expr == "mhc_coeffs_mma_fwd_kernel<__nv_bfloat16,true,2,3,2,2>" and k.smem == 2 * 2 * (8192 + 4608)
    args = dict(x=1 << 20, planes=1 << 21, part=1 << 22, tokens=5, D=64, Dp=64, K=24, Kp=24, ncc=1, tiles=1, d_split=64)
    with _jit.dry_run() as launches:
        k.launch((1, 1, 1), (128, 1, 1), 0, **args)
    assert launches[0][1] == k.expr and launches[0][5] == k.smem
    assert [type(a).__name__ for a in launches[0][4]][3:6] == ["int64", "int32", "int32"]
    missing = {a: v for a, v in args.items() if a != "d_split"}
    for bad, exc, match in [(missing, TypeError, r"missing \['d_split'\]"),
                            ({**args, "extra": 1}, TypeError, r"unknown \['extra'\]"),
                            ({**args, "K": 24.0}, TypeError, "argument K is 24.0"),
                            ({**args, "K": True}, TypeError, "argument K is True"),
                            ({**args, "x": None}, TypeError, "argument x is None"),
                            ({**args, "D": 2**31}, ValueError, "D = 2147483648 does not fit"),
                            ({**args, "planes": -1}, TypeError, "argument planes is -1")]:
        with pytest.raises(exc, match=match):
            k.launch((1, 1, 1), (128, 1, 1), 0, **bad)
    with pytest.raises(TypeError, match="missing .'SUB'."):
        fwd.MMA_FWD.bind(T="bfloat16", VEC=True, MT=2, NTILE=3, STAGES=2)
    with pytest.raises(TypeError, match="template parameter VEC is 1; it needs a bool"):
        fwd.MMA_FWD.bind(T="bfloat16", VEC=1, MT=2, NTILE=3, STAGES=2, SUB=2)
    with pytest.raises(TypeError, match="template parameter T is 'float64'"):
        fwd.MMA_FWD.bind(T="float64", VEC=True, MT=2, NTILE=3, STAGES=2, SUB=2)
    with _jit.dry_run() as launches:  # nullable pointers may be None; a kernel argument may be called count
        bwd.PREP.launch((1, 1, 1), (256, 1, 1), 0, part=1 << 20, g_pre=None, g_post=None, g_res=None, alpha=1 << 21,
                        dH=1 << 22, qa=1 << 23, tokens=3, D=8, n=2, K=8, KP=12, splits=1, eps=1e-5)
        bwd.ZERO.launch_grid_stride(10, 0, out=1 << 20, count=10)
    assert launches[0][4][1] is None and type(launches[0][4][-1]).__name__ == "float32"
    assert launches[1][1:4] == ("mhc_coeffs_zero_kernel", (1, 1, 1), (256, 1, 1))


def test_launch_shared_memory_is_what_the_kernels_lay_out():
    """For every launch with dynamic shared memory that the op plans make over n 1-32 (dtypes,
    alignments, gradient dtypes, with and without wgmma), the bytes allocated (KernelSpec.smem) equal
    the kernel's own constexpr size (mhc_coeffs::*_smem, which each kernel static_asserts its layout
    against), checked by compiling one static_assert per specialisation with NVRTC."""
    from mhc_cupy import _jit, _kernels, _nvrtc, _sources
    from mhc_cupy.ops._launch import KERNEL_SPECS

    try:
        _nvrtc.version()
    except _nvrtc.NVRTCNotFoundError as exc:
        pytest.skip(f"libnvrtc not available: {exc}")
    checks: dict = {}
    for f, expr, _, _, _, smem in _kernels.dry_launches(ns=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 17, 32)):
        spec = KERNEL_SPECS.get(expr.split("<")[0])
        if spec is None or spec.smem_cxx is None:
            assert smem == 0 or spec is None, expr
            continue
        checks.setdefault(f, {})[f"{spec.smem_cxx}{expr[len(spec.name):]}()"] = smem
    assert sum(map(len, checks.values())) > 150, checks.keys()
    for f, sizes in checks.items():
        asserts = "\n".join(f'static_assert({e} == {v}, "{e}: the launch allocates {v} bytes");'
                            for e, v in sizes.items())
        _nvrtc.compile(_sources.load_source(f) + asserts, f, [], arch="sm_80", options=_jit.NVRTC_OPTIONS)


def test_every_launch_within_the_device_limits_at_the_largest_shapes():
    """Every launch the op plans make (every op spec, its optional inputs all given and all absent,
    both grad modes and conventions, the opt-in kernel variants, aligned and misaligned pointers, with
    and without wgmma) at 4M tokens (n 1 / 4 / 5 / 32, C 7 / 65536: 2^22 x 32 x 65536 is far past any
    memory; planning allocates nothing) and at the coefficient path's largest vec(x), n * C = 2^30:
    grid x within 2^31 - 1, y and z within 65535, at most 1024 threads a block, dynamic shared
    memory within an H100 / H200 block's 227 KiB.  (A sweep over tokens 1 to 2^22, n 1 to 32,
    C 1 to 65536 and C up to 2^31 - 1, 7.2 million launches, found none outside, break-it pass 9.)"""
    import itertools

    from mhc_cupy import _jit, _kernels
    from mhc_cupy._kernel_choice import kernel_choice
    from mhc_cupy.ops import SPECS, coeffs

    shapes = [(2**22, n, C) for n in (1, 4, 5, 32) for C in (7, 65536)] + [(3, 4, 2**28), (3, 32, 2**25)]
    variants = ({}, {"small": True}, {"boundary": True}, {"layer_in": True, "boundary_bwd": True})
    count = 0
    for (T, n, C), (dt, tg), ptr, wg in itertools.product(
            shapes, (("bfloat16", "bfloat16"), ("float32", "float32")), (_kernels._ALIGNED, _kernels._MISALIGNED),
            (False, True)):
        sizes = {"n": n, "C": C, "K": coeffs.columns(n)}
        for k in SPECS.values():
            modes = ({"grad_mode": "unrolled"}, {"grad_mode": "implicit"}) if "grad_mode" in k.params else ({},)
            conventions = ({"convention": "paper"}, {"convention": "deepseek"}) if "convention" in k.params else ({},)
            absent = (False, True) if any(a.optional for a in k.args) else (False,)
            for mode, conv, ab, var in itertools.product(modes, conventions, absent, variants):
                opted = var.get("layer_in", False)  # (the variant under which the gated ops and inputs run)
                drop = () if opted else _kernels._GATED_INPUTS.get(k.name, ())
                infos = _kernels._infos(k, (T,), sizes, dt, tg, ptr, absent=ab, drop=drop)
                if k.name == "rmsnorm_bwd" and not ab:
                    continue  # a weighted row of 65536 floats is refused (test_size_limits.py)
                with _jit.dry_run() as launches, _jit.assume_wgmma(wg), kernel_choice(**var):
                    plan = k.planner(infos, **{**k.params, **mode, **conv})
                    if k.name in _kernels._GATED and not opted:
                        continue  # launches only under its kernel choice (layer_in, boundary_bwd)
                    plan.launch({a: (None if v is None else v.ptr) for a, v in infos.items()},
                                [ptr] * len(plan.outputs), [ptr] * len(plan.scratch), 0)
                for _, expr, grid, block, _, smem in launches:
                    assert 1 <= grid[0] <= 2**31 - 1 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535, (
                        k.name, T, n, C, expr, grid)
                    assert block[0] * block[1] * block[2] <= 1024 and block[2] <= 64, (k.name, expr, block)
                    assert 0 <= smem <= 227 * 1024, (k.name, T, n, C, expr, smem)
                    count += 1
    assert count > 50_000
