"""Which kernel specialisations exist: for CI compilation and for warm-up.

The list is not written by hand: every op's real launch plan is run on fake
(aligned or misaligned) pointers inside ``_jit.dry_run``, which records each
launch instead of running it, so it names exactly the name expressions real
calls would compile.
"""

from __future__ import annotations

import itertools

from . import _jit
from ._interop import ArrayInfo

_ALIGNED, _MISALIGNED = 1 << 20, (1 << 20) + 2
_DEV = ("cuda", 0)
_NUM_ITERS = 20


def _info(shape, dtype, ptr):
    return ArrayInfo(tuple(shape), dtype, _DEV, ptr, None)


def _cases(dt: str, n: int, C: int, ptr: int, tg: str):
    """(planner, infos, params) for every op at one configuration."""
    from .ops import post, pre, rmsnorm, sinkhorn, stream

    T = 3
    x, y = _info((T, n, C), dt, ptr), _info((T, C), dt, ptr)
    gx, gy = _info((T, n, C), tg, ptr), _info((T, C), tg, ptr)
    M, h, hs = _info((T, n, n), "float32", ptr), _info((T, n), "float32", ptr), _info((n,), "float32", ptr)
    w = _info((C,), "float32", ptr)
    cases = [
        (stream._plan_mix_fwd, {"x": x, "M": M}, {}),
        (stream._plan_mix_bwd, {"grad": gx, "x": x, "M": M}, {}),
        (post._plan_fwd, {"layer_out": y, "x": x, "H_post": h, "H_res": M}, {}),
        (post._plan_bwd, {"grad": gx, "layer_out": y, "x": x, "H_post": h, "H_res": M}, {}),
        *_rmsnorm_cases(rmsnorm, T, C, dt, tg, ptr),
        *_rmsnorm_cases(rmsnorm, T, n * C, dt, tg, ptr, weighted=False),  # vec(x), as the mHC paper (OPS.md 2)
        (sinkhorn._plan_fwd, {"logits": M}, {"num_iters": _NUM_ITERS, "eps": 1e-8}),
        (pre._plan_fwd, {"x": x, "h_pre_raw": h, "h_post_raw": h, "h_res_raw": M},
         {"num_iters": _NUM_ITERS, "eps": 1e-8}),
    ]
    for hh in (h, hs):
        cases += [
            (stream._plan_aggregate_fwd, {"x": x, "h": hh}, {}),
            (stream._plan_aggregate_bwd, {"grad": gy, "x": x, "h": hh}, {}),
            (stream._plan_distribute_fwd, {"y": y, "h": hh}, {}),
            (stream._plan_distribute_bwd, {"grad": gx, "y": y, "h": hh}, {}),
        ]
    for mode in ("unrolled", "implicit"):
        cases += [
            (sinkhorn._plan_bwd, {"grad_P": M, "logits": M}, {"num_iters": _NUM_ITERS, "eps": 1e-8, "grad_mode": mode}),
            (pre._plan_bwd, {"grad_layer_in": gy, "grad_H_pre": h, "grad_H_post": h, "grad_H_res": M, "x": x,
                             "h_pre_raw": h, "h_post_raw": h, "h_res_raw": M},
             {"num_iters": _NUM_ITERS, "eps": 1e-8, "grad_mode": mode}),
        ]
    cases += _coeffs_cases(x, h, M, n, C, ptr)
    cases += _layer_cases(x, y, gx, gy, h, M, n, C, ptr)
    return cases


def _rmsnorm_cases(rmsnorm, T: int, C: int, dt: str, tg: str, ptr: int, weighted: bool = True):
    x, g = _info((T, C), dt, ptr), _info((T, C), tg, ptr)
    weights = (None, _info((C,), "float32", ptr)) if weighted else (None,)
    return [(rmsnorm._plan_fwd, {"x": x, "weight": w}, {"eps": 1e-5}) for w in weights] + [
        (rmsnorm._plan_bwd, {"grad": g, "x": x, "weight": w}, {"eps": 1e-5}) for w in weights]


