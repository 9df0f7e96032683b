"""layer_in for the next GEMM on the GPU (OPS.md section 13): mhc_layer_pre_norm_fwd and mhc_layer_pre_fp8_fwd,
every output NaN-poisoned first, against the CPU reference's rounding.

Bitwise where the rounding allows: H_pre, H_post, H_res, stats are mhc_layer_pre_fwd's (same GPU, same
kernel choice); layer_in_fp8 and scale are mhc_cupy._reference_layer_in.quantise_e4m3 of the GPU's own
layer_in (or layer_in_normed); layer_in_normed is rms_normalise of the GPU's layer_in with the GPU's
rstd.  rstd itself: a float32 sum of squares in the kernel's order against the reference's float64, so
within (row terms per thread + 5 + warps + 4) * 2^-24 relative; bounded here by 2^-16 (C <= 20000).
The row kept in shared memory or recomputed from x, aligned (vectorised) or one element off (E = 1),
both kernel choices: the same bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _dispatch, _reference_layer_in as rli
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops import layer_in as layer_in_ops

from .helpers import (DTYPES, assert_close, coef, jax_gpu_ok, needs_torch, poisoned_allocations, rounded, to_gpu,
                      to_host)

pytestmark = pytest.mark.gpu
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.fixture(autouse=True)
def _kernel_on():
    """The kernel runs on a GPU only under the kernel choice layer_in (off by default until a GPU run
    has checked it; mhc_cupy._kernel_choice): in force for every test here."""
    with kernel_choice(layer_in=True):
        yield


def test_off_by_default_raises(rng):
    x, phi, alpha, bias, w = (to_gpu(a) for a in _case(rng, 3, 4, 64, "bfloat16"))
    with kernel_choice(layer_in=None):
        for f, args in ((m.mhc_layer_pre_norm_fwd, (x, phi, alpha, bias, w)),
                        (m.mhc_layer_pre_fp8_fwd, (x, phi, alpha, bias))):
            with pytest.raises(NotImplementedError, match=r"kernel_choice\(layer_in=True\)"):
                f(*args)


def _case(rng, T, n, C, dt):
    K = n * n + 2 * n
    x = rounded(rng, (T, n, C), dt)
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    return x, phi, np.array([0.8, 1.1, 0.9], np.float32), coef(rng, (K,), 0.3), 1 + coef(rng, (C,), 0.2)


def _misaligned(a):
    """a on the GPU one element past a 16-byte boundary (contiguous: the kernels' scalar path, E = 1)."""
    flat = a.reshape(-1)
    return to_gpu(np.concatenate([flat[:1], flat]))[1:].reshape(a.shape)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _run(g):
    """Every op's outputs on the GPU arrays g = (x, phi, alpha, bias, w), allocations poisoned."""
    with poisoned_allocations():
        return {"pre": m.mhc_layer_pre_fwd(*g[:4]), "norm": m.mhc_layer_pre_norm_fwd(*g),
                "fp8": m.mhc_layer_pre_fp8_fwd(*g[:4]), "norm_fp8": m.mhc_layer_pre_fp8_fwd(*g)}


def _same(got, want, what):
    """Bitwise equal, except that a NaN may have other bits (the GPU's conversions give the canonical NaN)."""
    nan = np.isnan(np.asarray(want).astype(np.float32))
    assert np.array_equal(np.isnan(np.asarray(got).astype(np.float32)), nan), f"{what}: NaN positions"
    assert np.array_equal(_bits(got[~nan]), _bits(want[~nan])), f"{what}: bits"


def _check(outs, w):
    """outs (:func:`_run`) against the reference's rounding of the GPU's own layer_in (module docstring)."""
    li = to_host(outs["pre"][0])
    for key in ("norm", "fp8", "norm_fp8"):
        for a, b, name in zip(outs[key][2:], outs["pre"][1:], ("H_pre", "H_post", "H_res", "stats")):
            assert np.array_equal(_bits(to_host(a)), _bits(to_host(b))), f"{key}: {name}"
    v = li.astype(np.float32)
    normed, rstd = to_host(outs["norm"][0]), to_host(outs["norm"][1])
    assert normed.dtype == li.dtype and rstd.shape == v.shape[:-1] + (1,)
    ref_rstd = rli.rms_rstd(v, 1e-6)
    ok = np.isfinite(ref_rstd)[:, 0]  # (a token of NaN: its rstd is NaN too)
    assert np.array_equal(np.isnan(rstd), np.isnan(ref_rstd)), "rstd: NaN tokens"
    assert_close(rstd[ok], ref_rstd[ok], 2.0**-16, "rstd", scale=0)
    _same(normed, rli.rms_normalise(v, rstd, w, li.dtype), "layer_in_normed (rms_normalise of layer_in, rstd)")
    for key, u in (("fp8", v), ("norm_fp8", normed.astype(np.float32))):
        q, scale = to_host(outs[key][0]), to_host(outs[key][1])
        assert q.dtype == np.uint8 and q.shape == u.shape  # CuPy: the float8 bits
        q_ref, scale_ref = rli.quantise_e4m3(u)
        assert np.array_equal(scale, scale_ref, equal_nan=True), f"{key}: scale"
        _same(q.view(F8), q_ref, f"{key}: layer_in_fp8")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("T,C", [(1, 7), (3, 24), (127, 4096), (3, 20000)])  # 20000: not kept (16 bit too)
@pytest.mark.parametrize("small", [False, True])
def test_bits_against_the_reference_rounding(rng, dt, n, T, C, small):
    args = _case(rng, T, n, C, dt)
    g = [to_gpu(a) for a in args]
    with kernel_choice(small=small):
        outs = _run(g)
        again = _run(g)
    _check(outs, args[4])
    for key in outs:
        for a, b in zip(outs[key], again[key]):
            assert np.array_equal(_bits(to_host(a)), _bits(to_host(b))), f"{key}: bitwise repeatable"


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_kept_recomputed_and_misaligned_rows(rng, monkeypatch, dt):
    """The row recomputed from x each pass (KEEP_MAX_BYTES 0) has the kept row's bits; x one element off
    16 bytes (E = 1: another order of the sum of squares) still the reference's rounding."""
    args = _case(rng, 5, 4, 1000, dt)
    g = [to_gpu(a) for a in args]
    kept = _run(g)
    monkeypatch.setattr(layer_in_ops, "KEEP_MAX_BYTES", 0)
    _dispatch._plans.clear()
    _dispatch._fast.clear()  # its recorded launches hold keep
    try:
        recomputed = _run(g)
    finally:
        _dispatch._plans.clear()
        _dispatch._fast.clear()
    for key in kept:
        for a, b in zip(kept[key], recomputed[key]):
            assert np.array_equal(_bits(to_host(a)), _bits(to_host(b))), key
    monkeypatch.undo()
    _check(_run([_misaligned(args[0])] + g[1:]), args[4])


def test_nan_and_zero_tokens(rng):
    x, phi, alpha, bias, w = _case(rng, 3, 4, 64, "bfloat16")
    x[0, 1, 5] = np.nan
    x[1] = 0
    outs = _run([to_gpu(a) for a in (x, phi, alpha, bias, w)])
    _check(outs, w)
    q, scale = to_host(outs["fp8"][0]).view(F8).astype(np.float32), to_host(outs["fp8"][1])
    assert np.isnan(scale[0, 0]) and np.isnan(q[0]).all() and scale[1, 0] == 1 and (q[1] == 0).all()


@needs_torch
def test_torch_tensors(rng):
    """torch CUDA tensors: float8_e4m3fn (the CuPy run's bits) and torch._scaled_mm with scale_a = scale."""
    import torch

    args = _case(rng, 32, 4, 256, "bfloat16")[:4]  # no norm_weight: layer_in itself
    ref = m.mhc_layer_pre_fp8_fwd(*[to_gpu(a) for a in args])
    t = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda() if a.dtype == ml_dtypes.bfloat16 else
         torch.from_numpy(a).cuda() for a in args]
    q, scale, *_ = m.mhc_layer_pre_fp8_fwd(*t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (32, 1)
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), to_host(ref[0])) and np.array_equal(
        scale.cpu().numpy(), to_host(ref[1]))
    li = m.mhc_layer_pre_fwd(*t)[0].float()
    W = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
    try:
        got = torch._scaled_mm(q, W.t(), scale_a=scale, scale_b=torch.ones(1, 64, device="cuda"),
                               out_dtype=torch.bfloat16).float()
    except RuntimeError as exc:  # row-wise scales need sm_89+ / a recent torch
        pytest.skip(f"torch._scaled_mm with row-wise scales: {exc}")
    want = li @ W.float().t()
    assert ((got - want).abs() <= 2.0**-3 * (li.abs() @ W.float().abs().t()) + 1e-2).all()


