"""Which kernel specialisations exist: for CI compilation and for warm-up.

The list is not written by hand: every op's real launch plan is run on fake
(aligned or misaligned) pointers inside ``_jit.dry_run``, which records each
launch instead of running it, so it names exactly the name expressions real
calls would compile.
"""

from __future__ import annotations

import itertools

from . import _checks, _jit
from ._kernel_choice import kernel_choice
from ._interop import ArrayInfo

_ALIGNED, _MISALIGNED = 1 << 20, (1 << 20) + 2
_DEV = ("cuda", 0)


def _info(shape, dtype, ptr):
    return ArrayInfo(tuple(shape), dtype, _DEV, ptr, None)


def _infos(kernel, lead: tuple, sizes: dict, dt: str, tg: str, ptr: int, shared: bool = False, absent: bool = False,
           drop=()):
    """Fake infos of ``kernel``'s arrays (its op spec): activations in ``dt``, incoming
    gradients of activations in ``tg``, the rest float32.  ``shared``: the shared-capable
    input without token dims; ``absent``: every optional input None; ``drop``: these None."""
    from .ops.spec import shape_of

    infos = {}
    for a in kernel.args:
        dtype = (tg if a in kernel.grads else dt) if a.kind == "activation" else "float32"
        shape = shape_of(a, () if shared and a.name == kernel.shared else lead, sizes)
        infos[a.name] = None if (absent and a.optional) or a.name in drop else _info(shape, dtype, ptr)
    return infos


#: Kernel variants that are off by default (mhc_cupy._kernel_choice) and which ops' plans use them: the
#: dry runs plan those ops under the default choice and with the variant on, so CI compiles it too.
_OPT_IN = {"mhc_boundary_fwd": ({"boundary": True}, {"small": True}, {"tail": True}),
           "mhc_layer_pre_fwd": ({"small": True}, {"tail": True}), "mhc_coeffs_fwd": ({"small": True},),
           "mhc_layer_pre_norm_fwd": ({"layer_in": True}, {"layer_in": True, "small": True}),
           "mhc_layer_pre_fp8_fwd": ({"layer_in": True}, {"layer_in": True, "small": True},
                                     {"layer_in": True, "tail": True}),
           "mhc_layer_pre_bwd": ({"boundary_bwd": True},), "mhc_boundary_bwd": ({"boundary_bwd": True},),
           "mhc_layer_post_bwd": ({"post_pipe": True},), "mhc_post_op_bwd": ({"post_pipe": True},)}
#: Ops that launch nothing on a GPU under the default choice (their only kernel is opt-in): planned with
#: their _OPT_IN variants only.
_GATED = {"mhc_layer_pre_norm_fwd", "mhc_layer_pre_fp8_fwd", "mhc_boundary_bwd"}
#: Optional inputs that an op takes on a GPU only under its _OPT_IN variants (None under the default choice).
_GATED_INPUTS = {"mhc_layer_pre_bwd": ("layer_out",)}


def _cases(dt: str, n: int, C: int, ptr: int, tg: str):
    """(planner, infos, params, variants) for every op spec at one configuration: with and without
    its optional inputs, its shared input in both forms, every ``grad_mode`` and ``convention``;
    ``variants``: the kernel choice to put in force ({}: the default; see _OPT_IN)."""
    from .ops import SPECS, coeffs, rmsnorm

    sizes = {"n": n, "C": C, "K": coeffs.columns(n)}
    cases = []
    for k in SPECS.values():
        modes = ("unrolled", "implicit") if "grad_mode" in k.params else (None,)
        conventions = ("paper", "deepseek") if "convention" in k.params else (None,)
        shared = (False, True) if k.shared and k.shared_mode == "expand" else (False,)
        absent = (False, True) if any(a.optional for a in k.args) else (False,)
        for mode, conv, sh, ab in itertools.product(modes, conventions, shared, absent):
            params = dict(k.params, **({"grad_mode": mode} if mode else {}), **({"convention": conv} if conv else {}))
            for variants in (() if k.name in _GATED else ({},)) + _OPT_IN.get(k.name, ()):
                drop = () if variants else _GATED_INPUTS.get(k.name, ())
                cases.append((k.planner, _infos(k, (3,), sizes, dt, tg, ptr, sh, ab, drop), params, variants))
    # RMSNorm of vec(x), as the mHC paper (OPS.md 2), with a weight too where its dw row fits every
    # supported GPU; the coefficient backward over many tokens (the narrow column sums over tokens:
    # dalpha, dbias)
    for k in (SPECS["rmsnorm_fwd"], SPECS["rmsnorm_bwd"]):
        for ab in (True, False) if n * C <= rmsnorm.WEIGHTED_C_EVERYWHERE else (True,):
            cases.append((k.planner, _infos(k, (3,), {"C": n * C}, dt, tg, ptr, absent=ab), k.params, {}))
    k = SPECS["mhc_coeffs_bwd"]
    infos = {**_infos(k, (300,), sizes, dt, tg, ptr), "grad_h_post_raw": None, "grad_h_res_raw": None}
    cases.append((k.planner, infos, k.params, {}))
    # and a weighted RMSNorm backward over many rows (dweight's partials of C columns: the wide
    # column sum, which sums of 64 rows or fewer do not use)
    k = SPECS["rmsnorm_bwd"]
    cases.append((k.planner, _infos(k, (300,), {"C": C}, dt, tg, ptr), k.params, {}))
    return cases


