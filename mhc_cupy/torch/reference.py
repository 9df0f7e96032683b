"""Differentiable oracles: the mHC ops and layer written with plain torch ops.

Shared by the tests, the bench (``python -m mhc_cupy.bench --layer``) and
:class:`MHCReference`; independent of the kernels and of the NumPy reference
``mhc_cupy.reference`` (float64 on the CPU, no autograd), so autograd through
these functions checks the hand-written backwards.

* :func:`sinkhorn_reference`: Sinkhorn-Knopp exactly as OPS.md section 1
  (row-max shift, then ``num_iters`` row / column steps, paper Eq. 9);
* :func:`mhc_reference`: the whole layer (OPS.md sections 6-8, paper Eqs. 3,
  8, 14-18);
* :class:`MHCReference`: :class:`mhc_cupy.torch.MHC` with that forward.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from .. import _convention
from .layers import MHC

__all__ = ["sinkhorn_reference", "mhc_reference", "MHCReference"]


def sinkhorn_reference(logits: Tensor, num_iters: int = 20, eps: float = 1e-8, convention: str = "paper") -> Tensor:
    """Sinkhorn-Knopp in plain torch ops, exactly as OPS.md section 1 (row-max shift first); under
    ``convention="deepseek"`` as OPS.md section 10: the softmax plus eps as the first row step, then a
    column step, then ``num_iters - 1`` row and column steps."""
    P = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    if _convention.check(convention) == "deepseek":
        if num_iters < 1:
            raise ValueError(f"num_iters must be >= 1 under convention='deepseek', got {num_iters}")
        P = P / P.sum(dim=-1, keepdim=True) + eps
        P = P / (P.sum(dim=-2, keepdim=True) + eps)
        num_iters -= 1
    for _ in range(num_iters):
        P = P / (P.sum(dim=-1, keepdim=True) + eps)
        P = P / (P.sum(dim=-2, keepdim=True) + eps)
    return P


def _alpha_columns(alpha: Tensor, n: int) -> Tensor:
    """alpha [..., 3] -> one scale per column of phi [..., n*n + 2n] (differentiable)."""
    lead = alpha.shape[:-1]
    return torch.cat([alpha[..., 0:1].expand(lead + (n,)), alpha[..., 1:2].expand(lead + (n,)),
                      alpha[..., 2:3].expand(lead + (n * n,))], dim=-1)


def mhc_reference(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, sublayer=None, num_iters: int = 20,
                  eps: float = 1e-8, rms_eps: float = 1e-5, args=(), kwargs=None, *, convention: str = "paper",
                  hc_eps: float = 0.0, post_mult: float = 2.0) -> Tensor:
    """The whole mHC layer in plain torch ops (autograd oracle for :class:`MHC`).

    Same formulas as :class:`MHC` (OPS.md sections 6-8, paper Eqs. 3, 8,
    14-18; ``convention="deepseek"``, ``hc_eps``, ``post_mult``: section 10, H_pre = sigmoid + hc_eps,
    H_post = post_mult sigmoid, DeepSeek's Sinkhorn and H_res transposed in the post op; the
    defaults are the paper's, whose eps / rms_eps defaults here stay the paper's under "deepseek"
    too: pass the layer's), computed in the dtype of x promoted to at least float32
    (coefficients) and x's dtype (activations: pass float32 / float64).
    ``sublayer`` is called as ``sublayer(layer_in, *args, **kwargs)``.
    ``alpha`` [..., 3] and ``bias`` [..., n*n + 2n] may also be given per token
    (broadcast against x's leading dims): their gradient is then each
    token's contribution to the shared parameter's gradient.
    """
    n, C = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    cdt = torch.promote_types(x.dtype, torch.float32)
    xt = x.reshape(lead + (n * C,)).to(cdt)
    r = torch.sqrt(xt.square().mean(dim=-1, keepdim=True) + rms_eps)
    h = _alpha_columns(alpha.to(cdt), n) * (xt @ phi.to(cdt)) / r + bias.to(cdt)
    H_pre = torch.sigmoid(h[..., :n]) + hc_eps
    H_post = post_mult * torch.sigmoid(h[..., n:2 * n])
    H_res = sinkhorn_reference(h[..., 2 * n:].reshape(lead + (n, n)), num_iters, eps, convention)
    if convention == "deepseek":  # out_j = sum_i H_res[i, j] x_i
        H_res = H_res.transpose(-1, -2)
    layer_in = (H_pre.unsqueeze(-1) * x.to(cdt)).sum(dim=-2).to(x.dtype)
    y = layer_in if sublayer is None else sublayer(layer_in, *args, **(kwargs or {}))
    out = H_res @ x.to(cdt) + H_post.unsqueeze(-1) * y.to(cdt).unsqueeze(-2)
    return out.to(x.dtype)


class MHCReference(MHC):
    """:class:`MHC` with the forward written in plain torch ops (:func:`mhc_reference`).

    Same constructor, parameters and state dict as :class:`MHC`; use
    :meth:`from_layer` to get a reference copy of an existing layer (deep
    copy of its sublayer and parameters).  For tests: autograd of this
    module is the oracle for the kernel path, under the layer's convention, hc_eps and post_mult (its
    Sinkhorn gradient is the unrolled one's, whatever ``grad_mode``).  Unlike MHC, dtype casts apply to
    phi / alpha / bias too (``.double()`` gives the float64 oracle).
    """

    float32_parameters = ()

    @classmethod
    def from_layer(cls, layer: MHC) -> "MHCReference":
        ref = copy.deepcopy(layer)
        ref.__class__ = cls
        return ref

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        self._check(x)
        return mhc_reference(x, self.phi, self.alpha, self.bias, self.sublayer, self.num_iters, self.eps,
                             self.rms_eps, args, kwargs, convention=self.convention, hc_eps=self.hc_eps,
                             post_mult=self.post_mult)
