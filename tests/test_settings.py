"""One settings object (issue 42 item 2): ``mhc_cupy._settings.LayerSettings`` resolved once, and the
same value reaching the planners and the plan cache key from the modules and the adapters."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mhc_cupy import _dispatch, _convention
from mhc_cupy._convention import DEFAULT
from mhc_cupy._settings import LayerSettings
from mhc_cupy.ops import SPECS, layer as L, pre as P, sinkhorn as S


def test_resolve_fills_the_convention_defaults():
    assert LayerSettings.resolve() == LayerSettings(20, 1e-8, 1e-5, "unrolled", "paper", 0.0, 2.0)
    assert LayerSettings.resolve("deepseek") == LayerSettings(20, 1e-6, 1e-6, "unrolled", "deepseek", 1e-6, 2.0)
    given = LayerSettings.resolve("deepseek", num_iters=np.int64(3), eps=1, grad_mode="implicit", post_mult=1)
    assert given == LayerSettings(3, 1.0, 1e-6, "implicit", "deepseek", 1e-6, 1.0)
    assert type(given.num_iters) is int and type(given.eps) is float and type(given.post_mult) is float
    for k, v in _convention.DEFAULTS["deepseek"].items():
        assert getattr(LayerSettings.resolve("deepseek", **{k: DEFAULT}), k) == v


def test_frozen_and_hashable():
    s = LayerSettings.resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.eps = 1.0
    assert {s: 1}[LayerSettings.resolve()] == 1
    assert LayerSettings.resolve() is s  # resolved once per distinct input (cached)
    assert s.values(("convention", "num_iters")) == ("paper", 20) and not s.deepseek


@pytest.mark.parametrize("kw,err,match", [
    (dict(convention="v4"), ValueError, "convention must be 'paper' or 'deepseek', got convention='v4'"),
    (dict(num_iters=True), TypeError, "num_iters must be an int, got bool True"),
    (dict(num_iters=2.0), TypeError, "num_iters must be an int, got float"),
    (dict(convention="deepseek", num_iters=0), ValueError, "num_iters must be >= 1 under convention='deepseek'"),
    (dict(eps=-1.0), ValueError, "eps must be finite and >= 0, got -1.0"),
    (dict(rms_eps=None), TypeError, "rms_eps must be a float, got NoneType None"),
    (dict(grad_mode="exact"), ValueError, "grad_mode must be 'unrolled' or 'implicit', got 'exact'"),
    (dict(hc_eps=float("nan")), ValueError, "hc_eps must be finite and >= 0"),
    (dict(post_mult=[2.0]), TypeError, "post_mult must be a float, got list"),  # unhashable: uncached path
])
def test_resolve_errors_name_the_argument(kw, err, match):
    with pytest.raises(err, match=match.replace("(", r"\(").replace(")", r"\)")):
        LayerSettings.resolve(**kw)
    with pytest.raises(err, match=match.replace("(", r"\(").replace(")", r"\)")):
        LayerSettings.resolve(**kw)  # again: errors are not cached


def test_planners_take_settings_or_the_primitives():
    """A planner of the op table takes the resolved settings (the adapters) or the op's parameters by
    name (the functional API, a custom operator, the op spec): the same plan."""
    info = _dispatch._interop.ArrayInfo((3, 4, 4), "float32", ("cpu", 0))
    a = S._plan_bwd({"grad_P": info, "logits": info}, num_iters=5, eps=1e-6, grad_mode="implicit",
                    convention="deepseek")
    b = S._plan_bwd({"grad_P": info, "logits": info},
                    settings=LayerSettings.resolve("deepseek", num_iters=5, eps=1e-6, grad_mode="implicit"))
    G = np.ones((3, 4, 4))
    L0 = np.arange(48.0).reshape(3, 4, 4) / 10
    np.testing.assert_array_equal(a.reference({"grad_P": G, "logits": L0})[0], b.reference({"grad_P": G, "logits": L0})[0])
    for k in ("sinkhorn_knopp_fwd", "sinkhorn_knopp_bwd", "mhc_pre_op_fwd", "mhc_pre_op_bwd", "mhc_layer_pre_fwd",
              "mhc_layer_pre_bwd"):
        assert getattr(SPECS[k].planner, "takes_settings", False), k
    assert SPECS["mhc_pre_op_fwd"].planner is P._plan_fwd and SPECS["mhc_layer_pre_bwd"].planner is L._plan_pre_bwd


def _spy_plans(monkeypatch):
    seen = []
    real = _dispatch._plan

    def spy(planner, infos, params):
        seen.append((planner.__name__, params))
        return real(planner, infos, params)

    monkeypatch.setattr(_dispatch, "_plan", spy)
    return seen


def test_the_module_settings_reach_the_plan_key(monkeypatch, rng):
    """MHC resolves its settings in the constructor; forward and backward hand that one object to the
    fused pieces' planners (the plan cache key), not seven values resolved again."""
    torch = pytest.importorskip("torch")
    from mhc_cupy.torch import MHC

    layer = MHC(8, 4, torch.nn.Tanh(), eps=1e-7, convention="deepseek", grad_mode="implicit")
    assert layer.settings == LayerSettings.resolve("deepseek", eps=1e-7, grad_mode="implicit")
    assert (layer.num_iters, layer.eps, layer.rms_eps, layer.hc_eps) == (20, 1e-7, 1e-6, 1e-6)
    seen = _spy_plans(monkeypatch)
    layer(torch.randn(3, 4, 8, requires_grad=True)).sum().backward()
    settings = [p["settings"] for name, p in seen if "settings" in p]
    assert {name for name, p in seen if "settings" in p} == {"_plan_pre_fwd", "_plan_pre_bwd"}, seen
    assert all(s is layer.settings for s in settings), settings



def test_the_adapter_settings_reach_the_plan_key(monkeypatch, rng):
    """mhc_cupy.torch.mhc_pre_op / sinkhorn_knopp resolve their keywords once; the forward and the
    backward plans key on that value."""
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt

    seen = _spy_plans(monkeypatch)
    logits = torch.randn(3, 4, 4, requires_grad=True)
    mt.sinkhorn_knopp(logits, 5, grad_mode="implicit", convention="deepseek").sum().backward()
    want = LayerSettings.resolve("deepseek", num_iters=5, grad_mode="implicit")
    assert [p for _, p in seen] == [{"settings": want}] * 2, seen
