"""PyTorch modules for mHC: the layer wrapper ``MHC`` and its helpers.

mHC (Xie et al., "mHC: Manifold-Constrained Hyper-Connections", arXiv
2512.24880) widens the residual stream to ``n`` parallel streams
``x_l [..., n, C]`` and updates it around each sublayer F (attention, MLP) as

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)                    (paper Eq. 3)

with per-token coefficients computed from ``x_l`` itself (paper Eqs. 14-18,
OPS.md section 8):

    x~ = vec(x_l) in R^{nC};  r = sqrt(mean(x~^2) + rms_eps);  Ht = x~ phi
    h_pre_raw  = alpha_pre  * Ht_pre  / r + b_pre
    h_post_raw = alpha_post * Ht_post / r + b_post
    h_res_raw  = alpha_res  * mat(Ht_res) / r + b_res
    H_pre = sigmoid(h_pre_raw);  H_post = 2 sigmoid(h_post_raw)      (paper Eq. 8)
    H_res = Sinkhorn-Knopp(h_res_raw)                                (paper Eq. 9)

Contents:

* :class:`MHC`: ``nn.Module`` wrapping any sublayer ``[..., C] -> [..., C]``;
  the fused layer pieces ``mhc_layer_pre`` -> F -> ``mhc_layer_post`` (OPS.md
  section 9), or coefficients (``mhc_coeffs``) -> ``mhc_pre_op`` -> F ->
  ``mhc_post_op`` (all in :mod:`mhc_cupy.torch.functions`).
* :func:`expand_streams` / :func:`collapse_streams` (and the modules
  :class:`ExpandStreams` / :class:`CollapseStreams`): into and out of the
  n-stream residual.
* :func:`identity_bias`: the biases that start the layer at a plain residual.

The same layer in plain torch ops (the tests' autograd oracle) is
:class:`mhc_cupy.torch.reference.MHCReference`.

Initialisation (see :func:`identity_bias`): the paper (Sec. 4, Eqs. 7-8)
makes every coefficient a static bias b plus a dynamic term from x gated by
a learnable scalar alpha (alpha_pre, alpha_post, alpha_res) that starts
small, so at initialisation the coefficients are essentially the biases.
OPS.md does not fix the bias values; the choice here starts the
layer at a plain residual connection, as Hyper-Connections (Zhu et al.,
arXiv 2409.19606) initialise theirs to reproduce the pre-norm residual:
H_pre = 1/n (the stream average), H_post = 1 (2 sigmoid(0)), H_res close to
the identity.  With the streams created by
:func:`expand_streams` (n equal copies) and collapsed by the mean, an mHC
network with phi = 0 is then the plain residual network up to float32
rounding and the Sinkhorn eps (measured ~1e-7 relative).  phi starts as a
tiny normal (std ``1 / sqrt(n C)``, so each dynamic logit is ~N(0, alpha^2),
std 0.01; each stream then differs from x + F(x) by ~1% of |F(x)|): that
breaks the symmetry between the n equal streams, which with phi = 0 would
stay equal forever.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor, nn

from .. import _checks, _convention, _layer_init
from .._convention import DEFAULT
from .._kernel_choice import current as _kernel_choice
from .._settings import LayerSettings
from ._float32 import Float32Parameters
from ._no_grad import forward as _no_grad_forward
from .functions import layer_post, layer_pre, mhc_coeffs, mhc_head, mhc_post_op, mhc_pre_op


__all__ = [
    "MHC", "MHCHead", "identity_bias", "expand_streams", "collapse_streams", "ExpandStreams", "CollapseStreams",
]


# ----------------------------------------------------------------- helpers
def _as_f32(t: Tensor) -> Tensor:
    """Coefficient parameters are float32 (OPS.md; dtype casts of the module keep them so); a
    differentiable cast where their data has another dtype (an FSDP2 policy's low param_dtype)."""
    return t if t.dtype == torch.float32 else t.float()


def _deepseek_sizes(hc_fn, hc_scale, hc_base, head: bool) -> tuple:
    """(C, n) of DeepSeek-layout parameter tensors (:func:`mhc_cupy._layer_init.deepseek_sizes`)."""
    for name, t in (("hc_fn", hc_fn), ("hc_scale", hc_scale), ("hc_base", hc_base)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():  # (copy_ into the float32 parameters would drop an imaginary part, or
            # take a bool / integer tensor's values for weights)
            raise TypeError(f"{name} has dtype {t.dtype}; it needs a real floating-point dtype")
    return _layer_init.deepseek_sizes(hc_fn.shape, hc_scale.shape, hc_base.shape, head)


def _normal_or_zero_(t: Tensor, std: float) -> None:
    """Fill t in place from N(0, std^2), or with zeros for std 0 (phi's and hc_fn's init)."""
    if std > 0:
        t.normal_(0.0, std)
    else:
        t.zero_()


def _what(v) -> str:
    """A value named for an error: a tensor's dtype and shape, else its type."""
    if isinstance(v, Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}" + (f" of {len(v)}" if isinstance(v, (tuple, list)) else "")


def _check_tensor(x, n: int, C: int) -> None:
    """TypeError naming x where it is not a tensor (None, a list, a NumPy array), as the ops give."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor [..., n_streams={n}, dim={C}], got {_what(x)}")


def _check_streams(x, n: int, C: int, who: str) -> None:
    """x is a tensor [..., n, C] for module ``who``: TypeError for a non-tensor, ValueError for another shape."""
    _check_tensor(x, n, C)
    if x.dim() < 2 or x.shape[-2] != n or x.shape[-1] != C:
        raise ValueError(f"x has shape {tuple(x.shape)}; {who} needs [..., n_streams={n}, dim={C}]")


def _detached_f32(t: Tensor) -> Tensor:
    """A float32 copy of a parameter, detached (for ``to_deepseek``)."""
    return t.detach().to(torch.float32, copy=True).contiguous()


# ------------------------------------------------------------ initialisation
def identity_bias(n: int, pre: Optional[float] = None, post: float = 1.0, res_diag: float = 0.95) -> Tensor:
    """Biases [n*n + 2n] (pre | post | res) that start mHC at a plain residual connection.

    * b_pre = logit(pre) so that H_pre = sigmoid(b_pre) = ``pre`` for every
      stream; default 1/n: layer_in is the stream average, which for n equal
      streams is the plain residual stream itself (n = 1: 0.99, since
      sigmoid never reaches 1).
    * b_post = logit(post / 2) so that H_post = 2 sigmoid(b_post) = ``post``;
      default 1 (b_post = 0): every stream receives F's output once, as
      ``x + F(x)``.
    * b_res = d on the diagonal, 0 elsewhere, with d = log(res_diag (n-1) /
      (1 - res_diag)): a matrix with one constant diagonal and one constant
      off-diagonal is already doubly stochastic after the first row step, so
      Sinkhorn returns exactly res_diag on the diagonal and
      (1 - res_diag)/(n - 1) elsewhere.  Default 0.95: close to the identity
      (each stream keeps itself, as Hyper-Connections' identity init), yet
      not so saturated that the Sinkhorn gradient (~P(1-P)) vanishes.  For n
      equal streams H_res acts only through its row sums (1), so this choice
      does not change the function at init, only how stream differences
      propagate once they appear.

    Args:
        n: streams, >= 1.
        pre: H_pre at init in (0, 1); default 1/n (0.99 for n = 1).
        post: H_post at init in (0, 2); default 1.
        res_diag: diagonal of H_res at init in [1/n, 1); default 0.95 (ignored for n = 1).

    Returns:
        float32 tensor [n*n + 2n].
    """
    return torch.from_numpy(_layer_init.identity_bias(n, pre, post, res_diag))


# --------------------------------------------------------- stream helpers
def expand_streams(h: Tensor, n: int) -> Tensor:
    """Copy a hidden state into n residual streams: [..., C] -> [..., n, C] (contiguous).

    Every stream starts as the embedding itself (the Hyper-Connections /
    mHC convention); the gradient is the sum over the streams.
    """
    n = _checks._int("n", n)  # (2.5, "3", True gave torch's or Python's own errors, or one stream)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def collapse_streams(x: Tensor, reduce: str = "mean") -> Tensor:
    """Merge the residual streams back into one hidden state: [..., n, C] -> [..., C].

    ``reduce="mean"`` (default) makes ``collapse_streams(expand_streams(h, n)) == h``
    (exactly for n a power of two, else up to one rounding) and keeps the
    scale of a plain residual stream; ``"sum"`` is the sum
    (n times larger; equivalent when a scale-invariant norm follows, as the
    final RMSNorm of a transformer).
    """
    if reduce == "mean":
        return x.mean(dim=-2)
    if reduce == "sum":
        return x.sum(dim=-2)
    raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")


class ExpandStreams(nn.Module):
    """Module form of :func:`expand_streams`."""

    def __init__(self, n_streams: int):
        super().__init__()
        self.n_streams = n_streams

    def forward(self, h: Tensor) -> Tensor:
        return expand_streams(h, self.n_streams)

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}"


class CollapseStreams(nn.Module):
    """Module form of :func:`collapse_streams`."""

    def __init__(self, reduce: str = "mean"):
        super().__init__()
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self.reduce = reduce

    def forward(self, x: Tensor) -> Tensor:
        return collapse_streams(x, self.reduce)

    def extra_repr(self) -> str:
        return f"reduce={self.reduce!r}"


# ------------------------------------------------------------------- layer
class _NotInAStack:
    """``MHC._stack_slot`` outside a recomputing :class:`mhc_cupy.torch.MHCStack`: the mHC pieces save
    their tensors as usual and nothing is recorded."""

    _as_usual = contextlib.nullcontext()

    def saving(self):
        return self._as_usual

    def record(self, x, y, H_post, H_res, convention, out) -> None:
        pass


class MHC(Float32Parameters):
    """mHC around one sublayer: x_{l+1} = H_res x_l + H_post^T F(H_pre x_l) (paper Eq. 3).

    The coefficients are computed per token from x_l (paper Eqs. 14-18, OPS.md
    section 8), activated and applied (section 7) in one piece,
    :func:`mhc_cupy.torch.mhc_layer_pre`; the residual update (section 6) is
    :func:`mhc_cupy.torch.mhc_layer_post`, whose backward hands the post op's part of
    dx to the first piece's, so dx is written once (OPS.md section 9; rounded once for
    n <= 4, twice above, where the post op's part comes rounded to x's dtype).  CUDA
    tensors run the toolkit's kernels; CPU tensors the NumPy reference.

    Args:
        dim: C, the hidden size of the sublayer.
        n_streams: n, the number of residual streams (1..32). Default 4 (the paper's).
        sublayer: F, any module [..., C] -> [..., C] (attention, MLP, with
            its own pre-norm); None = identity.  Extra forward arguments are
            passed through to it.  Its output (one real tensor [..., C]; anything else raises
            TypeError / ValueError) is cast to x's dtype.
        num_iters: Sinkhorn iterations (paper t_max). Default 20.
        eps: Sinkhorn eps. Default 1e-8, or 1e-6 under ``convention="deepseek"``.
        rms_eps: eps of r = sqrt(mean(x~^2) + eps). Default 1e-5, or 1e-6 under "deepseek".
        alpha_init: initial value of alpha_pre, alpha_post, alpha_res
            (paper: small). Default 0.01.
        phi_init_std: std of phi's normal init; default 1/sqrt(n*C) (each
            dynamic logit then starts ~N(0, alpha_init^2)).  0 gives zeros
            (then the n streams stay identical: no symmetry breaking).
        pre_init, post_init, res_diag_init: H_pre, H_post and diag(H_res) at
            init; see :func:`identity_bias`.  pre_init is in (hc_eps, 1 + hc_eps) (H_pre =
            sigmoid(b_pre) + hc_eps: the bias gives pre_init - hc_eps); default: sigmoid(b_pre) =
            1/n (0.99 for n = 1).  post_init is in (0, post_mult), and not given where post_mult
            is 0 (H_post is then 0); default post_mult / 2 (b_post = 0: 1 with the default post_mult 2).
        grad_mode: Sinkhorn backward, "unrolled" (default, exact) or "implicit".
        convention: "paper" (default; OPS.md sections 6-9 as written) or "deepseek" (the
            DeepSeek-V4 maths, OPS.md "DeepSeek-V4 convention": Sinkhorn with a softmax start,
            H_pre = sigmoid + hc_eps, H_post = post_mult sigmoid, the post op with H_res
            transposed).  Load a DeepSeek-V4 checkpoint with :meth:`from_deepseek`.  Keyword only
            (as hc_eps and post_mult).
        hc_eps: added to H_pre. Default 0, or 1e-6 under "deepseek".
        post_mult: H_post = post_mult sigmoid(h_post_raw). Default 2.

    Parameters:
        phi: float32 [n*C, n*n + 2n] (columns pre | post | res);
        alpha: float32 [3]; bias: float32 [n*n + 2n].
        DeepSeek-V4's layout of the same numbers (``hc_fn = phi^T``, ``hc_scale = alpha``,
        ``hc_base = bias``): :meth:`from_deepseek` / :meth:`to_deepseek` (docs/DEEPSEEK.md).

    Shapes:
        forward(x [..., n, C], *args, **kwargs) -> [..., n, C], dtype of x
        (bfloat16 / float16 / float32; coefficients are always float32).

    dtype casts (``.to(torch.bfloat16)``, ``.half()``, ``.bfloat16()``, ``.double()``) cast the
    sublayer only: phi, alpha and bias (and their gradients) stay float32, unrounded; device moves
    apply to all.  ``torch.func`` transforms (grad, vmap, ...) are not supported:
    NotImplementedError (use torch.autograd, and leading dims for a batch).

    Raises:
        TypeError / ValueError in the constructor (before allocating): dim not an
        int >= 1, n_streams not in 1..32, num_iters not an int in 0..10000
        (``mhc_cupy.MAX_NUM_ITERS``; >= 1 under "deepseek"), eps / rms_eps / hc_eps /
        post_mult not a finite float >= 0, pre_init not in (hc_eps, 1 + hc_eps), post_init not in
        (0, post_mult) or given with post_mult 0, res_diag_init not in [1/n, 1) (n > 1; a
        non-real pre_init / post_init / res_diag_init: TypeError), bad grad_mode or convention,
        sublayer neither None nor callable, alpha_init not a finite float, phi_init_std neither None
        nor a finite float >= 0.
    """

    float32_parameters = ("phi", "alpha", "bias")

    def __init__(self, dim: int, n_streams: int = 4, sublayer: Optional[nn.Module] = None,
                 num_iters: int = DEFAULT, eps: float = DEFAULT, rms_eps: float = DEFAULT,
                 alpha_init: float = 0.01, phi_init_std: Optional[float] = None, pre_init: Optional[float] = None,
                 post_init: Optional[float] = None, res_diag_init: float = 0.95, grad_mode: str = "unrolled", device=None, *,
                 convention: str = "paper", hc_eps: float = DEFAULT, post_mult: float = DEFAULT):
        super().__init__()
        # checked before phi (n*C x (n*n + 2n) floats) is allocated
        dim, n_streams = _checks.layer_size(dim, n_streams)
        if sublayer is not None and not callable(sublayer):
            raise TypeError(f"sublayer must be a module (or callable) [..., C] -> [..., C] or None, got "
                            f"{type(sublayer).__name__} {sublayer!r}")
        #: the layer's settings, resolved once (DEFAULT: the convention's); read-only attributes below
        self.settings = LayerSettings.resolve(convention, num_iters=num_iters, eps=eps, rms_eps=rms_eps,
                                              grad_mode=grad_mode, hc_eps=hc_eps, post_mult=post_mult)
        self.dim, self.n_streams = dim, n_streams
        self.alpha_init = _layer_init.init_value("alpha_init", alpha_init)
        self.phi_init_std = _layer_init.init_std("phi_init_std", phi_init_std, n_streams * dim)
        # the init values checked here, naming the constructor's arguments (identity_bias names its own)
        pre_init, post_init = (None if v is None else _layer_init.init_value(name, v)
                               for name, v in (("pre_init", pre_init), ("post_init", post_init)))
        res_diag_init = _layer_init.init_value("res_diag_init", res_diag_init)
        if n_streams > 1 and not 1.0 / n_streams <= res_diag_init < 1.0:
            raise ValueError(f"res_diag_init (diagonal of H_res at init) must be in [1/n, 1) = [{1.0 / n_streams}, 1) "
                             f"for n_streams = {n_streams}, got {res_diag_init}")
        if post_init is not None and not 0 < post_init < self.post_mult:
            raise ValueError(f"post_init (H_post at init = post_mult sigmoid(b_post)) must be in (0, post_mult = "
                             f"{self.post_mult}), got {post_init}" + (" (post_mult 0: H_post is 0, leave post_init out)"
                                                                      if self.post_mult == 0 else ""))
        if pre_init is not None and not self.hc_eps < pre_init < 1 + self.hc_eps:
            raise ValueError(f"pre_init (H_pre at init = sigmoid(b_pre) + hc_eps) must be in (hc_eps, 1 + hc_eps) = "
                             f"({self.hc_eps}, {1 + self.hc_eps}), got {pre_init}")
        self.pre_init, self.post_init, self.res_diag_init = pre_init, post_init, res_diag_init
        m = n_streams * n_streams + 2 * n_streams
        kw = {"device": device, "dtype": torch.float32}  # kept float32 by dtype casts (Float32Parameters)
        self.phi = nn.Parameter(torch.empty(n_streams * dim, m, **kw))
        self.alpha = nn.Parameter(torch.empty(3, **kw))
        self.bias = nn.Parameter(torch.empty(m, **kw))
        self.sublayer = sublayer if sublayer is not None else nn.Identity()
        # the fused layer pieces unless built under kernel_choice(fused=False) (a benchmark's
        # separate ops; read here, not in forward, which torch.compile traces: mhc_cupy._kernel_choice)
        self._fused = _kernel_choice().runs("fused")
        self.reset_parameters()

    num_iters = property(lambda self: self.settings.num_iters)
    eps = property(lambda self: self.settings.eps)
    rms_eps = property(lambda self: self.settings.rms_eps)
    grad_mode = property(lambda self: self.settings.grad_mode)
    convention = property(lambda self: self.settings.convention)
    hc_eps = property(lambda self: self.settings.hc_eps)
    post_mult = property(lambda self: self.settings.post_mult)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise phi, alpha and bias (not the sublayer)."""
        _normal_or_zero_(self.phi, self.phi_init_std)
        self.alpha.fill_(self.alpha_init)
        # identity_bias sets H_post = 2 sigmoid(b_post) = post: the same b_post gives post_mult / 2 of it here
        post = 1.0 if self.post_init is None else 2.0 * self.post_init / self.post_mult
        pre = None if self.pre_init is None else self.pre_init - self.hc_eps  # H_pre = sigmoid(b_pre) + hc_eps
        self.bias.copy_(identity_bias(self.n_streams, pre, post, self.res_diag_init))

    @classmethod
    def from_deepseek(cls, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, sublayer: Optional[nn.Module] = None,
                      **kw) -> "MHC":
        """An MHC layer holding DeepSeek-V4 parameters (docs/DEEPSEEK.md), ``convention="deepseek"``.

        Args:
            hc_fn: [n*n + 2n, n*C] (a V4 checkpoint's ``hc_attn_fn`` / ``hc_ffn_fn``), rows
                ordered pre | post | res: becomes phi = hc_fn^T.
            hc_scale: [3] (``hc_*_scale``) = alpha.  hc_base: [n*n + 2n] (``hc_*_base``) = bias.
            sublayer: F (attention / MLP with its own norm); None = identity.
            **kw: the constructor's other arguments (``convention`` defaults to "deepseek",
                ``device`` to hc_fn's).

        Returns:
            MHC with dim = C and n_streams = n read off hc_fn; its parameters are float32 copies
            (bit-exact for float32 input: :meth:`to_deepseek` gives the same tensors back).

        Raises:
            TypeError: a parameter is not a tensor, or not of a real floating-point dtype (complex, bool,
            integer).  ValueError: shapes are not a DeepSeek layer's.
        """
        C, n = _deepseek_sizes(hc_fn, hc_scale, hc_base, head=False)
        kw.setdefault("convention", "deepseek")
        kw.setdefault("device", hc_fn.device)
        layer = cls(C, n, sublayer, **kw)
        with torch.no_grad():
            layer.phi.copy_(hc_fn.t())
            layer.alpha.copy_(hc_scale)
            layer.bias.copy_(hc_base)
        return layer

    def to_deepseek(self) -> tuple[Tensor, Tensor, Tensor]:
        """(hc_fn [n*n + 2n, n*C], hc_scale [3], hc_base [n*n + 2n]): the parameters in
        DeepSeek-V4's layout (float32 copies, detached; the inverse of :meth:`from_deepseek`)."""
        return _detached_f32(self.phi.t()), _detached_f32(self.alpha), _detached_f32(self.bias)

    def _check(self, x: Tensor) -> None:
        _check_streams(x, self.n_streams, self.dim, "MHC")

    def coefficients(self, x: Tensor):
        """(h_pre_raw, h_post_raw, h_res_raw) for x [..., n, C] (float32, differentiable)."""
        self._check(x)
        return mhc_coeffs(x, _as_f32(self.phi), _as_f32(self.alpha), _as_f32(self.bias), self.rms_eps)

    #: set by :class:`mhc_cupy.torch.MHCStack` around a call when it recomputes: the hooks that save
    #: the mHC pieces' tensors (the sublayer's are its own) and the sink of the residual update's inputs
    _stack_slot = _NotInAStack()

    #: set by :class:`mhc_cupy.torch.MHCStack` with ``fuse_boundaries`` around a call: the pre piece that the
    #: previous layer's residual update computed for this call's x (``given``), and the next layer's, to
    #: compute in this one's (``next``) (functions.NextPre, OPS.md section 12)
    _pre_given = _pre_next = None

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        params = None
        if (not torch.is_grad_enabled() and self._fused and self._pre_given is None and self._pre_next is None
                and type(self._stack_slot) is _NotInAStack):
            params = self.phi, self.alpha, self.bias  # (read once: a parametrization runs at each read)
            out = _no_grad_forward(self, x, *params, args, kwargs)  # a repeated call: the same kernels, less host
            if out is not None:  # work
                return out
        s = self.settings
        slot = self._stack_slot
        given = prev = None
        if self._pre_given is not None:  # (the outputs only for the parameters they came from: see NextPre)
            params = params or (self.phi, self.alpha, self.bias)
            given, prev = self._pre_given.take(x, params) or (None, None)
        with slot.saving():
            if given is not None or self._fused:
                self._check(x)
                phi, alpha, bias = params or (self.phi, self.alpha, self.bias)
                layer_in, x_in, H_post, H_res = layer_pre(x, _as_f32(phi), _as_f32(alpha), _as_f32(bias),
                                                          {"settings": s}, given, prev)
                post = functools.partial(layer_post, nxt=self._pre_next)
            else:
                h_pre_raw, h_post_raw, h_res_raw = self.coefficients(x)
                layer_in, _, H_post, H_res = mhc_pre_op(x, h_pre_raw, h_post_raw, h_res_raw,
                                                        num_iters=s.num_iters, eps=s.eps, grad_mode=s.grad_mode,
                                                        convention=s.convention, hc_eps=s.hc_eps,
                                                        post_mult=s.post_mult)
                x_in, post = x, mhc_post_op
        y = self._sublayer_output(layer_in, x, args, kwargs)
        with slot.saving():
            out = post(y, x_in, H_post, H_res, convention=self.convention)
        slot.record(x, y, H_post, H_res, self.convention, out)
        return out

    def _sublayer_output(self, layer_in: Tensor, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """The sublayer's output for layer_in, checked and cast to x's dtype."""
        y = self.sublayer(layer_in, *args, **kwargs)
        if not isinstance(y, Tensor) or y.is_complex():  # (a tuple: an attention module's (out, weights))
            raise TypeError(f"sublayer returned {_what(y)}; MHC needs one real tensor [..., C] (a sublayer that "
                            "returns several values: wrap it to return its output alone)")
        if y.shape != layer_in.shape:
            raise ValueError(f"sublayer returned shape {tuple(y.shape)}; MHC needs [..., C] = {tuple(layer_in.shape)}")
        return y if y.dtype == x.dtype else y.to(x.dtype)  # (to() returns y itself then, at ~1 us)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_streams={self.n_streams}, num_iters={self.num_iters}, eps={self.eps}, "
                f"rms_eps={self.rms_eps}, grad_mode={self.grad_mode!r}"
                + ("" if self.convention == "paper" else
                   f", convention={self.convention!r}, hc_eps={self.hc_eps}, post_mult={self.post_mult}"))


# -------------------------------------------------------------------- head
class MHCHead(Float32Parameters):
    """The mHC head: the n residual streams merged into one hidden state at the end of the
    network (OPS.md section 11; DeepSeek-V4's ``hc_head``), in place of :func:`collapse_streams`.

    Per token, with x~ = vec(x): w = sigmoid((x~ hc_fn^T) / sqrt(mean(x~^2) + rms_eps) * hc_scale
    + hc_base) + hc_eps; out = sum_i w_i x_i (:func:`mhc_cupy.torch.mhc_head`; CUDA tensors run
    the fused kernels, CPU tensors the NumPy reference).

    Args:
        dim: C.  n_streams: n (1..32). Default 4.
        convention: "deepseek" (default: rms_eps = hc_eps = 1e-6, DeepSeek-V4's) or "paper"
            (the paper has no head: the coefficient path's rms_eps = 1e-5 and hc_eps = 0).
        rms_eps, hc_eps: override the convention's defaults (left out: the default).
        scale_init: initial hc_scale (small, as the paper's alpha). Default 0.01.
        fn_init_std: std of hc_fn's normal init; default 1/sqrt(n*C).
        device: of the parameters.

    Parameters (DeepSeek-V4's layout and names, so a checkpoint's ``hc_head_fn`` /
    ``hc_head_scale`` / ``hc_head_base`` load as they are):
        hc_fn: float32 [n, n*C]; hc_scale: float32 [1]; hc_base: float32 [n], initialised to
        logit(1/n) (0.99 for n = 1) so that the head starts as the stream mean.

    Shapes:
        forward(x [..., n, C]) -> [..., C], dtype of x.

    dtype casts of the module (``.to(torch.bfloat16)``, ``.half()``, ...) leave hc_fn, hc_scale and
    hc_base float32; ``torch.func`` transforms raise NotImplementedError (as :class:`MHC`).

    Raises:
        TypeError / ValueError in the constructor: dim not an int >= 1, n_streams not in 1..32,
        rms_eps / hc_eps not a finite float >= 0, bad convention, scale_init not a finite float,
        fn_init_std neither None nor a finite float >= 0.
    """

    float32_parameters = ("hc_fn", "hc_scale", "hc_base")

    def __init__(self, dim: int, n_streams: int = 4, convention: str = "deepseek", rms_eps: float = DEFAULT,
                 hc_eps: float = DEFAULT, scale_init: float = 0.01, fn_init_std: Optional[float] = None,
                 device=None):
        super().__init__()
        dim, n_streams = _checks.layer_size(dim, n_streams)
        self.convention = _convention.check(convention)
        self.rms_eps = _convention.rms_eps(convention, rms_eps)
        self.hc_eps = _checks.eps("hc_eps", _convention.resolve(convention, hc_eps=hc_eps))
        self.dim, self.n_streams = dim, n_streams
        self.scale_init = _layer_init.init_value("scale_init", scale_init)
        self.fn_init_std = _layer_init.init_std("fn_init_std", fn_init_std, n_streams * dim)
        kw = {"device": device, "dtype": torch.float32}
        self.hc_fn = nn.Parameter(torch.empty(n_streams, n_streams * dim, **kw))
        self.hc_scale = nn.Parameter(torch.empty(1, **kw))
        self.hc_base = nn.Parameter(torch.empty(n_streams, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise hc_fn (small normal), hc_scale (``scale_init``) and hc_base (the stream mean)."""
        _normal_or_zero_(self.hc_fn, self.fn_init_std)
        self.hc_scale.fill_(self.scale_init)
        self.hc_base.fill_(_layer_init.logit(1.0 / self.n_streams if self.n_streams > 1 else 0.99))

    def forward(self, x: Tensor) -> Tensor:
        _check_streams(x, self.n_streams, self.dim, "MHCHead")
        return mhc_head(x, _as_f32(self.hc_fn), _as_f32(self.hc_scale), _as_f32(self.hc_base), self.rms_eps,
                        self.hc_eps)

    @classmethod
    def from_deepseek(cls, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, **kw) -> "MHCHead":
        """A head holding DeepSeek-V4's ``hc_head_fn`` [n, n*C], ``hc_head_scale`` [1] and
        ``hc_head_base`` [n] (float32 copies; ``**kw``: the constructor's other arguments,
        ``device`` defaulting to hc_fn's).  Raises TypeError for a non-tensor argument or one not of a real
        floating-point dtype,
        ValueError for other shapes."""
        C, n = _deepseek_sizes(hc_fn, hc_scale, hc_base, head=True)
        kw.setdefault("device", hc_fn.device)
        head = cls(C, n, **kw)
        with torch.no_grad():
            for p, t in ((head.hc_fn, hc_fn), (head.hc_scale, hc_scale), (head.hc_base, hc_base)):
                p.copy_(t)
        return head

    def to_deepseek(self) -> tuple[Tensor, Tensor, Tensor]:
        """(hc_fn [n, n*C], hc_scale [1], hc_base [n]), float32 copies, detached."""
        return _detached_f32(self.hc_fn), _detached_f32(self.hc_scale), _detached_f32(self.hc_base)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_streams={self.n_streams}, convention={self.convention!r}, "
                f"rms_eps={self.rms_eps}, hc_eps={self.hc_eps}")

