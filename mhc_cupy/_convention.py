"""The two conventions of the mHC maths (OPS.md section 10, "DeepSeek-V4 convention") and their defaults.

``convention="paper"`` (the default everywhere) is OPS.md sections 1-9 as written;
``convention="deepseek"`` is the maths of the models trained with mHC (DeepSeek-V4 and its
reproductions): a softmax start of the Sinkhorn iteration, H_pre = sigmoid + hc_eps, and the
post op with H_res transposed.  A setting the caller did not give has the default
:data:`DEFAULT` in every public signature; :func:`resolve` (the one place that knows the
values) replaces it with the convention's.  An explicit None is not a default: it stays an
error (``TypeError`` naming the argument).  No framework and no op module is imported here,
so the NumPy reference can use it too.
"""

from __future__ import annotations

import numpy as np

from . import _checks

CONVENTIONS = ("paper", "deepseek")


class _Default:
    """The default of a setting (num_iters, eps, rms_eps, hc_eps, post_mult): the convention's value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFAULT"

    def __reduce__(self):  # one instance, also through pickle / deepcopy
        return "DEFAULT"


#: The default of every convention-dependent setting in the public signatures.
DEFAULT = _Default()

#: Types of the setting values a cache may key on: immutable and hashed by value (DEFAULT too). Any other
#: value is read afresh each call: a 0-d torch tensor is an int to num_iters (``__index__``) but hashes by
#: identity and may change in place between two calls, which then got the first call's result.
KEY_TYPES = (bool, int, float, str, type(None), np.generic, _Default)
#: The usual ones (a frozenset: one C call checks a call's values; NumPy scalars take the isinstance test).
EXACT_KEY_TYPES = frozenset(t for t in KEY_TYPES if t is not np.generic)

#: Default of each setting under each convention (OPS.md, the defaults tables).
DEFAULTS = {
    "paper": {"num_iters": 20, "eps": 1e-8, "rms_eps": 1e-5, "hc_eps": 0.0, "post_mult": 2.0},
    "deepseek": {"num_iters": 20, "eps": 1e-6, "rms_eps": 1e-6, "hc_eps": 1e-6, "post_mult": 2.0},
}


def check(convention) -> str:
    """``convention`` itself: "paper" or "deepseek"; anything else raises ValueError naming it."""
    if not isinstance(convention, str) or convention not in CONVENTIONS:
        raise ValueError(f"convention must be 'paper' or 'deepseek', got convention={convention!r}")
    return convention


def resolve(convention, **settings):
    """The given settings (keyword order) with each :data:`DEFAULT` replaced by the convention's value.

    ``resolve("deepseek", num_iters=DEFAULT, eps=1e-7)`` -> ``(20, 1e-7)``; a single setting
    gives a single value.  Raises ValueError for a bad convention.
    """
    defaults = DEFAULTS[check(convention)]
    values = tuple(defaults[k] if v is DEFAULT else v for k, v in settings.items())
    return values[0] if len(values) == 1 else values


def sinkhorn(convention, num_iters, eps) -> tuple:
    """(num_iters, eps, deepseek), resolved (DEFAULT: the convention's) and checked: under "deepseek" the
    softmax start is the first row step, so num_iters must be >= 1 (ValueError otherwise)."""
    num_iters, eps = resolve(convention, num_iters=num_iters, eps=eps)
    iters, eps = _checks.num_iters(num_iters), _checks.eps("eps", eps)
    if convention == "deepseek" and iters < 1:
        raise ValueError(f"num_iters must be >= 1 under convention='deepseek' (the softmax start is the first "
                         f"row step), got {iters}")
    return iters, eps, convention == "deepseek"


def activations(convention, hc_eps, post_mult) -> tuple:
    """(hc_eps, post_mult) of the pre op's H_pre = sigmoid + hc_eps and H_post = post_mult sigmoid,
    resolved (DEFAULT: the convention's) and checked (finite reals >= 0)."""
    hc_eps, post_mult = resolve(convention, hc_eps=hc_eps, post_mult=post_mult)
    return _checks.eps("hc_eps", hc_eps), _checks.eps("post_mult", post_mult)


def rms_eps(convention, value, name: str = "rms_eps") -> float:
    """The coefficient path's RMS eps, resolved (DEFAULT: the convention's) and checked."""
    return _checks.eps(name, resolve(convention, rms_eps=value))
