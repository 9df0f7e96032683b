"""Baselines: each op's maths written once against a small backend (PyTorch or jax.numpy)."""

from __future__ import annotations

from .specs import SPECS

# ------------------------------------------------------------------------ baseline math
# One definition per op, written against a tiny backend ``B`` (PyTorch or jax.numpy) so
# that the torch and JAX baselines are the same math: float32 arithmetic, the activation
# outputs rounded once at the end, exactly OPS.md.  Written as broadcast products and
# sums (no matmul over the tiny n x n), so that torch.compile / XLA can fuse each op
# into one kernel; the same code runs eagerly.

def _mix(B, x, M):
    """sum_j M[..., :, j] x[..., j, :] in float32, unrolled over j."""
    xf = B.f32(x)
    acc = M[..., :, 0:1] * xf[..., 0:1, :]
    for j in range(1, x.shape[-2]):
        acc = acc + M[..., :, j:j + 1] * xf[..., j:j + 1, :]
    return acc


def _sinkhorn(B, L, num_iters=20, eps=1e-8):
    P = B.exp(L - B.amax(L, -1))
    for _ in range(num_iters):
        P = P / (B.sum(P, -1) + eps)
        P = P / (B.sum(P, -2) + eps)
    return P


def _b_stream_mix(B, x, M):
    return (B.cast(_mix(B, x, M), x),)


def _b_stream_aggregate(B, x, h):
    return (B.cast((h[..., :, None] * B.f32(x)).sum(-2), x),)


def _b_stream_distribute(B, y, h):
    return (B.cast(h[..., :, None] * B.f32(y)[..., None, :], y),)


def _b_mhc_post_op(B, layer_out, x, H_post, H_res):
    return (B.cast(_mix(B, x, H_res) + H_post[..., :, None] * B.f32(layer_out)[..., None, :], x),)


def _b_mhc_pre_op(B, x, h_pre_raw, h_post_raw, h_res_raw, num_iters=20, eps=1e-8):
    H_pre = B.sigmoid(h_pre_raw)
    H_post = 2.0 * B.sigmoid(h_post_raw)
    H_res = _sinkhorn(B, h_res_raw, num_iters, eps)
    return B.cast((H_pre[..., :, None] * B.f32(x)).sum(-2), x), H_pre, H_post, H_res


def _b_sinkhorn_knopp(B, logits):
    return (_sinkhorn(B, logits),)


def _b_rmsnorm(B, x, eps=1e-5):
    xf = B.f32(x)
    return (B.cast(xf * B.rsqrt((xf * xf).mean(-1)[..., None] + eps), x),)


def _b_mhc_coeffs(B, x, phi, alpha, bias, eps=1e-5):
    n, C = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    xt = B.f32(x).reshape(lead + (n * C,))
    Ht = B.matmul(xt, phi)
    rinv = B.rsqrt((xt * xt).mean(-1)[..., None] + eps)
    h = B.alpha_cols(alpha, n) * Ht * rinv + bias
    return h[..., :n], h[..., n:2 * n], h[..., 2 * n:].reshape(lead + (n, n))


_MATH = {op: globals()[f"_b_{op}"] for op in SPECS}


def _b_mhc_layer(B, x, phi, alpha, bias, f, num_iters=20, eps=1e-8, rms_eps=1e-5):
    """The whole mHC layer from the op maths above (paper Eq. 3, OPS.md sections 6-8):
    coefficients -> pre op (layer_in rounded to x's dtype) -> f -> post op (rounded once)."""
    h_pre_raw, h_post_raw, h_res_raw = _b_mhc_coeffs(B, x, phi, alpha, bias, rms_eps)
    layer_in, _, H_post, H_res = _b_mhc_pre_op(B, x, h_pre_raw, h_post_raw, h_res_raw, num_iters, eps)
    (out,) = _b_mhc_post_op(B, B.cast(f(layer_in), x), x, H_post, H_res)
    return out


def _torch_backend():
    import torch

    class B:
        @staticmethod
        def f32(a):
            return a.float()

        @staticmethod
        def cast(a, like):
            return a.to(like.dtype)

        @staticmethod
        def sum(a, axis):  # keepdim
            return a.sum(axis, keepdim=True)

        @staticmethod
        def amax(a, axis):  # keepdim
            return a.amax(axis, keepdim=True)

        exp = staticmethod(torch.exp)
        sigmoid = staticmethod(torch.sigmoid)
        rsqrt = staticmethod(torch.rsqrt)
        matmul = staticmethod(torch.matmul)  # float32: full precision unless the user enabled TF32

        @staticmethod
        def alpha_cols(alpha, n):
            return torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])

    return B


