"""Launch-plan helpers shared by the op modules: C++ type names, vector
widths, block sizes, and scalar wrapping (every kernel scalar is a NumPy
scalar of its C type: ``i32`` int, ``i64`` long long, ``f32`` float;
``_jit.launch`` refuses a bare Python float or small int)."""

from __future__ import annotations

import functools
import math

import numpy as np

from .._jit import launch  # noqa: F401 - the op modules import it from here

CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_GRID = 2**31 - 1
MAX_THREADS = 256


def i32(v) -> np.int32:
    return np.int32(v)


def i64(v) -> np.int64:
    return np.int64(v)


def f32(v) -> np.float32:
    return np.float32(v)


def tokens_of(lead: tuple) -> int:
    return int(math.prod(lead))


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def vec_width(n: int, C: int, tensors, budget: int = 32) -> int:
    """Elements per thread access E (a power of two).

    ``tensors``: [(pointer, dtype name)] of every activation tensor the kernel
    reads or writes in rows of C.  E = 1 is the general path; a wider E needs
    C % E == 0 and every pointer aligned to its E-element access (at most 16
    bytes), and keeps n * E <= ``budget`` so the per-thread registers stay
    bounded for large n.
    """
    return _vec_width(n, C, tuple((p & 15, dt) for p, dt in tensors if p is not None), budget)


@functools.lru_cache(maxsize=4096)
def _vec_width(n: int, C: int, tensors: tuple, budget: int) -> int:
    smallest = min(ITEMSIZE[dt] for _, dt in tensors)
    e = min(16 // smallest, _pow2_floor(max(budget // max(n, 1), 1)))
    while e > 1:
        if C % e == 0 and all(p % min(e * ITEMSIZE[dt], 16) == 0 for p, dt in tensors):
            return e
        e //= 2
    return 1


def vec8(C: int, *ptrs) -> bool:
    """Rows of C 16-bit elements read 8 at a time (16-byte accesses): C % 8 == 0 and every given
    pointer 16-byte aligned (None: absent)."""
    return C % 8 == 0 and all(p % 16 == 0 for p in ptrs if p is not None)


@functools.lru_cache(maxsize=4096)
def threads_for(C: int, E: int) -> int:
    """Block size (multiple of 32, <= 256) that splits a row of C/E accesses evenly."""
    vecs = max(1, -(-C // E))
    rounds = -(-vecs // MAX_THREADS)
    per_round = -(-vecs // rounds)
    return max(32, min(MAX_THREADS, -(-per_round // 32) * 32))


def grid_for(tokens: int) -> tuple:
    return (min(tokens, MAX_GRID), 1, 1)


def launch_grid_stride(filename: str, expr: str, count: int, args, stream) -> None:
    """Launch a 1-D grid-stride kernel over count items: MAX_THREADS-thread blocks, at most 4096 of them."""
    launch(filename, expr, (max(1, min(-(-count // MAX_THREADS), 4096)), 1, 1), (MAX_THREADS, 1, 1), args, stream)


def column_sum(part_ptr, out_ptr, rows: int, cols: int, stream) -> None:
    """out[c] = sum_r part[r, c] in a fixed order (deterministic; the order depends on the shape only)."""
    if cols <= 32 and rows > 256:  # a sum over tokens of a few per-token terms: all 1024 threads on them
        launch("stream.cu", "mhc_column_sum_narrow_kernel", (1, 1, 1), (1024, 1, 1),
               (part_ptr, out_ptr, i64(rows), i32(cols)), stream)
        return
    if rows <= 64:  # the same bits as the kernel below with ty = 8, one thread per column
        launch_grid_stride("stream.cu", "mhc_column_sum_few_kernel", cols, (part_ptr, out_ptr, i64(rows), i32(cols)),
                           stream)
        return
    ty = 32 if rows > 256 else 8  # tall: more threads per column
    launch("stream.cu", "mhc_column_sum_kernel", (-(-cols // 32), 1, 1), (32, ty, 1),
           (part_ptr, out_ptr, i64(rows), i32(cols)), stream)
