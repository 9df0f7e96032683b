"""The mHC layer ``mhc_cupy.torch.MHC`` and the demo ``mhc_cupy.demo``: CPU and GPU cases.

CPU: every mHC op (coefficients, pre op, post op) runs the float64 NumPy
reference and rounds each output once to float32; the sublayer runs in
float32 torch.  The oracle is ``MHCReference`` (the same layer in plain
torch ops, Sinkhorn as OPS.md) run in float64, with float64 autograd.

Tolerance for the whole layer, float32 (u = 2^-24): about ten tensors are
rounded to float32 on the way (h_*_raw, H_pre / H_post / H_res, layer_in,
y, out; in the backward the coefficient, pre-op and post-op gradients), and
the float32 sublayer adds dot products of <= 4C terms (~sqrt(4C) u each).
Through Sinkhorn (logits of scale ~1) and the sublayer (Lipschitz ~1) that
stays within ~100 u; measured worst over 20 seeds and 5 shapes: 24 u
(1.4e-6).  tol = 1e-5 (~170 u), relative to |ref| + rms(ref); for d_alpha
and d_bias, which are sums over tokens that may cancel, relative to |ref|
plus the summed magnitude of the per-token contributions (``token_scales``).
Any wiring error (transposed H_res, swapped coefficient groups, a missing
factor 2 in H_post) is O(1) relative.

GPU (``gpu_test``, skipped without CUDA for both CuPy and torch): the kernels through ``mhc_cupy.torch``.

* bfloat16 on CUDA (residual streams bf16, sublayer under bf16 autocast,
  coefficients float32) against the pure-PyTorch reference layer
  ``MHCReference`` run in float32 on the same (bf16-valued) inputs and the
  same upstream gradient: forward and the gradients w.r.t. x, phi, alpha,
  bias and the sublayer's parameters;
* float32 on CUDA against the reference in float64 (tight);
* a tiny model of the demo trains a few steps on CUDA: finite, loss decreases;
  the demo's CLI runs with ``--device cuda --tiny --baseline``.

Tolerances, relative to ``|ref| + scale`` (scale = rms(ref), or for
gradients that are sums over tokens the sum of the per-token contributions'
magnitudes, see ``token_scales``):

* bf16 (unit roundoff u = 2^-8): the kernel path rounds each activation once
  (x, layer_in, the sublayer's autocast inputs and weights, y, out; in the
  backward the incoming gradient, d_layer_in, dx), accumulating in float32.
  The forward output goes through ~4 roundings in sequence: 8u = 3.1e-2.
  Gradients go through about twice as many (forward recompute + backward
  casts): 16u = 6.3e-2.  Measured by emulating this path on CPU (bf16
  autocast, the NumPy reference rounding each op output once to bf16; 4
  shapes x 6 seeds): out <= 2u, gradients <= 7u, d_alpha / d_bias <= 0.5u
  of their token scale.  A wiring error (transposed H_res, swapped
  coefficient groups, missing factor 2) is O(1) relative and fails by far.
* float32 on the GPU: kernel sums in float32 in a different order than the
  reference, and the Sinkhorn iteration repeated 20 times in float32 (the
  adapters' GPU tests: harness.TOL "sinkhorn" 2e-4 for its values,
  "sinkhorn_chain_grad" 1e-3 for gradients through it); the sublayer's cuBLAS float32 GEMMs (TF32 off by default):
  1e-3 for everything.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

from mhc_cupy import reference as R
from mhc_cupy.torch import (CollapseStreams, ExpandStreams, MHC, collapse_streams, expand_streams, identity_bias,
                            mhc_coeffs)
from mhc_cupy.torch.reference import MHCReference, sinkhorn_reference

from gpu.helpers import needs_torch
from harness import TOL, assert_close, default_dtype, gpu_test, token_scales

GPU = gpu_test(needs_torch, poison=False)


# ============================================================ CPU
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL_F32 = TOL["float32_layer"].value
U_F32 = TOL["float32_unit"].value

SHAPES = [  # (lead dims, n, C): the paper's n = 4; odd C; n = 1 (trivial Sinkhorn); 2-D lead; n = 8
    ((2, 3), 4, 16),
    ((5,), 3, 7),
    ((4,), 1, 8),
    ((2,), 4, 33),
    ((3,), 8, 5),
]


# ------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _float32_default():
    """Modules and random tensors here are float32, whatever default dtype another test left set."""
    with default_dtype(torch.float32):
        yield


def make_layer(C, n, seed, norm="layer"):
    """An MHC around a small MLP, coefficients moved away from their init (logits of scale ~1)."""
    torch.manual_seed(seed)
    first = nn.LayerNorm(C) if norm == "layer" else nn.Identity()
    sub = nn.Sequential(first, nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))
    layer = MHC(C, n, sub, alpha_init=1.0)
    with torch.no_grad():
        layer.bias.add_(torch.randn_like(layer.bias))
        layer.alpha.copy_(torch.tensor([0.5, 1.0, 1.5]))
    return layer


# ------------------------------------------------------- layer vs reference
@pytest.mark.parametrize("lead,n,C", SHAPES)
def test_mhc_matches_reference_forward_and_gradients(lead, n, C, rng):
    layer = make_layer(C, n, int(rng.integers(1 << 30)))
    ref = MHCReference.from_layer(layer).double()
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    g = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()

    x1 = x.clone().requires_grad_()
    out = layer(x1)
    out.backward(g)
    x2 = x.double().requires_grad_()
    out_ref = ref(x2)
    out_ref.backward(g.double())

    assert out.dtype == torch.float32 and out.shape == x.shape
    scales = token_scales(ref, x2, g.double())
    assert_close(out, out_ref, TOL_F32, "out")
    assert_close(x1.grad, x2.grad, TOL_F32, "dx")
    names = []
    for (name, p), (name_r, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert name == name_r
        names.append(name)
        assert p.grad is not None, name
        assert_close(p.grad, q.grad, TOL_F32, f"d_{name}", scales.get(name))
    assert {"phi", "alpha", "bias"} <= set(names) and any(s.startswith("sublayer.") for s in names)


def test_mhc_matches_reference_extra_args_and_no_norm(rng):
    """Extra forward arguments reach the sublayer; a sublayer without a norm (H_pre's scale matters)."""

    class Scaled(nn.Module):
        def __init__(self, C):
            super().__init__()
            self.lin = nn.Linear(C, C)

        def forward(self, h, scale=1.0):
            return torch.tanh(self.lin(h)) * scale

    torch.manual_seed(3)
    layer = MHC(12, 4, Scaled(12), alpha_init=0.7)
    ref = MHCReference.from_layer(layer).double()
    x = torch.from_numpy(rng.standard_normal((6, 4, 12))).float()
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    layer(x1, scale=0.5).sum().backward()
    ref(x2, scale=0.5).sum().backward()
    assert_close(x1.grad, x2.grad, TOL_F32, "dx")
    scale = token_scales(ref, x2, torch.ones_like(x2))["alpha"]
    assert_close(layer.alpha.grad, ref.alpha.grad, TOL_F32, "d_alpha", scale)


# ------------------------------------------------------ coefficient function
def _coeffs_torch64(x, phi, alpha, bias, eps=1e-5):
    """Independent float64 torch formula of OPS.md section 8."""
    n, C = x.shape[-2:]
    xt = x.reshape(x.shape[:-2] + (n * C,))
    r = torch.sqrt(xt.square().mean(-1, keepdim=True) + eps)
    a = torch.cat([alpha[0].repeat(n), alpha[1].repeat(n), alpha[2].repeat(n * n)])
    h = a * (xt @ phi) / r + bias
    return h[..., :n], h[..., n:2 * n], h[..., 2 * n:].reshape(x.shape[:-2] + (n, n))


@pytest.mark.parametrize("lead,n,C", [((2, 3), 4, 16), ((5,), 1, 7), ((0,), 4, 8)])
def test_coeffs_function(lead, n, C, rng):
    x = torch.from_numpy(rng.standard_normal(lead + (n, C))).float()
    phi = torch.from_numpy(rng.standard_normal((n * C, n * n + 2 * n)) / math.sqrt(n * C)).float()
    alpha = torch.tensor([0.3, -0.8, 1.2])
    bias = torch.from_numpy(rng.standard_normal(n * n + 2 * n)).float()
    leaves = [t.clone().requires_grad_() for t in (x, phi, alpha, bias)]
    outs = mhc_coeffs(*leaves)
    assert [o.dtype for o in outs] == [torch.float32] * 3
    assert [tuple(o.shape) for o in outs] == [lead + (n,), lead + (n,), lead + (n, n)]
    ref_out = R.mhc_coeffs_fwd(x.numpy(), phi.numpy(), alpha.numpy(), bias.numpy())
    for o, r_ in zip(outs, ref_out):
        assert_close(o, torch.from_numpy(r_), U_F32, "coeffs fwd (one rounding)")

    gs = [torch.from_numpy(rng.standard_normal(o.shape)).float() for o in outs]
    grads = torch.autograd.grad(outs, leaves, gs)
    ref_g = R.mhc_coeffs_bwd(*[g.numpy() for g in gs], x.numpy(), phi.numpy(), alpha.numpy(), bias.numpy())
    for what, a, b in zip(("dx", "dphi", "dalpha", "dbias"), grads, ref_g):
        assert a.dtype == torch.float32
        assert_close(a, torch.from_numpy(b), U_F32, f"{what} vs functional bwd (one rounding)")

    # independent float64 autograd of the formula
    leaves64 = [t.double().requires_grad_() for t in (x, phi, alpha, bias)]
    grads64 = torch.autograd.grad(_coeffs_torch64(*leaves64), leaves64, [g.double() for g in gs])
    for what, a, b in zip(("dx", "dphi", "dalpha", "dbias"), grads, grads64):
        assert_close(a, b, 1e-5, f"{what} vs float64 autograd")


def test_coeffs_function_unused_outputs(rng):
    """Only h_res_raw used: the backward gets None for the others and treats it as zero."""
    n, C = 4, 8
    x = torch.from_numpy(rng.standard_normal((3, n, C))).float().requires_grad_()
    phi = torch.from_numpy(rng.standard_normal((n * C, n * n + 2 * n)) * 0.1).float().requires_grad_()
    alpha = torch.tensor([0.5, 0.5, 0.5], requires_grad=True)
    bias = torch.zeros(n * n + 2 * n, requires_grad=True)
    _, _, h_res = mhc_coeffs(x, phi, alpha, bias, 1e-5)
    g = torch.from_numpy(rng.standard_normal(h_res.shape)).float()
    h_res.backward(g)
    dx, dphi, dalpha, dbias = R.mhc_coeffs_bwd(None, None, g.numpy(), x.detach().numpy(), phi.detach().numpy(),
                                               alpha.detach().numpy(), bias.detach().numpy())
    assert_close(x.grad, torch.from_numpy(dx), U_F32, "dx")
    assert_close(bias.grad, torch.from_numpy(dbias), U_F32, "dbias")
    assert torch.all(bias.grad[:2 * n] == 0)
    assert_close(alpha.grad, torch.from_numpy(dalpha), U_F32, "dalpha")
    assert alpha.grad[0] == 0 and alpha.grad[1] == 0


# ------------------------------------------------------------ shapes, dtypes
@pytest.mark.parametrize("lead", [(), (0,), (2, 3, 2)])
def test_shapes(lead):
    layer = make_layer(8, 4, 0)
    x = torch.randn(lead + (4, 8), requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert layer.phi.grad.shape == (32, 24) and layer.alpha.grad.shape == (3,) and layer.bias.grad.shape == (24,)


def test_bad_shapes_raise():
    layer = MHC(8, 4, nn.Linear(8, 8))
    with pytest.raises(ValueError, match="n_streams=4"):
        layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="dim=8"):
        layer(torch.randn(2, 4, 7))
    with pytest.raises(ValueError, match="sublayer returned"):
        MHC(8, 4, nn.Linear(8, 5))(torch.randn(2, 4, 8))
    # not one real tensor: a TypeError naming what came back (a tuple gave "'tuple' object has no
    # attribute 'shape'"; a complex output was cast to real, its imaginary part dropped with a warning)
    for returns, what in ((lambda t: (t, None), "a tuple of 2"), (lambda t: None, "a NoneType"),
                          (lambda t: t.to(torch.complex64), "a torch.complex64 tensor of shape \\(2, 8\\)")):
        with pytest.raises(TypeError, match=f"sublayer returned {what}; MHC needs one real tensor"):
            MHC(8, 4, returns)(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match=r"n_streams must be in 1\.\.32, got 0"):
        MHC(8, 0)
    with pytest.raises(ValueError, match="grad_mode must be 'unrolled' or 'implicit', got 'exact'"):
        MHC(8, 4, grad_mode="exact")


@pytest.mark.parametrize("cls, arg, value, exc, need", [
    (MHC, "phi_init_std", -1.0, ValueError, "must be finite and >= 0"),
    (MHC, "phi_init_std", math.nan, ValueError, "must be finite and >= 0"),
    (MHC, "phi_init_std", "0.1", TypeError, "must be a float"),
    (MHC, "alpha_init", math.inf, ValueError, "must be finite"),
    (MHC, "alpha_init", math.nan, ValueError, "must be finite"),
    (MHC, "alpha_init", True, TypeError, "must be a float"),
    (MHC, "alpha_init", 10**39, ValueError, r"must be finite in float32 \(\|value\| <= 3.403e\+38\)"),
    (MHC, "phi_init_std", 10**39, ValueError, r"must be 0 or between 1.4e-45 and 3.403e\+38 \(the kernels take it as a "
                                            r"float32\)"),
    ("MHCHead", "fn_init_std", -1.0, ValueError, "must be finite and >= 0"),
    ("MHCHead", "fn_init_std", math.nan, ValueError, "must be finite and >= 0"),
    ("MHCHead", "scale_init", math.nan, ValueError, "must be finite"),
    ("MHCHead", "scale_init", -math.inf, ValueError, "must be finite"),
])
def test_bad_init_arguments_raise(cls, arg, value, exc, need):
    """Initialisation arguments are checked in the constructor, naming the argument and its value
    (issue 41 item 11: they were accepted and gave NaN / inf parameters)."""
    from mhc_cupy.torch import MHCHead

    cls = MHCHead if cls == "MHCHead" else cls
    with pytest.raises(exc, match=rf"{arg} {need}.*{value!r}" if exc is TypeError else rf"{arg} {need}, got {value}"):
        cls(8, 4, **{arg: value})
    ok = cls(8, 4, **{arg: 0.0})  # zero is fine for all four (a std of 0: zeros)
    assert all(torch.isfinite(p).all() for p in ok.parameters())


def test_bf16_activations_and_f32_coefficients():
    """bf16 streams keep bf16; coefficients stay float32 even after module.bfloat16()."""
    layer = make_layer(16, 4, 1)
    layer.sublayer.to(torch.bfloat16)
    x = torch.randn(5, 4, 16).to(torch.bfloat16).requires_grad_()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and layer.phi.grad.dtype == torch.float32
    # a module converted wholesale: the sublayer is bf16, phi / alpha / bias stay float32
    layer2 = make_layer(16, 4, 1).bfloat16()
    assert {p.dtype for p in (layer2.phi, layer2.alpha, layer2.bias)} == {torch.float32}
    out2 = layer2(x.detach())
    assert out2.dtype == torch.bfloat16 and torch.isfinite(out2.float()).all()
    ref = make_layer(16, 4, 1)(x.detach().float())
    assert_close(out2.float(), ref, 5e-2, "bf16 module vs float32 module")  # bf16 sublayer: ~ a few 2^-8


def test_no_grad_and_implicit_grad_mode(rng):
    layer = make_layer(8, 4, 2)
    x = torch.from_numpy(rng.standard_normal((3, 4, 8))).float()
    with torch.no_grad():
        out_ng = layer(x)
    assert not out_ng.requires_grad
    assert torch.equal(out_ng, layer(x).detach())
    imp = MHC(8, 4, layer.sublayer, grad_mode="implicit")
    imp.load_state_dict(layer.state_dict())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xa).sum().backward()
    imp(xb).sum().backward()
    # 20 Sinkhorn iterations on logits of scale ~1 converge: the two gradients agree closely
    assert_close(xb.grad, xa.grad, 1e-3, "implicit vs unrolled dx")


