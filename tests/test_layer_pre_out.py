"""layer_in in the form the next GEMM takes (OPS.md section 13, issue 43 item 3): mhc_layer_pre_norm_fwd
(RMS-normalised with the sublayer's pre-norm weight) and mhc_layer_pre_fp8_fwd (float8 e4m3, one scale
per token), on the CPU (the NumPy reference): against float64 maths, bitwise against the rounding
OPS.md states (ml_dtypes' float8_e4m3fn cast of the float32 value over the scale), the NaN / zero /
inf / huge-value policy, bad input errors, the torch and JAX adapters' dtypes, and the kernel plans
(dry runs).  The kernel itself: tests/test_layer_in_emulation.py (CPU) and tests/gpu/test_layer_in_gpu.py.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import mhc_cupy as m
from harness import NP_DTYPES, assert_close
from mhc_cupy import _reference_layer_in as rli
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}  # unit roundoff of each dtype


def _case(rng, T, n, C, dt, scale=1.0):
    K = n * n + 2 * n
    x = (scale * rng.standard_normal((T, n, C))).astype(np.float32).astype(NP_DTYPES[dt])
    phi = (rng.standard_normal((n * C, K)) / np.sqrt(n * C)).astype(np.float32)
    alpha = np.array([0.8, 1.1, 0.9], np.float32)
    bias = (0.3 * rng.standard_normal(K)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(C)).astype(np.float32)
    return x, phi, alpha, bias, w


def _f32(a):
    return np.asarray(a).astype(np.float32)


GRID = [(T, n, C, dt) for T, n, C in [(1, 1, 7), (3, 3, 24), (127, 4, 24), (3, 4, 4096), (1, 4, 4096)]
        for dt in ("bfloat16", "float16", "float32")]


# ------------------------------------------------------------------ against float64 maths
@pytest.mark.parametrize("T,n,C,dt", GRID)
def test_against_float64(rng, T, n, C, dt):
    """The outputs against the float64 maths of the layer (layer_in not rounded): RMSNorm to a couple of
    roundings of x's dtype, the dequantised fp8 to e4m3's precision (3 mantissa bits: 2^-4 relative,
    2^-10 of the scale below the least normal), rstd and scale to float32 rounding of their maths."""
    x, phi, alpha, bias, w = _case(rng, T, n, C, dt)
    li64, *pre = R.mhc_layer_pre_fwd(x, phi, alpha, bias)  # float64, unrounded
    rstd64 = 1 / np.sqrt(np.mean(li64**2, -1, keepdims=True) + 1e-6)
    normed64 = li64 * rstd64 * w
    normed, rstd, *pre_n = m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w)
    assert normed.dtype == x.dtype and rstd.dtype == np.float32 and rstd.shape == (T, 1)
    # layer_in and the result rounded to x's dtype, rstd and the two products to float32
    assert_close(normed, normed64, 3 * ULP[dt] + 8 * 2.0**-24, "layer_in_normed", scale=0)
    assert_close(rstd, rstd64, ULP[dt] + 2.0**-23, "rstd", scale=0)  # of layer_in rounded to x's dtype
    for u64, got in ((li64, m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias)),
                     (normed64, m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, w))):
        q, scale, *pre_q = got
        assert q.dtype == F8 and q.shape == (T, C) and scale.dtype == np.float32 and scale.shape == (T, 1)
        amax = np.abs(u64).max(-1, keepdims=True)
        assert_close(scale, amax / 448, 3 * ULP[dt], "scale", scale=0)
        err = np.abs(_f32(q) * scale.astype(np.float64) - u64)
        assert (err <= (2.0**-4 + 3 * ULP[dt]) * np.abs(u64) + 2.0**-10 * scale).all(), "dequantised fp8"
        for a, b in zip(pre_q, pre):
            np.testing.assert_array_equal(a, b.astype(np.float32))
    for a, b in zip(pre_n, pre):
        np.testing.assert_array_equal(a, b.astype(np.float32))


def test_rstd_reference_is_float64_maths(rng):
    v = (rng.standard_normal((5, 300)) * np.array([[1e-3], [1], [1e3], [1e20], [0]])).astype(np.float32)
    want = 1 / np.sqrt(np.mean(v.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rli.rms_rstd(v, 1e-6), want, rtol=2.0**-24)


# ------------------------------------------------------------------ the rounding OPS.md states
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("T,n,C", [(1, 1, 7), (3, 3, 24), (127, 4, 40)])
def test_rounding_is_the_stated_one(rng, dt, T, n, C):
    """Bitwise: layer_in_fp8 is ml_dtypes' float8_e4m3fn cast of float32(u) / scale (clipped at 448),
    scale = float32(max |u|) / 448, with u = mhc_layer_pre_fwd's layer_in as stored (or the normed row);
    layer_in_normed is round(float32(float32(v * rstd) * w)) of that layer_in and the returned rstd."""
    x, phi, alpha, bias, w = _case(rng, T, n, C, dt)
    li = m.mhc_layer_pre_fwd(x, phi, alpha, bias)[0]
    assert li.dtype == x.dtype
    normed, rstd, *_ = m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w)
    v = _f32(li)
    want = ((v * rstd).astype(np.float32) * w).astype(np.float32).astype(x.dtype)
    np.testing.assert_array_equal(normed.view(np.uint8), want.view(np.uint8))
    for u, args in ((v, ()), (_f32(normed), (w,))):
        q, scale, *_ = m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, *args)
        want_scale = (np.abs(u).max(-1, keepdims=True) / np.float32(448)).astype(np.float32)
        np.testing.assert_array_equal(scale, want_scale)
        cast = np.clip((u / want_scale).astype(np.float32), -448, 448).astype(F8)
        np.testing.assert_array_equal(q.view(np.uint8), cast.view(np.uint8))
        assert np.abs(_f32(q)).max() == 448  # the row's amax maps to the largest e4m3 exactly


def test_norm_eps_reaches_the_rstd(rng):
    x, phi, alpha, bias, w = _case(rng, 2, 2, 8, "float32", scale=1e-3)
    li = _f32(m.mhc_layer_pre_fwd(x, phi, alpha, bias)[0])
    for eps in (0.0, 1e-6, 0.5):
        rstd = m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w, norm_eps=eps)[1]
        np.testing.assert_array_equal(rstd, rli.rms_rstd(li, eps))


# ------------------------------------------------------------------ edge cases
def test_zero_huge_nan_and_inf_rows(rng):
    """Zero row: scale 1, fp8 zeros; rstd 1/sqrt(norm_eps), normed zeros.  Huge values (1e30 in float32
    and bfloat16): finite scale, the amax at +-448.  A NaN: that token's scale (rstd) NaN and every
    output NaN (an inf in x makes the layer's coefficients NaN: the same).  An inf in layer_in: scale inf,
    NaN at the inf, 0 elsewhere (rstd 0 for the RMSNorm)."""
    x, phi, alpha, bias, w = _case(rng, 5, 2, 16, "float32")
    x[1] = 0
    x[2] *= 1e30
    x[3, 0, 4] = np.nan
    x[4, 1, 6] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        li = _f32(m.mhc_layer_pre_fwd(x, phi, alpha, bias)[0])
        q, scale, *_ = m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias)
        normed, rstd, *_ = m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w)
    q = _f32(q)
    assert scale[1, 0] == 1 and (q[1] == 0).all()
    assert rstd[1, 0] == np.float32(1 / np.sqrt(1e-6)) and (normed[1] == 0).all()
    assert np.isfinite(scale[2, 0]) and np.abs(q[2]).max() == 448 and np.isfinite(q[2]).all()
    np.testing.assert_allclose(_f32(q[2]) * scale[2, 0], li[2], rtol=2.0**-4, atol=2.0**-10 * float(scale[2, 0]))
    assert np.isfinite(normed[2]).all() and np.abs(normed[2]).max() < 10  # the RMSNorm of a huge row
    assert np.isnan(scale[3, 0]) and np.isnan(q[3]).all() and np.isnan(rstd[3, 0]) and np.isnan(normed[3]).all()
    assert np.isnan(scale[4, 0]) and np.isnan(q[4]).all() and np.isnan(rstd[4, 0]) and np.isnan(normed[4]).all()
    row = np.array([[1, np.inf, -2]], np.float32)
    with np.errstate(invalid="ignore"):
        q, scale = rli.quantise_e4m3(row)
        rstd = rli.rms_rstd(row, 1e-6)
        normed = rli.rms_normalise(row, rstd, np.ones(3, np.float32), np.float32)
    assert np.isinf(scale[0, 0]) and np.isnan(_f32(q)[0, 1]) and (_f32(q)[0, [0, 2]] == 0).all()
    assert rstd[0, 0] == 0 and np.isnan(normed[0, 1]) and (normed[0, [0, 2]] == 0).all()
    bf = x.astype(NP_DTYPES["bfloat16"])
    bf[:, :, :] = (rng.standard_normal(bf.shape) * 1e30).astype(bf.dtype)
    q, scale, *_ = m.mhc_layer_pre_fp8_fwd(bf, phi, alpha, bias)
    assert np.isfinite(scale).all() and (np.abs(_f32(q)).max(-1) == 448).all()


def test_denormal_amax_as_documented():
    """OPS.md section 13: the row's amax becomes +-448 exactly, except for an amax below ~7.9e-42, where
    amax / 448 is a float32 denormal of a few bits (its rounding takes u / scale at the amax to 224-670: 224
    to 448 in float8, q scale off by up to a third; the section claimed +-448 for every row); below amax
    3.15e-43 the scale is 1.  Checked at every
    denormal amax k 2^-149, k < 20000, and a normal one."""
    amax = np.arange(1, 20000, dtype=np.uint32).view(np.float32)[:, None]
    q, scale = rli.quantise_e4m3(np.concatenate([amax, amax / 3], axis=1))
    top = _f32(q)[:, 0]
    scaled = scale[:, 0] != 1
    np.testing.assert_array_equal(scaled, amax[:, 0] >= np.float32(3.15e-43))
    assert (top[~scaled] == 0).all() and top[scaled].min() == 224
    assert (top[amax[:, 0] > 7.87e-42] == 448).all() and top[amax[:, 0] == np.float32(7.868e-42)] == 416
    assert top[amax[:, 0] == np.float32(4e-43)] == 288
    np.testing.assert_allclose(top[scaled] * scale[scaled, 0], amax[scaled, 0], rtol=0.34)
    q, scale = rli.quantise_e4m3(np.array([[1e-30, -3e-31]], np.float32))
    assert _f32(q)[0, 0] == 448


def test_e4m3_cast_saturates_and_keeps_nan():
    v = np.array([448, 464, 465, 1e30, np.inf, -np.inf, np.nan, 2.0**-10, 1.5 * 2.0**-9, -0.0], np.float32)
    got = rli.to_e4m3(v)
    np.testing.assert_array_equal(_f32(got)[:6], [448, 448, 448, 448, 448, -448])
    assert np.isnan(_f32(got)[6]) and _f32(got)[7] == 0 and _f32(got)[8] == 2.0**-8
    assert got.view(np.uint8)[9] == 0x80


def test_zero_tokens():
    x = np.zeros((0, 4, 8), np.float32)
    _, phi, alpha, bias, w = _case(np.random.default_rng(0), 1, 4, 8, "float32")
    q, scale, *rest = m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, w)
    assert q.shape == (0, 8) and q.dtype == F8 and scale.shape == (0, 1)
    normed, rstd, *_ = m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w)
    assert normed.shape == (0, 8) and rstd.shape == (0, 1)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("op", ["mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"])
def test_bad_input_names_the_argument(rng, op):
    x, phi, alpha, bias, w = _case(rng, 3, 2, 8, "bfloat16")
    f = getattr(m, op)
    with pytest.raises(ValueError, match=r"norm_weight has shape \(9,\); it needs \(8,\)"):
        f(x, phi, alpha, bias, np.ones(9, np.float32))
    with pytest.raises(TypeError, match="norm_weight has dtype float16; coefficients need float32"):
        f(x, phi, alpha, bias, w.astype(np.float16))
    with pytest.raises(TypeError, match="norm_weight: expected an array .*, got list"):
        f(x, phi, alpha, bias, [1.0] * 8)
    with pytest.raises(ValueError, match="norm_eps must be finite and >= 0, got -1"):
        f(x, phi, alpha, bias, w, norm_eps=-1)
    with pytest.raises(TypeError, match="norm_eps must be a float"):
        f(x, phi, alpha, bias, w, norm_eps="1e-6")
    with pytest.raises(TypeError, match="x has dtype float64"):
        f(x.astype(np.float64), phi, alpha, bias, w)
    with pytest.raises(ValueError, match="phi has shape"):
        f(x, phi[1:], alpha, bias, w)
    if op == "mhc_layer_pre_norm_fwd":
        with pytest.raises(TypeError, match=r"norm_weight is None; it needs an array"):
            f(x, phi, alpha, bias, None)
    else:
        assert f(x, phi, alpha, bias, None)[0].dtype == F8  # None: no RMSNorm


# ------------------------------------------------------------------ adapters
def test_torch_dtypes_and_scaled_mm(rng):
    """torch CPU tensors: float8_e4m3fn and float32 [T, 1] from the functional API and the custom
    operator (the same bits); torch._scaled_mm of layer_in_fp8 with scale_a = scale is layer_in @ W to
    fp8 precision.  A tensor requiring grad gets the functional API's warning, no graph."""
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch  # noqa: F401 - registers torch.ops.mhc_cupy.*

    *args, w = [torch.from_numpy(a) for a in _case(rng, 16, 4, 32, "float32")]
    q, scale, *_ = m.mhc_layer_pre_fp8_fwd(*args)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (16, 32) and scale.dtype == torch.float32
    assert scale.shape == (16, 1)
    for norm_weight in (None, w):
        want = m.mhc_layer_pre_fp8_fwd(*args, norm_weight)
        opq = torch.ops.mhc_cupy.mhc_layer_pre_fp8_fwd(*args, norm_weight, 20, 1e-8, 1e-5)
        assert torch.equal(opq[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(opq[1], want[1])
    normed, rstd, *_ = torch.ops.mhc_cupy.mhc_layer_pre_norm_fwd(*args, w, 20, 1e-8, 1e-5)
    assert normed.dtype == torch.float32 and rstd.shape == (16, 1)
    assert m.mhc_layer_pre_norm_fwd(args[0].to(torch.bfloat16), *args[1:], w)[0].dtype == torch.bfloat16
    li = m.mhc_layer_pre_fwd(*args)[0]
    W = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    Wq, Ws = W.to(torch.float8_e4m3fn), torch.ones(1, 24)
    try:
        got = torch._scaled_mm(q, Wq.t(), scale_a=scale, scale_b=Ws, out_dtype=torch.float32)
    except RuntimeError as e:  # torch before 2.13 on the CPU: per-tensor scales only (an INTERNAL ASSERT)
        if "per-tensor" not in str(e):
            raise
        got = (q.float() * scale) @ Wq.float().t()  # what _scaled_mm computes with a row-wise scale_a
    want = li @ Wq.float().t()
    assert ((got - want).abs() <= 2.0**-3 * (li.abs() @ Wq.float().abs().t())).all()
    with pytest.warns(m.AutogradNotRecordedWarning, match=r"mhc_layer_pre_fp8_fwd .* has no gradient \(forward only\)"):
        out = m.mhc_layer_pre_fp8_fwd(args[0].requires_grad_(), *args[1:])
    assert out[0].grad_fn is None


def test_jax_dtypes_eager_and_jit(rng, jax_on_cpu):
    """JAX CPU arrays: jnp.float8_e4m3fn from the functional API (eager) and from the kernel call under
    jax.jit (its XLA buffer is uint8, viewed as float8), the same bits; vmap adds a token dim."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from mhc_cupy._jax_kernels import _k
    from mhc_cupy._settings import LayerSettings

    x, phi, alpha, bias, w = (jnp.asarray(a) for a in _case(rng, 3, 4, 24, "bfloat16"))
    eager = m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, w)
    assert eager[0].dtype == jnp.float8_e4m3fn and eager[1].dtype == jnp.float32 and eager[1].shape == (3, 1)
    params = (("settings", LayerSettings.resolve()), ("norm_eps", 1e-6))
    for name, args in (("mhc_layer_pre_fp8_fwd", (x, phi, alpha, bias, w)),
                       ("mhc_layer_pre_fp8_fwd", (x, phi, alpha, bias, None)),
                       ("mhc_layer_pre_norm_fwd", (x, phi, alpha, bias, w))):
        ref = getattr(m, name)(*args)
        got = jax.jit(lambda *a, _n=name: _k(_n, params, *a))(*args)
        assert [o.dtype for o in got] == [o.dtype for o in ref]
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    vm = jax.vmap(lambda xx: _k("mhc_layer_pre_fp8_fwd", params, xx, phi, alpha, bias, w))(jnp.stack([x, x]))
    assert vm[0].shape == (2, 3, 24) and vm[0].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(vm[0][1]).view(np.uint8), np.asarray(eager[0]).view(np.uint8))


# ------------------------------------------------------------------ kernel plans (dry runs)
def _launched(op, tokens, n, C, **absent):
    from mhc_cupy import _jit, _kernels
    from mhc_cupy.ops import SPECS

    k = SPECS[op]
    infos = _kernels._infos(k, (tokens,), {"n": n, "C": C, "K": n * n + 2 * n}, "bfloat16", "bfloat16",
                            _kernels._ALIGNED)
    infos.update(absent)
    with _jit.dry_run() as launches:
        plan = k.planner(infos, **k.params)
        plan.launch({a: None if v is None else v.ptr for a, v in infos.items()},
                    [_kernels._ALIGNED] * len(plan.outputs), [_kernels._ALIGNED] * len(plan.scratch), 0)
    return [(expr, args, smem) for _, expr, _, _, args, smem in launches]


@pytest.mark.parametrize("small", [False, True])
def test_plans_replace_the_aggregate(small):
    """Both ops launch mhc_layer_pre_fwd's kernels with its arguments up to the aggregate, which one
    mhc_stream_aggregate_out_kernel replaces (NORM, FP8 as the op; the row kept: C * 2 bytes of shared
    memory); under small=True the tail kernel (its layer_in to scratch) comes first: three launches."""
    with kernel_choice(small=small, layer_in=True):
        base = _launched("mhc_layer_pre_fwd", 5, 4, 64)
        runs = {"norm": _launched("mhc_layer_pre_norm_fwd", 5, 4, 64),
                "fp8": _launched("mhc_layer_pre_fp8_fwd", 5, 4, 64, norm_weight=None),
                "norm+fp8": _launched("mhc_layer_pre_fp8_fwd", 5, 4, 64)}
    names = [e.split("<")[0] for e, *_ in base]
    if small:
        assert names == ["mhc_coeffs_gemv_fwd_kernel", "mhc_layer_pre_tail_kernel"]
    else:
        assert names[-1] == "mhc_stream_aggregate_fwd_kernel"
        base = base[:-1]
    for key, flags in (("norm", "true,false"), ("fp8", "false,true"), ("norm+fp8", "true,true")):
        got = runs[key]
        assert [e for e, *_ in got[:-1]] == [e for e, *_ in base], key
        expr, args, smem = got[-1]
        assert expr == f"mhc_stream_aggregate_out_kernel<__nv_bfloat16,4,8,{flags}>" and smem == 64 * 2, key
        assert int(args[-1]) == 1  # keep


@pytest.mark.parametrize("op", ["mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd"])
def test_gpu_kernel_is_off_by_default(op):
    """On a GPU the ops launch nothing but raise NotImplementedError naming the kernel choice that runs
    their kernel (layer_in: off until a GPU run has checked it), before any launch."""
    with pytest.raises(NotImplementedError, match=r"kernel_choice\(layer_in=True\)"):
        _launched(op, 5, 4, 64)
    with kernel_choice(layer_in=False), pytest.raises(NotImplementedError):
        _launched(op, 5, 4, 64)


def test_every_kernel_specialisation_is_listed_for_ci():
    from mhc_cupy._kernels import all_specialisations

    exprs = {e for f, e in all_specialisations() if f == "stream.cu" and e.startswith("mhc_stream_aggregate_out")}
    for dt in ("__nv_bfloat16", "__half", "float"):
        for flags in ("true,false", "false,true", "true,true"):
            assert any(e.startswith(f"mhc_stream_aggregate_out_kernel<{dt},4,") and e.endswith(f"{flags}>")
                       for e in exprs), (dt, flags)
