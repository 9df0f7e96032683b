"""RMSNorm over the last dim (OPS.md section 2), ``kernels_cu/rmsnorm.cu``."""

from __future__ import annotations

import functools

from .. import _checks, _jit, reference
from .._dispatch import Plan, run
from ._launch import CTYPE, ITEMSIZE, column_sum, f32, grid_for, i32, i64, launch, threads_for, tokens_of, vec_width
from .spec import Arg, Kernel

_FILE = "rmsnorm.cu"
#: Blocks of the weighted backward: each sums dw over a contiguous range of
#: rows; fixed (independent of the device) so results are reproducible anywhere.
_BWD_BLOCKS = 1024
#: Static shared memory of the backward kernels (``red``: 2 x 32 floats); the
#: weighted backward adds C floats of dynamic shared memory (its dw row).
_BWD_STATIC_SMEM = 2 * 32 * 4
#: Shared memory a block may use on an H100 / H200 (static and dynamic together),
#: the most of any supported GPU: the weighted backward's C limit everywhere (the
#: CPU too: one contract) is at most (_MAX_SMEM - _BWD_STATIC_SMEM) / 4; a GPU with
#: less opt-in shared memory per block lowers it.
_MAX_SMEM = 227 * 1024
#: Shared memory per block every CUDA GPU since sm_70 grants without opting in.
_DEFAULT_SMEM = 48 * 1024
#: The weighted backward's C limit on every supported GPU: the least opt-in shared memory per
#: block among them (99 KiB, sm_86 / sm_89) less the static part, in floats (25280).
WEIGHTED_C_EVERYWHERE = (99 * 1024 - _BWD_STATIC_SMEM) // 4
#: Register-cached kernels (rows of fewer than _WIDE_VECS vectors): the vectors per
#: thread K tried, smallest first, and the largest block taken, per direction.  The
#: forward keeps 2 vectors a thread (fastest on an H200 at rows of 4096, from an
#: earlier layout study), the backward (two rows on chip) one while the block stays
#: within 896 threads, else 2.
_CACHED = {"fwd": ((2,), 640), "bwd": ((1, 2), 896)}
#: Rows of at least this many vectors take the two-pass kernels (their first pass
#: keeps the row in L2 for the second), with about _WIDE_VECS_PER_THREAD vectors a
#: thread in the forward and 1024-thread blocks in the backward.  H200, bf16, in one
#: process (devtmp A/B of 2026-12-02, CUDA events, medians), register-cached (K up to 8,
#: which held many registers: 43 % occupancy at rows of 28672) -> two-pass, in us:
#: forward 32768 x 10240: 363 -> 317, 16384 x 16384: 301 -> 255, 32768 x 28672:
#: 1216 -> 872, 16384 x 32768: 672 -> 501; backward 541 -> 514, 428 -> 394,
#: 1731 -> 1405, 1138 -> 826.  2 or 8 vectors a thread in the forward: 394 / 355,
#: 339 / 287, 1069 / 931, 501 / 545; backward blocks of 256 / 512 / 640 threads at
#: 16384 x 16384: 550 / 427 / 411.
_WIDE_VECS = 1024
_WIDE_VECS_PER_THREAD = 4


