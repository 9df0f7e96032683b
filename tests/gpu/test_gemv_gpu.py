"""The coefficient GEMM of a few tokens on CUDA cores (kernel choice gemv=True, off by default until
this passes on a GPU): mhc_coeffs_fwd, mhc_layer_pre_fwd and the head against the float64 reference
and against the tensor-core path, bitwise repeatable; backward through it."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops._launch import column_blocks

from .helpers import ACT_TOL, assert_close, coef, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu


def _case(rng, T, n, C, dt):
    K = n * n + 2 * n
    x = rounded(rng, (T, n, C), dt)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    return x, phi, np.array([0.8, 1.1, 0.9], np.float32), coef(rng, (K,), 0.3)


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("T,C", [(1, 7168), (3, 7), (8, 1000), (64, 512), (65, 64)])
def test_gemv_coefficients_match_the_reference_and_the_tensor_cores(rng, dt, n, T, C):
    if n * n * T * C > 2**26:
        pytest.skip("large")
    args = _case(rng, T, n, C, dt)
    g = [to_gpu(a) for a in args]
    with poisoned_allocations():
        with kernel_choice(small=True):
            got = m.mhc_layer_pre_fwd(*g)
            again = m.mhc_layer_pre_fwd(*g)
            raw = m.mhc_coeffs_fwd(*g)
        tc = m.mhc_layer_pre_fwd(*g)
    for a, b in zip(got, again):
        assert np.array_equal(np.ascontiguousarray(to_host(a)).view(np.uint8),
                              np.ascontiguousarray(to_host(b)).view(np.uint8)), "bitwise repeatable"
    ref = R.mhc_layer_pre_fwd(*args)
    assert_close(got[0], ref[0], ACT_TOL[dt], "layer_in")
    for a, b, name in zip(got[1:4], ref[1:4], ("H_pre", "H_post", "H_res")):
        assert_close(a, b, 1e-3, name)
    assert_close(got[4], ref[4], 1e-4, "stats", scale="max")
    for a, b, name in zip(got[1:], tc[1:], ("H_pre", "H_post", "H_res", "stats")):
        assert_close(a, b, 2e-4, name + " vs the tensor cores", scale="max")
    for a, b, name in zip(raw, R.mhc_coeffs_fwd(*args), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert_close(a, b, 1e-4, name, scale="max")


def test_gemv_backward_and_head(rng):
    T, n, C, dt = 5, 4, 96, "bfloat16"
    x, phi, alpha, bias = _case(rng, T, n, C, dt)
    gs = [coef(rng, (T, n)), coef(rng, (T, n)), coef(rng, (T, n, n))]
    with poisoned_allocations(), kernel_choice(small=True):
        got = m.mhc_coeffs_bwd(*(to_gpu(a) for a in gs), to_gpu(x), to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    ref = R.mhc_coeffs_bwd(*gs, x, phi, alpha, bias)
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], "dx", scale="max")
    for a, b, name in zip(got[1:], ref[1:], ("dphi", "dalpha", "dbias")):
        assert_close(a, b, 1e-4, name, scale="max")
    fn = coef(rng, (n, n * C), 1 / np.sqrt(n * C))
    scale, base = np.array([0.5], np.float32), coef(rng, (n,))
    with poisoned_allocations(), kernel_choice(small=True):
        out = m.mhc_head_fwd(to_gpu(x), to_gpu(fn), to_gpu(scale), to_gpu(base))
    assert_close(out, R.mhc_head_fwd(x, fn, scale, base), ACT_TOL[dt], "head")


@pytest.mark.parametrize("n,T,C", [(1, 7, 200), (4, 7, 200), (5, 7, 200), (16, 7, 200), (4, 1, 7168), (32, 2, 600)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_tail_kernel_has_the_separate_kernels_bits(rng, monkeypatch, n, T, C, convention):
    """From the same GEMV partials, mhc_layer_pre_tail_kernel gives the bits of the finish, Sinkhorn and
    aggregate kernels it stands for (the plan rebuilt with the tail switched off).  One token at C 7168, n 4:
    the GEMV's 256 ranges come through the tail's shared memory in one stage (staged_split_sums); n 32: 7
    ranges a stage, 256 ranges in 37 stages."""
    from mhc_cupy import _dispatch
    from mhc_cupy.ops import layer

    args = [to_gpu(a) for a in _case(rng, T, n, C, "bfloat16")]
    with kernel_choice(small=True):
        tail = m.mhc_layer_pre_fwd(*args, convention=convention)
        real = layer.launch_pre_from_sums
        monkeypatch.setattr(layer, "launch_pre_from_sums", lambda *a, **k: real(*a, **{**k, "tail": False}))
        _dispatch._plans.clear()
        _dispatch._fast.clear()
        sep = m.mhc_layer_pre_fwd(*args, convention=convention)
    _dispatch._plans.clear()
    _dispatch._fast.clear()
    for a, b, name in zip(tail, sep, ("layer_in", "H_pre", "H_post", "H_res", "stats")):
        assert np.array_equal(np.ascontiguousarray(to_host(a)).view(np.uint8),
                              np.ascontiguousarray(to_host(b)).view(np.uint8)), name


def _bits(a):
    return np.ascontiguousarray(to_host(a)).view(np.uint8)


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("n", [1, 4, 5, 8, 16])
@pytest.mark.parametrize("T,C", [(1, 7168), (3, 200), (64, 72), (65, 24)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_one_launch_tail_after_the_tensor_cores_has_the_default_bits(rng, dt, n, T, C, convention):
    """Kernel choice tail (at most 64 tokens; off by default until bench --small has measured it): the
    default GEMM, then mhc_layer_pre_tail_kernel for finish, Sinkhorn and aggregate: mhc_layer_pre_fwd
    and mhc_boundary_fwd bitwise the default path (which the tail kernel stands for), 65 tokens too (where
    it does not apply), and MHC's forward and gradients bitwise through it."""
    import torch

    import mhc_cupy.torch as mt

    if n * n * T * C > 2**26:
        pytest.skip("large")
    x, phi, alpha, bias = _case(rng, T, n, C, dt)
    g = [to_gpu(a) for a in (x, phi, alpha, bias)]
    y = to_gpu(rounded(rng, (T, C), dt))
    H_post, H_res = to_gpu(coef(rng, (T, n))), to_gpu(coef(rng, (T, n, n), 0.5))
    runs = {}
    for choice in ("default", "tail"):
        with poisoned_allocations(), kernel_choice(tail=choice == "tail"):
            runs[choice] = (*m.mhc_layer_pre_fwd(*g, convention=convention),
                            *m.mhc_boundary_fwd(y, g[0], H_post, H_res, *g[1:], convention=convention))
    for a, b, i in zip(runs["tail"], runs["default"], range(11)):
        assert np.array_equal(_bits(a), _bits(b)), f"output {i}"
    dev = torch.device("cuda")
    tdt = getattr(torch, dt)
    layer = mt.MHC(C, n, torch.nn.Tanh(), convention=convention).to(dev)
    xt = torch.from_numpy(x.astype(np.float32)).to(dev, tdt)
    grads = {}
    for choice in ("default", "tail"):
        layer.zero_grad(set_to_none=True)
        xg = xt.clone().requires_grad_()
        with kernel_choice(tail=choice == "tail"):
            out = layer(xg)
            out.float().square().sum().backward()
        grads[choice] = [out, xg.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["tail"], grads["default"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("T,C", [(1, 7168), (3, 4104), (64, 2048), (2, 13), (65, 7168)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_post_op_with_its_columns_over_blocks_has_the_default_bits(rng, dt, n, T, C, convention):
    """Under small (at most 64 tokens) the post op's forward splits a token's columns over several blocks
    (ops._launch.column_blocks; the grid it launched checked): bitwise the default's one block a token, on
    poisoned outputs, and close to the float64 reference."""
    from mhc_cupy.ops import stream as ops_stream  # (it launches through the launch it imported: spy there)

    x, y = to_gpu(rounded(rng, (T, n, C), dt)), to_gpu(rounded(rng, (T, C), dt))
    H_post, H_res = to_gpu(coef(rng, (T, n))), to_gpu(coef(rng, (T, n, n), 0.5))
    runs, grids = {}, {}
    launch = ops_stream.launch
    for choice in ("default", "small"):
        seen = []

        def spy(filename, expr, grid, block, *a, **k):
            seen.append((tuple(grid), int(expr.split(",")[2]), block[0]))  # (grid, E, threads)
            return launch(filename, expr, grid, block, *a, **k)

        with poisoned_allocations(), kernel_choice(small=choice == "small"):
            ops_stream.launch = spy
            try:
                m._dispatch._fast.clear()
                runs[choice] = m.mhc_post_op_fwd(y, x, H_post, H_res, convention=convention)
            finally:
                ops_stream.launch = launch
        grids[choice] = seen
    assert [g for g, _, _ in grids["default"]] == [(T, 1, 1)]
    # split where the row takes a block's threads more than one round (C 7168 and 4104 at a few tokens; at
    # 64 x 2048 too where E = 4: float32, or n = 8)
    (grid, E, threads), = grids["small"]
    assert grid == (T, column_blocks(T, C, E, threads) if T <= 64 else 1, 1), grids
    if (T, C) in ((1, 7168), (3, 4104)):
        assert grid[1] > 1, grids
    assert np.array_equal(_bits(runs["small"]), _bits(runs["default"]))
    ref = R.mhc_post_op_fwd(*(to_host(a) for a in (y, x, H_post, H_res)), convention)
    assert_close(to_host(runs["small"]), ref, ACT_TOL[dt], "out")