@pytest.mark.parametrize("op", ["mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"])
@pytest.mark.skipif(not jax_gpu_ok(), reason="needs a CUDA GPU for both CuPy and JAX")
def test_jax_arrays(rng, op):
    """Eager JAX GPU arrays (the CuPy run's bits; the float8 output viewed from CuPy's uint8) and the
    kernel call under jax.jit (XLA's buffer uint8, viewed as float8): the same bits."""
    import jax
    import jax.numpy as jnp

    from mhc_cupy._jax_kernels import _k
    from mhc_cupy._settings import LayerSettings

    args = _case(rng, 7, 4, 128, "bfloat16")
    ref = getattr(m, op)(*[to_gpu(a) for a in args])
    j = [jnp.asarray(a) for a in args]
    eager = getattr(m, op)(*j)
    jit = jax.jit(lambda *a: _k(op, (("settings", LayerSettings.resolve()), ("norm_eps", 1e-6)), *a))(*j)
    assert eager[0].dtype == (jnp.float8_e4m3fn if op.endswith("fp8_fwd") else jnp.bfloat16)
    for a, b, c in zip(ref, eager, jit):
        assert b.dtype == c.dtype
        assert np.array_equal(_bits(to_host(a)), _bits(np.asarray(b))) and np.array_equal(
            _bits(np.asarray(b)), _bits(np.asarray(c)))
