"""The coefficient path's launch plans (``mhc_cupy.ops.coeffs``), CPU only: the tensor-core kernels'
token / column / D layouts, which kernel each shape, dtype, alignment and device (wgmma or not) gets,
and the launches, shared memory and zero fills of plans run under ``_jit.dry_run`` (nothing compiled
or launched).  The numerics of the path are in tests/test_coeffs.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from mhc_cupy import _kernels
from mhc_cupy._interop import ArrayInfo
from mhc_cupy.ops import SPECS, coeffs
from mhc_cupy.ops.coeffs import common, fwd, split_bwd
from mhc_cupy.ops._launch import ITEMSIZE


# ------------------------------------------------------------ launch plans
def _info(shape, dtype="float32", ptr=1 << 20):
    return ArrayInfo(tuple(shape), dtype, ("cuda", 0), ptr, None)


@pytest.mark.parametrize("tokens", [1, 3, 31, 32, 33, 1000, 100_000])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (4, 1000), (4, 4096), (8, 4096), (32, 64)])
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_mma_layout_covers_everything_once(tokens, n, C, dt):
    D, K = n * C, coeffs.columns(n)
    L = coeffs.mma_layout(tokens, D, K, dt)
    step = 32 * coeffs.mma_sub(dt)
    assert step * ITEMSIZE[dt] == 128  # a stage holds 128 bytes of each token row
    assert L.ntile <= 6 and L.ncc * L.ntile * 8 == L.Kp >= K  # every column in exactly one chunk
    assert L.Kp - K < 8 * L.ncc  # chunks nearly equal: less than one 8-column tile of padding per chunk
    assert L.tiles * 128 >= tokens > (L.tiles - 1) * 128
    assert L.d_split % step == 0 and L.Dp % step == 0 and L.Dp >= D  # whole steps; the planes cover D
    assert L.splits * L.d_split >= D > (L.splits - 1) * L.d_split  # no empty D range
    assert 1 <= L.splits <= 64 and L.ncc * L.tiles * L.splits <= 2**31 - 1
    if L.ncc * L.tiles >= 1024:
        assert L.splits == 1  # split D only to fill the GPU
    if dt == "bfloat16" and K >= fwd._WG_MIN_K:
        # the wgmma kernel: its own column chunks (N <= 96), the same D ranges and token tiles
        assert L.wg_kc % 8 == 0 and 8 <= L.wg_kc <= 96 and L.wg_ncc * L.wg_kc >= K > (L.wg_ncc - 1) * L.wg_kc
        assert L.wg_ncc * L.wg_kc - K < 8 * L.wg_ncc and L.d_split % 64 == 0
        assert L.planes_shape[0][1] >= L.wg_ncc * L.wg_kc and L.wg_smem()[1] <= 227 * 1024
    else:
        assert L.wg_kc == L.wg_ncc == 0


@pytest.mark.parametrize("tokens", [0, 1, 63, 65, 5000, 10**6])
@pytest.mark.parametrize("n,C", [(1, 1), (2, 7), (4, 4096), (4, 7168), (8, 4096), (16, 1024), (32, 4096)])
def test_mma_token_splits(tokens, n, C):
    """The token ranges of the tensor-core backward: dphi partials bounded, every token in one range."""
    K = coeffs.columns(n)
    b = coeffs.backward_layout(tokens, n, C, K, "bfloat16")
    ranges = [b.dphi_splits] if K > 32 else [(b.splits, b.t_split)]
    if K > 32:  # the dx's token ranges (grid y): whole steps of its kernel (tile: BT tokens)
        ranges.append(b.dx_splits)
        step = 16 * (4 // coeffs.dx_tile_layout(n, K, "bfloat16")[0]) * split_bwd._DX_TILE_MT if b.dx_kind == "tile" else 16
        assert b.dx_splits[1] % step == 0 and b.dx_splits[0] <= 65535
    for splits, per in ranges:
        assert splits >= 1 and per >= 16 and per % 16 == 0
        assert splits * per >= tokens > (splits - 1) * per or tokens == 0
    splits = ranges[0][0]
    assert splits == 1 or splits * n * C * K <= 16 * 2**20  # partials bounded (64 MiB)


def _record(planner, infos, wgmma=False, **params):
    from mhc_cupy import _jit

    with _jit.dry_run() as launches, _jit.assume_wgmma(wgmma):
        plan = planner(infos, **params)
        ptrs = {k: (None if v is None else v.ptr) for k, v in infos.items()}
        plan.launch(ptrs, [1 << 20] * len(plan.outputs), [1 << 21] * len(plan.scratch), 0)
    return plan, [(expr, grid, block, args) for _, expr, grid, block, args, _ in launches]


@pytest.mark.parametrize("n,C,T", [(4, 4096, 16384), (4, 7, 3), (1, 1, 1), (8, 1000, 1000), (16, 64, 5)])
def test_launch_plans(n, C, T):
    D, K = n * C, coeffs.columns(n)
    cx = {"x": _info((T, n, C), "bfloat16"), "phi": _info((D, K)), "alpha": _info((3,)), "bias": _info((K,))}
    plan, calls = _record(coeffs._plan_fwd, cx, eps=1e-5)
    names = [c[0].split("<")[0] for c in calls]
    assert names == ["mhc_coeffs_split_phi_fwd_kernel", "mhc_coeffs_mma_fwd_kernel", "mhc_coeffs_fwd_finish_kernel"]
    for expr, grid, block, args in calls:
        assert 1 <= grid[0] <= 2**31 - 1 and grid[1] <= 65535 and block[0] * block[1] <= 1024
    g = {"grad_h_pre_raw": _info((T, n)), "grad_h_post_raw": _info((T, n)), "grad_h_res_raw": _info((T, n, n))}
    plan, calls = _record(coeffs._plan_bwd, {**g, **cx}, eps=1e-5)
    names = [c[0].split("<")[0] for c in calls]
    assert names[:3] == ["mhc_coeffs_split_phi_fwd_kernel", "mhc_coeffs_mma_fwd_kernel", "mhc_coeffs_bwd_prep_kernel"]
    if K <= 32:
        assert "mhc_coeffs_mma_bwd_kernel" in names and not any("dx" in name for name in names)
    else:  # dphi on tensor cores; dx with phi resident where its blocks leave 8 warps per SM (n = 8), else tiled
        assert "mhc_coeffs_mma_dphi_kernel" in names and "mhc_coeffs_bwd_dphi_kernel" not in names
        resident = "mhc_coeffs_mma_dx_kernel" in names
        assert resident == (n == 8) and resident != ("mhc_coeffs_mma_dx_tile_kernel" in names)
    scratch_bytes = sum(4 * int(np.prod(s)) for s, _ in plan.scratch.values())
    assert scratch_bytes <= 4 * (64 * T * (K + 1) + T * (K + 8) + 16 * 2**20 + D * K) + 12 * (D + 32) * (K + 16) \
        + 12 * (T + 16) * (K + 16)
    for expr, grid, block, args in calls:
        assert 1 <= grid[0] <= 2**31 - 1 and grid[1] <= 65535 and block[0] * block[1] <= 1024


@pytest.mark.parametrize("dt,C,ptr", [("bfloat16", 4096, 1 << 20), ("bfloat16", 7, 1 << 20),
                                      ("bfloat16", 4096, (1 << 20) + 2), ("float16", 4096, 1 << 20),
                                      ("float32", 64, 1 << 20)])
@pytest.mark.parametrize("n", [1, 4, 8, 16, 32])
def test_forward_gemm_on_wgmma_only_where_it_can(dt, C, ptr, n):
    """On a device with wgmma (sm_90a) the forward GEMM of bf16 x runs mhc_coeffs_wg_fwd_kernel
    (vectorised where D % 8 == 0 and x is aligned); other dtypes, and every dtype on other GPUs,
    the mma.sync kernel; so do narrow GEMMs (K < _WG_MIN_K, n < 7).  N of each wgmma covers its chunk's columns."""
    D, K, T = n * C, coeffs.columns(n), 300
    wg = dt == "bfloat16" and K >= fwd._WG_MIN_K
    cx = {"x": _info((T, n, C), dt, ptr), "phi": _info((D, K)), "alpha": _info((3,)), "bias": _info((K,))}
    for device_has_wgmma in (False, True):
        _, calls = _record(coeffs._plan_fwd, cx, wgmma=device_has_wgmma, eps=1e-5)
        names = [c[0].split("<")[0] for c in calls]
        if device_has_wgmma and wg:
            assert names == ["mhc_coeffs_split_phi_wg_kernel", "mhc_coeffs_wg_fwd_kernel", "mhc_coeffs_fwd_finish_kernel"]
            L = coeffs.mma_layout(T, D, K, dt)
            vec, kc = calls[1][0].split("<")[1].split(",")[:2]
            assert vec == ("true" if D % 8 == 0 and ptr % 16 == 0 else "false")
            assert int(kc) == L.wg_kc and calls[1][1][0] == L.wg_ncc * L.tiles * L.splits
        else:
            assert names == ["mhc_coeffs_split_phi_fwd_kernel", "mhc_coeffs_mma_fwd_kernel",
                             "mhc_coeffs_fwd_finish_kernel"]


