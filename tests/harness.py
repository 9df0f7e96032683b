"""The test harness: one ``assert_close``, one tolerance table (``TOL``), host copies.

Imported as ``harness`` from tests/ and tests/gpu/ (``conftest.py`` puts tests/ on
``sys.path``); no framework is imported here, arrays of any of them are accepted.

Two meanings of "close", each once:

* :func:`assert_close`: elementwise ``|got - ref| <= tol * (|ref| + scale)``, ``scale``
  rms(ref) by default: relative error for large elements, error relative to the
  array's size for elements near zero.  Also checks shapes and that ``got`` is finite
  (poisoned GPU allocations are NaN, so an unwritten element fails).
* :func:`assert_close_uniform`: one bound for every element,
  ``|actual - desired| <= rtol * scale`` with ``scale`` max|desired| by default (the
  NumPy reference against float64 torch, where errors are ~1e-12 of the largest term).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Tol:
    """One row of the tolerance table: a value (or one per dtype name) and why it holds."""

    value: object
    reason: str

    def __getitem__(self, dtype):
        """The value for ``dtype`` (a name, NumPy dtype or torch dtype) of a per-dtype row."""
        return self.value[_dtype_name(dtype)]


#: Every tolerance the tests use, relative to the scale of :func:`assert_close` unless a row
#: says otherwise.  A row only ever becomes tighter; each gives the reason it holds.
TOL = {
    "activation": Tol(
        {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5},
        "GPU activation output vs the float64 reference on the same rounded inputs: one rounding to the "
        "dtype (unit roundoff 2^-8, 2^-11, 2^-24) plus float32 accumulation"),
    "coefficient": Tol(
        1e-4,
        "float32 coefficient sums over C (and tokens): relative error grows like sqrt(C) * 2^-24; 1e-4 of "
        "the scale is a safe bound up to C ~ 1e5"),
    "sinkhorn": Tol(
        2e-4,
        "values through the 20-step Sinkhorn-Knopp iteration in float32 (P, H_res; 40 normalisations) at "
        "logit scales 1 to 6, and its gradient at logit scale 1 (n 1..32, tokens 1..1000: the GPU cases of "
        "tests/test_sinkhorn.py)"),
    "sinkhorn_chain_grad": Tol(
        1e-3,
        "gradients through the Sinkhorn iteration in the adapters' GPU checks: logits of scale 2 (JAX) and "
        "chained through the pre op, where tests/test_pre_op.py itself needs 5e-3 (pre op dh_res_raw, logit scale "
        "2) and 20 x 'sinkhorn' (scale 6); kept at the bound those checks have passed with, not tightened "
        "to 'sinkhorn' without a GPU measurement"),
    "layer_gpu": Tol(
        {"bfloat16": (8 * 2.0**-8, 16 * 2.0**-8), "float32": (1e-3, 1e-3)},
        "(output, gradients) of the whole MHC layer on the GPU vs MHCReference: bfloat16 (u = 2^-8, sublayers "
        "under autocast) measured out <= 2u, gradients <= 7u by CPU emulation, bound 8u / 16u; float32: kernel "
        "sums in another order, 20 float32 Sinkhorn steps and cuBLAS float32 GEMMs, 1e-3 for everything "
        "(tests/test_layer.py, its GPU cases)"),
    "rounding": Tol(
        {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-10},
        "CPU path (NumPy reference in float64, rounded once to the output dtype) vs float64 torch "
        "autograd: one rounding (ml_dtypes may round float64 -> float32 -> bfloat16: still one unit)"),
    "rounding_elementwise": Tol(
        {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7},
        "an output that is the float64 result rounded once, elementwise relative (no rms term): "
        "bfloat16 2^-7 as float64 -> float32 -> bfloat16 can round twice"),
    "float32_layer": Tol(
        1e-5,
        "the float32 mHC layer (NumPy reference per op, rounded to float32 between ops) vs its float64 "
        "plain-torch oracle"),
    "float32_unit": Tol(2.0**-24, "one float32 rounding of a float64 result (unit roundoff)"),
}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "") if not isinstance(dtype, str) else dtype


# ------------------------------------------------------------------ host copies
def to_host(a):
    """A CuPy array (bfloat16 included) as a NumPy array of the same dtype."""
    import cupy as cp

    if a.dtype == BF16:
        return cp.asnumpy(a.view(cp.uint16)).view(BF16)
    return cp.asnumpy(a)


def f64(a) -> np.ndarray:
    """Any array (NumPy, torch on any device, CuPy, JAX, Python numbers) as a float64 NumPy array."""
    module = type(a).__module__
    if module.startswith("torch"):
        return a.detach().to("cpu").double().numpy()
    if module.startswith("cupy"):
        a = to_host(a)
    return np.asarray(np.asarray(a).astype(np.float64))


# ------------------------------------------------------------------ closeness
def assert_close(got, ref, tol, what="", scale=None):
    """All of ``got`` finite, shapes equal, and ``|got - ref| <= tol * (|ref| + scale)`` elementwise.

    ``scale``: None = rms(ref); "max" = max|ref|; or a number / array broadcast against
    ref (the size of the terms when the result is a cancellation of larger terms, e.g.
    RMSNorm dx).  Floored at 1e-300 (ref all zero: got must be zero).
    """
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite (unwritten?) elements"
    if ref.size == 0:
        return
    if scale is None:
        scale = np.sqrt(np.mean(ref**2))
    elif isinstance(scale, str):
        assert scale == "max", f"scale must be None, 'max' or a number / array, got {scale!r}"
        scale = np.abs(ref).max()
    scale = np.maximum(f64(scale), 1e-300)
    err = np.abs(got - ref)
    bound = tol * (np.abs(ref) + scale)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (
        f"{what}: max error {err.max():.3e}, worst err/bound {(err / bound).max():.2f} (tol {tol}); worst at "
        f"flat index {worst}: got {got.flat[worst]!r}, ref {ref.flat[worst]!r}")


def assert_close_uniform(actual, desired, rtol, what="", scale=None, dtype=None):
    """``|actual - desired| <= rtol * scale`` for every element, shapes equal (and ``actual.dtype == dtype``
    if given).  ``scale`` defaults to max|desired|; pass the magnitude of the terms that cancel when the
    result is a small difference of large terms (RMSNorm dx with mean(x^2) >> eps)."""
    if dtype is not None:
        assert np.asarray(actual).dtype == dtype, (what, np.asarray(actual).dtype)
    actual, desired = f64(actual), f64(desired)
    assert actual.shape == desired.shape, (what, actual.shape, desired.shape)
    if scale is None:
        scale = np.abs(desired).max() if desired.size else 0.0
    np.testing.assert_allclose(actual, desired, rtol=0, atol=rtol * scale + 1e-300, err_msg=what)


def assert_rounded(actual, expected, dtype):
    """``actual`` is ``expected`` (float64) rounded once to ``dtype``: elementwise relative
    ``TOL['rounding_elementwise']``."""
    a, e = f64(actual), f64(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    np.testing.assert_allclose(a, e, rtol=TOL["rounding_elementwise"][dtype], atol=1e-30)


# ------------------------------------------------------------------ torch helpers
@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype set to ``dtype`` inside the block, restored after it."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def token_scales(ref, x, g):
    """Summed magnitude of the per-token contributions to d_alpha and d_bias of the layer
    ``ref`` (an ``MHCReference``) at input x and output gradient g, floored at its rms.

    The reference is re-run with alpha and bias given per token, so each token's contribution
    is its own gradient; a rounding error of relative size e in every term moves the sum by at
    most e times this scale (a gradient that is zero by symmetry still gets noise of that size).
    """
    import torch

    from mhc_cupy.torch.reference import mhc_reference

    lead = x.shape[:-2]
    alpha = ref.alpha.detach().expand(lead + (3,)).clone().requires_grad_()
    bias = ref.bias.detach().expand(lead + ref.bias.shape).clone().requires_grad_()
    out = mhc_reference(x.detach(), ref.phi.detach(), alpha, bias, ref.sublayer, ref.num_iters, ref.eps, ref.rms_eps)
    da, db = torch.autograd.grad(out, (alpha, bias), g)
    scales = {}
    for name, d in (("alpha", da), ("bias", db)):
        s = d.abs().reshape(-1, d.shape[-1]).sum(0).double()
        scales[name] = torch.maximum(s, s.square().mean().sqrt())
    return scales


# ------------------------------------------------------------------ GPU cases
def gpu_test(*marks, poison: bool = True):
    """Decorator of a GPU case in a family's test file: ``pytest.mark.gpu`` (skipped without a
    CUDA GPU, see conftest.py), the given extra ``marks`` (e.g. a skipif), and with ``poison``
    the ``nan_poison`` fixture (every CuPy allocation starts as NaN, so an element a kernel
    failed to write fails the comparison; the outputs of mhc_cupy's calls start as NaN in every
    GPU test anyway: conftest.py's ``_poisoned_outputs``)."""
    import pytest

    def decorate(fn):
        for mark in (pytest.mark.gpu, *marks) + ((pytest.mark.usefixtures("nan_poison"),) if poison else ()):
            fn = mark(fn)
        return fn

    return decorate


# ------------------------------------------------------------------ inputs from the op specs
NP_DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def spec_inputs(op: str, rng, lead, n: int, C: int, dtype: str, scale=None, shared: bool = False,
                absent=()) -> dict:
    """Random inputs of ``op`` (its ``<op>_fwd`` spec in ``mhc_cupy.ops.SPECS``): name -> NumPy array.

    Shapes come from the spec's shape codes (token dims ``lead``, streams ``n``, hidden size
    ``C``); values are standard normal times ``scale[name]`` (default 1, phi 1/sqrt(n*C)), or
    ``shift + s * normal`` for an entry ``(s, shift)``; activations are rounded to ``dtype``, the
    rest float32.  ``shared``: the spec's shared input without token dims (a shared h [n]);
    ``absent``: optional inputs left out.  The signature of each op is declared once, in its spec.
    """
    from mhc_cupy.ops import SPECS, coeffs
    from mhc_cupy.ops.spec import shape_of

    spec = SPECS[f"{op}_fwd"]
    sizes = {"n": n, "C": C, "K": coeffs.columns(n)}
    scale = {"phi": (n * C) ** -0.5, **(scale or {})}
    out = {}
    for a in spec.inputs:
        if a.name in absent:
            continue
        s, shift = scale.get(a.name, 1.0), 0.0
        if isinstance(s, tuple):
            s, shift = s
        v = shift + s * rng.standard_normal(shape_of(a, () if shared and a.name == spec.shared else tuple(lead), sizes))
        out[a.name] = v.astype(NP_DTYPES[dtype] if a.kind == "activation" else np.float32)
    return out


def spec_parameters(op: str, shared: bool = False, absent=()) -> tuple:
    """The inputs of ``op`` shared by all tokens: its parameters (phi, alpha, bias, RMSNorm's
    weight) and, with ``shared``, its shared coefficient (h [n])."""
    from mhc_cupy.ops import SPECS

    spec = SPECS[f"{op}_fwd"]
    return tuple(a.name for a in spec.inputs if a.name not in absent
                 and (a.kind == "parameter" or (shared and a.name == spec.shared)))


def count_calls(monkeypatch, module, names) -> dict:
    """{name: calls so far} of the functions ``names`` of ``module``, each wrapped (monkeypatch) to count."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*a, _f=getattr(module, name), _name=name, **k):
            calls[_name] += 1
            return _f(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return calls
