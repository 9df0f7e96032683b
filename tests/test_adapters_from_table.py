"""The adapters from the op table (issue 42 item 4): every differentiable op of ``mhc_cupy.torch`` and
``mhc_cupy.jax`` takes what the functional ``*_bwd`` takes less its incoming gradients, and every
custom operator's arguments are its spec's arrays and parameters, so a parameter added to an op's
functional API and spec entry reaches both adapters with nothing else to edit."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _adapter
from mhc_cupy.ops import SPECS

#: The ops whose adapters are generated whole (mhc_cupy.jax.mhc_head takes a parameter dict, by hand).
OPS = ["sinkhorn_knopp", "rmsnorm", "stream_mix", "stream_aggregate", "stream_distribute", "mhc_post_op",
       "mhc_pre_op", "mhc_coeffs"]


def _functional(op):
    """mhc_cupy.<op>_bwd's signature without the incoming gradients."""
    grads = {a.name for a in SPECS[f"{op}_bwd"].grads}
    sig = inspect.signature(getattr(m, f"{op}_bwd"))
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in grads])


@pytest.mark.parametrize("op", OPS + ["mhc_head"])
def test_torch_signatures_are_the_functional_apis(op):
    mt = pytest.importorskip("mhc_cupy.torch")
    fn = getattr(mt, op)
    assert inspect.signature(fn) == _functional(op), op
    assert fn.__module__ == "mhc_cupy.torch.functions" and fn.__name__ == op and fn.__doc__.strip()


@pytest.mark.parametrize("op", OPS)
def test_jax_signatures_are_the_functional_apis(op):
    mj = pytest.importorskip("mhc_cupy.jax")
    fn = getattr(mj, op)
    assert inspect.signature(fn) == _functional(op), op
    assert fn.__module__ == "mhc_cupy.jax" and fn.__name__ == op and fn.__doc__.strip()


def test_a_wrong_call_is_pythons_own_type_error():
    mt = pytest.importorskip("mhc_cupy.torch")
    with pytest.raises(TypeError, match=r"stream_mix\(\) got an unexpected keyword argument 'scale'"):
        mt.stream_mix(None, None, scale=2.0)
    with pytest.raises(TypeError, match=r"sinkhorn_knopp\(\) takes from 1 to 4 positional arguments but 5"):
        mt.sinkhorn_knopp(None, 20, 1e-8, "unrolled", "paper")


def test_custom_operators_take_the_spec_arrays_and_parameters():
    """Each torch.ops.mhc_cupy.<name>'s arguments: its kernel's arrays (less the one a variant leaves
    out) and parameters, the forward's with its backward's, in the functional API's order."""
    pytest.importorskip("mhc_cupy.torch")
    from mhc_cupy.torch._factory import REGISTERED

    assert {"mhc_layer_pre_fwd", "mhc_layer_pre_bwd", "mhc_layer_post_bwd", "rmsnorm_weight_bwd"} < set(REGISTERED)
    for name, r in REGISTERED.items():
        k, op = r.kernel, name[:-4]
        public = name.endswith("_fwd") and op in OPS + ["mhc_head"]  # a differentiable op's forward
        params = {**k.params, **(SPECS[f"{op}_bwd"].params if public else {})}
        names = [a.name for a in r.op._schema.arguments]
        assert set(names) - set(params) <= set(k.names) and set(params) <= set(names), name
        assert r.params == tuple(n for n in names if n in params) and r.arrays == frozenset(names) - set(params)
        order = _adapter.parameters(op)[1] if public else inspect.signature(getattr(m, k.name)).parameters.values()
        order = [p for p in order if p.name in names]
        assert names == [p.name for p in order], name
        # defaults where the functional API's arguments are keyword-only (the schemas as written by hand before)
        defaults = [a.has_default_value() for a in r.op._schema.arguments]
        assert defaults == [p.kind is p.KEYWORD_ONLY for p in order], name
    weight = next(a for a in REGISTERED["rmsnorm_weight_bwd"].op._schema.arguments if a.name == "weight")
    assert str(weight.type) == "Tensor"  # required where its gradient is returned