@pytest.mark.parametrize("dt,C,ptr", [("bfloat16", 72, 1 << 20), ("bfloat16", 20, 1 << 20),
                                      ("bfloat16", 72, (1 << 20) + 2), ("float16", 72, 1 << 20),
                                      ("float32", 72, 1 << 20)])
@pytest.mark.parametrize("n", [4, 5, 7, 8, 9, 10, 16])
@pytest.mark.parametrize("layer", [None, "bfloat16", "float32"])
def test_dx_on_wgmma_only_where_it_can(dt, C, ptr, n, layer):
    """On a device with wgmma (sm_90a) the dx of bf16 x for n = 5 .. 9 (K >= _WG_DX_MIN_K, two blocks an
    SM) runs mhc_coeffs_wg_dx_kernel where C % 8 == 0, x, dx and the layer's gradients are 16-byte
    aligned and those gradients bf16 (layer: their dtype, None: mhc_coeffs_bwd); otherwise, and on
    other GPUs, the mma.sync dx kernels.  Its launch: phi and dH split in their own column order (K16
    columns), 128 positions a block, 64-token ranges covering the tokens, shared memory the kernel's
    formula within _WG_DX_SMEM."""
    T, D, K = 300, n * C, coeffs.columns(n)
    K16 = -(-K // 16) * 16
    cx = {"x": _info((T, n, C), dt, ptr), "phi": _info((D, K)), "alpha": _info((3,)), "bias": _info((K,))}
    if layer:
        from mhc_cupy.ops import layer as L

        if layer == "float32" and dt != "bfloat16":
            return  # gradients in x's dtype or float32 (the float32 case is the bf16 row's)
        cx.update({"stats": _info((T, K + 1)), "H_pre": _info((T, n)), "H_res": _info((T, n, n)),
                   "grad_layer_in": _info((T, C), layer if dt == "bfloat16" else dt), "grad_out": None,
                   "grad_x": _info((T, n, C), layer if dt == "bfloat16" else dt),
                   "grad_H_post": _info((T, n)), "grad_H_res": _info((T, n, n))})
        planner, params = L._plan_pre_bwd, dict(num_iters=20, eps=1e-6, rms_eps=1e-5, grad_mode="unrolled",
                                                convention="paper", hc_eps=0.0, post_mult=2.0)
    else:
        cx.update({"grad_h_pre_raw": _info((T, n)), "grad_h_post_raw": _info((T, n)),
                   "grad_h_res_raw": _info((T, n, n))})
        planner, params = coeffs._plan_bwd, dict(eps=1e-5)
    wg = dt == "bfloat16" and 5 <= n <= 9 and C % 8 == 0 and ptr % 16 == 0 and layer != "float32"
    for device_has_wgmma in (False, True):
        _, calls = _record(planner, cx, wgmma=device_has_wgmma, **params)
        names = [c[0].split("<")[0] for c in calls]
        dx = [c for c in calls if "_dx" in c[0]]
        assert len(dx) == (n > 4)
        if not (device_has_wgmma and wg):
            assert "mhc_coeffs_wg_dx_kernel" not in names
            continue
        expr, grid, block, args = dx[0]
        lay, ks, nb, stages = expr.rstrip(">").split("<")[1].split(",")
        ks, nb, stages = int(ks), int(nb), int(stages)
        assert lay == ("true" if layer else "false")
        assert 16 * ks == K16 and nb == 128 and stages == 2 and block == (128, 1, 1)
        assert coeffs.wg_dx_layout(K) == (nb, stages, 4 * nb * K16 + stages * 256 * K16)
        assert 4 * nb * K16 + stages * 256 * K16 <= split_bwd._WG_DX_SMEM
        t_split = args[-2]
        assert grid[0] == -(-D // nb) and t_split % 64 == 0 and grid[1] * t_split >= T > (grid[1] - 1) * t_split
        splits = [c for c in calls if c[0] == "mhc_coeffs_split_rows_kernel"]
        assert [c[3][6:9] for c in splits] == [(K16, 0, 0)] * 2  # K16 columns, own order, no row pairs


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 19])
def test_split_bwd_launches(dt, n):
    """n > 4: the dphi / dx kernels' dynamic shared memory is the kernels' own formula and within the
    portable limit; dx runs with phi resident (32 columns per warp, W streams per block with W | n) where
    its shared memory leaves at least _DX_MIN_WARPS (8) warps per 2 x 99 KiB (OPS.md section 9: n 5-8
    at 16 bits, 5, 6 and 8 in float32), else with phi streamed (mhc_coeffs_mma_dx_tile_kernel)."""
    T, C = 1000, 72
    D, K = n * C, coeffs.columns(n)
    cx = {"x": _info((T, n, C), dt), "phi": _info((D, K)), "alpha": _info((3,)), "bias": _info((K,)),
          "grad_h_pre_raw": _info((T, n)), "grad_h_post_raw": _info((T, n)), "grad_h_res_raw": _info((T, n, n))}
    from mhc_cupy import _jit

    with _jit.dry_run() as launches:
        plan = coeffs._plan_bwd(cx, **SPECS["mhc_coeffs_bwd"].params)
        plan.launch({k: v.ptr for k, v in cx.items()}, [1 << 20] * len(plan.outputs), [1 << 21] * len(plan.scratch), 0)
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[dt]
    seen = set()
    for _, expr, grid, block, args, smem in launches:
        name, _, params = expr.partition("<")
        params = params.rstrip(">").split(",")
        if name == "mhc_coeffs_mma_dphi_kernel":
            nq, stages = int(params[2]), int(params[3])
            assert smem == stages * (16 * (256 * size + 16) + 3 * 8 * nq * 32)
            assert grid[0] == -(-D // 256) * -(-K // (8 * nq)) and block[0] == 128
        elif name == "mhc_coeffs_mma_dx_kernel":
            ks, w, nt, stages = (int(v) for v in params[4:8])
            po = 3 if size == 4 else 2
            assert ks == -(-K // 16) and n % w == 0 and block[0] == 32 * w
            assert nt == 4 and w * (2 * common._SMEM_PORTABLE // smem) >= split_bwd._DX_MIN_WARPS == 8
            assert smem == (w * 8 * nt + stages * 16) * 16 * ks * po * 2 and stages >= 2
            assert grid[0] == -(-C // (8 * nt)) * (n // w)
        elif name == "mhc_coeffs_mma_dx_tile_kernel":
            ks, w, mt, stages = (int(v) for v in params[4:8])
            po, bt = (3 if size == 4 else 2), 16 * (4 // w) * mt
            assert ks % 2 == 0 and 16 * ks >= K > 16 * (ks - 2) and n % w == 0 and block[0] == 128
            assert smem == stages * po * (bt + 32 * w) * 64 and stages >= 2
            assert grid[0] == -(-C // 32) * (n // w) and grid[1] * args[-2] >= T
            assert args[-2] % bt == 0  # t_split: whole steps
        else:
            continue
        seen.add(name)
        assert smem <= common._SMEM_PORTABLE, (expr, smem)
    assert ("mhc_coeffs_mma_dx_kernel" in seen) == (n in ((5, 6, 8) if size == 4 else (5, 6, 7, 8)))
    assert ("mhc_coeffs_mma_dx_tile_kernel" in seen) == ("mhc_coeffs_mma_dx_kernel" not in seen)
    assert "mhc_coeffs_mma_dphi_kernel" in seen


def test_zero_token_backward_plan_only_zero_fills():
    cx = {"x": _info((0, 4, 8), "bfloat16"), "phi": _info((32, 24)), "alpha": _info((3,)), "bias": _info((24,))}
    g = {"grad_h_pre_raw": None, "grad_h_post_raw": None, "grad_h_res_raw": None}
    plan, calls = _record(coeffs._plan_bwd, {**g, **cx}, eps=1e-5)
    assert {c[0] for c in calls} == {"mhc_coeffs_zero_kernel"}
    assert sorted(c[3][1] for c in calls) == [3, 24, 32 * 24]


def test_missing_gradients_zero_fill_their_bias_slice():
    n = 3
    cx = {"x": _info((5, n, 8), "float32"), "phi": _info((n * 8, 15)), "alpha": _info((3,)), "bias": _info((15,))}
    g = {"grad_h_pre_raw": _info((5, n)), "grad_h_post_raw": None, "grad_h_res_raw": None}
    plan, calls = _record(coeffs._plan_bwd, {**g, **cx}, eps=1e-5)
    zeros = [(c[3][0], c[3][1]) for c in calls if c[0] == "mhc_coeffs_zero_kernel"]
    dbias = 1 << 20  # every output has this fake pointer
    assert sorted(zeros) == [(dbias + 4 * n, n), (dbias + 8 * n, n * n)]


def test_registry_lists_coeffs_kernels():
    specs = [e for f, e in _kernels.all_specialisations() if f.startswith("coeffs_")]
    for name in ("mhc_coeffs_mma_fwd_kernel<__nv_bfloat16,true,2,3,2,2>", "mhc_coeffs_fwd_finish_kernel",
                 "mhc_coeffs_bwd_prep_kernel", "mhc_coeffs_mma_bwd_kernel<__nv_bfloat16,__nv_bfloat16,true,false,4,2,3,3>",
                 "mhc_coeffs_zero_kernel", "mhc_coeffs_split_phi_fwd_kernel", "mhc_coeffs_split_rows_kernel",
                 "mhc_coeffs_split_cols_kernel"):
        assert name in specs, name
    # the n > 4 dx where phi's resident rows would leave too few warps per SM
    assert any(e.startswith("mhc_coeffs_mma_dx_tile_kernel<__nv_bfloat16,") for e in specs)