def _jax_backend():
    import jax
    import jax.numpy as jnp

    class B:
        @staticmethod
        def f32(a):
            return a.astype(jnp.float32)

        @staticmethod
        def cast(a, like):
            return a.astype(like.dtype)

        @staticmethod
        def sum(a, axis):  # keepdims
            return jnp.sum(a, axis=axis, keepdims=True)

        @staticmethod
        def amax(a, axis):  # keepdims
            return jnp.max(a, axis=axis, keepdims=True)

        exp = staticmethod(jnp.exp)
        sigmoid = staticmethod(jax.nn.sigmoid)
        rsqrt = staticmethod(jax.lax.rsqrt)

        @staticmethod
        def matmul(a, b):  # float32 for real (XLA's GPU default would allow TF32)
            return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

        @staticmethod
        def alpha_cols(alpha, n):
            return jnp.concatenate([jnp.broadcast_to(alpha[0:1], (n,)), jnp.broadcast_to(alpha[1:2], (n,)),
                                    jnp.broadcast_to(alpha[2:3], (n * n,))])

    return B


def _baseline_fwd(backend, name: str, op: str):
    """The baseline forward of ``op`` written with ``backend``: ``f(*inputs) -> tuple of outputs``."""
    math_fn = _MATH[op]

    def f(*inputs):
        return tuple(math_fn(backend, *inputs))

    f.__name__ = f"{name}_{op}"
    return f


def torch_fwd(op: str):
    """The PyTorch baseline forward of ``op``."""
    return _baseline_fwd(_torch_backend(), "torch", op)


def jax_fwd(op: str):
    """The jax.numpy baseline forward of ``op``."""
    return _baseline_fwd(_jax_backend(), "jax", op)


def jnp_mhc_layer(params: dict, x, f, num_iters: int = 20, eps: float = 1e-8, rms_eps: float = 1e-5):
    """The mHC layer of :func:`mhc_cupy.jax.mhc_layer` in plain ``jax.numpy`` (no mhc_cupy kernels).

    x_{l+1} = H_res x_l + H_post^T f(H_pre x_l) (paper Eq. 3) with the coefficient path of
    OPS.md section 8: float32 maths (the GEMM at ``Precision.HIGHEST``), layer_in and the
    output rounded once to x's dtype, Sinkhorn-Knopp with the row-max shift (OPS.md section 1).

    Args:
        params: {"phi" [n*C, n*n + 2n], "alpha" [3], "bias" [n*n + 2n]}, float32
            (:func:`mhc_cupy.jax.mhc_init`).
        x: [..., n, C], bfloat16 / float16 / float32.
        f: the sublayer [..., C] -> [..., C]; its output is cast to x's dtype.
        num_iters, eps: Sinkhorn-Knopp iterations and eps; rms_eps: the coefficient path's eps.

    Returns:
        [..., n, C], dtype of x; differentiable with ``jax.grad`` / ``jax.vjp``.
    """
    return _b_mhc_layer(_jax_backend(), x, params["phi"], params["alpha"], params["bias"], f, num_iters, eps,
                        rms_eps)


def jnp_sinkhorn(L, num_iters: int = 20, eps: float = 1e-8):
    """Sinkhorn-Knopp in plain ``jax.numpy`` exactly as OPS.md section 1 (row-max shift, then
    ``num_iters`` row / column steps): the baselines' maths, also the JAX tests' oracle.

    Args: L float32 [..., n, n] logits; num_iters >= 0; eps >= 0.  Returns P, float32 [..., n, n].
    """
    return _sinkhorn(_jax_backend(), L, num_iters, eps)


def torch_bwd(f, inputs, grads) -> tuple:
    """Gradients of ``f`` w.r.t. ``inputs`` for upstream ``grads`` (torch.autograd.grad)."""
    import torch

    ins = [t.detach().requires_grad_() for t in inputs]
    return tuple(torch.autograd.grad(f(*ins), ins, tuple(grads)))


def jax_bwd(f, inputs, grads) -> tuple:
    """Gradients of ``f`` w.r.t. ``inputs`` for upstream ``grads`` (jax.vjp)."""
    import jax

    _, vjp = jax.vjp(f, *inputs)
    return tuple(vjp(tuple(grads)))

