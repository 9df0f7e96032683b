"""The coefficient path, ``mhc_coeffs_fwd`` / ``mhc_coeffs_bwd`` (OPS.md section 8): CPU and GPU cases.

CPU (no GPU needed): CPU inputs run the float64 reference through the same planner the GPU
path uses, so these pin the API (shapes, dtypes, None gradients, zero tokens, error
messages).  Also the op through mhc_cupy.torch and mhc_cupy.jax, and the reference itself against
float64 torch autograd of a plain-torch forward (tests/paper_oracle.py).  The launch plans (layouts,
kernel choice, dry-run launches) are in tests/test_coeffs_layout.py.

GPU (``gpu_test``: skipped without a GPU; CuPy allocations NaN-poisoned, so an unwritten
element fails): the kernels against the float64 reference.  Inputs are rounded to the
activation dtype first and the reference runs on exactly those values, so what is left is
the kernels' float32 arithmetic:

* h (forward): a float32 dot product over D = n*C terms on tensor cores (phi in three bf16
  parts, each step's MMAs summed into a float32 accumulator), then at most 64 D ranges in a
  fixed order: a few units of 2^-24 times sqrt(number of terms) times the size of the terms;
  with phi ~ 1/sqrt(D) the terms are ~1/sqrt(D) and h ~ 1, which gives ~1e-6 relative.
  COEF_TOL = 1e-4 of the output scale leaves a wide margin for the general cases;
  ``test_coeffs_float32_accurate_over_long_rows`` holds h to 2e-6 at D = 131072.
* dx: dH phi^T (K float32 terms) minus c x, rounded once to the activation dtype, so
  ACT_TOL (one rounding) on the scale of its two terms (they may cancel).
* dphi: float32 sums over tokens of x dH (fixed order): COEF_TOL of its scale.
* dalpha, dbias: float32 sums over tokens (and columns) of terms of random sign; the
  scale is the root sum of squares of the terms, the natural size of such a sum.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops import _launch, coeffs
from mhc_cupy.ops.coeffs import fwd, split_bwd

from gpu.helpers import ACT_TOL, COEF_TOL, f64, rounded, to_gpu, to_host
from harness import assert_close, assert_close_uniform, assert_rounded, gpu_test
from paper_oracle import assert_reference, t_coeffs, torch_vjp

GPU = gpu_test()


# ============================================================ CPU
def _inputs(rng, lead, n, C, dtype=np.float32):
    D, K = n * C, n * n + 2 * n
    x = rng.standard_normal(lead + (n, C)).astype(dtype)
    phi = (rng.standard_normal((D, K)) / np.sqrt(D)).astype(np.float32)
    alpha = np.array([0.7, -1.3, 0.4], np.float32)
    bias = (0.1 * rng.standard_normal(K)).astype(np.float32)
    return x, phi, alpha, bias


def _grads(rng, lead, n):
    return (rng.standard_normal(lead + (n,)).astype(np.float32), rng.standard_normal(lead + (n,)).astype(np.float32),
            rng.standard_normal(lead + (n, n)).astype(np.float32))


# ------------------------------------------------ the reference against torch autograd
COEFF_SHAPES = [((0,), 4, 7), ((1,), 1, 1), ((3,), 2, 1000), ((127,), 4, 64),
                ((2, 3), 3, 7), ((3,), 16, 64)]


@pytest.mark.parametrize("lead,n,C", COEFF_SHAPES)
@pytest.mark.parametrize("present", [(1, 1, 1), (0, 1, 0)])
def test_mhc_coeffs(rng, lead, n, C, present):
    eps = 1e-5
    m = n * n + 2 * n
    x = rng.normal(size=lead + (n, C)) * 1.5
    if x.size:
        x.reshape(-1, n, C)[0] = 0.0            # an all-zero token stays finite
    phi = rng.normal(size=(n * C, m)) / np.sqrt(n * C)
    alpha = rng.normal(size=3)
    bias = rng.normal(size=m)
    out_shapes = [lead + (n,), lead + (n,), lead + (n, n)]
    grads = [rng.normal(size=s) if p else None for s, p in zip(out_shapes, present)]

    outs_ref, grads_ref = torch_vjp(
        lambda *a: t_coeffs(*a, eps), [x, phi, alpha, bias], grads)
    outs = R.mhc_coeffs_fwd(x, phi, alpha, bias, eps=eps)
    for name, a, b in zip(("h_pre_raw", "h_post_raw", "h_res_raw"), outs, outs_ref):
        assert_reference(a, b, 1e-12, name)
    ours = R.mhc_coeffs_bwd(*grads, x, phi, alpha, bias, eps=eps)
    assert len(ours) == 4
    for name, a, b in zip(("dx", "dphi", "dalpha", "dbias"), ours, grads_ref):
        assert_reference(a, b, 1e-10, name)
        assert np.all(np.isfinite(a))


# ------------------------------------------------------------ API on CPU
@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (3, 16)])
def test_numpy_matches_reference(rng, lead, n, C):
    x, phi, alpha, bias = _inputs(rng, lead, n, C)
    h = m.mhc_coeffs_fwd(x, phi, alpha, bias)
    ref = R.mhc_coeffs_fwd(x, phi, alpha, bias)
    for got, r, shape, name in zip(h, ref, (lead + (n,), lead + (n,), lead + (n, n)), ("pre", "post", "res")):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == shape, name
        assert_close(got, r, 1e-6, name, scale="max")
    g = _grads(rng, lead, n)
    got = m.mhc_coeffs_bwd(*g, x, phi, alpha, bias, eps=1e-3)
    ref = R.mhc_coeffs_bwd(*g, x, phi, alpha, bias, eps=1e-3)
    D, K = n * C, n * n + 2 * n
    for a, r, shape, dt, name in zip(got, ref, (x.shape, (D, K), (3,), (K,)),
                                     (np.float32, np.float32, np.float32, np.float32),
                                     ("dx", "dphi", "dalpha", "dbias")):
        assert a.shape == shape and a.dtype == dt, name
        assert_close(a, r, 1e-6, name, scale="max")


def test_eps_is_used(rng):
    x, phi, alpha, bias = _inputs(rng, (4,), 2, 3)
    x *= 1e-3
    a = m.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-5)[2]
    b = m.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-2)[2]
    assert_close(b, R.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-2)[2], 1e-6, "eps 1e-2", scale="max")
    assert not np.allclose(a, b)


def test_torch_cpu_bfloat16(rng):
    torch = pytest.importorskip("torch")
    n, C = 4, 8
    x, phi, alpha, bias = _inputs(rng, (3,), n, C)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    xr = xt.float().numpy()  # the values the reference sees
    h = m.mhc_coeffs_fwd(xt, torch.from_numpy(phi), torch.from_numpy(alpha), torch.from_numpy(bias))
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in h)
    for got, r in zip(h, R.mhc_coeffs_fwd(xr, phi, alpha, bias)):
        assert_close(got.numpy(), r, 1e-6, "h", scale="max")
    g = [torch.from_numpy(v) for v in _grads(rng, (3,), n)]
    dx, dphi, dalpha, dbias = m.mhc_coeffs_bwd(*g, xt, torch.from_numpy(phi), torch.from_numpy(alpha),
                                              torch.from_numpy(bias))
    assert dx.dtype == torch.bfloat16 and dx.shape == xt.shape
    assert dphi.dtype == dalpha.dtype == dbias.dtype == torch.float32
    ref = R.mhc_coeffs_bwd(*[v.numpy() for v in g], xr, phi, alpha, bias)
    assert_rounded(dx.float().numpy(), ref[0], "bfloat16")  # the float64 dx rounded once (was rtol / atol 1e-2 of max)
    for a, r in zip((dphi, dalpha, dbias), ref[1:]):
        assert_close(a.numpy(), r, 1e-6, "param grad", scale="max")


@pytest.mark.parametrize("present", [(True, False, False), (False, True, False), (False, False, True),
                                     (False, False, False)])
def test_missing_gradients_are_zero(rng, present):
    n, C = 3, 5
    x, phi, alpha, bias = _inputs(rng, (6,), n, C)
    full = _grads(rng, (6,), n)
    g = [v if p else None for v, p in zip(full, present)]
    got = m.mhc_coeffs_bwd(*g, x, phi, alpha, bias)
    ref = R.mhc_coeffs_bwd(*[v if p else np.zeros_like(v) for v, p in zip(full, present)], x, phi, alpha, bias)
    for a, r in zip(got, ref):
        assert_close(a, r, 1e-6, "grad", scale="max")
    if not any(present):
        assert all((np.asarray(a) == 0).all() for a in got)


def test_zero_tokens(rng):
    n, C = 4, 6
    x, phi, alpha, bias = _inputs(rng, (0, 3), n, C)
    h = m.mhc_coeffs_fwd(x, phi, alpha, bias)
    assert [v.shape for v in h] == [(0, 3, n), (0, 3, n), (0, 3, n, n)]
    g = _grads(rng, (0, 3), n)
    dx, dphi, dalpha, dbias = m.mhc_coeffs_bwd(*g, x, phi, alpha, bias)
    assert dx.shape == x.shape
    assert dphi.shape == phi.shape and (dphi == 0).all()
    assert (dalpha == 0).all() and (dbias == 0).all()


# ------------------------------------------------------------ validation
def _ok(rng, n=4, C=8, T=3):
    x, phi, alpha, bias = _inputs(rng, (T,), n, C)
    return dict(x=x, phi=phi, alpha=alpha, bias=bias)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: a.update(x=a["x"].astype(np.float64)), TypeError, "x has dtype float64"),
    (lambda a: a.update(x=a["x"].astype(np.int8)), TypeError, "x has dtype int8"),
    (lambda a: a.update(phi=a["phi"].astype(np.float16)), TypeError, "phi has dtype float16"),
    (lambda a: a.update(alpha=a["alpha"].astype(np.float64)), TypeError, "alpha has dtype float64"),
    (lambda a: a.update(bias=a["bias"].astype(np.float16)), TypeError, "bias has dtype float16"),
    (lambda a: a.update(phi=a["phi"][:, :-1]), ValueError, r"phi has shape \(32, 23\); it needs \(32, 24\)"),
    (lambda a: a.update(phi=a["phi"].T.copy()), ValueError, "phi has shape"),
    (lambda a: a.update(alpha=a["alpha"][:2]), ValueError, r"alpha has shape \(2,\); it needs \(3,\)"),
    (lambda a: a.update(bias=a["bias"][:-2]), ValueError, r"bias has shape \(22,\); it needs \(24,\)"),
    (lambda a: a.update(x=a["x"][0, 0]), ValueError, r"x has shape \(8,\); it needs \[\.\.\., n, C\]"),
    (lambda a: a.update(x=np.zeros((3, 4, 0), np.float32), phi=np.zeros((0, 24), np.float32)), ValueError,
     "C >= 1"),
])
def test_forward_validation(rng, change, exc, match):
    a = _ok(rng)
    change(a)
    with pytest.raises(exc, match=match):
        m.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"])


def test_n_out_of_range():
    x = np.zeros((2, 33, 1), np.float32)
    K = 33 * 33 + 66
    with pytest.raises(ValueError, match="supported n is 1 to 32"):
        m.mhc_coeffs_fwd(x, np.zeros((33, K), np.float32), np.zeros(3, np.float32), np.zeros(K, np.float32))


def test_eps_validation(rng):
    a = _ok(rng)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        m.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        m.mhc_coeffs_fwd(a["x"], a["phi"], a["alpha"], a["bias"], eps="big")


@pytest.mark.parametrize("which,bad,exc,match", [
    (0, lambda g: g.astype(np.float64), TypeError, "grad_h_pre_raw has dtype float64"),
    (1, lambda g: g[:, :3], ValueError, r"grad_h_post_raw has shape \(3, 3\); it needs \(3, 4\)"),
    (2, lambda g: g.reshape(3, 16), ValueError, r"grad_h_res_raw has shape \(3, 16\); it needs \(3, 4, 4\)"),
    (2, lambda g: g.astype(np.float16), TypeError, "grad_h_res_raw has dtype float16"),
])
def test_backward_validation(rng, which, bad, exc, match):
    a = _ok(rng)
    g = list(_grads(rng, (3,), 4))
    g[which] = bad(g[which])
    with pytest.raises(exc, match=match):
        m.mhc_coeffs_bwd(*g, a["x"], a["phi"], a["alpha"], a["bias"])


def test_exports():
    assert "mhc_coeffs_fwd" in m.__all__ and "mhc_coeffs_bwd" in m.__all__
    assert m.mhc_coeffs_fwd is coeffs.mhc_coeffs_fwd


# ------------------------------------------------- through the adapters (CPU)
def test_torch_forward_backward_and_compile(rng):
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt

    x, phi, alpha, bias = (torch.from_numpy(a).requires_grad_() for a in _inputs(rng, (2, 3), 3, 7))
    outs = mt.mhc_coeffs(x, phi, alpha, bias)
    for got, ref in zip(outs, R.mhc_coeffs_fwd(*(t.detach().numpy() for t in (x, phi, alpha, bias)))):
        np.testing.assert_allclose(got.detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    g_pre, g_res = torch.randn_like(outs[0]), torch.randn_like(outs[2])
    loss = (outs[0] * g_pre).sum() + (outs[2] * g_res).sum()  # h_post_raw unused: a None gradient
    grads = torch.autograd.grad(loss, (x, phi, alpha, bias))
    ref = R.mhc_coeffs_bwd(g_pre.numpy(), None, g_res.numpy(), *(t.detach().numpy() for t in (x, phi, alpha, bias)))
    for got, r in zip(grads, ref):
        np.testing.assert_allclose(got.numpy(), r, rtol=1e-4, atol=1e-4)
    compiled = torch.compile(lambda *a: mt.mhc_coeffs(*a)[2].sum(), backend="aot_eager", fullgraph=True)
    grads_c = torch.autograd.grad(compiled(x, phi, alpha, bias), (x, phi))
    grads_e = torch.autograd.grad(mt.mhc_coeffs(x, phi, alpha, bias)[2].sum(), (x, phi))
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("jax_on_cpu")
def test_jax_jit_grad_vmap(rng):
    jax = pytest.importorskip("jax")
    import mhc_cupy.jax as mj

    x, phi, alpha, bias = _inputs(rng, (5,), 4, 16)
    for got, ref in zip(mj.mhc_coeffs(x, phi, alpha, bias), R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)

    def loss(x, phi, alpha, bias):
        a, _, c = mj.mhc_coeffs(x, phi, alpha, bias)
        return (a**2).sum() + (1.5 * c).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, phi, alpha, bias)
    h_pre = R.mhc_coeffs_fwd(x, phi, alpha, bias)[0]
    ref = R.mhc_coeffs_bwd(2 * h_pre, None, np.full((5, 4, 4), 1.5), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(got), r, rtol=1e-4, atol=1e-4)
    xb = np.stack([x, -2 * x])
    batched = jax.vmap(lambda xx: mj.mhc_coeffs(xx, phi, alpha, bias))(xb)
    np.testing.assert_allclose(np.asarray(batched[2][1]), R.mhc_coeffs_fwd(-2 * x, phi, alpha, bias)[2],
                               rtol=1e-5, atol=1e-5)
    per_example = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None, None, None))(xb, phi, alpha, bias)
    np.testing.assert_allclose(np.asarray(per_example[1]), np.asarray(jax.grad(loss, argnums=1)(-2 * x, phi, alpha, bias)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("jax_on_cpu")
def test_jax_mhc_layer_matches_reference(rng):
    """mhc_cupy.jax.mhc_layer = H_res x + H_post^T f(H_pre x) with coefficients from the coefficient path."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import mhc_cupy.jax as mj

    n, C = 4, 16
    params = mj.mhc_init(jax.random.PRNGKey(0), C, n)
    params["alpha"] = jnp.asarray([0.5, 0.4, 0.3], jnp.float32)  # away from init, so every path matters
    x = rng.standard_normal((3, n, C)).astype(np.float32)
    W = (rng.standard_normal((C, C)) * 0.3).astype(np.float32)

    def f(h):
        return jnp.tanh(h @ W)

    out = mj.mhc_layer(params, x, f)
    p = {k: np.asarray(v) for k, v in params.items()}
    h = R.mhc_coeffs_fwd(x, p["phi"], p["alpha"], p["bias"])
    layer_in, _, H_post, H_res = R.mhc_pre_op_fwd(x, *h)
    ref = R.mhc_post_op_fwd(np.tanh(layer_in @ W), x, H_post, H_res)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    # differentiable end to end, under jit
    g = jax.jit(jax.grad(lambda p_, x_: mj.mhc_layer(p_, x_, f).sum()))(params, x)
    assert all(np.isfinite(np.asarray(v)).all() for v in g.values())
    # at init the layer is close to a plain residual x + f(mean of streams) for equal streams
    init = mj.mhc_init(jax.random.PRNGKey(1), C, n)
    xe = np.repeat(rng.standard_normal((3, 1, C)).astype(np.float32), n, axis=1)
    np.testing.assert_allclose(np.asarray(mj.mhc_layer(init, xe, f)), xe + np.tanh(xe @ W), atol=0.05)

