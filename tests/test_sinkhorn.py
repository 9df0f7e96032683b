"""Sinkhorn-Knopp, ``sinkhorn_knopp_fwd`` / ``sinkhorn_knopp_bwd`` (OPS.md section 1): CPU and GPU cases.

CPU: the float64 NumPy reference against float64 torch autograd of the plain-torch oracle
(``mhc_cupy.torch.reference.sinkhorn_reference``), unrolled and implicit gradients, on fresh
random logits seeded per test.

GPU (``gpu_test``: skipped without a GPU, CuPy allocations NaN-poisoned): the kernels against
the float64 reference on the same float32 logits; what is left is float32 arithmetic through
the normalisation steps (``SINKHORN_TOL``, relative to the scale).  The DeepSeek-V4 convention's
Sinkhorn (softmax start) is in tests/test_deepseek.py (CPU) and tests/test_deepseek_gpu.py (GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy.torch.reference import sinkhorn_reference

from gpu.helpers import NS, SINKHORN_TOL, assert_close, coef, f64, to_gpu, to_host
from harness import gpu_test
from paper_oracle import LEADS, assert_reference, torch_vjp

GPU = gpu_test()


# ============================================================ CPU
def test_num_iters_tensor_changed_in_place_is_read_again(rng):
    """num_iters may be any integer with __index__, a 0-d torch tensor too; but the plan cache (and the
    settings' cache) keyed on it, and a tensor hashes by identity: after it.fill_(20) the same tensor
    got the num_iters=0 plan, silently. Such values are read afresh each call."""
    import mhc_cupy.torch as mt

    L = rng.standard_normal((3, 4, 4)).astype(np.float32)
    G = rng.standard_normal((3, 4, 4)).astype(np.float32)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    h = rng.standard_normal((3, 4)).astype(np.float32)
    calls = {
        "fwd": lambda it: m.sinkhorn_knopp_fwd(L, it),
        "bwd": lambda it: m.sinkhorn_knopp_bwd(G, L, it),
        "pre": lambda it: m.mhc_pre_op_fwd(x, h, h, L, it)[3],
        "torch": lambda it: mt.sinkhorn_knopp(torch.from_numpy(L), it).numpy(),
    }
    for name, f in calls.items():
        it = torch.tensor(0)
        f(it)
        it.fill_(20)
        np.testing.assert_array_equal(f(it), f(20), err_msg=name)


# ----------------------------------------------------------------------------------------------
# the reference against float64 torch autograd
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead", LEADS + [()])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_fwd_columns_and_torch(rng, lead, n):
    L = rng.normal(size=lead + (n, n)) * 3
    P = R.sinkhorn_knopp_fwd(L)
    assert P.shape == L.shape and P.dtype == np.float64
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-6)
    ref = sinkhorn_reference(torch.tensor(L), 20, 1e-8).numpy()
    assert_reference(P, ref, 1e-12)


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_sinkhorn_fwd_converged_rows_and_cols(rng, n):
    L = rng.normal(size=(5, n, n))
    P = R.sinkhorn_knopp_fwd(L, num_iters=300, eps=1e-12)
    np.testing.assert_allclose(P.sum(-1), 1.0, atol=1e-8)
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-8)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_sinkhorn_large_logits_finite(rng, n):
    L = rng.normal(size=(7, n, n)) * 100
    assert L.max() > 88
    P = R.sinkhorn_knopp_fwd(L)
    assert np.all(np.isfinite(P))
    np.testing.assert_allclose(P.sum(-2), 1.0, atol=1e-6)
    # torch of the same (shifted) forward agrees, and the gradient is finite
    G = rng.normal(size=L.shape)
    for mode in ("unrolled", "implicit"):
        assert np.all(np.isfinite(R.sinkhorn_knopp_bwd(G, L, grad_mode=mode)))
    L32 = L.astype(np.float32)
    assert np.all(np.isfinite(R.sinkhorn_knopp_fwd(L32)))
    # (the comparisons the comment above names: P and both gradients against float64 torch)
    assert_reference(P, sinkhorn_reference(torch.tensor(L), 20, 1e-8).numpy(), 1e-12)
    _, (ref,) = torch_vjp(lambda l: sinkhorn_reference(l, 20, 1e-8), [L], [G])
    assert_reference(R.sinkhorn_knopp_bwd(G, L), ref, 1e-9)


@pytest.mark.parametrize("mode", ["unrolled", "implicit"])
def test_sinkhorn_n1(rng, mode):
    L = rng.normal(size=(4, 1, 1)) * 50
    P = R.sinkhorn_knopp_fwd(L)
    np.testing.assert_allclose(P, 1.0, atol=1e-7)
    d = R.sinkhorn_knopp_bwd(rng.normal(size=L.shape), L, grad_mode=mode)
    assert d.shape == L.shape
    np.testing.assert_allclose(d, 0.0, atol=1e-14)


def test_sinkhorn_num_iters_0(rng):
    L = rng.normal(size=(3, 4, 4)) * 5
    P = R.sinkhorn_knopp_fwd(L, num_iters=0)
    np.testing.assert_array_equal(P, np.exp(L - L.max(-1, keepdims=True)))


@pytest.mark.parametrize("scale", [1.0, 6.0])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("num_iters", [0, 1, 5, 20])
def test_sinkhorn_unrolled_bwd_vs_torch(rng, scale, n, num_iters):
    lead = {1: (3,), 2: (127,), 3: (2, 3), 4: (1,), 8: (3,), 16: (2, 3)}[n]
    L = rng.normal(size=lead + (n, n)) * scale
    G = rng.normal(size=L.shape)
    ours = R.sinkhorn_knopp_bwd(G, L, num_iters=num_iters)
    _, (ref,) = torch_vjp(lambda l: sinkhorn_reference(l, num_iters, 1e-8), [L], [G])
    assert_reference(ours, ref, 1e-9)
    # default grad_mode is "unrolled"
    np.testing.assert_array_equal(
        ours, R.sinkhorn_knopp_bwd(G, L, num_iters, 1e-8, grad_mode="unrolled"))
    # every row sums to 0
    np.testing.assert_allclose(ours.sum(-1), 0.0, atol=1e-12 * max(np.abs(ours).max(), 1))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_implicit_bwd_converged(rng, n):
    L = rng.normal(size=(3, n, n))
    G = rng.normal(size=L.shape)
    ours = R.sinkhorn_knopp_bwd(G, L, num_iters=300, eps=0.0, grad_mode="implicit")
    _, (ref,) = torch_vjp(lambda l: sinkhorn_reference(l, 300, 0.0), [L], [G])
    assert_reference(ours, ref, 1e-7)
    np.testing.assert_allclose(ours.sum(-1), 0.0, atol=1e-12 * max(np.abs(ours).max(), 1))


@pytest.mark.parametrize("n", [3, 4, 8])
def test_sinkhorn_implicit_differs_when_unconverged(rng, n):
    L = rng.normal(size=(4, n, n)) * 6
    G = rng.normal(size=L.shape)
    imp = R.sinkhorn_knopp_bwd(G, L, num_iters=3, grad_mode="implicit")
    unr = R.sinkhorn_knopp_bwd(G, L, num_iters=3, grad_mode="unrolled")
    assert np.abs(imp - unr).max() > 1e-3 * np.abs(unr).max()
    # still a valid gradient direction: rows sum to 0
    np.testing.assert_allclose(imp.sum(-1), 0.0, atol=1e-12 * max(np.abs(imp).max(), 1))


def test_sinkhorn_bad_grad_mode(rng):
    L = rng.normal(size=(2, 3, 3))
    with pytest.raises(ValueError, match="grad_mode"):
        R.sinkhorn_knopp_bwd(L, L, grad_mode="gauss-seidel")
    with pytest.raises(ValueError, match="grad_mode"):
        R.mhc_pre_op_bwd(None, None, None, None, np.zeros((2, 3, 4)), np.zeros((2, 3)),
                         np.zeros((2, 3)), L, grad_mode="exact")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the reference's 1 / 0: the documented inf)
def test_sinkhorn_logit_scale_1000_and_eps_0_as_documented(rng):
    """OPS.md section 1, edge cases: at logit scale ~1000 a column that is no row's maximum
    stays 0 (finite, not doubly stochastic, ~zero gradient); eps = 0 then gives NaN."""
    L = np.array([[0.0, 1000.0, -500.0], [900.0, 0.0, -1000.0], [0.0, 950.0, 10.0]])[None]  # maxima: 1, 0, 1
    P = R.sinkhorn_knopp_fwd(L)
    assert np.isfinite(P).all()
    np.testing.assert_array_equal(P[0, :, 2], 0.0)  # column 2 holds no row maximum
    np.testing.assert_allclose(P.sum(-2)[0], [1.0, 1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(P[0, [0, 2], 1], [0.5, 0.5], atol=1e-7)  # two rows share column 1: 1/2 each
    G = rng.standard_normal(L.shape)
    for mode in ("unrolled", "implicit"):
        np.testing.assert_allclose(R.sinkhorn_knopp_bwd(G, L, grad_mode=mode), 0.0, atol=1e-6)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.isnan(R.sinkhorn_knopp_fwd(L, eps=0.0)).all()
        L0 = rng.standard_normal((2, 4, 4))
        np.testing.assert_allclose(R.sinkhorn_knopp_fwd(L0, eps=0.0).sum(-2), 1.0, atol=1e-12)
        assert np.isnan(R.rmsnorm_fwd(np.zeros((1, 4)), eps=0.0)).all()
        # a column whose largest entry is ~720 below its rows' maxima: its sum (~1e-313) is not 0, but
        # its reciprocal overflows (the reciprocal step of OPS.md section 1); eps > 0 keeps it finite
        Lg = np.array([[0.0, -725.0, -1.0], [0.0, -720.0, -2.0], [-1.0, -733.0, 0.0]])[None]
        assert not np.isfinite(R.sinkhorn_knopp_fwd(Lg, num_iters=1, eps=0.0)).all()
        assert np.isfinite(R.sinkhorn_knopp_fwd(Lg, num_iters=1)).all()

@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_sinkhorn_non_finite_logits_as_documented(rng, convention):
    """OPS.md section 1, non-finite logits: a -inf entry is an exact 0 (the DeepSeek convention's eps
    after the softmax: tiny) and the rest normalises; a row of all -inf, a
    +inf or a NaN makes that token's matrix NaN, forward and backward, and leaves the other tokens
    alone."""
    n = 5
    L = rng.standard_normal((4, n, n))
    L[0, 1, 3] = -np.inf
    L[1, 2, :] = -np.inf
    L[2, 0, 4] = np.inf
    L[3, 4, 0] = np.nan
    G = rng.standard_normal(L.shape)
    clean = rng.standard_normal((3, n, n))  # tokens after the bad ones stay right
    with np.errstate(invalid="ignore"):  # (-inf - -inf in the row maximum's subtraction)
        P = R.sinkhorn_knopp_fwd(np.concatenate([L, clean]), convention=convention)
    assert np.isfinite(P[0]).all()
    if convention == "paper":
        assert P[0, 1, 3] == 0.0
    else:  # the softmax's exact 0, then eps added and normalised (section 10)
        assert 0.0 < P[0, 1, 3] < 1e-5
    np.testing.assert_allclose(P[0].sum(-2), 1.0, atol=1e-5)  # (DeepSeek's eps: 1 - 1e-6)
    np.testing.assert_allclose(P[0].sum(-1), 1.0, atol=1e-5)
    with np.errstate(invalid="ignore"):
        assert np.isnan(P[1:4]).all()
        dL = R.sinkhorn_knopp_bwd(np.concatenate([G, G[:3]]), np.concatenate([L, clean]), convention=convention)
    assert np.isnan(dL[1:4]).all() and np.isfinite(dL[0]).all() and np.isfinite(dL[4:]).all()
    assert dL[0, 1, 3] == 0.0  # exp at -inf: no gradient reaches the logit
    np.testing.assert_array_equal(P[4:], R.sinkhorn_knopp_fwd(clean, convention=convention))


def _implicit_by_least_squares(P, G):
    """Independent oracle of OPS.md section 1's implicit gradient: the whole 2n system
    [diag(rowsum P), P; P^T, diag(colsum P)] (a, b) = (rowsum(P G), colsum(P G)) per matrix, by
    minimum-norm least squares (SVD), then dL = P (G - a 1^T - 1 b^T)."""
    n = P.shape[-1]
    out = np.empty_like(P)
    for k in np.ndindex(P.shape[:-2]):
        p, g = P[k], G[k]
        A = np.block([[np.diag(p.sum(1)), p], [p.T, np.diag(p.sum(0))]])
        ab = np.linalg.lstsq(A, np.concatenate([(p * g).sum(1), (p * g).sum(0)]), rcond=None)[0]
        out[k] = p * (g - ab[:n, None] - ab[None, n:])
    return out


@pytest.mark.parametrize("n,scale", [(17, 100), (32, 100), (32, 300)])
def test_sinkhorn_implicit_nearly_permutation(rng, n, scale):
    """Logits of scale 100 at n = 17, 32 (the default num_iters and eps) leave P nearly a permutation: the
    implicit backward's Schur complement is nearly singular (condition numbers 1e16-1e85), short of
    exactly. LU solved it with its round-off amplified along the near-null directions, and dL came out
    up to 1e21 (rows summing to 1e7, against the invariant 0) where the gradient is ~1e-7."""
    L = rng.standard_normal((60, n, n)) * scale
    G = rng.standard_normal(L.shape)
    P = R.sinkhorn_knopp_fwd(L)
    ours = R.sinkhorn_knopp_bwd(G, L, grad_mode="implicit")
    np.testing.assert_allclose(ours, _implicit_by_least_squares(P, G), rtol=0, atol=1e-10)
    np.testing.assert_allclose(ours.sum(-1), 0.0, atol=1e-10)
    # the functional op (float32) too
    d = m.sinkhorn_knopp_bwd(G.astype(np.float32), L.astype(np.float32), grad_mode="implicit")
    assert np.abs(d).max() <= np.abs(G).max()


# ============================================================ GPU
# ------------------------------------------------------------------ Sinkhorn
@GPU
@pytest.mark.parametrize("n", NS + [17, 32])
@pytest.mark.parametrize("T", [1, 3, 127, 1000])
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_sinkhorn_unrolled(rng, n, T, scale):
    L = coef(rng, (T, n, n), scale)
    G = coef(rng, (T, n, n))
    P = m.sinkhorn_knopp_fwd(to_gpu(L))
    assert_close(P, R.sinkhorn_knopp_fwd(L), SINKHORN_TOL, "P")
    dL = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L)))
    assert_close(dL, R.sinkhorn_knopp_bwd(G, L), 20 * SINKHORN_TOL if scale > 1 else SINKHORN_TOL, "dL")
    assert np.abs(f64(dL).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(dL).max()), "rows of dL must sum to 0"


@GPU
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("num_iters", [0, 1, 5, 20, 200])
def test_sinkhorn_iters_and_history(rng, n, num_iters):
    """num_iters = 200 keeps its step history in global scratch instead of shared memory."""
    L = coef(rng, (33, n, n))
    G = coef(rng, (33, n, n))
    assert_close(m.sinkhorn_knopp_fwd(to_gpu(L), num_iters), R.sinkhorn_knopp_fwd(L, num_iters), SINKHORN_TOL, "P")
    assert_close(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), num_iters),
                 R.sinkhorn_knopp_bwd(G, L, num_iters), 5 * SINKHORN_TOL, "dL")


@GPU
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_sinkhorn_implicit(rng, n):
    L = coef(rng, (200, n, n))
    G = coef(rng, (200, n, n))
    got = to_host(m.sinkhorn_knopp_bwd(to_gpu(G), to_gpu(L), 20, 1e-8, "implicit"))
    assert_close(got, R.sinkhorn_knopp_bwd(G, L, 20, 1e-8, "implicit"), 1e-3, "implicit dL")
    assert np.abs(f64(got).sum(-1)).max() <= 1e-5 * max(1.0, np.abs(got).max())


def _sinkhorn_f32(L, num_iters=20, eps=1e-8):
    """The forward evaluated in float32 (what the kernel can represent)."""
    P = np.exp(L - L.max(-1, keepdims=True), dtype=np.float32)
    for _ in range(num_iters):
        P = P / (P.sum(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
        P = P / (P.sum(-2, keepdims=True, dtype=np.float32) + np.float32(eps))
    return P


@GPU
def test_sinkhorn_large_logits_and_n1(rng):
    """Logits of scale 100: exp(L) would overflow without the row-max shift; most
    exp(L - max) underflow in float32, so the float32 evaluation is the reference."""
    L = coef(rng, (50, 4, 4), 100.0)
    P = to_host(m.sinkhorn_knopp_fwd(to_gpu(L)))
    assert np.isfinite(P).all()
    assert_close(P, _sinkhorn_f32(L), 1e-4, "P")
    assert_close(to_host(m.sinkhorn_knopp_fwd(to_gpu(L / 10))), R.sinkhorn_knopp_fwd(L / 10), SINKHORN_TOL, "P/10")
    dL = to_host(m.sinkhorn_knopp_bwd(to_gpu(coef(rng, (50, 4, 4))), to_gpu(L), grad_mode="implicit"))
    assert np.isfinite(dL).all()
    L1 = coef(rng, (9, 1, 1))
    assert (to_host(m.sinkhorn_knopp_fwd(to_gpu(L1))) == 1).all()
    assert (to_host(m.sinkhorn_knopp_bwd(to_gpu(L1), to_gpu(L1))) == 0).all()
