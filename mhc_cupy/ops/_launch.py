"""Launch-plan helpers shared by the op modules: C++ type names, vector
widths, block sizes, scalar wrapping (every kernel scalar is a NumPy
scalar of its C type: ``i32`` int, ``i64`` long long, ``f32`` float;
``_jit.launch`` refuses a bare Python float or small int), and
:class:`KernelSpec`, a kernel's typed launch description."""

from __future__ import annotations

import functools
import inspect
import keyword
import math
import re

import numpy as np

from .._jit import launch  # noqa: F401 - the op modules import it from here

CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
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


def grid_for(tokens: int, column_blocks: int = 1) -> tuple:
    """One block per token (grid-stride past MAX_GRID), each token's columns split over ``column_blocks``."""
    return (min(tokens, MAX_GRID), column_blocks, 1)


#: Blocks that a forward kernel without reductions over columns aims at when it splits a token's columns
#: over several blocks (mhc::first_col; a few tokens, kernel choice small): two an SM of the H200's 132.
SPLIT_BLOCKS = 264


def column_blocks(tokens: int, C: int, E: int, threads: int) -> int:
    """gridDim.y for such a kernel: about SPLIT_BLOCKS blocks in all, at most one per round of the block's
    threads over a row (each thread then takes one E-column piece of it, where the row allows)."""
    rounds = -(-max(1, -(-C // E)) // threads)
    return max(1, min(rounds, -(-SPLIT_BLOCKS // max(tokens, 1))))


def grid_stride(count: int) -> tuple[tuple, tuple]:
    """(grid, block) of a 1-D grid-stride kernel over count items: MAX_THREADS-thread blocks, at most 4096."""
    return (max(1, min(-(-count // MAX_THREADS), 4096)), 1, 1), (MAX_THREADS, 1, 1)


def launch_grid_stride(filename: str, expr: str, count: int, args, stream) -> None:
    """Launch a 1-D grid-stride kernel over count items (:func:`grid_stride`)."""
    launch(filename, expr, *grid_stride(count), args, stream)


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


# ------------------------------------------------------------------ typed launch descriptions
#: NumPy type of each scalar C type a kernel takes (``mhc::i64`` is long long).
_SCALARS = {"int": np.int32, "unsigned": np.uint32, "i64": np.int64, "long long": np.int64, "float": np.float32}
#: (min, max) of each integer C type's NumPy type (np.iinfo made at each argument cost a microsecond a call)
_RANGES = {t: (int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in set(_SCALARS.values()) if t is not np.float32}
_REALS = (int, float, np.integer, np.floating)
_INTS = (int, np.integer)
_BOOLS = (bool, np.bool_)
_DECL = re.compile(r"^(.*?)\s*\b(\w+)$")
#: Every KernelSpec by kernel name (tests compare them with the kernels' C++ declarations).
KERNEL_SPECS: dict = {}


def _decls(text: str) -> tuple:
    """((C type, name), ...) of a comma-separated C++ declaration list, ``__restrict__`` dropped and
    blanks normalised."""
    out = []
    for d in filter(None, (d.replace("__restrict__", " ").strip() for d in text.split(","))):
        ctype, name = _DECL.match(d).groups()
        out.append((re.sub(r"\s*\*", "*", " ".join(ctype.split())), name))
    return tuple(out)


class KernelSpec:
    """A kernel's typed launch description, from which its NVRTC name expression, its argument
    tuple and its dynamic shared memory are derived.

    Args:
        file: its source, ``kernels_cu/<file>``.
        name: the ``__global__`` function.
        template: its template parameters as declared, e.g. ``"typename T, bool VEC, int NT"`` (kinds
            ``typename`` (given as a dtype name: "bfloat16", "float16", "float32"), ``bool``, ``int``).
        params: its parameters as declared without ``__restrict__``, e.g. ``"const T* x, float* out,
            i64 tokens, int C, float eps"``: pointers (a Python int, or None where listed in
            ``nullable``), ``int`` / ``unsigned`` (32 bits), ``i64``, ``float`` (32 bits).
        nullable: pointer parameters that may be None (a null pointer the kernel checks for).
        smem: (bytes, C++ function) of a kernel with dynamic shared memory: ``bytes(**template values)``
            (it names the template parameters it needs) is what a launch allocates, and the C++
            ``constexpr int`` function template (the kernel's own template parameters) is what the
            kernel lays out (the kernel static_asserts against it; tests compare the two).

    Raises:
        ValueError: a declaration that does not parse, or a nullable name that is no pointer parameter.
    """

    def __init__(self, file: str, name: str, template: str = "", params: str = "", *, nullable=(), smem=None):
        self.file, self.name = file, name
        self.template, self.params = _decls(template), _decls(params)
        for kind, t in self.template:
            if kind not in ("typename", "bool", "int"):
                raise ValueError(f"{name}: template parameter {t} is a {kind}; KernelSpec knows typename, bool, int")
        for ctype, p in self.params:
            if not ctype.endswith("*") and ctype not in _SCALARS:
                raise ValueError(f"{name}: parameter {p} has C type {ctype!r}; KernelSpec knows pointers and "
                                 f"{list(_SCALARS)}")
        for p in (*(t for _, t in self.template), *(p for _, p in self.params)):
            if keyword.iskeyword(p):
                raise ValueError(f"{name}: {p} is a Python keyword; give the kernel's parameter another name")
        pointers = {p for ctype, p in self.params if ctype.endswith("*")}
        if not set(nullable) <= pointers:
            raise ValueError(f"{name}: nullable {sorted(set(nullable) - pointers)} are not pointer parameters")
        self.nullable = frozenset(nullable)
        self._names = frozenset(p for _, p in self.params)
        # per parameter, what pack checks: (name, C type, None for a pointer or the NumPy scalar type)
        self._packing = tuple((p, ctype, None if ctype.endswith("*") else _SCALARS[ctype]) for ctype, p in self.params)
        self.smem_bytes, self.smem_cxx = smem if smem else (None, None)
        self._smem_args = tuple(inspect.signature(self.smem_bytes).parameters) if smem else ()
        if not set(self._smem_args) <= {t for _, t in self.template}:
            raise ValueError(f"{name}: the shared-memory function takes {self._smem_args}, not template parameters")
        self._bound: dict = {}
        KERNEL_SPECS[name] = self

    def smem(self, **values) -> int:
        """Dynamic shared bytes for these template values (only those the bytes function names)."""
        return self.smem_bytes(**values) if self.smem_bytes else 0

    def bind(self, **values) -> "BoundKernel":
        """The specialisation with these template values (every template parameter, by name).

        Raises:
            TypeError: a template parameter missing, unknown or of the wrong type.
        """
        names = [t for _, t in self.template]
        if set(values) != set(names):
            raise TypeError(f"{self.name} takes template parameters {names}; missing "
                            f"{sorted(set(names) - set(values))}, unknown {sorted(set(values) - set(names))}")
        key = tuple((type(values[t]), values[t]) for t in names)  # (True and 1 are equal keys otherwise)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._bind(values)
        return bound

    def _bind(self, values: dict) -> "BoundKernel":
        parts = []
        for kind, t in self.template:
            v = values[t]
            if kind == "typename" and v in CTYPE:
                parts.append(CTYPE[v])
            elif kind == "bool" and isinstance(v, bool):
                parts.append("true" if v else "false")
            elif kind == "int" and isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                parts.append(str(int(v)))
            else:
                need = {"typename": f"a dtype name of {list(CTYPE)}", "bool": "a bool", "int": "an int"}[kind]
                raise TypeError(f"{self.name}: template parameter {t} is {v!r}; it needs {need}")
        expr = f"{self.name}<{','.join(parts)}>" if parts else self.name
        smem = self.smem(**{t: values[t] for t in self._smem_args})
        return BoundKernel(self, expr, smem)

    def launch(self, grid, block, stream, /, **args) -> None:
        """Launch a kernel without template parameters (:meth:`BoundKernel.launch`)."""
        self.bind().launch(grid, block, stream, **args)

    def launch_grid_stride(self, count: int, stream, /, **args) -> None:
        """Launch a kernel without template parameters over count items (:meth:`BoundKernel.launch_grid_stride`)."""
        self.bind().launch_grid_stride(count, stream, **args)

    def pack(self, expr: str, args: dict) -> tuple:
        """The kernel's argument tuple from its arguments by name: pointers as given (None: null),
        scalars as NumPy scalars of their C type.

        Raises:
            TypeError: an argument missing, unknown, or of the wrong type (a pointer that is not an
                int, or None where the kernel needs one; a scalar that is not an int / a real number).
            ValueError: an integer outside its C type's range.
        """
        if len(args) != len(self._names) or not self._names.issuperset(args):
            names = [p for _, p in self.params]
            raise TypeError(f"{expr} takes arguments {names}; missing {sorted(set(names) - set(args))}, "
                            f"unknown {sorted(set(args) - set(names))}")
        out = []
        for p, ctype, t in self._packing:
            v = args[p]
            if t is None:  # a pointer
                if v is None and p in self.nullable or isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    out.append(v)
                    continue
                need = "a device pointer (int)" + (" or None" if p in self.nullable else "")
            elif isinstance(v, _BOOLS):
                need = f"a {'real number' if t is np.float32 else 'Python or NumPy int'} (C type {ctype})"
            elif t is np.float32:
                if isinstance(v, _REALS):
                    out.append(np.float32(v))
                    continue
                need = f"a real number (C type {ctype})"
            else:
                if isinstance(v, _INTS):
                    lo, hi = _RANGES[t]
                    if not lo <= v <= hi:
                        raise ValueError(f"{expr}: argument {p} = {v} does not fit its C type {ctype}")
                    out.append(t(v))
                    continue
                need = f"a Python or NumPy int (C type {ctype})"
            raise TypeError(f"{expr}: argument {p} is {v!r} ({type(v).__name__}); it needs {need}")
        return tuple(out)


class BoundKernel:
    """One specialisation of a :class:`KernelSpec`: its name expression and dynamic shared memory."""

    def __init__(self, spec: KernelSpec, expr: str, smem: int):
        self.spec, self.expr, self.smem = spec, expr, smem

    def launch(self, grid, block, stream, /, **args) -> None:
        """Launch it on ``stream`` with its arguments by name (:meth:`KernelSpec.pack`) and its
        dynamic shared memory."""
        launch(self.spec.file, self.expr, grid, block, self.spec.pack(self.expr, args), stream, self.smem)

    def launch_grid_stride(self, count: int, stream, /, **args) -> None:
        """Launch it as a 1-D grid-stride kernel over count items (:func:`grid_stride`)."""
        self.launch(*grid_stride(count), stream, **args)