# ------------------------------------------------------------ stream helpers
def test_expand_collapse():
    h = torch.randn(2, 3, 5, requires_grad=True)
    x = expand_streams(h, 4)
    assert x.shape == (2, 3, 4, 5) and x.is_contiguous()
    assert all(torch.equal(x[..., i, :], h) for i in range(4))
    assert torch.equal(collapse_streams(x), h)  # mean: inverse of expand (exact for n a power of 2)
    assert torch.allclose(collapse_streams(x, "sum"), 4 * h)
    x.sum().backward()
    assert torch.equal(h.grad, torch.full_like(h, 4.0))  # gradient of the copy: sum over streams
    assert torch.allclose(CollapseStreams()(ExpandStreams(3)(h)), h, rtol=2**-23, atol=0)  # (3h)/3: one rounding
    assert torch.allclose(CollapseStreams("sum")(ExpandStreams(3)(h)), 3 * h)
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum', got 'max'"):
        collapse_streams(x, "max")
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        expand_streams(h, 0)
    for n in (2.5, "3", True):  # not an int: a TypeError naming n (torch's / Python's own errors, or True as 1)
        with pytest.raises(TypeError, match="n must be an int"):
            expand_streams(h, n)
        with pytest.raises(TypeError, match="n must be an int"):
            identity_bias(n)


