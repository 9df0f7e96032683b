"""The DeepSeek-V4 mHC maths in plain torch ops: the float64 autograd oracle of convention="deepseek".

Written from the convention's statement (OPS.md "DeepSeek-V4 convention"), independently of
``mhc_cupy.reference`` and of the kernels: a softmax start plus eps, column steps with eps in the
denominator, H_pre = sigmoid + hc_eps, H_post = post_mult sigmoid, the post op with H_res
transposed, the coefficient path in DeepSeek's parameter layout (hc_fn = phi^T [m, nC],
hc_scale = alpha, hc_base = bias).  Gradients are torch autograd of these forwards.  Imported
as ``deepseek_oracle`` by the tests (conftest puts tests/ on the path).
"""

from __future__ import annotations

import numpy as np
import torch

from paper_oracle import torch_vjp

ITERS, EPS, RMS_EPS, HC_EPS, POST_MULT = 20, 1e-6, 1e-6, 1e-6, 2.0

#: The CPU tests' grid: token leading shapes and streams n.
LEADS = [(1,), (3,), (127,)]
NS = [1, 2, 3, 4, 5, 8]


def t64(a, grad=True):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def oracle(fn, inputs, g):
    """(output, input gradients) of a one-output ``fn`` in float64 torch for the incoming gradient ``g``."""
    (out,), grads = torch_vjp(fn, inputs, [g])
    return out, grads


def head_params(rng, n, C):
    """hc_fn [n, nC], hc_scale [1], hc_base [n] at a realistic scale (logits of order 1)."""
    return rng.normal(size=(n, n * C)) / np.sqrt(n * C), rng.uniform(0.5, 2.0, size=1), rng.normal(size=n) * 0.5


def layer_params(rng, n, C):
    """DeepSeek-layout layer parameters hc_fn [m, nC], hc_scale [3], hc_base [m], m = n^2 + 2n."""
    m = n * n + 2 * n
    return rng.normal(size=(m, n * C)) / np.sqrt(n * C), rng.uniform(0.5, 2.0, size=3), rng.normal(size=m) * 0.5


def sinkhorn(logits, iters=ITERS, eps=EPS):
    """P = softmax(rows) + eps; P /= colsum + eps; then (iters - 1) x (rows, columns), eps in the sums."""
    P = torch.softmax(logits, dim=-1) + eps
    P = P / (P.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        P = P / (P.sum(dim=-1, keepdim=True) + eps)
        P = P / (P.sum(dim=-2, keepdim=True) + eps)
    return P


def pre_op(x, h_pre_raw, h_post_raw, h_res_raw, iters=ITERS, eps=EPS, hc_eps=HC_EPS, post_mult=POST_MULT):
    """(layer_in, H_pre, H_post, H_res): layer_in = sum_i H_pre_i x_i."""
    H_pre = torch.sigmoid(h_pre_raw) + hc_eps
    H_post = post_mult * torch.sigmoid(h_post_raw)
    H_res = sinkhorn(h_res_raw, iters, eps)
    return torch.einsum("...i,...ic->...c", H_pre, x), H_pre, H_post, H_res


def post_op(y, x, H_post, H_res):
    """out_j = H_post_j y + sum_i H_res[i, j] x_i."""
    return H_post[..., :, None] * y[..., None, :] + torch.einsum("...ij,...ic->...jc", H_res, x)


def coeffs(x, hc_fn, hc_scale, hc_base, rms_eps=RMS_EPS):
    """Raw (pre, post, res) from mixes = (x~ hc_fn^T) rsqrt(mean(x~^2) + rms_eps), hc_fn [m, nC]."""
    n, C = x.shape[-2], x.shape[-1]
    xt = x.reshape(*x.shape[:-2], n * C)
    mixes = (xt @ hc_fn.T) * torch.rsqrt(xt.square().mean(-1, keepdim=True) + rms_eps)
    pre = mixes[..., :n] * hc_scale[0] + hc_base[:n]
    post = mixes[..., n:2 * n] * hc_scale[1] + hc_base[n:2 * n]
    res = mixes[..., 2 * n:] * hc_scale[2] + hc_base[2 * n:]
    return pre, post, res.reshape(*x.shape[:-2], n, n)


def layer(x, hc_fn, hc_scale, hc_base, sublayer=None, iters=ITERS, eps=EPS, rms_eps=RMS_EPS, hc_eps=HC_EPS,
          post_mult=POST_MULT):
    """One whole mHC layer: coefficients, pre op, sublayer (identity if None), post op."""
    layer_in, _, H_post, H_res = pre_op(x, *coeffs(x, hc_fn, hc_scale, hc_base, rms_eps), iters, eps, hc_eps,
                                        post_mult)
    y = layer_in if sublayer is None else sublayer(layer_in)
    return post_op(y, x, H_post, H_res)


def head(x, hc_fn, hc_scale, hc_base, rms_eps=RMS_EPS, hc_eps=HC_EPS):
    """hc_head: w = sigmoid((x~ hc_fn^T) rsqrt(mean(x~^2) + rms_eps) hc_scale + hc_base) + hc_eps
    (hc_fn [n, nC], hc_scale [1], hc_base [n]); out = sum_i w_i x_i."""
    n, C = x.shape[-2], x.shape[-1]
    xt = x.reshape(*x.shape[:-2], n * C)
    mixes = (xt @ hc_fn.T) * torch.rsqrt(xt.square().mean(-1, keepdim=True) + rms_eps)
    w = torch.sigmoid(mixes * hc_scale + hc_base) + hc_eps
    return (w[..., :, None] * x).sum(dim=-2)
