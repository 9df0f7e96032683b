"""The mHC head (OPS.md section 11, DeepSeek-V4 ``hc_head``) and the deepseek-convention layer on
the GPU, against the float64 reference / oracle.

Inputs are rounded to the activation dtype first and the reference runs in float64 on exactly
those values, so what is left is the kernels' float32 arithmetic:

* out: sum_i w_i x_i with w from a float32 dot product over D = n*C terms (the coefficient
  path's tensor-core GEMM, float32-accurate): ACT_TOL (one rounding) plus the w error, which is
  ~1e-6 relative (see tests/test_coeffs.py), far below bfloat16 / float16 rounding and
  covered for float32 by ACT_TOL's 1e-5.
* dx: w_i g + dH hc_fn - c x, float32, rounded once: 2 ACT_TOL on the scale of its terms.
* dhc_fn, dhc_scale, dhc_base: float32 sums over tokens in a fixed order: COEF_TOL of the root
  sum of squares of their per-token terms.
Every CuPy allocation is NaN-poisoned, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R

from .helpers import ACT_TOL, COEF_TOL, assert_close, f64, poisoned_allocations, rounded, to_gpu, to_host, torch_cuda_ok

pytestmark = pytest.mark.gpu

DTYPES = ["bfloat16", "float16", "float32"]
# (tokens, C): C = 1 (with n = 32: 32-thread blocks), 7, 33 odd (scalar paths); 64 / 1000 / 4096 vectorised; T = 1000 with C = 1000 splits
# D in the forward GEMM and the dhc_fn sum over tokens.
SIZES = [(1, 1), (3, 7), (127, 33), (127, 64), (1000, 1000), (3, 4096)]
NS = [1, 2, 3, 4, 5, 8, 16, 32]


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_allocations():
        yield


def _case(rng, lead, n, C, dt):
    D = n * C
    x = rounded(rng, lead + (n, C), dt)
    hc_fn = (rng.standard_normal((n, D)) / np.sqrt(D)).astype(np.float32)
    hc_scale = np.array([0.8], np.float32)
    hc_base = (0.5 * rng.standard_normal(n)).astype(np.float32)
    g = rounded(rng, lead + (C,), dt)
    return x, hc_fn, hc_scale, hc_base, g


def _scales(g, x, hc_fn, hc_scale, hc_base, rms_eps=1e-6):
    """Sizes of the terms behind dx, dhc_scale, dhc_base (for the tolerance scales)."""
    n, C = x.shape[-2], x.shape[-1]
    xt = f64(x).reshape(-1, n * C)
    g = f64(g).reshape(-1, C)
    H = xt @ f64(hc_fn).T
    rinv = 1 / np.sqrt(np.mean(xt**2, -1, keepdims=True) + rms_eps)
    s = 1 / (1 + np.exp(-(H * rinv * hc_scale[0] + hc_base)))
    gz = np.einsum("tc,tkc->tk", g, xt.reshape(-1, n, C)) * s * (1 - s)
    dH = gz * hc_scale[0] * rinv
    dx_scale = max(float(np.sqrt(np.mean(g**2))), float(np.sqrt(np.mean((dH @ f64(hc_fn)) ** 2))))
    return dx_scale, float(np.sqrt(np.sum((gz * H * rinv) ** 2))), float(np.sqrt(np.sum(gz**2) / n))


def _check(rng, lead, n, C, dt, g_dtype=None, x_scale=1.0):
    x, hc_fn, hc_scale, hc_base, g = _case(rng, lead, n, C, dt)
    if x_scale != 1.0:
        x = (f64(x) * x_scale).astype(x.dtype)
    if g_dtype is not None:
        g = g.astype(g_dtype)
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    out = m.mhc_head_fwd(*gpu)
    assert out.dtype == x.dtype
    assert_close(to_host(out), R.mhc_head_fwd(x, hc_fn, hc_scale, hc_base), ACT_TOL[dt], "out")
    got = m.mhc_head_bwd(to_gpu(g), *gpu)
    ref = R.mhc_head_bwd(g, x, hc_fn, hc_scale, hc_base)
    dx_scale, scale_scale, base_scale = _scales(g, x, hc_fn, hc_scale, hc_base)
    assert got[0].dtype == x.dtype
    assert_close(to_host(got[0]), ref[0], 2 * ACT_TOL[dt], "dx", scale=dx_scale)
    assert_close(to_host(got[1]), ref[1], COEF_TOL, "dhc_fn")
    assert_close(to_host(got[2]), ref[2], COEF_TOL, "dhc_scale", scale=scale_scale)
    assert_close(to_host(got[3]), ref[3], COEF_TOL, "dhc_base", scale=base_scale)
    return gpu, g


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_head(rng, dt, n, T, C):
    _check(rng, (T,), n, C, dt)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_head_float32_grad(rng, dt):
    """The incoming gradient in float32 with bfloat16 / float16 activations."""
    _check(rng, (127,), 4, 64, dt, g_dtype=np.float32)


def test_head_leading_dims_and_misaligned(rng):
    _check(rng, (2, 3, 5), 4, 64, "bfloat16")
    # a view at an odd element offset: no vector path (C % 8 == 0 but the pointer is misaligned)
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (7,), 4, 64, "bfloat16")
    xg = to_gpu(np.concatenate([np.zeros(1, x.dtype), x.reshape(-1)]))[1:].reshape(x.shape)
    out = m.mhc_head_fwd(xg, *(to_gpu(v) for v in (hc_fn, hc_scale, hc_base)))
    assert_close(to_host(out), R.mhc_head_fwd(x, hc_fn, hc_scale, hc_base), ACT_TOL["bfloat16"], "out")


def test_head_zero_tokens(rng):
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (0,), 4, 64, "bfloat16")
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    assert m.mhc_head_fwd(*gpu).shape == (0, 64)
    dx, dfn, dscale, dbase = m.mhc_head_bwd(to_gpu(g), *gpu)
    assert dx.shape == (0, 4, 64)
    for a in (dfn, dscale, dbase):
        assert (f64(to_host(a)) == 0).all()


@pytest.mark.parametrize("n,T,C", [(4, 1000, 1000), (8, 3000, 64)])
def test_head_deterministic(rng, n, T, C):
    """Two identical calls give the same bits (no atomics; the dhc_fn sum over tokens is split)."""
    x, hc_fn, hc_scale, hc_base, g = _case(rng, (T,), n, C, "bfloat16")
    gpu = [to_gpu(v) for v in (x, hc_fn, hc_scale, hc_base)]
    first = [to_host(a) for a in (m.mhc_head_fwd(*gpu), *m.mhc_head_bwd(to_gpu(g), *gpu))]
    for _ in range(3):
        again = [to_host(a) for a in (m.mhc_head_fwd(*gpu), *m.mhc_head_bwd(to_gpu(g), *gpu))]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ------------------------------------------------------------------ torch: MHCHead and MHC(convention="deepseek")
needs_torch = pytest.mark.skipif(not torch_cuda_ok(), reason="needs torch with CUDA")


@needs_torch
@pytest.mark.parametrize("n", [1, 4, 8])
def test_torch_head_module_cuda(rng, n):
    """MHCHead on CUDA (the kernels) equals MHCHead on the CPU (the reference) to float32 tolerance,
    values and gradients, eagerly and under torch.compile."""
    import torch

    from mhc_cupy.torch import MHCHead

    C = 64
    cpu = MHCHead(C, n, scale_init=0.8)
    with torch.no_grad():
        cpu.hc_base.normal_()
    gpu = MHCHead.from_deepseek(*(t.cuda() for t in cpu.to_deepseek()))
    x = torch.tensor(rng.standard_normal((127, n, C)), dtype=torch.float32)
    g = torch.tensor(rng.standard_normal((127, C)), dtype=torch.float32)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    cpu(xc).backward(g)
    for fn in (gpu, torch.compile(gpu, fullgraph=True)):
        xg.grad = None
        for p in gpu.parameters():
            p.grad = None
        out = fn(xg)
        out.backward(g.cuda())
        assert_close(out.detach().cpu(), cpu(x).detach(), ACT_TOL["float32"], "out")
        assert_close(xg.grad.cpu(), xc.grad, 2 * ACT_TOL["float32"], "dx")
        for a, b in zip(gpu.parameters(), cpu.parameters()):
            assert_close(a.grad.cpu(), b.grad, COEF_TOL, "parameter gradient")


@needs_torch
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_torch_mhc_deepseek_cuda(rng, n, dt):
    """MHC(convention="deepseek") from DeepSeek-layout parameters on CUDA (fused pieces for n <= 4,
    separate ops above) against the plain-torch float64 oracle layer: values and gradients."""
    import torch

    import deepseek_oracle as O
    from mhc_cupy.torch import MHC

    from harness import TOL

    C, T = 64, 127
    m_ = n * n + 2 * n
    ds = [torch.tensor(rng.standard_normal((m_, n * C)) / np.sqrt(n * C), dtype=torch.float32),
          torch.tensor(rng.uniform(0.5, 2.0, 3), dtype=torch.float32),
          torch.tensor(rng.standard_normal(m_) * 0.5, dtype=torch.float32)]
    layer = MHC.from_deepseek(*(t.cuda() for t in ds))
    tdt = getattr(torch, dt)
    x = torch.tensor(rng.standard_normal((T, n, C)), dtype=tdt, device="cuda", requires_grad=True)
    g = torch.tensor(rng.standard_normal((T, n, C)), dtype=tdt, device="cuda")
    out = layer(x)
    out.backward(g)
    ts = [t.double().requires_grad_() for t in (x.detach().cpu(), *ds)]
    want = O.layer(*ts)
    want.backward(g.double().cpu())
    tol_out, tol_grad = TOL["layer_gpu"][dt]
    assert out.dtype == tdt
    assert_close(out.detach().cpu(), want.detach(), tol_out, "out")
    got = (x.grad, layer.phi.grad.t(), layer.alpha.grad, layer.bias.grad)
    for a, t, name in zip(got, ts, ("dx", "dhc_fn", "dhc_scale", "dhc_base")):
        assert_close(a.cpu(), t.grad, tol_grad, name)


@needs_torch
def test_torch_mhc_deepseek_deterministic(rng):
    """MHC(convention="deepseek") on CUDA: a repeated forward and backward gives the same bits."""
    import torch

    from mhc_cupy.torch import MHC

    layer = MHC(256, 4, convention="deepseek", device="cuda")
    x = torch.tensor(rng.standard_normal((2000, 4, 256)), dtype=torch.bfloat16, device="cuda")
    g = torch.randn(x.shape, dtype=torch.bfloat16, device="cuda")

    def run():
        xi = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        out = layer(xi)
        out.backward(g)
        return [out.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    first = run()
    for a, b in zip(first, run()):
        assert torch.equal(a, b)  # finite values: equal means the same bits


@pytest.mark.parametrize("x_scale", [1e10, 1e20])
def test_head_huge_tokens(rng, x_scale):
    """|x| ~ 1e20 (its float32 sum of squares overflows, and g x and the raw mix H both grow with
    |x|): the forward's scaled sum and the backward's products with H / r keep out, dx, dhc_fn,
    dhc_scale and dhc_base finite and right."""
    _check(rng, (3,), 4, 4096, "bfloat16", x_scale=x_scale)
