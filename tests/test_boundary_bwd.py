"""The fused boundary backward (OPS.md section 12, "Fused boundary backward"): ``mhc_layer_pre_bwd``
with ``layer_out`` and ``mhc_boundary_bwd`` on the CPU (against the unfused ops they replace, bitwise,
and a float64 oracle of what they add), their errors, and the kernels their GPU plans launch (dry runs:
off by default, kernel choice ``boundary_bwd``).  MHCStack's use of them: tests/test_stack.py; on the
GPU: tests/gpu/test_boundary_gpu.py."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy._kernel_choice import kernel_choice

from harness import assert_rounded
from test_kernel_choice import launched

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _bits(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _layer(rng, lead, n, C, dt, convention):
    """x, phi, alpha, bias of one layer (coefficient logits of scale ~1), its pre piece's outputs, and
    the backward's incoming gradients: y (layer_out), g (grad_out), g_li (grad_layer_in)."""
    K = n * n + 2 * n
    x = rng.standard_normal(lead + (n, C)).astype(dt)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    alpha = np.array([0.5, 1.0, 1.5], np.float32)
    bias = rng.standard_normal(K).astype(np.float32)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias, convention=convention)
    y, g_li = (rng.standard_normal(lead + (C,)).astype(dt) for _ in range(2))
    g = rng.standard_normal(lead + (n, C)).astype(dt)
    return dict(x=x, phi=phi, alpha=alpha, bias=bias, stats=stats, H_pre=H_pre, H_res=H_res), H_post, y, g, g_li


CASES = [((3,), 1, 8, "float32"), ((5,), 2, 7, "bfloat16"), ((2, 3), 4, 13, "float16"), ((127,), 4, 16, "bfloat16"),
         ((), 3, 9, "float32"), ((4,), 5, 6, "bfloat16"), ((0,), 4, 8, "bfloat16")]


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("lead,n,C,dt", CASES)
@pytest.mark.parametrize("given", [False, True])
def test_equal_to_the_unfused_ops(rng, lead, n, C, dt, convention, given):
    """mhc_layer_pre_bwd(layer_out=y) is mhc_layer_post_bwd's dH_post, dH_res (plus the given ones) fed to
    mhc_layer_pre_bwd; mhc_boundary_bwd adds the previous layer's dy, mhc_layer_post_bwd's d_layer_out of
    g = dx: all bitwise on the CPU."""
    a, H_post, y, g, g_li = _layer(rng, lead, n, C, DTYPES[dt], convention)
    gp = rng.standard_normal(lead + (n,)).astype(np.float32) if given else None
    gr = rng.standard_normal(lead + (n, n)).astype(np.float32) if given else None
    _, dH_post, dH_res = m.mhc_layer_post_bwd(g, y, a["x"], H_post, a["H_res"], convention=convention)
    if given:
        dH_post, dH_res = dH_post + gp, dH_res + gr
    want = m.mhc_layer_pre_bwd(g_li, g, dH_post, dH_res, **a, convention=convention)
    got = m.mhc_layer_pre_bwd(g_li, g, gp, gr, **a, convention=convention, layer_out=y)
    for name, u, v in zip(("dx", "dphi", "dalpha", "dbias"), got, want):
        assert np.array_equal(_bits(u), _bits(v)), name

    H_post_prev = (rng.random(lead + (n,)) * 2).astype(np.float32)
    *rest, dy_prev = m.mhc_boundary_bwd(g_li, g, gp, gr, **a, layer_out=y, H_post_prev=H_post_prev,
                                        convention=convention)
    for name, u, v in zip(("dx", "dphi", "dalpha", "dbias"), rest, want):
        assert np.array_equal(_bits(u), _bits(v)), name
    dy, _, _ = m.mhc_layer_post_bwd(rest[0], y, a["x"], H_post_prev, a["H_res"], convention=convention)
    assert dy_prev.dtype == a["x"].dtype and dy_prev.shape == lead + (C,)
    assert np.array_equal(_bits(dy_prev), _bits(dy))
    # the float64 oracle of what it adds: sum_i H_post_prev_i dx_i of the dx returned
    want_dy = np.einsum("...i,...ic->...c", H_post_prev.astype(np.float64), np.asarray(rest[0], np.float64))
    assert_rounded(dy_prev, want_dy, dt)  # rounded once (was rtol 2e-2 for 16-bit dtypes, atol 1e-6)


def test_without_layer_out_or_gradients(rng):
    """layer_out None: mhc_boundary_bwd is mhc_layer_pre_bwd and the dy; no layer gradient at all: dx is
    the coefficient path's alone, dy_prev of it."""
    a, H_post, y, g, g_li = _layer(rng, (6,), 4, 8, ml_dtypes.bfloat16, "paper")
    H_post_prev = np.full((6, 4), 0.5, np.float32)
    for grads in ((g_li, g, None, None), (None, None, None, None)):
        want = m.mhc_layer_pre_bwd(*grads, **a)
        got = m.mhc_boundary_bwd(*grads, **a, layer_out=None, H_post_prev=H_post_prev)
        for u, v in zip(got, want):
            assert np.array_equal(_bits(u), _bits(v))
        assert np.array_equal(_bits(got[4]), _bits(m.stream_aggregate_fwd(got[0], H_post_prev)))