def _coeffs_cases(x, h, M, n: int, C: int, ptr: int):
    """The coefficient path (OPS.md section 8, ops/coeffs.py): forward, backward with
    every incoming gradient and with none (the zero-fill kernel)."""
    from .ops import coeffs

    K = coeffs.columns(n)
    cx = {"x": x, "phi": _info((n * C, K), "float32", ptr), "alpha": _info((3,), "float32", ptr),
          "bias": _info((K,), "float32", ptr)}
    none = {"grad_h_pre_raw": None, "grad_h_post_raw": None, "grad_h_res_raw": None}
    return [
        (coeffs._plan_fwd, cx, {"eps": 1e-5}),
        (coeffs._plan_bwd, {"grad_h_pre_raw": h, "grad_h_post_raw": h, "grad_h_res_raw": M, **cx}, {"eps": 1e-5}),
        (coeffs._plan_bwd, {**none, **cx}, {"eps": 1e-5}),
        # many tokens: the narrow column sums over tokens (dalpha, dbias)
        (coeffs._plan_bwd, {"grad_h_pre_raw": _info((300, n), "float32", ptr), "grad_h_post_raw": None,
                            "grad_h_res_raw": None, **cx, "x": _info((300, n, C), x.dtype, ptr)}, {"eps": 1e-5}),
    ]


def _layer_cases(x, y, gx, gy, h, M, n: int, C: int, ptr: int):
    """The fused layer pieces (OPS.md section 9, ops/layer.py); the backward on the GPU for n <= 4."""
    from .ops import coeffs, layer

    K = coeffs.columns(n)
    cx = {"x": x, "phi": _info((n * C, K), "float32", ptr), "alpha": _info((3,), "float32", ptr),
          "bias": _info((K,), "float32", ptr)}
    params = {"num_iters": _NUM_ITERS, "eps": 1e-8, "rms_eps": 1e-5}
    cases = [(layer._plan_pre_fwd, cx, params),
             (layer._plan_post_bwd, {"grad": gx, "layer_out": y, "x": x, "H_post": h, "H_res": M}, {})]
    if K <= 32:
        saved = {"stats": _info(x.shape[:-2] + (K + 1,), "float32", ptr), "H_pre": h, "H_res": M}
        cases.append((layer._plan_pre_bwd, {"grad_layer_in": gy, "grad_out": gx, "grad_H_post": h, "grad_H_res": M,
                                            **cx, **saved}, {**params, "grad_mode": "unrolled"}))
    return cases


def dry_launches(dtypes=("bfloat16", "float16", "float32"), ns=(4,), Cs=(4096, 7), aligned=(True, False),
                 grad_f32=(False, True)) -> list[tuple]:
    """Every launch (``_jit.dry_run``'s tuples) the op plans make at these settings, on fake
    pointers (``_ALIGNED`` / ``_MISALIGNED``, and addresses derived from them); no GPU needed."""
    with _jit.dry_run() as launches:
        for dt, n, C, al, gf in itertools.product(dtypes, ns, Cs, aligned, grad_f32):
            ptr = _ALIGNED if al else _MISALIGNED
            for planner, infos, params in _cases(dt, n, C, ptr, "float32" if gf else dt):
                plan = planner(infos, **params)
                ptrs = {k: (None if v is None else v.ptr) for k, v in infos.items()}
                plan.launch(ptrs, [ptr] * len(plan.outputs), [ptr] * len(plan.scratch), 0)
    return launches


def specialisations(dtypes=("bfloat16", "float16", "float32"), ns=(4,), Cs=(4096, 7), aligned=(True, False),
                    grad_f32=(False, True)) -> list[tuple[str, str]]:
    """Sorted unique (kernel file, name expression) pairs that calls with these settings compile."""
    return sorted({(filename, expr) for filename, expr, *_ in dry_launches(dtypes, ns, Cs, aligned, grad_f32)})


def all_specialisations() -> list[tuple[str, str]]:
    """Representative set compiled by CI: every dtype at n = 4, every supported
    size class of n at bfloat16, vectorised and scalar paths."""
    return sorted(set(specialisations()) | set(specialisations(dtypes=("bfloat16",), ns=(1, 2, 3, 8, 16, 17, 32))))


def warmup(dtypes=("bfloat16",), ns=(4,), grad_f32=(False, True), verbose=False) -> int:
    """Compile (or load from the disk cache) the common specialisations for the current GPU.

    Covers every op forward and backward for the given activation dtypes and
    stream counts, on aligned inputs (the vectorised path), with activation-
    dtype and float32 incoming gradients.  Returns how many kernels are ready.

    Raises:
        RuntimeError: no CUDA GPU (CuPy reports none available).
    """
    import cupy

    if not cupy.cuda.is_available():
        raise RuntimeError("mhc_cupy.warmup needs a CUDA GPU; CuPy reports none available")
    pairs = specialisations(dtypes=tuple(dtypes), ns=tuple(ns), Cs=(4096,), aligned=(True,), grad_f32=tuple(grad_f32))
    for filename, expr in pairs:
        if verbose:
            print(f"  {filename}: {expr}")
        _jit.get_function(filename, expr)
    return len(pairs)