# ============================================================ GPU
DTYPES = ["bfloat16", "float16", "float32"]
NS = [1, 2, 3, 4, 8]
# (tokens, C): C = 1 and 7 give D with no vector path for odd n (scalar loads); 64, 1000
# the vectorised one; T = 1 and 3 split D over blocks (few token tiles), T = 127 / 1000
# several token tiles (T = 1000 with C = 1000 also splits D, and splits the dphi sum over tokens).
SIZES = [(1, 1), (3, 7), (127, 64), (1000, 1000)]
ALPHA = np.array([0.7, -1.3, 0.4], np.float32)


def _case(rng, T, n, C, dt, lead=None):
    lead = (T,) if lead is None else lead
    D, K = n * C, n * n + 2 * n
    x = rounded(rng, lead + (n, C), dt)
    phi = (rng.standard_normal((D, K)) / np.sqrt(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(K)).astype(np.float32)
    g = (rng.standard_normal(lead + (n,)).astype(np.float32), rng.standard_normal(lead + (n,)).astype(np.float32),
         rng.standard_normal(lead + (n, n)).astype(np.float32))
    return x, phi, ALPHA.copy(), bias, g


def _terms(g, x, phi, alpha, eps=1e-5):
    """Sizes of the terms behind dx, dalpha, dbias (for the tolerance scales)."""
    n, C = x.shape[-2], x.shape[-1]
    K = n * n + 2 * n
    xt = f64(x).reshape(-1, n * C)
    gh = np.concatenate([f64(v).reshape(-1, w) if v is not None else np.zeros((xt.shape[0], w))
                         for v, w in zip(g, (n, n, n * n))], -1)
    a = np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(n * n, alpha[2])])
    H = xt @ f64(phi)
    rinv = 1 / np.sqrt(np.mean(xt**2, -1, keepdims=True) + eps)
    dH = gh * a * rinv
    s = (gh * a * H).sum(-1, keepdims=True)
    dx_scale = max(float(np.sqrt(np.mean((dH @ f64(phi).T) ** 2))), float(np.sqrt(np.mean((s * rinv**3 * xt / (n * C)) ** 2))))
    alpha_scale = float(np.sqrt(np.sum((gh * H * rinv) ** 2)))
    bias_scale = float(np.sqrt(np.sum(gh**2) / K))
    return dx_scale, alpha_scale, bias_scale