def test_custom_operators_default_a_setting_to_the_conventions_value(rng):
    """A keyword-only setting whose functional default is the convention's (DEFAULT: hc_eps is 1e-6 under
    "deepseek", 0 under "paper") is ``float? =None`` in the schema, and left out or None it is the
    convention's value.  (It was the paper's default in the schema: torch.ops.mhc_cupy.mhc_layer_pre_fwd(...,
    convention="deepseek") added 0 to H_pre where mhc_cupy.mhc_layer_pre_fwd adds 1e-6, silently.)"""
    torch = pytest.importorskip("torch")
    pytest.importorskip("mhc_cupy.torch")
    from mhc_cupy._convention import DEFAULT
    from mhc_cupy.torch._factory import REGISTERED

    seen = set()
    for name, r in REGISTERED.items():
        sig = inspect.signature(getattr(m, r.kernel.name)).parameters
        for a in r.op._schema.arguments:
            p = sig.get(a.name)
            if p is not None and p.kind is p.KEYWORD_ONLY and p.default is DEFAULT:
                assert str(a.type).startswith("Optional[") and a.default_value is None, (name, a.name)
                seen.add(a.name)
    assert {"hc_eps", "post_mult"} <= seen
    x = torch.from_numpy(rng.standard_normal((3, 4, 8), dtype=np.float32))
    phi = torch.from_numpy(rng.standard_normal((32, 24), dtype=np.float32)) * 0.1
    alpha, bias = torch.full((3,), 0.3), torch.from_numpy(rng.standard_normal(24, dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
    for name, arrays in (("mhc_layer_pre_fwd", (x, phi, alpha, bias)), ("mhc_layer_pre_norm_fwd", (x, phi, alpha, bias, w))):
        op = getattr(torch.ops.mhc_cupy, name)
        for convention in ("paper", "deepseek"):
            want = getattr(m, name)(*arrays, 20, 1e-6, 1e-6, convention=convention)
            for kw in ({}, {"hc_eps": None}, {"hc_eps": None, "post_mult": None}):
                got = op(*arrays, 20, 1e-6, 1e-6, convention=convention, **kw)
                assert all(torch.equal(g, v) for g, v in zip(got, want)), (name, convention, kw)
            other = op(*arrays, 20, 1e-6, 1e-6, convention=convention, hc_eps=0.25)
            assert not torch.equal(other[1], want[1]) and torch.equal(other[1], getattr(m, name)(
                *arrays, 20, 1e-6, 1e-6, convention=convention, hc_eps=0.25)[1])


@pytest.mark.parametrize("adapter", ["mhc_cupy.torch.functions", "mhc_cupy.jax"])
def test_a_new_parameter_passes_the_hand_written_hooks(adapter, monkeypatch):
    """A scalar added to an op's functional API and spec entry reaches the planner's keyword arguments
    through the op's hand-written hook (given the arguments by name, it returns what it changes), with
    the hook's own changes as before: nothing in the adapter is edited (issue 42, "Done when")."""
    mod = pytest.importorskip(adapter)
    body = lambda arrays, kw: f"    return {kw}\n"  # noqa: E731 - the planner's kw itself
    for op, hook in mod._BY_HAND.items():
        arrays = {a: None for a in _adapter.parameters(op)[0]}
        before = _adapter.public(op, "", "t", body, {}, hook)(**arrays)
        with monkeypatch.context() as mp:
            for name in (f"{op}_fwd", f"{op}_bwd"):
                mp.setitem(SPECS, name, dataclasses.replace(SPECS[name], params={**SPECS[name].params, "extra": 0.0}))
            functional = inspect.signature(getattr(m.ops, f"{op}_bwd"))
            extra = inspect.Parameter("extra", inspect.Parameter.KEYWORD_ONLY, default=0.0)
            mp.setattr(m.ops, f"{op}_bwd", lambda *a, **k: None)
            getattr(m.ops, f"{op}_bwd").__signature__ = functional.replace(
                parameters=[*functional.parameters.values(), extra])
            assert _adapter.public(op, "", "t", body, {}, hook)(**arrays, extra=0.5) == {**before, "extra": 0.5}, op


def test_flat_is_the_one_place_settings_become_primitives():
    from mhc_cupy._settings import LayerSettings

    s = LayerSettings.resolve("deepseek", num_iters=3)
    assert _adapter.flat(("num_iters", "convention", "eps"), {"settings": s}) == (3, "deepseek", 1e-6)
    assert _adapter.flat(("eps",), {"eps": 0.5}) == (0.5,)
