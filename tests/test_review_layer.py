"""Review findings shown on the CPU (branch review)."""

from __future__ import annotations

import pytest

from mhc_cupy.ops import _launch, coeffs


def _capture(monkeypatch):
    calls = []
    monkeypatch.setattr(_launch, "launch", lambda f, name, *a, **k: calls.append(name))  # (every KernelSpec's)
    monkeypatch.setattr(coeffs.bwd, "column_sum", lambda *a, **k: None)
    return calls


@pytest.mark.parametrize("g,g_li", [(4096, None), (4096, 8192), (None, 8192)])
def test_mma_bwd_adds_the_layer_terms_whenever_a_layer_gradient_is_given(monkeypatch, g, g_li):
    """mhc_layer_pre_bwd(grad_layer_in, grad_out=None, ...) documents None as zero, so dx must still
    get H_pre_i grad_layer_in; launch_mma_bwd chose LAYER = (g is not None) and dropped it."""
    calls = _capture(monkeypatch)
    b = coeffs.mma_bwd(100, 4, 64, 24)
    sc = dict.fromkeys(b.scratch(), 1 << 20)
    coeffs.launch_mma_bwd(b, "bfloat16", x=1 << 12, phi=1 << 13, dH=1 << 14, KP=28, dx=1 << 15, dphi=1 << 16, sc=sc,
                          stream=0, tg="bfloat16", g=g, g_li=g_li, H_pre=1 << 17, H_res=1 << 18)
    kernel = [c for c in calls if c.startswith("mhc_coeffs_mma_bwd_kernel")][0]
    layer_flag = kernel.split("<")[1].split(",")[3]
    assert layer_flag == "true", kernel


# ------------------------------------------------------------ the fused layer's x_link
# mhc_layer_pre returns x_link, which carries mhc_layer_post's output gradient back to the pre
# piece's backward (it folds the post op's H_res^T g into dx).  Any other use of x_link gave a
# silently wrong dx (review findings); now the misuses raise, and the legitimate uses (review3:
# retain_graph, subsets of inputs, checkpoints, shared weights, create_graph, non-contiguous
# output gradients) give the separate ops' gradients.  n = 3: H_res is not symmetric.
N, C, T = 3, 8, 3


def _leaves(seed=0):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, N, C, generator=g, dtype=torch.float64).float()
    phi = 0.1 * torch.randn(N * C, N * N + 2 * N, generator=g)
    alpha = torch.full((3,), 0.5)
    bias = 0.1 * torch.randn(N * N + 2 * N, generator=g)
    return [t.requires_grad_() for t in (x, phi, alpha, bias)]


def _fused(x, phi, alpha, bias):
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    return mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res)


def _separate(x, phi, alpha, bias):
    from mhc_cupy.torch import mhc_coeffs, mhc_post_op, mhc_pre_op

    layer_in, _, H_post, H_res = mhc_pre_op(x, *mhc_coeffs(x, phi, alpha, bias))
    return mhc_post_op(layer_in.tanh(), x, H_post, H_res)


def _grads(forward, seed=0):
    leaves = _leaves(seed)
    forward(*leaves).square().sum().backward()
    return [t.grad for t in leaves]


def _assert_grads_close(got, want):
    import torch

    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("misuse", ["residual", "post_twice", "no_post", "other_grad_first"])
def test_x_link_misuse_raises_instead_of_a_wrong_dx(misuse):
    """x_link also used as a plain residual, given to two post calls, used without a post call,
    or another gradient reaching it first: the backward raises instead of a wrong dx."""
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    x, phi, alpha, bias = _leaves()
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    if misuse == "residual":
        out = mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res) + x_link
    elif misuse == "post_twice":
        out = mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res) + mhc_layer_post(layer_in, x_link, H_post, H_res)
    elif misuse == "other_grad_first":  # the other use's gradient reaches x_link before the post op's
        out = mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res) * 2.0 + x_link.sum()
    else:
        out = layer_in.tanh()[..., None, :] * x_link
    with pytest.raises(RuntimeError, match="x_link received a gradient"):
        out.square().sum().backward()