def _check_bwd(got, ref, g, x, phi, alpha, dt, what=""):
    dx_scale, alpha_scale, bias_scale = _terms(g, x, phi, alpha)
    assert got[0].dtype == x.dtype
    assert_close(got[0], ref[0], 2 * ACT_TOL[dt], what + "dx", scale=dx_scale)
    assert_close(got[1], ref[1], COEF_TOL, what + "dphi")
    assert_close(got[2], ref[2], COEF_TOL, what + "dalpha", scale=alpha_scale)
    assert_close(got[3], ref[3], COEF_TOL, what + "dbias", scale=bias_scale)


def _run(x, phi, alpha, bias, g):
    gpu = [to_gpu(v) for v in (x, phi, alpha, bias)]
    h = m.mhc_coeffs_fwd(*gpu)
    grads = m.mhc_coeffs_bwd(*[None if v is None else to_gpu(v) for v in g], *gpu)
    return h, grads


def _check(rng, T, n, C, dt, lead=None):
    x, phi, alpha, bias, g = _case(rng, T, n, C, dt, lead)
    h, got = _run(x, phi, alpha, bias, g)
    for a, b, name in zip(h, R.mhc_coeffs_fwd(x, phi, alpha, bias), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert a.dtype == np.float32
        assert_close(a, b, COEF_TOL, name)
    _check_bwd(got, R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt)


@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("T,C", SIZES)
def test_coeffs(rng, dt, n, T, C):
    _check(rng, T, n, C, dt)


@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 1000])
def test_coeffs_wide(rng, dt, T):
    """n = 4, C = 4096 (D = 16384): many steps per block; T = 1000 splits D and the dphi sum."""
    _check(rng, T, 4, 4096, dt)


