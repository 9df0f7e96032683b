"""Framework-free pieces of a stack of mHC layers with stream recompute (paper section 4.3,
docs/OPS.md section 12), shared by :mod:`mhc_cupy.torch.stack` (``MHCStack``) and
:mod:`mhc_cupy._jax_stack` (``mhc_cupy.jax.mhc_stack``)."""

from __future__ import annotations

import math
import numbers
from typing import Optional


def recompute_blocks(recompute, n: int, L: int) -> Optional[int]:
    """L_r, the layers per recompute block, for ``recompute`` None (no recompute), a positive
    int (Python or NumPy), or "auto" (the paper's L_r* = sqrt(n L / (n + 2)) rounded, at least 1, section 4.3).

    Returns None where nothing is recomputed (None, or L_r = 1: every layer is a boundary).

    Raises:
        ValueError / TypeError: ``recompute`` is none of those.
    """
    if recompute is None:
        return None
    if isinstance(recompute, str):
        if recompute != "auto":
            raise ValueError(f"recompute must be None, a positive int or 'auto', got {recompute!r}")
        L_r = max(1, round(math.sqrt(n * L / (n + 2))))
    elif isinstance(recompute, bool) or not isinstance(recompute, numbers.Integral):
        raise TypeError(f"recompute must be None, a positive int or 'auto', got {type(recompute).__name__} "
                        f"{recompute!r}")
    elif recompute < 1:
        raise ValueError(f"recompute must be None, a positive int or 'auto', got {recompute}")
    else:
        L_r = int(recompute)
    return L_r if L_r > 1 else None
