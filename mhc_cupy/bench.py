"""Benchmarks: ``python -m mhc_cupy.bench`` (``--help`` for the flags; benchmarks/README.md).

Every op, forward and backward, at tokens x C x n (bf16 activations by
default), against the same math in PyTorch eager, ``torch.compile`` and
``jax.jit`` on the same inputs, with a byte model that turns times into GB/s
and a fraction of the device-to-device copy bandwidth measured in the same run.

How each number is taken
------------------------
* **Cache.** Every call reads a different input set: ``R = 1 + ceil(2 L2 / B)``
  sets (B = the op's bytes per call, L2 read from the device; 2 <= R <= 64),
  used in turn, so at least 2 L2 of other traffic separates two uses of one
  set and every read comes from HBM.  The last R outputs are kept alive too, so
  outputs rotate as well.  The rotation is inside what is replayed: one CUDA
  graph holds ``calls`` consecutive calls (a multiple of R) on sets
  0, 1, ..., R-1, 0, 1, ...  (Only Sinkhorn at <= ~16k tokens moves so few
  bytes that the cap R = 64 leaves its sets partly in L2; it is latency-bound.)
* **mhc_cupy.** The functional ``*_fwd`` / ``*_bwd`` calls on CuPy inputs,
  captured into one CUDA graph (``calls`` calls) after warm-up; the graph is
  replayed between two CUDA events ``reps`` times; a sample is one replay's
  time / ``calls``; the number reported is the median sample (min and max are
  in the JSON).  Graph replay excludes the host cost of the Python call, which
  is measured separately (host overhead).
* **torch / torch.compile.** The baseline math below, eager or compiled
  (``torch.compile(dynamic=False)``, default mode, recompiled per shape),
  captured into a ``torch.cuda.CUDAGraph`` the same way and timed with
  ``torch.cuda.Event`` (so both are PyTorch's GPU time without its host
  overhead); if capture fails, ``calls`` eager calls between two events (the
  JSON says which).  Backward: the forward runs outside the timed region (on
  the capture stream, ``R`` autograd graphs kept), and only
  ``torch.autograd.grad(out, inputs, g, retain_graph=True)`` is timed.
* **jax.jit.** The same math in ``jnp`` under ``jax.jit``; wall clock over
  ``calls`` dispatches followed by ``jax.block_until_ready``, per call, median
  of ``reps``.  This includes JAX's per-call dispatch (a few us): it is hidden
  when the GPU work per call is longer, not for Sinkhorn at small sizes.
  Backward: ``out, vjp = jax.vjp(f, *inputs)`` per input set outside the timed
  region; the timed call is one jitted pullback applied to each set's residuals.
* **Copy bandwidth.** ``cupy.copyto`` between two 2 GiB buffers, run eagerly
  (not in a graph: a graph turns the copy into a copy-engine node, measured at
  2.77 TB/s against 4.25 TB/s eagerly on an H200) between CUDA events, median
  of 20, counting bytes read + bytes written.
* **Byte model** (``BYTES``): each input read once, each output written once;
  activations at the activation itemsize, coefficients and their gradients
  float32.  GB/s = bytes / time; "% of copy" = that over the copy bandwidth.

Every baseline output is compared with ours on the first input set (relative
L2 error, reported as ``max_rel_err``), so a baseline that computes different
math is caught.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------------- ops
#: Implementations, in table order.
IMPLS = ("mhc_cupy", "torch", "torch.compile", "jax.jit")
BASELINES = IMPLS[1:]

#: Ops benchmarked by default, in table order.
DEFAULT_OPS = ("stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op", "mhc_pre_op",
               "sinkhorn_knopp", "rmsnorm", "mhc_coeffs")

#: Shape codes of the arrays below: T tokens, n streams, C hidden size, N = n*C (vec(x)),
#: m = n*n + 2n (columns of phi).
_DIMS = {
    "TnC": lambda T, C, n: (T, n, C),
    "TC": lambda T, C, n: (T, C),
    "Tn": lambda T, C, n: (T, n),
    "Tnn": lambda T, C, n: (T, n, n),
    "TN": lambda T, C, n: (T, n * C),
    "Nm": lambda T, C, n: (n * C, n * n + 2 * n),
    "m": lambda T, C, n: (n * n + 2 * n,),
    "3": lambda T, C, n: (3,),
}

#: Per op: its inputs and forward outputs as (name, kind, shape code); kind "act" = activation
#: dtype, "coef" = float32.  The backward takes one upstream gradient per forward output
#: (same kind and shape) followed by the forward inputs, and returns one gradient per input
#: (same kind and shape): ``<op>_bwd(*grads, *inputs)``.  ``uses_C`` False: C does not
#: change the op (Sinkhorn), so it runs once per (tokens, n).
SPECS = {
    "stream_mix": dict(inputs=(("x", "act", "TnC"), ("M", "coef", "Tnn")),
                       outputs=(("out", "act", "TnC"),)),
    "stream_aggregate": dict(inputs=(("x", "act", "TnC"), ("h", "coef", "Tn")),
                             outputs=(("out", "act", "TC"),)),
    "stream_distribute": dict(inputs=(("y", "act", "TC"), ("h", "coef", "Tn")),
                              outputs=(("out", "act", "TnC"),)),
    "mhc_post_op": dict(inputs=(("layer_out", "act", "TC"), ("x", "act", "TnC"), ("H_post", "coef", "Tn"),
                                ("H_res", "coef", "Tnn")),
                        outputs=(("out", "act", "TnC"),)),
    "mhc_pre_op": dict(inputs=(("x", "act", "TnC"), ("h_pre_raw", "coef", "Tn"), ("h_post_raw", "coef", "Tn"),
                               ("h_res_raw", "coef", "Tnn")),
                       outputs=(("layer_in", "act", "TC"), ("H_pre", "coef", "Tn"), ("H_post", "coef", "Tn"),
                                ("H_res", "coef", "Tnn"))),
    "sinkhorn_knopp": dict(inputs=(("logits", "coef", "Tnn"),), outputs=(("P", "coef", "Tnn"),), uses_C=False),
    "rmsnorm": dict(inputs=(("x", "act", "TN"),), outputs=(("out", "act", "TN"),)),
    "mhc_coeffs": dict(inputs=(("x", "act", "TnC"), ("phi", "coef", "Nm"), ("alpha", "coef", "3"),
                               ("bias", "coef", "m")),
                       outputs=(("h_pre_raw", "coef", "Tn"), ("h_post_raw", "coef", "Tn"),
                                ("h_res_raw", "coef", "Tnn"))),
}

#: Ops whose bandwidth targets are checked (fwd >= 90 %, bwd >= 85 % of copy).
BANDWIDTH_TARGETS = {"fwd": 0.90, "bwd": 0.85}
BANDWIDTH_TARGET_OPS = ("stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op", "mhc_pre_op")
SINKHORN_TARGET_US, SINKHORN_TARGET_TOKENS = 15.0, 32768
HOST_TARGET_RATIO = 2.0
#: The shapes the bandwidth and torch.compile targets apply to (the issue's
#: "16384+ tokens, C >= 4096, n = 4"); other shapes are reported, not judged.
TARGET_MIN_TOKENS, TARGET_MIN_C, TARGET_N = 16384, 4096, 4
TARGET_DOMAIN = f"T >= {TARGET_MIN_TOKENS}, C >= {TARGET_MIN_C}, n = {TARGET_N}"


def in_target_domain(r: dict) -> bool:
    """A result row the targets judge (Sinkhorn has no C: tokens and n only)."""
    return (r["tokens"] >= TARGET_MIN_TOKENS and r["n"] == TARGET_N
            and (r["C"] is None or r["C"] >= TARGET_MIN_C))

# Byte model: every input read once, every output written once.  With
#   A = T*n*C*s (one [T, n, C] activation), Y = T*C*s (one [T, C] activation),
#   K = 4*T (one float32 per token), m = n*n + 2n, P = 4*(n*C*m + 3 + m) (phi, alpha, bias),
# s the activation itemsize:
BYTES = {
    ("stream_mix", "fwd"): lambda A, Y, K, n, P: 2 * A + n * n * K,                 # x, M -> out
    ("stream_mix", "bwd"): lambda A, Y, K, n, P: 3 * A + 2 * n * n * K,             # g, x, M -> dx, dM
    ("stream_aggregate", "fwd"): lambda A, Y, K, n, P: A + Y + n * K,               # x, h -> out
    ("stream_aggregate", "bwd"): lambda A, Y, K, n, P: 2 * A + Y + 2 * n * K,       # g, x, h -> dx, dh
    ("stream_distribute", "fwd"): lambda A, Y, K, n, P: A + Y + n * K,              # y, h -> out
    ("stream_distribute", "bwd"): lambda A, Y, K, n, P: A + 2 * Y + 2 * n * K,      # g, y, h -> dy, dh
    ("mhc_post_op", "fwd"): lambda A, Y, K, n, P: 2 * A + Y + (n * n + n) * K,      # y, x, H_post, H_res -> out
    ("mhc_post_op", "bwd"): lambda A, Y, K, n, P: 3 * A + 2 * Y + 2 * (n * n + n) * K,  # g, y, x, H -> dy, dx, dH
    ("mhc_pre_op", "fwd"): lambda A, Y, K, n, P: A + Y + 2 * (n * n + 2 * n) * K,   # x, raw -> layer_in, H
    ("mhc_pre_op", "bwd"): lambda A, Y, K, n, P: 2 * A + Y + 3 * (n * n + 2 * n) * K,  # g, gH, x, raw -> dx, draw
    ("sinkhorn_knopp", "fwd"): lambda A, Y, K, n, P: 2 * n * n * K,                 # logits -> P
    ("sinkhorn_knopp", "bwd"): lambda A, Y, K, n, P: 3 * n * n * K,                 # g, logits -> dlogits
    ("rmsnorm", "fwd"): lambda A, Y, K, n, P: 2 * A,                                # x [T, n*C] -> out
    ("rmsnorm", "bwd"): lambda A, Y, K, n, P: 3 * A,                                # g, x -> dx
    ("mhc_coeffs", "fwd"): lambda A, Y, K, n, P: A + P + (n * n + 2 * n) * K,       # x, phi, alpha, bias -> h raw
    ("mhc_coeffs", "bwd"): lambda A, Y, K, n, P: 2 * A + 2 * P + (n * n + 2 * n) * K,  # gh, x, params -> dx, dparams
}

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                  "float16": "float16", "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32"}


def nbytes(op: str, direction: str, T: int, C: int, n: int, itemsize: int) -> int:
    """Bytes of one call under the byte model ``BYTES`` (each input read once, each output written once)."""
    A, Y, K = T * n * C * itemsize, T * C * itemsize, 4 * T
    P = 4 * (n * C * (n * n + 2 * n) + 3 + (n * n + 2 * n))
    return int(BYTES[(op, direction)](A, Y, K, n, P))


def shape_of(code: str, T: int, C: int, n: int) -> tuple:
    return _DIMS[code](T, C, n)


def spec_nbytes(op: str, direction: str, T: int, C: int, n: int, itemsize: int) -> int:
    """The byte model derived from ``SPECS`` (sum of the sizes of what is read and written);
    equals ``nbytes`` (a test checks it)."""
    s = SPECS[op]

    def size(arrays):
        return sum(math.prod(shape_of(code, T, C, n)) * (itemsize if kind == "act" else 4) for _, kind, code in arrays)

    if direction == "fwd":
        return size(s["inputs"]) + size(s["outputs"])
    return size(s["outputs"]) + 2 * size(s["inputs"])  # grads in; inputs in; input grads out


def uses_C(op: str) -> bool:
    return SPECS[op].get("uses_C", True)


def rotation(bytes_per_call: int, l2_bytes: int, min_calls: int = 10, max_sets: int = 64) -> tuple[int, int]:
    """(input sets R, calls per timed graph).

    R = 1 + ceil(2 * L2 / bytes_per_call), clamped to [2, max_sets]: between two uses of a
    set the other sets move at least 2 L2 through the cache.  Calls per graph: the smallest
    multiple of R that is >= min_calls.
    """
    sets = 1 + math.ceil(2 * l2_bytes / max(1, bytes_per_call))
    sets = max(2, min(max_sets, sets))
    calls = sets * math.ceil(max(1, min_calls) / sets)
    return sets, calls


def plan_cases(ops, shapes) -> list[tuple]:
    """(op, T, C, n) in run order; C is None for ops that do not use it (run once per T, n)."""
    cases, seen = [], set()
    for T, C, n in shapes:
        for op in ops:
            c = C if uses_C(op) else None
            if (op, T, c, n) not in seen:
                seen.add((op, T, c, n))
                cases.append((op, T, c, n))
    return cases


def shape_str(T, C, n) -> str:
    return f"{T}x{'-' if C is None else C}x{n}"


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


def _b_mhc_pre_op(B, x, h_pre_raw, h_post_raw, h_res_raw):
    H_pre = B.sigmoid(h_pre_raw)
    H_post = 2.0 * B.sigmoid(h_post_raw)
    H_res = _sinkhorn(B, h_res_raw)
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


# ------------------------------------------------------------------------------- inputs
def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


_bf16_kernel = None


def _cupy_f32_to_act(a, dtype: str):
    """float32 CuPy array -> activation dtype (bf16 by round-to-nearest-even on the bits)."""
    import cupy as cp

    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(cp.float16)
    global _bf16_kernel
    if _bf16_kernel is None:
        _bf16_kernel = cp.ElementwiseKernel("uint32 u", "uint16 r", "r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16",
                                            "mhc_bench_f32_to_bf16")
    return _bf16_kernel(a.view(cp.uint32)).view(_np_dtype("bfloat16"))


def make_inputs(op: str, T: int, C: int, n: int, dtype: str, seed: int = 0, xp: str = "numpy") -> dict:
    """Random inputs of ``op`` and upstream gradients of its outputs.

    Returns ``{"in": [...], "grads": [...]}`` in the order of ``SPECS``; standard normal
    values (phi scaled by 1/sqrt(n*C)), activations in ``dtype``, the rest float32.
    ``xp``: "numpy" (host) or "cupy" (current device).  ``C`` is ignored by ops that
    do not use it.
    """
    C = C or 1
    s = SPECS[op]
    if xp == "cupy":
        import cupy as cp

        rng = cp.random.default_rng(seed)

        def draw(shape):
            return rng.standard_normal(shape, dtype=cp.float32)

        def act(a):
            return _cupy_f32_to_act(a, dtype)
    else:
        rng = np.random.default_rng(seed)

        def draw(shape):
            return rng.standard_normal(shape, dtype=np.float32)

        def act(a):
            return a.astype(_np_dtype(dtype))

    def arrays(specs):
        out = []
        for name, kind, code in specs:
            a = draw(shape_of(code, T, C, n))
            if name == "phi":
                a *= np.float32(1.0 / math.sqrt(n * C))
            out.append(act(a) if kind == "act" else a)
        return out

    return {"in": arrays(s["inputs"]), "grads": arrays(s["outputs"])}


def _cupy_to_torch(a):
    import cupy as cp
    import torch

    if a.dtype == _np_dtype("bfloat16"):
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _cupy_to_jax(a, device=None):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    bf16 = a.dtype == _np_dtype("bfloat16")
    src = a.view(cp.int16) if bf16 else a
    try:
        j = jax.dlpack.from_dlpack(src)
    except Exception:  # no zero-copy import: go through the host
        j = jax.device_put(cp.asnumpy(src), device)
    return jax.lax.bitcast_convert_type(j, jnp.bfloat16) if bf16 else j


def _to_cupy_f32(a):
    """A CuPy float32 copy of a CuPy / torch / jax array (for comparisons)."""
    import cupy as cp

    mod = type(a).__module__
    if mod.startswith("torch"):
        import torch

        t = a.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return _bits_to_f32(cp.from_dlpack(t.view(torch.int16)).view(cp.uint16))
        return cp.from_dlpack(t).astype(cp.float32)
    if not isinstance(a, cp.ndarray):  # jax
        import jax
        import jax.numpy as jnp

        if a.dtype == jnp.bfloat16:
            return _bits_to_f32(cp.from_dlpack(jax.lax.bitcast_convert_type(a, jnp.uint16)))
        return cp.from_dlpack(a).astype(cp.float32)
    if a.dtype == _np_dtype("bfloat16"):
        return _bits_to_f32(a.view(cp.uint16))
    return a.astype(cp.float32)


def _bits_to_f32(u16):
    import cupy as cp

    return (u16.astype(cp.uint32) << 16).view(cp.float32)


def _max_rel_err(ours, theirs) -> float:
    """max over outputs of ||ours - theirs|| / ||theirs|| (float32, on the GPU)."""
    import cupy as cp

    worst = 0.0
    for a, b in zip(_as_tuple(ours), _as_tuple(theirs), strict=True):
        a, b = _to_cupy_f32(a), _to_cupy_f32(b)
        den = float(cp.linalg.norm(b.ravel()))
        num = float(cp.linalg.norm((a - b).ravel()))
        worst = max(worst, num / den if den > 0 else num)
    return worst


def _as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


# ------------------------------------------------------------------------------ timing
def _stats(samples_ms) -> dict:
    us = [t * 1e3 for t in samples_ms]
    return {"us": statistics.median(us), "us_min": min(us), "us_max": max(us), "samples": len(us)}


def _time_cupy(call, sets: int, calls: int, warmup: int, reps: int) -> dict:
    """GPU time of ``call(k)`` (k = input set) from CUDA-graph replays; see the module doc."""
    import cupy as cp

    cp.cuda.Device().synchronize()  # inputs were made on the null stream; s does not wait for it
    s = cp.cuda.Stream(non_blocking=True)
    keep = collections.deque(maxlen=sets)
    with s:
        for i in range(max(warmup, sets)):
            keep.append(call(i % sets))
        s.synchronize()
        keep.clear()
        s.begin_capture()
        try:
            for i in range(calls):
                keep.append(call(i % sets))
        finally:
            graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(s)
            graph.launch(s)
            stop.record(s)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / calls)
    del graph
    keep.clear()
    return dict(_stats(times), method="cuda graph")


def _time_torch(prepare, sets: int, calls: int, warmup: int, reps: int) -> dict:
    """GPU time of PyTorch calls.  ``prepare()`` runs on the capture stream and returns
    ``call(k)``; calls are captured into a CUDA graph (fallback: eager calls between events)."""
    import torch

    torch.cuda.synchronize()  # inputs were made by CuPy on the null stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    keep = collections.deque(maxlen=sets)
    with torch.cuda.stream(s):
        call = prepare()
        for i in range(max(warmup, sets)):
            keep.append(call(i % sets))
    s.synchronize()
    keep.clear()
    graph, method = None, "cuda graph"
    try:
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (JAX's, say) cannot invalidate the capture
        with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
            for i in range(calls):
                keep.append(call(i % sets))
    except Exception as e:  # noqa: BLE001 - any capture failure: time eagerly instead
        graph, method = None, f"events, eager calls (graph capture failed: {type(e).__name__}: {str(e)[:120]})"
        keep.clear()
        torch.cuda.synchronize()

    def once():
        if graph is not None:
            graph.replay()
        else:
            for i in range(calls):
                keep.append(call(i % sets))

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(s):
        once()
        s.synchronize()
        for _ in range(reps):
            start.record(s)
            once()
            stop.record(s)
            stop.synchronize()
            times.append(start.elapsed_time(stop) / calls)
    del graph, call
    keep.clear()
    return dict(_stats(times), method=method)


def _time_jax(call, sets: int, calls: int, warmup: int, reps: int) -> dict:
    """Wall-clock time per ``call(k)`` of a jitted JAX function (dispatch included)."""
    import jax

    keep = collections.deque(maxlen=sets)
    for i in range(max(warmup, sets)):
        keep.append(call(i % sets))
    jax.block_until_ready(list(keep))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(calls):
            keep.append(call(i % sets))
        jax.block_until_ready(list(keep))
        times.append((time.perf_counter() - t) * 1e3 / calls)
    keep.clear()
    return dict(_stats(times), method="wall clock + block_until_ready")


def time_ms(fn, warmup: int = 3, reps: int = 20, per_graph: int = 10) -> float:
    """Median GPU time of one ``fn()`` in ms: ``per_graph`` calls in one CUDA graph,
    replayed between CUDA events (host overhead excluded; no input rotation: the
    caller's inputs are re-read every call, so keep them well above L2)."""
    return _time_cupy(lambda k: fn(), 1, per_graph, warmup, reps)["us"] / 1e3


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20, warmup: int = 3) -> dict:
    """Device-to-device copy bandwidth, GB/s = (bytes read + bytes written) / time.

    ``cupy.copyto`` between two ``nbytes`` buffers, run eagerly on the current stream
    (never captured: a graph turns the copy into a slower copy-engine node) between
    CUDA events; median of ``reps``.  Also an elementwise copy kernel, for reference.
    """
    import cupy as cp

    a = cp.random.default_rng(1).standard_normal(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    kernel = cp.ElementwiseKernel("T x", "T y", "y = x", "mhc_bench_copy")
    stream = cp.cuda.get_current_stream()
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def median_ms(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start.record(stream)
            fn()
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
        return statistics.median(times)

    ms = median_ms(lambda: cp.copyto(b, a))
    ms_kernel = median_ms(lambda: kernel(a, b))
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return {"GBps": 2 * nbytes / ms / 1e6, "kernel_GBps": 2 * nbytes / ms_kernel / 1e6, "bytes": 2 * nbytes,
            "method": f"cupy.copyto eager (not in a graph), 2 x {nbytes / 2**30:g} GiB buffers, CUDA events, "
                      f"median of {reps}; bytes = read + written.  kernel_GBps: an elementwise copy kernel, "
                      f"same method"}


def per_call_us(fn, sync, calls: int = 2000, warmup: int = 100, repeats: int = 5) -> float:
    """Host wall-clock microseconds per call of a tiny ``fn()`` in steady state: median over
    ``repeats`` bursts of ``calls // repeats`` calls, each burst ended by ``sync(last result)``."""
    last = None
    for _ in range(warmup):
        last = fn()
    sync(last)
    per = max(1, calls // repeats)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(per):
            last = fn()
        sync(last)
        samples.append((time.perf_counter() - t) / per * 1e6)
    return statistics.median(samples)


# ------------------------------------------------------------------------ environment
def gpu_problem() -> str | None:
    """Why the GPU benchmarks cannot run here, or None."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return "no CUDA GPU is visible (cupy.cuda.is_available() is False)"
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"the CUDA runtime failed ({type(e).__name__}: {e})"
    return None


def _torch_status() -> str | None:
    """None when PyTorch with a CUDA device is usable, else why not."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"PyTorch is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


def _jax_status() -> str | None:
    try:
        import jax
    except Exception as e:  # noqa: BLE001
        return f"JAX is not importable ({type(e).__name__}: {e})"
    try:
        jax.devices("gpu")
    except Exception as e:  # noqa: BLE001
        return f"JAX {jax.__version__} has no GPU backend ({type(e).__name__}: {str(e)[:160]})"
    return None


def _device_meta() -> dict:
    import cupy as cp

    d = cp.cuda.Device()
    p = cp.cuda.runtime.getDeviceProperties(d.id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    l2 = p.get("l2CacheSize")
    if not l2:
        try:
            l2 = d.attributes["L2CacheSize"]
        except Exception:  # noqa: BLE001
            l2 = None
    meta = {"name": name, "ordinal": d.id, "sm": f"{p['major']}{p['minor']}",
            "multiprocessors": p.get("multiProcessorCount"), "memory_bytes": p.get("totalGlobalMem"),
            "l2_bytes": l2}
    clock, width = p.get("memoryClockRate"), p.get("memoryBusWidth")
    if clock and width:  # kHz, bits; DDR: 2 transfers per clock
        meta["datasheet_style_peak_GBps"] = 2 * clock * 1e3 * width / 8 / 1e9
    return meta


def _versions() -> dict:
    from .__main__ import info

    v = dict(info())
    for mod in ("jaxlib", "triton", "matplotlib"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"not available ({type(e).__name__})"
    try:
        import torch

        v["torch CUDA"] = str(torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    return v


# ----------------------------------------------------------------------------- running
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def _case(op, T, C, n, dtype, cfg, copy_GBps, l2, baselines) -> list[dict]:
    """Time one (op, shape) for every implementation; returns the fwd and bwd rows."""
    import mhc_cupy as m

    isz = _ITEMSIZE[dtype]
    Cb = C if C is not None else 1
    fwd_bytes = nbytes(op, "fwd", T, Cb, n, isz)
    R, calls = rotation(fwd_bytes, l2, cfg.min_calls)
    sets = [make_inputs(op, T, Cb, n, dtype, seed=k, xp="cupy") for k in range(R)]
    _sync()
    rows = {}
    for d in ("fwd", "bwd"):
        b = nbytes(op, d, T, Cb, n, isz)
        rows[d] = {"op": op, "dir": d, "tokens": T, "C": C, "n": n, "dtype": dtype, "bytes": b, "sets": R,
                   "calls_per_graph": calls, "copy_GBps": copy_GBps, "impls": {}}

    def record(d, impl, res):
        if "us" in res:
            res["GBps"] = rows[d]["bytes"] / (res["us"] * 1e-6) / 1e9
            res["frac_of_copy"] = res["GBps"] / copy_GBps
        rows[d]["impls"][impl] = res

    fwd_fn, bwd_fn = getattr(m, f"{op}_fwd"), getattr(m, f"{op}_bwd")
    ours = {}
    for d, fn in (("fwd", lambda k: fwd_fn(*sets[k]["in"])), ("bwd", lambda k: bwd_fn(*sets[k]["grads"], *sets[k]["in"]))):
        try:
            record(d, "mhc_cupy", _time_cupy(fn, R, calls, cfg.warmup, cfg.reps))
            ours[d] = fn(0)
        except Exception as e:  # noqa: BLE001 - report and go on
            record(d, "mhc_cupy", _error(e))
            _log(f"  mhc_cupy {op} {d} failed: {rows[d]['impls']['mhc_cupy']['error']}")

    for impl in baselines:
        for d in ("fwd", "bwd"):
            try:
                if impl in ("torch", "torch.compile"):
                    res, out = _torch_case(op, d, sets, R, calls, cfg, compiled=impl == "torch.compile")
                else:
                    res, out = _jax_case(op, d, sets, R, calls, cfg)
                if d in ours:
                    res["max_rel_err"] = _max_rel_err(ours[d], out)
                    if res["max_rel_err"] > cfg.check_tol:
                        _log(f"  WARNING: {impl} {op} {d} differs from mhc_cupy by {res['max_rel_err']:.2e} "
                             f"(relative L2)")
                del out
            except Exception as e:  # noqa: BLE001
                res = _error(e)
                _log(f"  {impl} {op} {d} failed: {res['error']}")
            record(d, impl, res)
            _free_gpu_memory()
    del sets, ours
    _free_gpu_memory()
    for d in ("fwd", "bwd"):
        mine = rows[d]["impls"].get("mhc_cupy", {})
        rows[d]["speedup"] = {impl: (rows[d]["impls"][impl]["us"] / mine["us"]
                                     if "us" in mine and "us" in rows[d]["impls"].get(impl, {}) else None)
                              for impl in baselines}
    return [rows["fwd"], rows["bwd"]]


def _torch_case(op, d, sets, R, calls, cfg, compiled: bool):
    import torch

    f = torch_fwd(op)
    if compiled:
        torch._dynamo.reset()  # a fresh static-shape compile per shape (no recompile limit, no dynamic kernels)
        f = torch.compile(f, dynamic=False)
    tin = [[_cupy_to_torch(a) for a in s["in"]] for s in sets]
    tg = [[_cupy_to_torch(a) for a in s["grads"]] for s in sets]
    torch.cuda.synchronize()
    if d == "fwd":
        def prepare():
            def call(k):
                with torch.no_grad():
                    return f(*tin[k])
            return call
        res = _time_torch(prepare, R, calls, cfg.warmup, cfg.reps)
        with torch.no_grad():
            out = f(*tin[0])
        return res, out

    state = {}

    def prepare():  # on the capture stream: the backward then runs there too
        state["ins"] = [[t.detach().requires_grad_() for t in tin[k]] for k in range(R)]
        state["outs"] = [f(*state["ins"][k]) for k in range(R)]

        def call(k):
            return torch.autograd.grad(state["outs"][k], state["ins"][k], tg[k], retain_graph=True)
        return call
    res = _time_torch(prepare, R, calls, cfg.warmup, cfg.reps)
    out = torch_bwd(f, tin[0], tg[0])
    state.clear()
    return res, out


def _jax_case(op, d, sets, R, calls, cfg):
    import jax

    dev = jax.devices("gpu")[0]
    jin = [[_cupy_to_jax(a, dev) for a in s["in"]] for s in sets]
    jg = [[_cupy_to_jax(a, dev) for a in s["grads"]] for s in sets]
    f = jax.jit(jax_fwd(op))
    if d == "fwd":
        res = _time_jax(lambda k: f(*jin[k]), R, calls, cfg.warmup, cfg.reps)
        return res, f(*jin[0])
    # The residuals of each set as jax.vjp saves them; one jitted pullback for all sets
    # (a VJP object as a jit argument would retrace per set: its treedef names its own
    # closure, so set 0's treedef is rebuilt around every set's residual leaves).
    flat = [jax.tree_util.tree_flatten(jax.vjp(f, *jin[k])[1]) for k in range(R)]
    treedef = flat[0][1]
    if any(len(lv) != treedef.num_leaves for lv, _ in flat):
        raise RuntimeError("jax.vjp residuals differ in structure between input sets")
    leaves = [lv for lv, _ in flat]
    grads = [tuple(g) for g in jg]
    del flat
    b = jax.jit(lambda lv, g: jax.tree_util.tree_unflatten(treedef, lv)(g))
    res = _time_jax(lambda k: b(leaves[k], grads[k]), R, calls, cfg.warmup, cfg.reps)
    out = b(leaves[0], grads[0])
    return res, out


def host_overhead(dtype: str, ops, torch_ok: bool, jax_ok: bool, calls: int = 2000) -> dict:
    """Host cost per call of tiny calls (tokens 1, C 64, n 4) through every front end."""
    import cupy as cp

    import mhc_cupy as m

    T, C, n = 1, 64, 4
    sync_cp = lambda last: cp.cuda.Device().synchronize()  # noqa: E731
    routes, per_op = {}, {}
    x, M = make_inputs("stream_mix", T, C, n, dtype, seed=0, xp="cupy")["in"]
    routes["functional stream_mix_fwd, cupy inputs"] = per_call_us(lambda: m.stream_mix_fwd(x, M), sync_cp, calls)
    for op in ops:
        s = make_inputs(op, T, C, n, dtype, seed=1, xp="cupy")
        f, b = getattr(m, f"{op}_fwd"), getattr(m, f"{op}_bwd")
        try:
            per_op[op] = {"fwd": per_call_us(lambda: f(*s["in"]), sync_cp, calls),
                          "bwd": per_call_us(lambda: b(*s["grads"], *s["in"]), sync_cp, calls)}
        except Exception as e:  # noqa: BLE001
            per_op[op] = _error(e)
    if torch_ok:
        import torch

        import mhc_cupy.torch as mt

        sync_t = lambda last: torch.cuda.synchronize()  # noqa: E731
        xt, Mt = _cupy_to_torch(x), _cupy_to_torch(M)
        xg = xt.detach().requires_grad_()
        routes["native torch.add (no grad)"] = per_call_us(lambda: torch.add(xt, xt), sync_t, calls)
        routes["native torch.add (requires grad)"] = per_call_us(lambda: torch.add(xg, xg), sync_t, calls)
        routes["mhc_cupy.torch.stream_mix (no grad)"] = per_call_us(lambda: mt.stream_mix(xt, Mt), sync_t, calls)
        routes["mhc_cupy.torch.stream_mix (requires grad)"] = per_call_us(lambda: mt.stream_mix(xg, Mt), sync_t, calls)
        routes["functional stream_mix_fwd, torch inputs"] = per_call_us(lambda: m.stream_mix_fwd(xt, Mt), sync_t,
                                                                        calls)
    if jax_ok:
        import jax

        import mhc_cupy.jax as mj

        sync_j = jax.block_until_ready
        dev = jax.devices("gpu")[0]
        xj, Mj = _cupy_to_jax(x, dev), _cupy_to_jax(M, dev)
        jit_op = jax.jit(lambda a, b: mj.stream_mix(a, b))
        jit_native = jax.jit(jax_fwd("stream_mix"))
        jit_add = jax.jit(lambda a: a + a)
        routes["mhc_cupy.jax.stream_mix (eager)"] = per_call_us(lambda: mj.stream_mix(xj, Mj), sync_j, calls)
        routes["native jnp x + x (eager)"] = per_call_us(lambda: xj + xj, sync_j, calls)
        routes["jax.jit(f), f calls mhc_cupy.jax.stream_mix"] = per_call_us(lambda: jit_op(xj, Mj), sync_j, calls)
        routes["jax.jit(f), f = stream_mix in native jnp"] = per_call_us(lambda: jit_native(xj, Mj), sync_j, calls)
        routes["jax.jit(f), f = x + x"] = per_call_us(lambda: jit_add(xj), sync_j, calls)
    return {"shape": {"tokens": T, "C": C, "n": n, "dtype": dtype}, "routes": routes, "per_op": per_op,
            "method": f"wall clock per call, median of 5 bursts of {calls // 5} calls after 100 warm-up calls, "
                      f"each burst ended by a device sync"}


def run_benchmarks(cfg) -> dict:
    """Run everything ``cfg`` (parsed arguments) asks for; returns the result dict."""
    t0 = time.perf_counter()
    skipped = []
    baselines = list(cfg.baselines)
    torch_ok = jax_ok = False
    if any(b.startswith("torch") for b in baselines) or not cfg.no_host:
        why = _torch_status()
        torch_ok = why is None
        if why:
            skipped.append(f"torch baselines and torch host-overhead routes skipped: {why}")
    if "jax.jit" in baselines or not cfg.no_host:
        why = _jax_status()
        jax_ok = why is None
        if why:
            skipped.append(f"jax baselines and jax host-overhead routes skipped: {why}")
    baselines = [b for b in baselines if (torch_ok if b.startswith("torch") else jax_ok)]
    for s in skipped:
        _log(s)

    device = _device_meta()
    l2 = int(device.get("l2_bytes") or 64 << 20)
    result = {
        "schema": "mhc_cupy.bench/1",
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "argv": list(cfg.argv), "device": device, "versions": _versions(),
                 "settings": {"dtype": cfg.dtype, "reps": cfg.reps, "warmup": cfg.warmup, "min_calls": cfg.min_calls,
                              "baselines": baselines, "shapes": [list(s) for s in cfg.shapes], "ops": list(cfg.ops),
                              "l2_bytes_used_for_rotation": l2}},
        "copy": {}, "results": [], "host_overhead_us": {}, "targets": [], "skipped": skipped,
    }
    _log(f"device: {device['name']} (sm_{device['sm']}, L2 {l2 / 2**20:.0f} MiB)")
    result["copy"] = copy_bandwidth()
    copy_GBps = result["copy"]["GBps"]
    _log(f"device-to-device copy: {copy_GBps:.0f} GB/s (eager cupy.copyto; copy kernel "
         f"{result['copy']['kernel_GBps']:.0f} GB/s)")

    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for op, T, C, n in plan_cases(cfg.ops, cfg.shapes):
        rows = _case(op, T, C, n, cfg.dtype, cfg, copy_GBps, l2, baselines)
        result["results"].extend(rows)
        for r in rows:
            _log(f"[{time.perf_counter() - t0:7.1f} s] {_progress_line(r)}")
        write_json(result, out_dir / "bench.json")  # partial results survive a timeout
        _free_gpu_memory()

    if not cfg.no_host:
        _log("host overhead ...")
        result["host_overhead_us"] = host_overhead(cfg.dtype, cfg.ops, torch_ok, jax_ok)
    result["targets"] = evaluate_targets(result)
    result["meta"]["wall_s"] = time.perf_counter() - t0
    return result


def _progress_line(r) -> str:
    parts = []
    for impl, v in r["impls"].items():
        parts.append(f"{impl} {v['us']:.1f} us" + (f" ({v['frac_of_copy']:.0%})" if impl == "mhc_cupy" else "")
                     if "us" in v else f"{impl} error")
    return f"{r['op']} {r['dir']} {shape_str(r['tokens'], r['C'], r['n'])}: " + " | ".join(parts)


# --------------------------------------------------------------------------- reporting
def _key(r) -> tuple:
    op_rank = DEFAULT_OPS.index(r["op"]) if r["op"] in DEFAULT_OPS else len(DEFAULT_OPS)
    return (op_rank, r["op"], r["dir"] != "fwd", r["n"], r["tokens"], r["C"] or 0)


def _us(r, impl):
    return r.get("impls", {}).get(impl, {}).get("us")


def evaluate_targets(result: dict) -> list[dict]:
    """The issue's targets against the measured numbers: status "met", "missed" or "not measured"."""
    rows = [r for r in result.get("results", []) if in_target_domain(r)]
    out = []

    def add(name, status, measured, detail):
        out.append({"name": name, "status": status, "measured": measured, "detail": detail})

    for op in BANDWIDTH_TARGET_OPS:
        for d, goal in BANDWIDTH_TARGETS.items():
            name = f"{op} {d} >= {goal:.0%} of copy"
            vals = [(r["impls"]["mhc_cupy"]["frac_of_copy"], shape_str(r["tokens"], r["C"], r["n"]))
                    for r in rows if r["op"] == op and r["dir"] == d and "frac_of_copy" in r["impls"].get("mhc_cupy", {})]
            if not vals:
                add(name, "not measured", None, f"no shape with {TARGET_DOMAIN}")
                continue
            worst = min(vals)
            med = statistics.median(v for v, _ in vals)
            add(name, "met" if worst[0] >= goal else "missed", worst[0],
                f"worst {worst[0]:.1%} at {worst[1]}, median {med:.1%} over {len(vals)} shapes with {TARGET_DOMAIN}")
    for d in ("fwd", "bwd"):
        name = f"sinkhorn_knopp {d} at {SINKHORN_TARGET_TOKENS} tokens (n 4) < {SINKHORN_TARGET_US:g} us"
        vals = [_us(r, "mhc_cupy") for r in rows if r["op"] == "sinkhorn_knopp" and r["dir"] == d
                and r["tokens"] == SINKHORN_TARGET_TOKENS and r["n"] == 4 and _us(r, "mhc_cupy") is not None]
        if not vals:
            add(name, "not measured", None, f"run with --tokens including {SINKHORN_TARGET_TOKENS}")
        else:
            add(name, "met" if max(vals) < SINKHORN_TARGET_US else "missed", max(vals), f"{max(vals):.1f} us")
    ops = sorted({r["op"] for r in result.get("results", [])},
                 key=lambda o: (DEFAULT_OPS.index(o) if o in DEFAULT_OPS else 99, o))
    for op in ops:
        for d in ("fwd", "bwd"):
            name = f"{op} {d} faster than torch.compile"
            vals = [(r["speedup"]["torch.compile"], shape_str(r["tokens"], r["C"], r["n"])) for r in rows
                    if r["op"] == op and r["dir"] == d and (r.get("speedup") or {}).get("torch.compile") is not None]
            if not vals:
                add(name, "not measured", None, f"no shape with {TARGET_DOMAIN}")
                continue
            worst = min(vals)
            add(name, "met" if worst[0] > 1.0 else "missed", worst[0],
                f"slowest speedup {worst[0]:.2f}x at {worst[1]} over {len(vals)} shapes with {TARGET_DOMAIN}")
    routes = (result.get("host_overhead_us") or {}).get("routes", {})
    for grad in ("no grad", "requires grad"):
        name = f"mhc_cupy.torch host overhead ({grad}) <= {HOST_TARGET_RATIO:g}x torch.add"
        ours, native = routes.get(f"mhc_cupy.torch.stream_mix ({grad})"), routes.get(f"native torch.add ({grad})")
        if ours is None or native is None:
            add(name, "not measured", None, "")
        else:
            ratio = ours / native
            add(name, "met" if ratio <= HOST_TARGET_RATIO else "missed", ratio,
                f"{ours:.1f} us vs {native:.1f} us = {ratio:.2f}x")
    return out


def _fmt_speedup(r, impl) -> str:
    v = r.get("impls", {}).get(impl)
    if v is None:
        return "-"
    if "error" in v:
        return "err"
    s = (r.get("speedup") or {}).get(impl)
    return "-" if s is None else f"{s:.2f}x"


def format_table(result: dict) -> str:
    rows = sorted(result.get("results", []), key=_key)
    impls = [i for i in BASELINES if any(i in r.get("impls", {}) for r in rows)]
    short = {"torch": "torch", "torch.compile": "compile", "jax.jit": "jax.jit"}
    head = (f"{'op':<18} {'dir':<4} {'T x C x n':>15} {'us':>9} {'GB/s':>6} {'% copy':>7}"
            + "".join(f" {short[i]:>8}" for i in impls))
    lines = [" " * 64 + ("speedup vs" if impls else ""), head, "-" * len(head)]
    for r in rows:
        mine = r["impls"].get("mhc_cupy", {})
        if "us" in mine:
            body = f"{mine['us']:>9.1f} {mine['GBps']:>6.0f} {mine['frac_of_copy']:>7.1%}"
        else:
            body = f"{'error':>9} {'':>6} {'':>7}"
        lines.append(f"{r['op']:<18} {r['dir']:<4} {shape_str(r['tokens'], r['C'], r['n']):>15} {body}"
                     + "".join(f" {_fmt_speedup(r, i):>8}" for i in impls))
    lines.append("speedup = baseline time / mhc_cupy time (> 1: mhc_cupy faster); "
                 "% copy = GB/s of the byte model / device-to-device copy GB/s")
    return "\n".join(lines)


def format_targets(targets: list[dict]) -> str:
    lines = ["targets:"]
    for t in targets:
        status = {"met": "met", "missed": "MISSED"}.get(t["status"], t["status"])
        lines.append(f"  [{status:^12}] {t['name']}" + (f": {t['detail']}" if t.get("detail") else ""))
    return "\n".join(lines)


def format_host(host: dict) -> str:
    if not host:
        return "host overhead: not measured"
    sh = host.get("shape", {})
    lines = [f"host overhead per call (tokens {sh.get('tokens')}, C {sh.get('C')}, n {sh.get('n')}, "
             f"{sh.get('dtype')}), us:"]
    for name, us in host.get("routes", {}).items():
        lines.append(f"  {name:<48} {us:8.1f}")
    if host.get("per_op"):
        lines.append("  functional API, cupy inputs, per op:")
        for op, v in host["per_op"].items():
            lines.append(f"    {op:<20} " + (f"fwd {v['fwd']:6.1f}   bwd {v['bwd']:6.1f}" if "fwd" in v
                                                else v.get("error", "")))
    return "\n".join(lines)


def format_report(result: dict) -> str:
    meta, copy = result.get("meta", {}), result.get("copy", {})
    dev = meta.get("device", {})
    lines = [f"mhc_cupy.bench  {meta.get('date', '')}  {dev.get('name', '?')} (sm_{dev.get('sm', '?')})  "
             f"dtype {meta.get('settings', {}).get('dtype', '?')}"]
    if copy:
        lines.append(f"device-to-device copy: {copy['GBps']:.0f} GB/s (eager cupy.copyto, read + write)")
    for s in result.get("skipped", []):
        lines.append(f"skipped: {s}")
    lines += ["", format_host(result.get("host_overhead_us") or {}), "",
              format_targets(result.get("targets") or evaluate_targets(result)), "", format_table(result)]
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def write_plot(result: dict, path) -> None:
    """Bar plot of % of copy bandwidth per op and implementation (median over shapes,
    whiskers min..max), forward and backward panels.  Matplotlib Agg, no pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result.get("results", [])
    ops = sorted({r["op"] for r in rows}, key=lambda o: (DEFAULT_OPS.index(o) if o in DEFAULT_OPS else 99, o))
    impls = [i for i in IMPLS if any("frac_of_copy" in r.get("impls", {}).get(i, {}) for r in rows)]
    fig = Figure(figsize=(max(8.0, 1.3 * len(ops) + 2) * 2, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    width = 0.8 / max(1, len(impls))
    copy = (result.get("copy") or {}).get("GBps")
    for ax, d in zip(axes, ("fwd", "bwd")):
        xs = np.arange(len(ops))
        for k, impl in enumerate(impls):
            med, lo, hi = [], [], []
            for op in ops:
                v = [100 * r["impls"][impl]["frac_of_copy"] for r in rows
                     if r["op"] == op and r["dir"] == d and "frac_of_copy" in r.get("impls", {}).get(impl, {})]
                med.append(statistics.median(v) if v else np.nan)
                lo.append(min(v) if v else np.nan)
                hi.append(max(v) if v else np.nan)
            med, lo, hi = map(np.asarray, (med, lo, hi))
            ax.bar(xs + (k - (len(impls) - 1) / 2) * width, med, width, label=impl,
                   yerr=np.nan_to_num(np.vstack([med - lo, hi - med])), capsize=2)
        ax.axhline(100, color="k", ls="--", lw=0.8,
                   label="device copy" + (f" ({copy:.0f} GB/s)" if copy else ""))
        ax.axhline(100 * BANDWIDTH_TARGETS[d], color="tab:red", ls=":", lw=1,
                   label=f"target {BANDWIDTH_TARGETS[d]:.0%} (stream / post / pre)")
        ax.set_xticks(xs, ops, rotation=30, ha="right")
        ax.set_title(f"{d}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% of device-to-device copy bandwidth (byte model)")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
    meta = result.get("meta", {})
    fig.suptitle(f"mhc_cupy vs baselines, {meta.get('device', {}).get('name', '?')}, "
                 f"{meta.get('settings', {}).get('dtype', '?')}: median over shapes, whiskers min..max")
    fig.savefig(path, dpi=110)


def write_outputs(result: dict, out_dir) -> dict:
    """bench.json, bench.txt (the report) and bench.png in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "txt": out_dir / "bench.txt", "png": out_dir / "bench.png"}
    write_json(result, paths["json"])
    paths["txt"].write_text(format_report(result) + "\n")
    try:
        write_plot(result, paths["png"])
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        _log(f"plot not written ({type(e).__name__}: {e})")
        paths.pop("png")
    return paths


def merge_results(results: list[dict]) -> dict:
    """Combine several bench.json results (e.g. one per --tokens value): rows of later
    files replace rows of the same (op, dir, shape, dtype); targets are re-evaluated."""
    if not results:
        raise ValueError("nothing to merge")
    merged = json.loads(json.dumps(results[0]))
    by_key = {}
    for res in results:
        for r in res.get("results", []):
            by_key[(r["op"], r["dir"], r["tokens"], r["C"], r["n"], r["dtype"])] = r
    merged["results"] = list(by_key.values())
    for res in results[1:]:
        if res.get("host_overhead_us"):
            merged["host_overhead_us"] = res["host_overhead_us"]
        merged["skipped"] = sorted(set(merged.get("skipped", [])) | set(res.get("skipped", [])))
    merged["meta"]["merged_from"] = [{"date": r.get("meta", {}).get("date"), "argv": r.get("meta", {}).get("argv"),
                                      "copy_GBps": (r.get("copy") or {}).get("GBps")} for r in results]
    merged["targets"] = evaluate_targets(merged)
    return merged


# ---------------------------------------------------------------------------------- CLI
QUICK = {"tokens": "32768", "C": "2560", "n": "4", "reps": 10, "warmup": 3}
DEFAULT_EXTRA = "16384x4096x8"


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"{flag}: expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated ops (default: all)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 4096,16384,32768)")
    ap.add_argument("--C", default=None, help="comma-separated hidden sizes (default 2560,4096,7168)")
    ap.add_argument("--n", default=None, help="comma-separated stream counts (default 4)")
    ap.add_argument("--extra-shapes", default=None,
                    help=f"extra TxCxn shapes, comma-separated (default {DEFAULT_EXTRA}; '' for none; "
                         f"none with --quick)")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype: bfloat16, float16 or float32")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (median; default 30)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls before capture (default 5)")
    ap.add_argument("--min-calls", type=int, default=10, help="at least this many calls per timed graph")
    ap.add_argument("--quick", action="store_true",
                    help=f"one shape ({QUICK['tokens']}x{QUICK['C']}x{QUICK['n']}), {QUICK['reps']} reps")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help="comma-separated: torch, torch.compile, jax.jit (default: all three)")
    ap.add_argument("--no-baselines", action="store_true", help="time mhc_cupy only")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead measurements")
    ap.add_argument("--check-tol", type=float, default=1e-2,
                    help="warn when a baseline differs from mhc_cupy by more than this (relative L2)")
    ap.add_argument("--out", default="bench_out", help="output directory (bench.json, bench.txt, bench.png)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no GPU needed: merge saved bench.json files and write the report, JSON and plot to --out")
    return ap


_BASELINE_ALIASES = {"torch": "torch", "eager": "torch", "torch.compile": "torch.compile", "compile": "torch.compile",
                     "inductor": "torch.compile", "jax": "jax.jit", "jax.jit": "jax.jit"}


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve: adds ``shapes`` [(T, C, n)], ``ops``, ``baselines`` lists and ``argv``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in SPECS]
    if bad or not ops:
        ap.error(f"--ops: unknown {bad}; choose from {', '.join(SPECS)}")
    args.ops = ops
    dt = _DTYPE_ALIASES.get(args.dtype.lower())
    if dt is None:
        ap.error(f"--dtype: expected bfloat16, float16 or float32, got {args.dtype!r}")
    args.dtype = dt
    if args.no_baselines:
        args.baselines = []
    else:
        names = [b.strip() for b in args.baselines.split(",") if b.strip()]
        bad = [b for b in names if b not in _BASELINE_ALIASES]
        if bad:
            ap.error(f"--baselines: unknown {bad}; choose from torch, torch.compile, jax.jit")
        args.baselines = [b for b in BASELINES if b in {_BASELINE_ALIASES[x] for x in names}]
    q = args.quick
    tokens = _ints(args.tokens or (QUICK["tokens"] if q else "4096,16384,32768"), "--tokens")
    Cs = _ints(args.C or (QUICK["C"] if q else "2560,4096,7168"), "--C")
    ns = _ints(args.n or (QUICK["n"] if q else "4"), "--n")
    args.reps = args.reps if args.reps is not None else (QUICK["reps"] if q else 30)
    args.warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if q else 5)
    if args.reps < 1 or args.warmup < 0 or args.min_calls < 1:
        ap.error("--reps and --min-calls must be >= 1, --warmup >= 0")
    shapes = [(T, C, n) for n in ns for T in tokens for C in Cs]
    extra = args.extra_shapes if args.extra_shapes is not None else ("" if q else DEFAULT_EXTRA)
    for item in (e.strip() for e in extra.split(",") if e.strip()):
        try:
            T, C, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            ap.error(f"--extra-shapes: expected TxCxn, got {item!r}")
        if (T, C, n) not in shapes:
            shapes.append((T, C, n))
    args.shapes = shapes
    return args


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.merge:
        try:
            results = [json.loads(Path(p).read_text()) for p in cfg.merge]
        except (OSError, json.JSONDecodeError) as e:
            print(f"python -m mhc_cupy.bench --merge: cannot read {e}", file=sys.stderr)
            return 2
        result = merge_results(results)
    else:
        why = gpu_problem()
        if why:
            print(f"python -m mhc_cupy.bench needs a CUDA GPU: {why}.\n"
                  f"(Saved results can be re-rendered without one: --merge bench.json --out DIR.)", file=sys.stderr)
            return 2
        # JAX would otherwise take 75% of the GPU at its first use, starving CuPy and PyTorch.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        result = run_benchmarks(cfg)
    paths = write_outputs(result, cfg.out)
    print(format_report(result))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