def test_bad_input_names_the_argument(rng):
    a, H_post, y, g, g_li = _layer(rng, (6,), 4, 8, np.float32, "paper")
    with pytest.raises(ValueError, match="layer_out is given but grad_out is None"):
        m.mhc_layer_pre_bwd(g_li, None, None, None, **a, layer_out=y)
    with pytest.raises(ValueError, match=r"layer_out has shape \(6, 9\); it needs \(6, 8\)"):
        m.mhc_layer_pre_bwd(g_li, g, None, None, **a, layer_out=np.zeros((6, 9), np.float32))
    with pytest.raises(TypeError, match="layer_out"):
        m.mhc_layer_pre_bwd(g_li, g, None, None, **a, layer_out=y.astype(np.float16))
    with pytest.raises(ValueError, match=r"H_post_prev has shape \(6, 3\); it needs \(6, 4\)"):
        m.mhc_boundary_bwd(g_li, g, None, None, **a, layer_out=y, H_post_prev=np.zeros((6, 3), np.float32))
    with pytest.raises(TypeError, match="H_post_prev has dtype float64; coefficients need float32"):
        m.mhc_boundary_bwd(g_li, g, None, None, **a, layer_out=y, H_post_prev=np.zeros((6, 4)))


@pytest.mark.parametrize("op", ["mhc_layer_pre_bwd", "mhc_boundary_bwd"])
def test_gpu_plan_is_off_by_default(op):
    """On a GPU the new paths run only under kernel_choice(boundary_bwd=True) (their kernels await a GPU
    check); mhc_layer_pre_bwd without layer_out plans as before."""
    with pytest.raises(NotImplementedError, match=r"kernel_choice\(boundary_bwd=True\)"):
        launched(op, 300, 4, 64)


def test_gpu_plan_under_the_choice():
    """n <= 4: the merged pass replaces the aggregate backward and dy_prev comes from the dx kernel (no
    launch of its own); n = 8 (split dx kernels): dy_prev by the aggregate of dx afterwards."""
    names = functools.partial(launched, "mhc_boundary_bwd", 300)
    with kernel_choice(boundary_bwd=True):
        n4, n8, pre4 = names(4, 64), names(8, 64), launched("mhc_layer_pre_bwd", 300, 4, 64)
    assert "mhc_layer_post_pre_bwd_kernel" in n4 and "mhc_coeffs_mma_bwd_dy_kernel" in n4, n4
    for k in ("mhc_stream_aggregate_bwd_kernel", "mhc_stream_aggregate_fwd_kernel", "mhc_coeffs_mma_bwd_kernel"):
        assert k not in n4, (k, n4)
    assert "mhc_layer_post_pre_bwd_kernel" in pre4 and "mhc_coeffs_mma_bwd_kernel" in pre4, pre4
    assert "mhc_coeffs_mma_bwd_dy_kernel" not in pre4
    assert n8[-1] == "mhc_stream_aggregate_fwd_kernel" and "mhc_layer_post_pre_bwd_kernel" in n8, n8


@pytest.mark.parametrize("tokens,C", [(1, 64), (3, 200), (127, 1000), (300, 24), (4097, 72), (70000, 8)])
def test_dy_epilogue_writes_every_element_once_from_its_own_block(tokens, C):
    """mhc_coeffs_mma_bwd_dy_kernel's epilogue, emulated from the planned launch (grid, t_split): block
    (x, y) covers columns [64 x, 64 x + 64) of tokens [y t_split, ...) 16 a step; after a step's dx
    stores (all n streams of those tokens and columns: the block's own) and a barrier, its threads
    q = threadIdx.x + 32 n k write dy_prev[t, c] for (u, c) = (q / 64, 64 x + q % 64).  Every (t, c)
    is written once, and the dx it reads back is the block's own step's."""
    from mhc_cupy import _jit, _kernels
    from mhc_cupy.ops import SPECS
    from mhc_cupy.ops.coeffs.bwd import MMA_BWD_DY

    n = 4
    k = SPECS["mhc_boundary_bwd"]
    infos = _kernels._infos(k, (tokens,), {"n": n, "C": C, "K": 24}, "bfloat16", "bfloat16", _kernels._ALIGNED)
    with _jit.dry_run() as launches, kernel_choice(boundary_bwd=True):
        plan = k.planner(infos, **k.params)
        plan.launch({a: v.ptr for a, v in infos.items()}, [_kernels._ALIGNED] * len(plan.outputs),
                    [_kernels._ALIGNED] * len(plan.scratch), 0)
    (_, expr, grid, block, args, _), = [r for r in launches if "mma_bwd_dy_kernel" in r[1]]
    a = dict(zip([p for _, p in MMA_BWD_DY.params], args))
    t_split = int(a["t_split"])
    assert int(a["tokens"]) == tokens and int(a["C"]) == C and block[0] == 32 * n
    assert grid[0] * 64 >= C and grid[1] * t_split >= tokens and t_split % 16 == 0
    writes = np.zeros((tokens, C), np.int64)
    q = np.arange(16 * 64)
    u, cl = q >> 6, q & 63
    for bx in range(grid[0]):
        for by in range(grid[1]):
            t_begin = by * t_split
            rows = max(min(tokens, t_begin + t_split) - t_begin, 0)
            for step in range((rows + 15) // 16):
                ok = (step * 16 + u < rows) & (64 * bx + cl < C)
                t, c = t_begin + step * 16 + u[ok], 64 * bx + cl[ok]
                assert ((t - t_begin) // 16 == step).all() and (c // 64 == bx).all()  # the block's own dx
                np.add.at(writes, (t, c), 1)
    assert (writes == 1).all()