@pytest.mark.parametrize("change", ["scaled", "other_layer"])
def test_layer_post_refuses_an_H_res_other_than_the_pre_pieces(change):
    """The pre piece's backward folds its own H_res^T g into dx: mhc_layer_post with another H_res
    (rescaled, another layer's) ran its forward on that one and gave a wrong dx (review3)."""
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    x, phi, alpha, bias = _leaves()
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    other = 0.5 * H_res if change == "scaled" else mhc_layer_pre(*_leaves(seed=1))[3]
    with pytest.raises(ValueError, match="H_res must be the H_res output"):
        mhc_layer_post(layer_in.tanh(), x_link, H_post, other)
    mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res.detach())  # the same data: accepted


def _retain_graph_twice(x, phi, alpha, bias):
    import torch

    out = _fused(x, phi, alpha, bias)
    torch.autograd.grad(out.square().sum(), [phi], retain_graph=True)  # a subset of the inputs first
    torch.autograd.grad(out.sum(), [alpha], retain_graph=True)  # an expanded output gradient
    return out


def _checkpoint(fn, reentrant):
    from torch.utils.checkpoint import checkpoint

    return lambda *a: checkpoint(fn, *a, use_reentrant=reentrant)


def _checkpoint_sublayer(reentrant):
    from torch.utils.checkpoint import checkpoint

    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    def forward(x, phi, alpha, bias):
        layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
        return mhc_layer_post(checkpoint(lambda t: t.tanh(), layer_in, use_reentrant=reentrant), x_link, H_post, H_res)
    return forward


def _checkpoint_sublayer_and_post(x, phi, alpha, bias):
    """The sublayer and the post op checkpointed (non-reentrant: the backward re-runs mhc_layer_post)."""
    from torch.utils.checkpoint import checkpoint

    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    return checkpoint(lambda li, xl, hp, hr: mhc_layer_post(li.tanh(), xl, hp, hr), layer_in, x_link, H_post, H_res,
                      use_reentrant=False)


def _two_layers_shared(x, phi, alpha, bias):
    out = _fused(x, phi, alpha, bias)
    return _fused(out, phi, alpha, bias) + out  # the same parameters twice, and a skip over the second


def _two_layers_shared_ref(x, phi, alpha, bias):
    out = _separate(x, phi, alpha, bias)
    return _separate(out, phi, alpha, bias) + out


@pytest.mark.parametrize("forward,reference", [
    (_retain_graph_twice, _separate),
    (_checkpoint(_fused, True), _separate), (_checkpoint(_fused, False), _separate),
    (_checkpoint_sublayer(True), _separate), (_checkpoint_sublayer(False), _separate),
    (_checkpoint_sublayer_and_post, _separate),
    (_two_layers_shared, _two_layers_shared_ref),
], ids=["retain_graph_subsets", "ckpt_whole_reentrant", "ckpt_whole", "ckpt_sublayer_reentrant",
        "ckpt_sublayer", "ckpt_sublayer_and_post", "two_layers_shared_weights"])
def test_x_link_legitimate_uses_match_the_separate_ops(forward, reference):
    pytest.importorskip("torch")
    _assert_grads_close(_grads(forward), _grads(reference))


def test_x_link_reentrant_checkpoint_of_the_post_op_alone_is_refused():
    """A reentrant checkpoint re-runs mhc_layer_post on a detached x_link: refused with the advice,
    not a wrong dx."""
    from torch.utils.checkpoint import checkpoint

    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    x, phi, alpha, bias = _leaves()
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    out = checkpoint(lambda li, xl, hp, hr: mhc_layer_post(li.tanh(), xl, hp, hr), layer_in, x_link, H_post, H_res,
                     use_reentrant=True)
    with pytest.raises(ValueError, match="x_link must be the x_link output"):
        out.square().sum().backward()


