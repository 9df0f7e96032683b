"""Framework-free pieces of a stack of mHC layers with stream recompute (paper section 4.3,
docs/OPS.md section 12), shared by :mod:`mhc_cupy.torch.stack` (``MHCStack``) and
:mod:`mhc_cupy._jax_stack` (``mhc_cupy.jax.mhc_stack``)."""

from __future__ import annotations

import math
import numbers
from typing import Optional


def recompute_blocks(recompute, n: int, L: int) -> Optional[int]:
    """L_r, the layers per recompute block, for ``recompute`` None (no recompute), a positive
    int (Python or NumPy), or "auto" (the paper's L_r* = sqrt(n L / (n + 2)) rounded, at least 1, section 4.3;
    the blocks a stack makes of it: :func:`block_sizes`).

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


def block_sizes(recompute, n: int, L: int) -> Optional[tuple]:
    """The number of layers in each recompute block, first block to last (summing to L), or None where
    nothing is recomputed (:func:`recompute_blocks` is None).

    An int L_r: blocks of L_r layers, the last one of the 1 .. L_r layers left.  ``"auto"``: B blocks,
    B = ceil(L / L_r*) for the paper's L_r* (or more, where B (B + 1) / 2 < L), sized to shrink toward
    the output: block k (0 = the first) holds at most B - k layers, as many as that allows from the first
    block on, one at least.  The backward starts at the output, where every sublayer's activations are
    still held (a model's peak): there the stack holds its B - 1 boundary streams and rebuilds none
    (blocks of L_r* layers: as many boundaries and L_r* - 1 rebuilt streams); at block k's last layer it
    holds k boundaries and at most B - k - 1 rebuilt streams, no more than at the output.  The number of
    streams rebuilt, L - B, is the paper's or fewer.
    """
    L_r = recompute_blocks(recompute, n, L)
    if L_r is None or L < 1:  # (L = 0: a stack whose layers were all deleted)
        return None
    B = -(-L // L_r)
    if recompute != "auto":
        return (L_r,) * (B - 1) + (L - L_r * (B - 1),)
    while B * (B + 1) // 2 < L:
        B += 1
    sizes, left = [], L
    for k in range(B):  # as many layers as block k may hold, leaving one for each block after it
        sizes.append(min(B - k, left - (B - k - 1)))
        left -= sizes[-1]
    return tuple(sizes)
