"""The paper-convention maths in plain float64 torch: the autograd oracle of the NumPy reference.

Straightforward torch forwards of OPS.md sections 2-8 (written independently of
``mhc_cupy.reference``; Sinkhorn-Knopp is the plain-torch ``mhc_cupy.torch.reference.sinkhorn_reference``)
and :func:`torch_vjp`, their float64 vector-Jacobian products.  The DeepSeek-V4 convention's
oracle is ``deepseek_oracle``.  Imported by the family test files (conftest puts tests/ on the path).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mhc_cupy.torch.reference import sinkhorn_reference

from harness import assert_close_uniform

#: Token leading shapes of the reference checks: none, one, odd counts, two leading dims.
LEADS = [(0,), (1,), (3,), (127,), (2, 3)]

#: The reference's outputs are float64 and within rtol * max|desired| of float64 torch.
assert_reference = functools.partial(assert_close_uniform, dtype=np.float64)


def _t(a):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def torch_vjp(fn, inputs, grads):
    """Run ``fn`` on float64 tensor copies of ``inputs``; return (outputs, input gradients).

    ``grads`` has one entry per output (``None`` = that output's gradient is zero).
    """
    ts = [_t(a) for a in inputs]
    outs = fn(*ts)
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    loss = sum(
        (o * torch.as_tensor(np.asarray(g, dtype=np.float64))).sum()
        for o, g in zip(outs, grads)
        if g is not None
    )
    if not torch.is_tensor(loss):  # all grads None
        return [o.detach().numpy() for o in outs], [np.zeros(a.shape) for a in inputs]
    gs = torch.autograd.grad(loss, ts, allow_unused=True)
    gs = [np.zeros(t.shape) if g is None else g.numpy() for g, t in zip(gs, ts)]
    return [o.detach().numpy() for o in outs], gs


# ---- straightforward torch forwards (independent of the reference) ---------------------------

def t_rmsnorm(x, eps=1e-5, weight=None):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def t_mix(x, M):
    return torch.einsum("...ij,...jc->...ic", M, x)


def t_aggregate(x, h):
    if h.dim() == 1:
        return torch.einsum("i,...ic->...c", h, x)
    return torch.einsum("...i,...ic->...c", h, x)


def t_distribute(y, h):
    if h.dim() == 1:
        return torch.einsum("i,...c->...ic", h, y)
    return torch.einsum("...i,...c->...ic", h, y)


def t_post(y, x, H_post, H_res):
    return torch.einsum("...ij,...jc->...ic", H_res, x) + H_post[..., :, None] * y[..., None, :]


def t_pre(x, hp, hq, hr, num_iters=20, eps=1e-8):
    H_pre = torch.sigmoid(hp)
    H_post = 2 * torch.sigmoid(hq)
    H_res = sinkhorn_reference(hr, num_iters, eps)
    return torch.einsum("...i,...ic->...c", H_pre, x), H_pre, H_post, H_res


def t_coeffs(x, phi, alpha, bias, eps=1e-5):
    n, C = x.shape[-2], x.shape[-1]
    xt = x.reshape(*x.shape[:-2], n * C)
    r = torch.sqrt((xt ** 2).mean(-1, keepdim=True) + eps)
    H = xt @ phi
    pre = alpha[0] * H[..., :n] / r + bias[:n]
    post = alpha[1] * H[..., n:2 * n] / r + bias[n:2 * n]
    res = alpha[2] * H[..., 2 * n:] / r + bias[2 * n:]
    return pre, post, res.reshape(*x.shape[:-2], n, n)