def two_pass_threads(direction: str, C: int, E: int) -> int:
    """Block size of the two-pass kernel of ``direction`` for a row of C elements in
    vectors of E (before the compiled kernel's register limit)."""
    vecs = -(-C // E)
    if vecs < _WIDE_VECS:
        return threads_for(C, E)
    if direction == "bwd":
        return 1024
    return min(1024, -(-vecs // (_WIDE_VECS_PER_THREAD * 32)) * 32)


@functools.lru_cache(maxsize=1024)
def cached_layout(direction: str, C: int, E: int, dtypes) -> tuple | None:
    """(threads, K) of the register-cached kernel of ``direction`` (each
    thread keeps K vectors of E elements of each row), or None when the
    two-pass kernels run: rows that do not fit, or of _WIDE_VECS vectors or
    more.  Needs whole 32-bit words per vector."""
    vecs = -(-C // E)
    if C == 0 or vecs >= _WIDE_VECS or any(E * ITEMSIZE[dt] % 4 for dt in dtypes):
        return None
    ks, max_threads = _CACHED[direction]
    for K in ks:
        threads = -(-vecs // (K * 32)) * 32
        if threads <= max_threads:
            return threads, K
    return None


@functools.lru_cache(maxsize=None)
def _smem_optin(ordinal: int) -> int | None:
    """cudaDevAttrMaxSharedMemoryPerBlockOptin of GPU ``ordinal`` (bytes), or
    None when no such GPU can be queried (then the launch checks)."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        return rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal)
    except Exception:  # noqa: BLE001 - no CuPy / driver / device: nothing to query
        return None


def _weighted_c_error(C: int, smem: int, static: int, where: str) -> ValueError:
    return ValueError(
        f"rmsnorm_bwd with a weight supports C <= {(smem - static) // 4}; x has C = {C} (the backward keeps a "
        f"float32 row of C in shared memory: {smem} bytes per block {where}, {static} of them static)")


def check_weighted_c(C: int, device) -> None:
    """Raise ValueError when the weighted backward's dw row (C floats of
    dynamic shared memory) cannot fit: C <= (S - 256) / 4 with S the opt-in
    shared memory per block of ``device`` (a ("cuda", ordinal) tuple), at most
    _MAX_SMEM: C <= 58048 on sm_90, 41664 on sm_80, 25280 on sm_86 / sm_89; no limit on
    the CPU (the NumPy reference)."""
    if device[0] != "cuda":
        return
    smem, where = _MAX_SMEM, "on an H100 / H200"
    if device[0] == "cuda" and C * 4 + _BWD_STATIC_SMEM > _DEFAULT_SMEM:
        optin = _smem_optin(device[1])
        if optin is not None and optin <= smem:
            smem, where = optin, f"on {device[0]}:{device[1]}"
    if C * 4 + _BWD_STATIC_SMEM > smem:
        raise _weighted_c_error(C, smem, _BWD_STATIC_SMEM, where)


_static_smem: dict = {}  # function pointer -> its static shared memory (bytes)


def _check_launch_smem(expr: str, C: int) -> None:
    """The exact check at launch: C floats plus the compiled kernel's static
    shared memory within the current device's opt-in limit."""
    if getattr(_jit._local, "dry_run", None) is not None:  # listing kernels (_jit.dry_run): no GPU
        return
    import cupy
    from cupy_backends.cuda.api import driver

    dev = cupy.cuda.runtime.getDevice()
    optin = _smem_optin(dev)
    fn = _jit.get_function(_FILE, expr)
    static = _static_smem.get(fn.ptr)
    if static is None:
        static = _static_smem[fn.ptr] = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
    if optin is not None and C * 4 + static > optin:
        raise _weighted_c_error(C, optin, static, f"on cuda:{dev}")


def _kernel(kind: str, types: str, E: int, C: int, has_w: bool, layout):
    """(name expression, threads) of the forward / backward kernel for a row of
    C: the register-cached one when ``layout`` is given and its block fits the
    compiled kernel's register budget, else the two-pass one (its block within
    that budget too)."""
    w = "true" if has_w else "false"
    if layout is not None:
        threads, K = layout
        expr = f"mhc_rmsnorm_{kind}_cached_kernel<{types},{E},{K},{w}>"
        if threads <= _jit.max_threads(_FILE, expr):
            return expr, threads
    expr = f"mhc_rmsnorm_{kind}_kernel<{types},{E},{w}>"
    return expr, min(two_pass_threads(kind, C, E), _jit.max_threads(_FILE, expr))


def _check(infos, eps, with_grad: bool):
    x, w = infos["x"], infos["weight"]
    dt = _checks.activation("x", x)
    _checks.min_ndim("x", x, 1, "[..., C]")
    C = _checks.row_length("x", x)
    tg = None
    if with_grad:
        tg = _checks.gradient("grad", infos["grad"], dt)
        _checks.same_shape("grad", infos["grad"].shape, "x", x.shape)
    if w is not None:
        _checks.coefficient("weight", w)
        _checks.expect_shape("weight", w.shape, (C,), "one weight per element of the last dim of x")
        if with_grad:
            check_weighted_c(C, x.device)
    return dt, tg, C, tokens_of(x.shape[:-1]), _checks.eps("eps", eps)


def _plan_fwd(infos, eps):
    dt, _, C, rows, eps = _check(infos, eps, False)
    has_w = infos["weight"] is not None

    def run_kernels(p, outs, sc, stream):
        E = vec_width(1, C, [(p["x"], dt), (outs[0], dt)])
        expr, threads = _kernel("fwd", CTYPE[dt], E, C, has_w, cached_layout("fwd", C, E, (dt,)))
        launch(_FILE, expr, grid_for(rows), (threads, 1, 1),
               (p["x"], p["weight"], outs[0], i64(rows), i32(C), f32(eps)), stream)

    return Plan([(infos["x"].shape, dt)], run_kernels,
                lambda a: (reference.rmsnorm_fwd(a["x"], eps, a["weight"]),), single=True, empty=rows == 0 or C == 0)


def _plan_bwd(infos, eps):
    dt, tg, C, rows, eps = _check(infos, eps, True)
    has_w = infos["weight"] is not None
    blocks = max(1, min(rows, _BWD_BLOCKS))
    per_block = -(-rows // blocks) if rows else 1
    blocks = -(-rows // per_block) if rows else 1
    outputs = [(infos["x"].shape, dt)] + ([((C,), "float32")] if has_w else [])

    def run_kernels(p, outs, sc, stream):
        E = vec_width(1, C, [(p["x"], dt), (p["grad"], tg), (outs[0], dt)])
        expr, threads = _kernel("bwd", f"{CTYPE[dt]},{CTYPE[tg]}", E, C, has_w, cached_layout("bwd", C, E, (dt, tg)))
        if has_w and C * 4 > _DEFAULT_SMEM // 2:
            _check_launch_smem(expr, C)
        launch(_FILE, expr, (blocks, 1, 1), (threads, 1, 1),
               (p["grad"], p["x"], p["weight"], outs[0], sc.get("dweight_part"), i64(rows), i32(C), f32(eps),
                i64(per_block)), stream, shared_mem=C * 4 if has_w else 0)
        if has_w:
            column_sum(sc["dweight_part"], outs[1], blocks, C, stream)

    def ref(a):
        r = reference.rmsnorm_bwd(a["grad"], a["x"], eps, a["weight"])
        return r if has_w else (r,)

    # With a weight and no rows, the launch still runs: it writes d_weight = 0.
    empty = C == 0 or (rows == 0 and not has_w)
    return Plan(outputs, run_kernels, ref, scratch={"dweight_part": ((blocks, C), "float32")} if has_w else {},
                single=not has_w, empty=empty)


def rmsnorm_fwd(x, eps=1e-5, weight=None):
    """RMSNorm: y = x / sqrt(mean(x^2, last dim) + eps) (* weight) (OPS.md section 2).

    For the mHC coefficient path normalise vec(x) of length n*C: pass x viewed
    as [..., n*C] (a free reshape of a contiguous [..., n, C]).

    Args:
        x: [..., C], bfloat16 / float16 / float32.
        eps: >= 0, added to the mean square. Default 1e-5.
        weight: optional float32 [C].

    Returns:
        y: [..., C], dtype of x (statistics in float32, one rounding at the end).

    Raises:
        TypeError: bad dtypes.  ValueError: weight shape, devices, eps.

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.rmsnorm`` for gradients.
    """
    return run(_plan_fwd, {"x": x, "weight": weight}, eps=eps)


def rmsnorm_bwd(grad, x, eps=1e-5, weight=None):
    """Gradient of :func:`rmsnorm_fwd` (OPS.md section 2); statistics recomputed from x.

    With g' = grad * weight and r = 1/sqrt(mean(x^2) + eps):
    dx = r g' - x r^3 mean(g' x);  d_weight = sum over tokens of grad * x * r.

    Args:
        grad: [..., C], dtype of x or float32.
        x, eps, weight: as given to the forward.

    Returns:
        dx ([..., C], dtype of x), or (dx, d_weight float32 [C]) when a weight
        is given.  d_weight is summed over tokens in a fixed order
        (deterministic, no atomics).

    Raises:
        TypeError / ValueError: as the forward; grad shape differs from x;
        with a weight, C above what a GPU's shared memory per block holds
        (C floats: C <= 58048 on sm_90, 41664 on sm_80, 25280 on sm_86 / sm_89; no
        limit on the CPU).

    Autograd: none.  Torch tensors that require grad (with grad mode on) give an
    ``AutogradNotRecordedWarning`` (once per op): use ``mhc_cupy.torch.rmsnorm`` for gradients.
    """
    return run(_plan_bwd, {"grad": grad, "x": x, "weight": weight}, eps=eps)


# ------------------------------------------------------------------ op spec
_X, _W = Arg("x", "...C", "activation"), Arg("weight", "C", "parameter", optional=True)
KERNELS = (
    Kernel("rmsnorm_fwd", _plan_fwd, (_X, _W), (Arg("out", "...C", "activation"),), params={"eps": 1e-5},
           shared="weight", shared_mode="sequential"),
    Kernel("rmsnorm_bwd", _plan_bwd, (_X, _W), (_X, _W), grads=(Arg("grad", "...C", "activation"),),
           params={"eps": 1e-5}, shared="weight", shared_mode="sequential"),
)