@GPU
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T,C", [(3, 32768), (1000, 4096)])
def test_coeffs_float32_accurate_over_long_rows(rng, dt, T, C):
    """h to ~float32 accuracy at D = n*C up to 131072: a float32 sum of D terms in any sane order
    is good to a few 1e-7 of max |h| here (H~ ~ 1).  The tensor cores' own accumulation truncates;
    summing a D range's thousands of MMAs in it gave 1e-5 .. 4e-5 (H200), so each step's MMAs go
    into a fresh accumulator added in float32.  2e-6 fails the truncating sum and passes the fix."""
    n = 4
    x, phi, alpha, bias, _ = _case(rng, T, n, C, dt)
    got = m.mhc_coeffs_fwd(*(to_gpu(v) for v in (x, phi, alpha, bias)))
    for a, r, what in zip(got, R.mhc_coeffs_fwd(x, phi, alpha, bias), ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert_close(to_host(a), r, 2e-6, what, scale="max")


@GPU
@pytest.mark.parametrize("n,T,C,dt", [(16, 127, 64, "bfloat16"), (16, 3, 1000, "bfloat16"), (5, 50, 33, "bfloat16"),
                                      (32, 2, 16, "bfloat16"), (6, 127, 40, "float16"), (7, 33, 24, "float32"),
                                      (17, 20, 8, "float32")])
def test_coeffs_large_n(rng, n, T, C, dt):
    """n > 4: column chunks in the forward, the separate dx / dphi kernels in the backward (dx with phi
    resident, 2 or 1 streams per block, for n = 5, 6 here; with phi streamed for float32 n = 7 and
    n = 16, 17, 32)."""
    _check(rng, T, n, C, dt)


@GPU
@pytest.mark.parametrize("n,T,C", [(1, 1, 8), (4, 3, 264), (4, 127, 72), (4, 1000, 4096), (8, 200, 2048), (7, 65, 56),
                                   (16, 127, 64), (17, 33, 40), (32, 5, 16)])
def test_forward_gemm_wgmma_matches_mma_sync(rng, monkeypatch, n, T, C):
    """bf16: the forward GEMM on wgmma (sm_90a devices) and on mma.sync give the same raw
    coefficients to float32 accuracy (both float32-accurate products; the sums differ in order), and
    both match the float64 reference.  Tokens not a multiple of 64, D splits (T = 1000, C = 4096),
    several column chunks (n >= 10); narrow GEMMs (n < 7) too, which the library gives the mma.sync kernel."""
    import cupy

    from mhc_cupy import _dispatch, _jit

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma is an sm_90 (H100 / H200) instruction")
    assert _jit.uses_wgmma()
    x, phi, alpha, bias, _ = _case(rng, T, n, C, "bfloat16")
    args = [to_gpu(v) for v in (x, phi, alpha, bias)]
    got = {}
    monkeypatch.setattr(fwd, "_WG_MIN_K", 0)
    monkeypatch.setattr(_dispatch, "_plans", {})  # plans made with the library's _WG_MIN_K
    monkeypatch.setattr(_dispatch, "_fast", {})
    for on in (True, False):  # the plan caches key on the kernel choice: nothing to clear between the two
        with kernel_choice(wg_fwd=on):
            got[on] = [to_host(a) for a in m.mhc_coeffs_fwd(*args)]
    ref = R.mhc_coeffs_fwd(x, phi, alpha, bias)
    for a, b, r, what in zip(got[True], got[False], ref, ("h_pre_raw", "h_post_raw", "h_res_raw")):
        assert_close(a, r, COEF_TOL, what)
        assert_close(a, b, 2e-6, what, scale="max")
    # x one bf16 past an aligned address (the element-wise fills): the same sums, the same bits
    flat = to_gpu(np.concatenate([np.zeros(1, x.dtype), x.reshape(-1)]))
    shifted = flat[1:].reshape(x.shape)
    with kernel_choice(wg_fwd=True):
        for a, b in zip(got[True], (to_host(v) for v in m.mhc_coeffs_fwd(shifted, *args[1:]))):
            assert a.tobytes() == b.tobytes()


@GPU
@pytest.mark.parametrize("n,T,C", [(5, 127, 64), (6, 3, 40), (7, 65, 24), (8, 300, 72), (8, 1, 8), (9, 200, 56),
                                   (9, 129, 8)])
def test_dx_wgmma_matches_mma_sync(rng, monkeypatch, n, T, C):
    """bf16, n >= 5: the dx on wgmma (sm_90a devices; mhc_coeffs_wg_dx_kernel, counted) and on mma.sync
    agree to one rounding of bf16 (the same float32-accurate products summed in another order) and
    both match the float64 reference; dphi, dalpha, dbias come from the same kernels (same bits).
    Through mhc_layer_pre_bwd too, with every layer term (g_layer_in, grad_out, grad_x) under both
    conventions (deepseek: H_res transposed; test_layer_fused holds the layer's dx to the float64
    reference at n = 8).  Tokens 1, 3 and not a multiple of 64 (partial tiles), D not a multiple of
    128 (a block's positions past D)."""
    import cupy

    from mhc_cupy import _dispatch, _jit

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma is an sm_90 (H100 / H200) instruction")
    assert _jit.uses_wgmma()
    seen = []
    real_launch = _launch.launch

    def counting(filename, expr, *a, **k):
        seen.append(expr.split("<")[0])
        return real_launch(filename, expr, *a, **k)

    monkeypatch.setattr(_launch, "launch", counting)  # every KernelSpec launches through it
    x, phi, alpha, bias, g = _case(rng, T, n, C, "bfloat16")
    gpu = [to_gpu(v) for v in (x, phi, alpha, bias)]
    gl = rounded(rng, (T, C), "bfloat16"), rounded(rng, (T, n, C), "bfloat16"), rounded(rng, (T, n, C), "bfloat16")
    gl_d = [to_gpu(v) for v in gl]
    got = {}
    # fresh caches: a replayed fast-path entry would launch without passing through the counter
    monkeypatch.setattr(_dispatch, "_plans", {})
    monkeypatch.setattr(_dispatch, "_fast", {})
    for on in (True, False):  # each choice plans afresh (the plan caches key on it)
        seen.clear()
        with kernel_choice(wg_dx=on):
            got[on] = [[to_host(a) for a in m.mhc_coeffs_bwd(*[to_gpu(v) for v in g], *gpu)]]
            for conv in ("paper", "deepseek"):
                layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(*gpu, convention=conv)
                _, dH_post, dH_res = m.mhc_layer_post_bwd(gl_d[1], layer_in, gpu[0], H_post, H_res, convention=conv)
                got[on].append([to_host(a) for a in m.mhc_layer_pre_bwd(gl_d[0], gl_d[1], dH_post, dH_res, *gpu,
                                                                         stats, H_pre, H_res, convention=conv,
                                                                         grad_x=gl_d[2])])
        assert seen.count("mhc_coeffs_wg_dx_kernel") == (3 if on else 0)
    ref = R.mhc_coeffs_bwd(*g, x, phi, alpha, bias)
    for on in (True, False):
        _check_bwd(got[on][0], ref, g, x, phi, alpha, "bfloat16")
    dx_scale = _terms(g, x, phi, alpha)[0]
    for k, what in ((0, "coeffs "), (1, "layer paper "), (2, "layer deepseek ")):
        a, b = got[True][k], got[False][k]
        scale = dx_scale if k == 0 else max(float(np.abs(f64(b[0])).max()), 1e-30)
        assert np.isfinite(f64(a[0])).all(), what + "dx"
        assert_close(a[0], b[0], ACT_TOL["bfloat16"], what + "dx", scale=scale)
        assert (a[0] != b[0]).mean() < 0.05, what + "dx: most values the same bits"
        for u, v, name in zip(a[1:], b[1:], ("dphi", "dalpha", "dbias")):
            assert u.tobytes() == v.tobytes(), what + name


@GPU
@pytest.mark.parametrize("n,T,C,dt", [(8, 300, 72, "bfloat16"), (6, 77, 40, "float16"), (8, 50, 36, "float32")])
def test_dx_column_tiles_bitwise(rng, monkeypatch, n, T, C, dt):
    """mhc_coeffs_mma_dx_kernel with 64 columns per warp (NT = 8) gives the dx of the 32-column one
    the library runs (NT = 4), bit for bit (the same sums in the same order); C not a multiple of
    either, 300 tokens wrap the stage ring."""
    from mhc_cupy import _dispatch

    x, phi, alpha, bias, g = _case(rng, T, n, C, dt)
    args = [to_gpu(v) for v in (*g, x, phi, alpha, bias)]
    got = {}
    for nt in (4, 8):
        monkeypatch.setattr(split_bwd, "_DX_NT", nt)
        monkeypatch.setattr(_dispatch, "_plans", {})
        monkeypatch.setattr(_dispatch, "_fast", {})
        with kernel_choice(wg_dx=False):  # the mma.sync dx kernels (bf16 on sm_90a: the wgmma dx)
            got[nt] = [to_host(a) for a in m.mhc_coeffs_bwd(*args)]
    for a, b, what in zip(got[4], got[8], ("dx", "dphi", "dalpha", "dbias")):
        assert a.tobytes() == b.tobytes(), what
    _check_bwd(got[4], R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt)


@GPU
def test_leading_dims(rng):
    _check(rng, None, 4, 64, "bfloat16", lead=(2, 3, 5))


@GPU
@pytest.mark.parametrize("present", [(True, False, False), (False, True, False), (False, False, True),
                                     (False, False, False)])
def test_missing_gradients(rng, present):
    n, T, C = 4, 77, 96
    x, phi, alpha, bias, g = _case(rng, T, n, C, "bfloat16")
    g = tuple(v if p else None for v, p in zip(g, present))
    _, got = _run(x, phi, alpha, bias, g)
    ref = R.mhc_coeffs_bwd(*g, x, phi, alpha, bias)
    if any(present):
        _check_bwd(got, ref, g, x, phi, alpha, "bfloat16")
    else:
        for a in got:
            assert (f64(to_host(a)) == 0).all()


@GPU
def test_zero_tokens_on_gpu(rng):
    x, phi, alpha, bias, g = _case(rng, 0, 4, 64, "bfloat16")
    h, got = _run(x, phi, alpha, bias, g)
    assert [v.shape for v in h] == [(0, 4), (0, 4), (0, 4, 4)]
    assert got[0].shape == x.shape
    for a in got[1:]:  # written, not left poisoned
        assert (to_host(a) == 0).all()


@GPU
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_offset_views(rng, dt):
    """x one element off alignment (scalar path) and phi one float off: same as contiguous."""
    import cupy as cp

    n, T, C = 4, 37, 1000
    x, phi, alpha, bias, g = _case(rng, T, n, C, dt)
    xbuf = to_gpu(np.concatenate([rounded(rng, (1,), dt), x.reshape(-1)]))
    x_off = xbuf[1:].reshape(x.shape)
    pbuf = to_gpu(np.concatenate([np.zeros(1, np.float32), phi.reshape(-1)]))
    phi_off = pbuf[1:].reshape(phi.shape)
    h = m.mhc_coeffs_fwd(x_off, phi_off, to_gpu(alpha), to_gpu(bias))
    for a, b in zip(h, R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        assert_close(a, b, COEF_TOL, "h offset")
    got = m.mhc_coeffs_bwd(*[to_gpu(v) for v in g], x_off, phi_off, to_gpu(alpha), to_gpu(bias))
    _check_bwd(got, R.mhc_coeffs_bwd(*g, x, phi, alpha, bias), g, x, phi, alpha, dt, "offset ")
    # a non-contiguous x (copied by the dispatcher) gives the same bits as the contiguous one
    x_t = cp.ascontiguousarray(to_gpu(x).transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not x_t.flags.c_contiguous
    a = m.mhc_coeffs_fwd(x_t, to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    b = m.mhc_coeffs_fwd(to_gpu(x), to_gpu(phi), to_gpu(alpha), to_gpu(bias))
    for u, v in zip(a, b):
        assert np.array_equal(to_host(u), to_host(v))


@GPU
def test_all_zero_token_stays_finite(rng):
    """eps keeps r > 0: a zero token gives h = bias and finite gradients."""
    x, phi, alpha, bias, g = _case(rng, 5, 4, 64, "float32")
    x[2] = 0
    h, got = _run(x, phi, alpha, bias, g)
    assert np.allclose(to_host(h[0])[2], bias[:4]) and np.allclose(to_host(h[2])[2].reshape(-1), bias[8:])
    for a in got:
        assert np.isfinite(f64(to_host(a))).all()


@GPU
def test_bitwise_deterministic(rng):
    """Identical calls give identical bits (fixed-order sums, no atomics), on every path:
    D ranges + finish kernel (T = 1000, C = 1000), token splits of dphi + column sums."""
    n, T, C = 4, 1000, 1000
    x, phi, alpha, bias, g = _case(rng, T, n, C, "bfloat16")
    first = [to_host(a) for a in (*_run(x, phi, alpha, bias, g)[0], *_run(x, phi, alpha, bias, g)[1])]
    second = [to_host(a) for a in (*_run(x, phi, alpha, bias, g)[0], *_run(x, phi, alpha, bias, g)[1])]
    for a, b in zip(first, second):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    x8, phi8, alpha8, bias8, g8 = _case(rng, 300, 8, 100, "bfloat16")
    a = [to_host(v) for v in _run(x8, phi8, alpha8, bias8, g8)[1]]
    b = [to_host(v) for v in _run(x8, phi8, alpha8, bias8, g8)[1]]
    for u, v in zip(a, b):
        assert np.array_equal(u.view(np.uint8), v.view(np.uint8))


@GPU
def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    n, T, C = 4, 64, 256
    x, phi, alpha, bias, g = _case(rng, T, n, C, "float32")
    t = [torch.from_numpy(v).cuda() for v in (x, phi, alpha, bias)]
    xb = t[0].to(torch.bfloat16)
    h = m.mhc_coeffs_fwd(xb, *t[1:])
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in h)
    xr = xb.float().cpu().numpy()
    for a, b in zip(h, R.mhc_coeffs_fwd(xr, phi, alpha, bias)):
        assert_close(a.cpu().numpy(), b, COEF_TOL, "torch h")
    got = m.mhc_coeffs_bwd(*[torch.from_numpy(v).cuda() for v in g], xb, *t[1:])
    assert got[0].dtype == torch.bfloat16
    host = [got[0].float().cpu().numpy()] + [v.cpu().numpy() for v in got[1:]]
    _check_bwd(host, R.mhc_coeffs_bwd(*g, xr, phi, alpha, bias), g, xr, phi, alpha, "bfloat16", "torch ")

# ------------------------------------------------- through the adapters (GPU)
def _rms(a):
    """The uniform bound's scale of the adapter checks: rms of the reference (max error <= tol * rms)."""
    return float(np.sqrt(np.mean(np.square(f64(a)))))


@GPU
def test_torch_cuda(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import mhc_cupy.torch as mt

    x, phi, alpha, bias = _inputs(rng, (37,), 4, 1000)
    xt = torch.from_numpy(x).cuda().requires_grad_()
    pt, at, bt = (torch.from_numpy(a).cuda().requires_grad_() for a in (phi, alpha, bias))
    outs = mt.mhc_coeffs(xt, pt, at, bt)
    for got, ref in zip(outs, R.mhc_coeffs_fwd(x, phi, alpha, bias)):
        assert_close_uniform(got.detach().cpu().numpy(), ref, 1e-4, scale=_rms(ref))
    g = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(sum((o * gi).sum() for o, gi in zip(outs, g)), (xt, pt, at, bt))
    ref = R.mhc_coeffs_bwd(*(gi.cpu().numpy() for gi in g), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        assert_close_uniform(got.cpu().numpy(), r, 1e-4, scale=_rms(r))


@GPU
def test_jax_gpu(rng):
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("jax has no GPU")
    import mhc_cupy.jax as mj

    x, phi, alpha, bias = _inputs(rng, (37,), 4, 1000)

    def loss(x, phi, alpha, bias):
        a, b, c = mj.mhc_coeffs(x, phi, alpha, bias)
        return (a**2).sum() + b.sum() + (1.5 * c).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jax.device_put(a) for a in (x, phi, alpha, bias)))
    h_pre = R.mhc_coeffs_fwd(x, phi, alpha, bias)[0]
    ref = R.mhc_coeffs_bwd(2 * h_pre, np.ones_like(h_pre), np.full((x.shape[0], 4, 4), 1.5), x, phi, alpha, bias)
    for got, r in zip(grads, ref):
        assert_close_uniform(np.asarray(got), r, 1e-4, scale=_rms(r))
