"""Review findings shown on the CPU (branch review)."""

from __future__ import annotations

import pytest

from mhc_cupy.ops import coeffs


def _capture(monkeypatch):
    calls = []
    monkeypatch.setattr(coeffs, "launch", lambda f, name, *a, **k: calls.append(name))
    monkeypatch.setattr(coeffs, "column_sum", lambda *a, **k: None)
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


def _layer_case(torch, n=2, C=8):
    torch.manual_seed(0)
    x = torch.randn(3, n, C, dtype=torch.float64).float().requires_grad_()
    phi = (0.1 * torch.randn(n * C, n * n + 2 * n)).requires_grad_()
    alpha = torch.full((3,), 0.5, requires_grad=True)
    bias = torch.zeros(n * n + 2 * n, requires_grad=True)
    return x, phi, alpha, bias


@pytest.mark.parametrize("misuse", ["residual", "post_twice", "no_post", "other_grad_first"])
def test_x_link_misuse_raises_instead_of_a_wrong_dx(misuse):
    """x_link's gradient is taken to be mhc_layer_post's output gradient: any other use of it
    (here also a plain residual, a second post call, no post call) gave a silently wrong dx
    (review finding); now it raises, in the forward where it can and else in the backward."""
    torch = pytest.importorskip("torch")
    from mhc_cupy.torch import mhc_layer_post, mhc_layer_pre

    x, phi, alpha, bias = _layer_case(torch)
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    if misuse == "post_twice":
        mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res)
        with pytest.raises(ValueError, match="already given to mhc_layer_post"):
            mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res)
        return
    if misuse == "residual":
        out = mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res) + x_link
    elif misuse == "other_grad_first":  # the other use's gradient reaches x_link before the post op's
        out = mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res) * 2.0 + x_link.sum()
    else:
        out = torch.tanh(layer_in)[..., None, :] * x_link
    with pytest.raises(RuntimeError, match="x_link received a gradient"):
        out.square().sum().backward()


def test_x_link_intended_use_matches_the_separate_ops():
    """The intended use (x_link only into one mhc_layer_post) gives the separate ops' values and dx,
    also when the layer's output feeds several later uses."""
    torch = pytest.importorskip("torch")
    from mhc_cupy.torch import mhc_coeffs, mhc_layer_post, mhc_layer_pre, mhc_post_op, mhc_pre_op

    x, phi, alpha, bias = _layer_case(torch)
    layer_in, x_link, H_post, H_res = mhc_layer_pre(x, phi, alpha, bias)
    out = mhc_layer_post(torch.tanh(layer_in), x_link, H_post, H_res)
    loss = out.square().sum() + (out * out.detach()).sum() + x.sum()  # x itself may be used anywhere
    (gx_fused,) = torch.autograd.grad(loss, x)

    h = mhc_coeffs(x, phi, alpha, bias)
    layer_in2, _, H_post2, H_res2 = mhc_pre_op(x, *h)
    out2 = mhc_post_op(torch.tanh(layer_in2), x, H_post2, H_res2)
    loss2 = out2.square().sum() + (out2 * out2.detach()).sum() + x.sum()
    (gx_ref,) = torch.autograd.grad(loss2, x)
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_fused, gx_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt,n", [(dt, n) for dt in ("bfloat16", "float16", "float32") for n in range(1, 33)])
def test_coefficient_kernels_fit_99_kib_of_shared_memory(dt, n):
    """sm_86 / sm_89 / sm_120 give a block at most 101376 bytes (99 KiB) of dynamic shared
    memory (OPS.md lists sm_86 / sm_89 limits); with 4 / 3 stages the float32 forward (n = 6,
    11..32: 102400 bytes) and the float32 backward at n = 4 (115200 bytes) asked for more.
    bf16 / f16 keep the deepest pipelines (the H200-tuned ones)."""
    K = coeffs.columns(n)
    C = 4096
    mma = coeffs.mma_layout(4096, n * C, K)
    stages, fwd = coeffs.mma_fwd_smem(dt, mma.ntile)
    assert fwd <= 101376 and stages >= 2
    if dt != "float32":
        assert stages == coeffs._MMA_STAGES
    if K <= coeffs._MMA_BWD_MAX_K:
        stages, bwd = coeffs.mma_bwd(4096, n, C, K).pipeline(dt)
        assert bwd <= 101376 and stages >= 2
        if dt != "float32":
            assert stages == coeffs._MMA_BWD_STAGES


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
