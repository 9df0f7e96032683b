"""The settings of an mHC layer, resolved once: :class:`LayerSettings`.

An mHC layer (and each op of it that takes them: Sinkhorn, the pre op, the fused layer pieces)
has seven settings: ``num_iters``, ``eps`` (Sinkhorn), ``rms_eps`` (the coefficient path),
``grad_mode`` (the Sinkhorn backward), ``convention`` ("paper" / "deepseek", OPS.md
"DeepSeek-V4 convention"), ``hc_eps`` and ``post_mult`` (the pre op's activations).
:meth:`LayerSettings.resolve` checks what the caller gave and fills what it left out
(:data:`mhc_cupy._convention.DEFAULT`) with the convention's defaults, once; the frozen value it
returns is what the modules (``mhc_cupy.torch.MHC``), the adapters (``mhc_cupy.torch``,
``mhc_cupy.jax``), the planners (``ops.sinkhorn``, ``ops.pre``, ``ops.layer``) and the plan
caches take.  Hashable, so it is a plan-cache key and a static JAX argument as it is.

Where primitives are needed (a ``torch.library`` custom operator's arguments: the one place is
:func:`mhc_cupy._adapter.flat`), :meth:`LayerSettings.values` flattens it; :func:`takes_settings`
lets a planner take the primitives back (the functional API's keywords, a custom operator), and
:func:`filled` gives them, unchecked, to a caller that cannot check yet (code traced by
torch.compile).  No framework is imported here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import _checks, _convention
from ._convention import DEFAULT

__all__ = ["LayerSettings", "takes_settings", "filled"]


@dataclass(frozen=True)
class LayerSettings:
    """The resolved settings of an mHC layer (defaults: the paper convention's).

    Attributes:
        num_iters: Sinkhorn iterations, int in 0..``MAX_NUM_ITERS`` (>= 1 under "deepseek").
        eps: Sinkhorn eps, float >= 0.  rms_eps: the coefficient path's eps, float >= 0.
        grad_mode: the Sinkhorn backward, "unrolled" or "implicit".
        convention: "paper" or "deepseek".
        hc_eps: added to H_pre, float >= 0.  post_mult: H_post's factor, float >= 0.

    Build it with :meth:`resolve` (which checks); the constructor takes the values as they are.
    """

    num_iters: int = 20
    eps: float = 1e-8
    rms_eps: float = 1e-5
    grad_mode: str = "unrolled"
    convention: str = "paper"
    hc_eps: float = 0.0
    post_mult: float = 2.0

    @classmethod
    def resolve(cls, convention="paper", *, num_iters=DEFAULT, eps=DEFAULT, rms_eps=DEFAULT, grad_mode="unrolled",
                hc_eps=DEFAULT, post_mult=DEFAULT) -> "LayerSettings":
        """The settings given, checked, with each one left out (DEFAULT) the convention's default.

        Returns:
            LayerSettings (num_iters an int, the eps values and post_mult floats).

        Raises:
            ValueError: convention not "paper" / "deepseek"; num_iters out of range (or 0 under
            "deepseek"); eps / rms_eps / hc_eps / post_mult negative or not finite; grad_mode
            not "unrolled" / "implicit".  TypeError: num_iters not an int, an eps not a real
            number (None included).  Each error names the argument.
        """
        values = (convention, num_iters, eps, rms_eps, grad_mode, hc_eps, post_mult)
        if _convention.EXACT_KEY_TYPES.issuperset(map(type, values)) or \
                all(isinstance(v, _convention.KEY_TYPES) for v in values):
            return _resolved(*values)
        return _resolve(*values)  # not a cache key (an unhashable value, a tensor): uncached (its check names it)

    @property
    def deepseek(self) -> bool:
        """Whether the DeepSeek-V4 maths applies (the Sinkhorn softmax start, H_res transposed)."""
        return self.convention == "deepseek"

    def values(self, names) -> tuple:
        """The values of the settings ``names`` (e.g. a custom operator's parameters), in that order."""
        return tuple(getattr(self, k) for k in names)


def _resolve(convention, num_iters, eps, rms_eps, grad_mode, hc_eps, post_mult) -> LayerSettings:
    iters, eps, _ = _convention.sinkhorn(convention, num_iters, eps)  # checks the convention first
    rms_eps = _convention.rms_eps(convention, rms_eps)
    grad_mode = _checks.grad_mode(grad_mode)
    hc_eps, post_mult = _convention.activations(convention, hc_eps, post_mult)
    return LayerSettings(iters, eps, rms_eps, grad_mode, convention, hc_eps, post_mult)


# typed: num_iters=True must not hit the entry of num_iters=1 (nor eps=1 that of eps=1.0)
_resolved = functools.lru_cache(maxsize=1024, typed=True)(_resolve)


def filled(convention="paper", **given) -> dict:
    """The settings given (and the convention), each DEFAULT replaced by the convention's default,
    otherwise unchecked (the convention is: ValueError): for a caller whose values may not be
    concrete (a function traced by torch.compile), with the checks to come (a custom operator's
    fake function resolves them)."""
    defaults = _convention.DEFAULTS[_convention.check(convention)]
    return {"convention": convention, **{k: defaults[k] if v is DEFAULT else v for k, v in given.items()}}


def takes_settings(plan):
    """A planner ``plan(infos, settings)`` as an op table's planner ``planner(infos, **params)``.

    The returned planner takes either ``settings=`` a :class:`LayerSettings` (the adapters: the
    plan cache keys on it) or the op's parameters by name as primitives (the functional API's
    keywords, a custom operator's arguments, the op spec's defaults), which it resolves with
    :meth:`LayerSettings.resolve` first (the checks and their errors are those of ``resolve``).
    """

    @functools.wraps(plan)
    def planner(infos, settings: LayerSettings | None = None, **params):
        return plan(infos, LayerSettings.resolve(**params) if settings is None else settings)

    planner.takes_settings = True
    return planner
