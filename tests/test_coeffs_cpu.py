"""The coefficient path (OPS.md section 8) on CPU: the functional API, its validation and
its launch plans (no GPU needed).

CPU inputs run the float64 reference through the same planner the GPU path uses, so
these tests pin the API (shapes, dtypes, None gradients, zero tokens, error messages);
the reference itself is checked against torch autograd in tests/test_reference.py.
The launch-plan tests check the index layout invariants the kernels rely on.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _kernels
from mhc_cupy import reference as R
from mhc_cupy._interop import ArrayInfo
from mhc_cupy.ops import coeffs


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


def _close(got, ref, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: {got.shape} != {ref.shape}"
    # outputs are the float64 reference rounded once to their dtype
    assert np.allclose(got, ref, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(ref).max(initial=0))), what


# ------------------------------------------------------------ API on CPU
@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (3, 16)])
def test_numpy_matches_reference(rng, lead, n, C):
    x, phi, alpha, bias = _inputs(rng, lead, n, C)
    h = m.mhc_coeffs_fwd(x, phi, alpha, bias)
    ref = R.mhc_coeffs_fwd(x, phi, alpha, bias)
    for got, r, shape, name in zip(h, ref, (lead + (n,), lead + (n,), lead + (n, n)), ("pre", "post", "res")):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == shape, name
        _close(got, r, name)
    g = _grads(rng, lead, n)
    got = m.mhc_coeffs_bwd(*g, x, phi, alpha, bias, eps=1e-3)
    ref = R.mhc_coeffs_bwd(*g, x, phi, alpha, bias, eps=1e-3)
    D, K = n * C, n * n + 2 * n
    for a, r, shape, dt, name in zip(got, ref, (x.shape, (D, K), (3,), (K,)),
                                     (np.float32, np.float32, np.float32, np.float32),
                                     ("dx", "dphi", "dalpha", "dbias")):
        assert a.shape == shape and a.dtype == dt, name
        _close(a, r, name)


def test_eps_is_used(rng):
    x, phi, alpha, bias = _inputs(rng, (4,), 2, 3)
    x *= 1e-3
    a = m.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-5)[2]
    b = m.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-2)[2]
    _close(b, R.mhc_coeffs_fwd(x, phi, alpha, bias, 1e-2)[2], "eps 1e-2")
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
        _close(got.numpy(), r, "h")
    g = [torch.from_numpy(v) for v in _grads(rng, (3,), n)]
    dx, dphi, dalpha, dbias = m.mhc_coeffs_bwd(*g, xt, torch.from_numpy(phi), torch.from_numpy(alpha),
                                              torch.from_numpy(bias))
    assert dx.dtype == torch.bfloat16 and dx.shape == xt.shape
    assert dphi.dtype == dalpha.dtype == dbias.dtype == torch.float32
    ref = R.mhc_coeffs_bwd(*[v.numpy() for v in g], xr, phi, alpha, bias)
    np.testing.assert_allclose(dx.float().numpy(), ref[0], rtol=1e-2, atol=1e-2 * np.abs(ref[0]).max())
    for a, r in zip((dphi, dalpha, dbias), ref[1:]):
        _close(a.numpy(), r, "param grad")


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
        _close(a, r, "grad")
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


# ------------------------------------------------------------ launch plans
def _info(shape, dtype="float32", ptr=1 << 20):
    return ArrayInfo(tuple(shape), dtype, ("cuda", 0), ptr, None)


@pytest.mark.parametrize("tokens", [1, 3, 31, 32, 33, 1000, 100_000])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (4, 1000), (4, 4096), (8, 4096), (32, 64)])
def test_mma_layout_covers_everything_once(tokens, n, C):
    D, K = n * C, coeffs.columns(n)
    L = coeffs.mma_layout(tokens, D, K)
    assert L.ntile <= 6 and L.ncc * L.ntile * 8 == L.Kp >= K  # every column in exactly one chunk
    assert L.Kp - K < 8 * L.ncc  # chunks nearly equal: less than one 8-column tile of padding per chunk
    assert L.tiles * 128 >= tokens > (L.tiles - 1) * 128
    assert L.d_split % 32 == 0 and L.Dp % 32 == 0 and L.Dp >= D  # whole steps; the planes cover D
    assert L.splits * L.d_split >= D > (L.splits - 1) * L.d_split  # no empty D range
    assert 1 <= L.splits <= 64 and L.ncc * L.tiles * L.splits <= 2**31 - 1
    if L.ncc * L.tiles >= 1024:
        assert L.splits == 1  # split D only to fill the GPU


@pytest.mark.parametrize("tokens", [0, 1, 63, 65, 5000, 10**6])
@pytest.mark.parametrize("n,C", [(1, 1), (2, 7), (4, 4096), (4, 7168)])
def test_mma_token_splits(tokens, n, C):
    K = coeffs.columns(n)
    splits, per = coeffs.mma_token_splits(tokens, n, C, K)
    assert splits >= 1 and per >= 16 and per % 16 == 0
    assert splits * per >= tokens > (splits - 1) * per or tokens == 0
    assert splits == 1 or splits * n * C * K <= 16 * 2**20  # partials bounded (64 MiB)


@pytest.mark.parametrize("tokens", [0, 1, 63, 65, 5000, 10**6])
@pytest.mark.parametrize("n,C", [(1, 1), (4, 7), (4, 4096), (8, 4096), (32, 4096)])
def test_token_splits(tokens, n, C):
    D, K = n * C, coeffs.columns(n)
    splits, per = coeffs.token_splits(tokens, D, K, 1)
    assert splits >= 1 and per >= 1
    assert splits * per >= tokens > (splits - 1) * per or tokens == 0
    assert splits == 1 or splits * D * K <= 16 * 2**20  # partials bounded (64 MiB)


def _record(planner, infos, **params):
    from mhc_cupy import _jit

    with _jit.dry_run() as launches:
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
        assert "mhc_coeffs_mma_bwd_kernel" in names and "mhc_coeffs_bwd_dx_kernel" not in names
    else:
        assert {"mhc_coeffs_transpose_kernel", "mhc_coeffs_bwd_dx_kernel", "mhc_coeffs_bwd_dphi_kernel"} <= set(names)
    scratch_bytes = sum(4 * int(np.prod(s)) for s, _ in plan.scratch.values())
    assert scratch_bytes <= 4 * (64 * T * (K + 1) + T * (K + 8) + 16 * 2**20 + D * K) + 12 * (D + 32) * (K + 16) \
        + 12 * (T + 16) * (K + 16)
    for expr, grid, block, args in calls:
        assert 1 <= grid[0] <= 2**31 - 1 and grid[1] <= 65535 and block[0] * block[1] <= 1024


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
    specs = [e for f, e in _kernels.all_specialisations() if f == "coeffs.cu"]
    for name in ("mhc_coeffs_mma_fwd_kernel<__nv_bfloat16,true,2,3,4>", "mhc_coeffs_fwd_finish_kernel",
                 "mhc_coeffs_bwd_prep_kernel", "mhc_coeffs_mma_bwd_kernel<__nv_bfloat16,__nv_bfloat16,true,false,2,3,3>",
                 "mhc_coeffs_bwd_dx_kernel<__nv_bfloat16,__nv_bfloat16,2,16,false>", "mhc_coeffs_transpose_kernel",
                 "mhc_coeffs_zero_kernel", "mhc_coeffs_split_phi_fwd_kernel", "mhc_coeffs_split_rows_kernel",
                 "mhc_coeffs_split_cols_kernel"):
        assert name in specs, name