# ------------------------------------------------------------- initialisation
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_identity_bias(n):
    b = identity_bias(n).double()
    H_pre = torch.sigmoid(b[:n])
    H_post = 2 * torch.sigmoid(b[n:2 * n])
    H_res = sinkhorn_reference(b[2 * n:].reshape(n, n))
    assert torch.allclose(H_pre, torch.full((n,), 1.0 / n if n > 1 else 0.99, dtype=torch.float64))
    assert torch.allclose(H_post, torch.ones(n, dtype=torch.float64))
    if n > 1:
        eye = torch.eye(n, dtype=torch.float64)
        expect = 0.95 * eye + (0.05 / (n - 1)) * (1 - eye)
        assert torch.allclose(H_res, expect, atol=1e-7)
    else:
        assert torch.allclose(H_res, torch.ones(1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"res_diag .* must be in \[1/n, 1\) = \[0\.25, 1\), got 0\.1"):
        identity_bias(4, res_diag=0.1)


def _plain_vs_mhc(layer, h):
    sub = layer.sublayer
    with torch.no_grad():
        plain = h + sub(h)
        out = layer(expand_streams(h, layer.n_streams))
    return plain, out, (out - plain.unsqueeze(-2)).abs().max().item(), sub(h).abs().max().item()


def test_init_close_to_plain_residual():
    """At init mHC around F starts at the plain residual x + F(x) (streams = copies of x).

    phi = 0: exact up to float32 rounding and the Sinkhorn row-sum error
    (every stream is x + F(x) to ~1e-6 relative).  Default init (phi ~
    N(0, 1/(nC)), alpha = 0.01): the dynamic logits are ~N(0, 1e-4), so
    H_pre and H_post move by ~0.5% and every stream differs from x + F(x) by
    about 1% of max |F(x)| (measured 1.0-1.4% over 5 seeds: bound 5%).
    """
    torch.manual_seed(0)
    C, n = 32, 4
    h = torch.randn(64, C)
    sub = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
    exact = MHC(C, n, sub, phi_init_std=0.0)
    plain, out, err, fmax = _plain_vs_mhc(exact, h)
    assert err <= 1e-5 * plain.abs().max().item()
    assert torch.allclose(collapse_streams(out), plain, atol=1e-5)
    default = MHC(C, n, sub)
    plain, out, err, fmax = _plain_vs_mhc(default, h)
    assert err <= 0.05 * fmax, (err, fmax)
    assert default.alpha.detach().tolist() == pytest.approx([0.01] * 3)


# ---------------------------------------------------------------------- demo
def test_demo_models_share_initial_sublayer_weights():
    from mhc_cupy import demo

    cfg = demo.Config(**demo.TINY_PRESET)
    torch.manual_seed(0)
    a = demo.TinyGPT(cfg, "mhc")
    torch.manual_seed(0)
    b = demo.TinyGPT(cfg, "plain")
    for i in range(len(a.blocks)):
        for (na, pa), (nb, pb) in zip(a.blocks[i].sublayer.named_parameters(), b.blocks[i].sublayer.named_parameters()):
            assert na == nb and torch.equal(pa, pb)
    assert torch.equal(a.tok.weight, b.tok.weight) and torch.equal(a.head.weight, b.head.weight)


def test_demo_tiny_model_learns_a_batch():
    from mhc_cupy import demo

    cfg = demo.Config(**demo.TINY_PRESET)
    torch.manual_seed(0)
    model = demo.TinyGPT(cfg, "mhc")
    train, _ = demo.split_data(demo.load_text())
    x, y = demo.get_batch(train, 4, 32, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0, losses


def test_demo_cli_subprocess(tmp_path):
    out = tmp_path / "tmp"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mhc_cupy.demo", "--tiny", "--steps", "3", "--out", str(out),
                           "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU" in proc.stdout
    assert (out / "loss_curve.png").stat().st_size > 0
    with open(out / "summary.json") as f:
        js = json.load(f)
    assert js["steps"] == 3 and js["device"] == "cpu" and "baseline" not in js
    assert math.isfinite(js["mhc"]["final_eval_loss"]) and math.isfinite(js["mhc"]["final_train_loss"])
    assert js["config"]["streams"] == 4


def test_demo_baseline(tmp_path):
    from mhc_cupy import demo

    summary = demo.main(["--tiny", "--device", "cpu", "--steps", "4", "--eval-every", "2", "--layers", "1",
                         "--baseline", "--out", str(tmp_path)])
    assert os.path.exists(tmp_path / "loss_curve.png")
    with open(tmp_path / "summary.json") as f:
        js = json.load(f)
    assert js == json.loads(json.dumps(summary))
    for name in ("mhc", "baseline"):
        assert js[name]["eval_step"] == [0, 2, 4]
        assert all(math.isfinite(v) for v in js[name]["eval_loss"])
        assert js[name]["tokens_per_s"] > 0
    cmp = js["comparison"]["held_out_at_equal_steps"]
    assert [c["step"] for c in cmp] == [0, 2, 4]
    # same sublayer weights, same data: at step 0 mHC (phi ~ 0) is nearly the plain residual model
    assert abs(cmp[0]["mhc_minus_baseline"]) < 0.05


def test_demo_text_file(tmp_path):
    from mhc_cupy import demo

    text = tmp_path / "corpus.txt"
    text.write_bytes(("The quick brown fox jumps over the lazy dog. " * 400).encode())
    summary = demo.main(["--text", str(text), "--device", "cpu", "--steps", "2", "--layers", "1", "--dim", "32",
                         "--seq", "32", "--batch", "4", "--streams", "2", "--out", str(tmp_path / "o")])
    assert summary["corpus_bytes"] == 45 * 400 and summary["config"]["streams"] == 2
    assert math.isfinite(summary["mhc"]["final_eval_loss"])
    assert (tmp_path / "o" / "summary.json").exists()


def test_double_backward_raises():
    """Second-order gradients through the layer raise (the eager backward records no graph)."""
    torch.manual_seed(0)
    layer = MHC(8, n_streams=4, sublayer=torch.nn.Linear(8, 8))
    x = torch.randn(3, 4, 8, requires_grad=True)
    (g,) = torch.autograd.grad((layer(x) ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("n", [4, 8])  # the post op's dx folded into the pre piece's backward, or not
def test_double_backward_raises_from_a_linear_loss(n):
    """A gradient penalty's start, create_graph=True from layer(x).sum(): no incoming gradient
    requires grad, so torch's once_differentiable left dx unmarked, a constant; the penalty's
    gradient to phi then silently dropped.  It must raise."""
    torch.manual_seed(0)
    layer = MHC(8, n_streams=n, sublayer=torch.nn.Linear(8, 8))
    x = torch.randn(3, n, 8, requires_grad=True)
    (g,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.square().sum().backward()


@pytest.mark.parametrize("kw,exc,match", [
    (dict(dim=4096, n_streams=33, num_iters=-1, eps=-1.0), ValueError, "n_streams must be in 1..32, got 33"),
    (dict(dim=64, n_streams=0), ValueError, "n_streams must be in 1..32"),
    (dict(dim=0), ValueError, "dim must be >= 1"),
    (dict(dim=64.0), TypeError, "dim must be an int"),
    (dict(dim=64, num_iters=-1), ValueError, "num_iters must be in 0..10000"),
    (dict(dim=64, num_iters=2**31), ValueError, "num_iters must be in 0..10000"),
    (dict(dim=64, num_iters=True), TypeError, "num_iters must be an int"),
    (dict(dim=64, eps=-1.0), ValueError, "eps must be finite and >= 0"),
    (dict(dim=64, eps=1e-50), ValueError, "eps must be 0 or between 1.4e-45 and 3.403e"),
    (dict(dim=64, rms_eps=1e300), ValueError, "rms_eps must be 0 or between"),
    (dict(dim=64, rms_eps="1e-5"), TypeError, "rms_eps must be a float"),
    (dict(dim=64, grad_mode="exact"), ValueError, "grad_mode must be"),
    (dict(dim=64, sublayer=3), TypeError, "sublayer must be a module"),
])
def test_constructor_validates_before_allocating(monkeypatch, kw, exc, match):
    """Bad settings raise in MHC(...) before phi is allocated, not at the first forward."""
    def no_alloc(*a, **k):
        raise AssertionError("allocated before validating")

    monkeypatch.setattr(torch, "empty", no_alloc)
    with pytest.raises(exc, match=match):
        MHC(**kw)


def test_demo_plot_labels_the_running_mean(tmp_path, monkeypatch):
    """The loss plot's train curve is a running mean: its legend says over how many steps."""
    import matplotlib.pyplot as plt

    from mhc_cupy import demo

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    steps = list(range(1, 201))
    hist = {"step": steps, "train_loss": [5.0 - s / 100 for s in steps], "eval_step": [0, 200], "eval_loss": [5.0, 3.0]}
    demo.plot({"mhc": hist}, str(tmp_path / "p.png"), "t")
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert labels == ["mhc train (running mean of 4 steps)", "mhc held-out"]

# ============================================================ GPU
DEV = "cuda"
LAYER_TOL = TOL["layer_gpu"]  # (output, gradients) per activation dtype: the module docstring says why
GPU_SHAPES = [  # (lead dims, n, C): the demo's n = 4; odd token count; n = 1; n = 8, C not a multiple of 8
    ((4, 64), 4, 128),
    ((2, 33), 4, 96),
    ((50,), 1, 64),
    ((3, 16), 8, 60),
]


# ------------------------------------------------------------------ helpers
def make_gpu_layer(C, n, seed, device):
    """An MHC around a pre-norm MLP, with coefficients away from their init (logits of scale ~1)."""
    torch.manual_seed(seed)
    sub = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
    layer = MHC(C, n, sub, alpha_init=1.0)
    with torch.no_grad():
        layer.bias.add_(torch.randn_like(layer.bias))
        layer.alpha.copy_(torch.tensor([0.5, 1.0, 1.5]))
    return layer.to(device)


def compare(device, dtype, lead, n, C, seed):
    """Run MHC (kernels, ``dtype`` activations) and MHCReference (float32 for bf16, float64 for float32)."""
    layer = make_gpu_layer(C, n, seed, device)
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    ref = MHCReference.from_layer(layer).to(ref_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(lead + (n, C), generator=gen, device=device).to(dtype)
    g = torch.randn(lead + (n, C), generator=gen, device=device).to(dtype)

    x1 = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = layer(x1)
    out.backward(g)
    assert out.dtype == dtype and x1.grad.dtype == dtype
    for p in (layer.phi, layer.alpha, layer.bias):
        assert p.grad.dtype == torch.float32

    x2 = x.to(ref_dtype).requires_grad_()
    out_ref = ref(x2)
    out_ref.backward(g.to(ref_dtype))

    tol_out, tol_grad = LAYER_TOL[dtype]
    scales = token_scales(ref, x2, g.to(ref_dtype))
    assert_close(out, out_ref, tol_out, "out")
    assert_close(x1.grad, x2.grad, tol_grad, "dx")
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, tol_grad, f"d_{name}", scales.get(name))


# -------------------------------------------------------------------- tests
@GPU
@pytest.mark.parametrize("lead,n,C", GPU_SHAPES)
def test_layer_bf16_matches_reference_f32(lead, n, C):
    compare(DEV, torch.bfloat16, lead, n, C, zlib.crc32(f"bf16{lead}{n}{C}".encode()))


@GPU
@pytest.mark.parametrize("lead,n,C", GPU_SHAPES[:2])
def test_layer_f32_matches_reference_f64(lead, n, C):
    compare(DEV, torch.float32, lead, n, C, zlib.crc32(f"f32{lead}{n}{C}".encode()))


@GPU
def test_layer_kernels_match_cpu_path():
    """The same float32 layer on CUDA (kernels) and on CPU (NumPy reference): same result to 1e-3."""
    layer = make_gpu_layer(64, 4, 7, "cpu")
    x = torch.randn(3, 40, 4, 64)
    out_cpu = layer(x)
    out_gpu = layer.to(DEV)(x.to(DEV))
    assert_close(out_gpu, out_cpu, LAYER_TOL[torch.float32][0], "out cuda vs cpu")


@GPU
def test_tiny_model_trains_bf16():
    """A tiny demo model (bf16 streams, bf16 autocast) on a fixed batch: finite, loss decreases."""
    from mhc_cupy import demo

    cfg = demo.Config(**demo.TINY_PRESET)
    torch.manual_seed(0)
    model = demo.TinyGPT(cfg, "mhc", stream_dtype=torch.bfloat16).to(DEV)
    train, _ = demo.split_data(demo.load_text())
    x, y = demo.get_batch(train, cfg.batch, cfg.seq, torch.Generator().manual_seed(0))
    x, y = x.to(DEV), y.to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v and abs(v) != float("inf"), losses)), losses
    for p in model.parameters():
        assert torch.isfinite(p).all()
    # from ln(256) = 5.5 at init; memorising one batch of 512 bytes goes well below 3 in 30 steps
    assert losses[-1] < losses[0] - 1.0, losses


@GPU
def test_demo_cli_cuda(tmp_path):
    from mhc_cupy import demo

    out = tmp_path / "demo"
    summary = demo.main(["--tiny", "--device", "cuda", "--steps", "20", "--eval-every", "10", "--baseline",
                         "--out", str(out)])
    assert summary["device"] == "cuda" and summary["stream_dtype"] == "bfloat16"
    assert os.path.getsize(out / "loss_curve.png") > 0
    with open(out / "summary.json") as f:
        js = json.load(f)
    for name in ("mhc", "baseline"):
        assert js[name]["final_eval_loss"] < js[name]["eval_loss"][0]
        assert js[name]["tokens_per_s"] > 0