def dry_launches(dtypes=("bfloat16", "float16", "float32"), ns=(4,), Cs=(4096, 7), aligned=(True, False),
                 grad_f32=(False, True), wgmma=(False, True)) -> list[tuple]:
    """Every launch (``_jit.dry_run``'s tuples) the op plans make at these settings, on fake
    pointers (``_ALIGNED`` / ``_MISALIGNED``, and addresses derived from them), as on devices
    without and with wgmma (``wgmma``); no GPU needed."""
    with _jit.dry_run() as launches:
        for wg, dt, n, C, al, gf in itertools.product(wgmma, dtypes, ns, Cs, aligned, grad_f32):
            ptr = _ALIGNED if al else _MISALIGNED
            with _jit.assume_wgmma(wg):  # as on GPUs without and with wgmma (sm_90a)
                for planner, infos, params, variants in _cases(dt, n, C, ptr, "float32" if gf else dt):
                    with kernel_choice(**variants):
                        plan = planner(infos, **params)
                        ptrs = {k: (None if v is None else v.ptr) for k, v in infos.items()}
                        plan.launch(ptrs, [ptr] * len(plan.outputs), [ptr] * len(plan.scratch), 0)
    return launches


def specialisations(dtypes=("bfloat16", "float16", "float32"), ns=(4,), Cs=(4096, 7), aligned=(True, False),
                    grad_f32=(False, True), wgmma=(False, True)) -> list[tuple[str, str]]:
    """Sorted unique (kernel file, name expression) pairs that calls with these settings compile."""
    return sorted({(filename, expr) for filename, expr, *_ in dry_launches(dtypes, ns, Cs, aligned, grad_f32, wgmma)})


def all_specialisations() -> list[tuple[str, str]]:
    """Representative set compiled by CI: every dtype at n = 4 and n = 8 (the coefficient
    backward's fused kernel and its dx with phi resident) and the dx with phi streamed (n = 16),
    every supported size class of n at bfloat16, vectorised and scalar paths."""
    tile = {(f, e) for f, e in specialisations(dtypes=("float16", "float32"), ns=(16,)) if "dx_tile" in e}
    return sorted(set(specialisations(ns=(4, 8))) | tile |
                  set(specialisations(dtypes=("bfloat16",), ns=(1, 2, 3, 5, 7, 8, 16, 17, 32))))


def warmup(dtypes=("bfloat16",), ns=(4,), grad_f32=(False, True), verbose=False) -> int:
    """Compile (or load from the disk cache) the common specialisations for the current GPU.

    Covers every op forward and backward for the given activation dtypes and
    stream counts, on aligned inputs (the vectorised path), with activation-
    dtype and float32 incoming gradients.  Returns how many kernels are ready.

    Raises:
        ValueError: a dtype not in bfloat16 / float16 / float32, or an n outside 1..32 (named).
        TypeError: an n that is no int (4.0, True, "4"), a grad_f32 that is no bool, or an argument that is
            neither one value nor a sequence of them (named; a single dtype name, n or bool is taken as one).
        RuntimeError: no CUDA GPU (CuPy reports none available).
    """
    import cupy

    dtypes, ns, grad_f32 = _several("dtypes", dtypes, str), _several("ns", ns, int), _several("grad_f32", grad_f32, bool)
    for dt in dtypes:
        if dt not in _checks.ACTIVATION_DTYPES:
            raise ValueError(f"dtypes has {dt!r}; each needs to be one of {', '.join(_checks.ACTIVATION_DTYPES)}")
    ns = tuple(_checks._int("ns", n) for n in ns)  # not 4.0, True or "4": the planners would build shapes of them
    for n in ns:
        _checks.streams(n, "ns")
    grad_f32 = tuple(_checks.flag("grad_f32", g) for g in grad_f32)
    if not cupy.cuda.is_available():
        raise RuntimeError("mhc_cupy.warmup needs a CUDA GPU; CuPy reports none available")
    pairs = specialisations(dtypes=tuple(dtypes), ns=tuple(ns), Cs=(4096,), aligned=(True,), grad_f32=tuple(grad_f32),
                            wgmma=(_jit.uses_wgmma(),))  # the path this device runs
    for filename, expr in pairs:
        if verbose:
            print(f"  {filename}: {expr}")
        _jit.get_function(filename, expr)
    return len(pairs)


def _several(name: str, value, one: type) -> tuple:
    """``warmup``'s ``value``: one ``one`` (a str of dtypes: one dtype, not its characters) or an iterable of
    them, as a tuple; TypeError naming ``name`` for anything else."""
    if isinstance(value, one) or (one is int and hasattr(value, "__index__") and not isinstance(value, bool)):
        return (value,)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        what = {str: "a dtype name (str)", int: "an int", bool: "a bool"}[one]
        raise TypeError(f"{name} must be {what} or a sequence of them, got {type(value).__name__} {value!r}")
    return tuple(value)