def test_x_link_create_graph_and_noncontiguous_output_gradients():
    import torch

    x, phi, alpha, bias = _leaves()
    out = _fused(x, phi, alpha, bias)
    G = torch.randn(C, N, T).permute(2, 1, 0)  # non-contiguous
    (gx,) = torch.autograd.grad(out, [x], G, create_graph=True)
    x2 = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(_separate(x2, phi, alpha, bias), [x2], G)
    torch.testing.assert_close(gx, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt,n", [(dt, n) for dt in ("bfloat16", "float16", "float32") for n in range(1, 33)])
def test_coefficient_kernels_fit_99_kib_of_shared_memory(dt, n):
    """sm_86 / sm_89 / sm_120 give a block at most 101376 bytes (99 KiB) of dynamic shared
    memory (OPS.md lists sm_86 / sm_89 limits); with 4 / 3 stages the float32 forward (n = 6,
    11..32: 102400 bytes) and the float32 backward at n = 4 (115200 bytes) asked for more.
    bf16 / f16 keep the deepest pipelines (the H200-tuned ones; the layer's backward at n = 4, which
    also stages its gradients, has 2 stages)."""
    K = coeffs.columns(n)
    C = 4096
    mma = coeffs.mma_layout(4096, n * C, K, dt)
    stages, fwd = coeffs.mma_fwd_smem(dt, mma.ntile)
    assert fwd <= 101376 and stages >= 2
    if dt != "float32":
        assert stages == coeffs.fwd._MMA_STAGES[dt]
    if K <= coeffs.plans._MMA_BWD_MAX_K:
        stages, bwd = coeffs.mma_bwd(4096, n, C, K).pipeline(dt)
        assert bwd <= 101376 and stages >= 2
        if dt != "float32":
            assert stages == coeffs.common._MMA_BWD_STAGES
            stages, bwd = coeffs.mma_bwd(4096, n, C, K).pipeline(dt, g_staged=True)  # never for float32 gradients
            assert bwd <= 101376 and stages >= 2


def test_layer_post_refuses_x_in_place_of_x_link():
    """Passing x (or any tensor but mhc_layer_pre's x_link) to mhc_layer_post raises instead of
    giving a silently wrong dx."""
    torch = pytest.importorskip("torch")
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    n, C = 2, 8
    x = torch.randn(3, n, C, requires_grad=True)
    phi = (0.1 * torch.randn(n * C, n * n + 2 * n)).requires_grad_()
    alpha, bias = torch.full((3,), 0.5, requires_grad=True), torch.zeros(n * n + 2 * n, requires_grad=True)
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    with pytest.raises(ValueError, match="x_link"):
        mhc_layer_post(torch.tanh(layer_in), x, H_post, H_res)
    with pytest.raises(ValueError, match="x_link"):
        mhc_layer_post(torch.tanh(layer_in), x_link * 1.0, H_post, H_res)
    mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res).sum().backward()  # the intended use
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("change", ["view", "copy"])
def test_x_link_must_be_the_pre_halfs_output_as_returned(change):
    """mhc_layer_post knows mhc_layer_pre's x_link by the mark it carries (its own backward node),
    not by a node's type name: a view or a copy of it is refused, naming what it needs."""
    pytest.importorskip("torch")
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    x, phi, alpha, bias = _leaves()
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    bad = x_link.view_as(x_link) if change == "view" else x_link.clone()
    with pytest.raises(ValueError, match="x_link must be the x_link output of mhc_layer_pre, as it returned it"):
        mhc_layer_post(layer_in.tanh(), bad, H_post, H_res)
    mhc_layer_post(layer_in.tanh(), x_link, H_post, H_res).sum().backward()  # the output itself: accepted
    assert x.grad is not None
