"""Which variant runs where the library has more than one for a job: :class:`KernelChoice`, put in
force for a block by :func:`kernel_choice`.

The library picks its kernels and its layer path itself (the measured choice).  A benchmark or a
test that times or compares the alternatives states the ones it wants as one frozen value, in
force for a block, instead of assigning module state:

    with kernel_choice(wg_fwd=False, fused=False):
        layer = MHC(C, n)   # the separate ops
        out = layer(x)      # the coefficient GEMM on mma.sync

The variants (each ``None``: the library's choice, :data:`LIBRARY_CHOICE`; ``True``: the variant
wherever it applies; ``False``: never):

* ``wg_fwd``: the coefficient path's forward GEMM on wgmma (``mhc_coeffs_wg_fwd_kernel``: bf16 x,
  K >= ``ops.coeffs.fwd._WG_MIN_K``, a device with wgmma), else on mma.sync.
* ``wg_dx``: the coefficient backward's dx on wgmma (``mhc_coeffs_wg_dx_kernel``: bf16 x, n = 5 .. 9,
  aligned arrays, a device with wgmma; ``ops.coeffs.split_bwd``), else the mma.sync dx kernels.
* ``fused``: :class:`mhc_cupy.torch.MHC` runs the fused layer pieces (OPS.md section 9), else the
  separate ops (coefficients -> pre op -> sublayer -> post op).
* ``boundary``: ``mhc_boundary_fwd`` runs ``mhc_boundary_fwd_kernel`` (the post op and the next
  coefficient GEMM in one pass; n <= 6, C % 8 == 0, aligned), else the two ops' kernels.  Off by
  default: checked correct on the H200, slower there than the two ops' kernels (OPS.md section 12).
* ``small``: the small-token forward (at most 64 tokens): the coefficient GEMM on CUDA cores, phi
  read as float32 (``mhc_coeffs_gemv_fwd_kernel``, no bf16 planes pass; ``ops.coeffs.fwd.gemv_layout``)
  and the layer's pre piece after it (finish, Sinkhorn, activations, aggregate) in one kernel
  (``mhc_layer_pre_tail_kernel``): ``mhc_layer_pre_fwd`` in two launches; the post op's forward then splits a
  token's columns over several blocks (``ops._launch.column_blocks``, as the tail kernel does wherever it
  runs; the same bits).  Else the tensor-core GEMM
  and the separate kernels.  Off by default: checked correct on the H200, slower there under CUDA graphs
  (benchmarks/h200_small.md: 38.7 against 32.1 us at one token).
* ``tail``: at most 64 tokens, the pre piece after the tensor-core GEMM in one launch: the small path's
  ``mhc_layer_pre_tail_kernel`` (finish, Sinkhorn, activations, aggregate; the three kernels' bits) after
  the default GEMM, so ``mhc_layer_pre_fwd`` takes three launches (phi's planes, the GEMM, the tail)
  instead of five, with the default path's bits; the post op's forward splits a token's columns over
  several blocks as under ``small``.  Off by default until bench --small has measured it.
* ``layer_in``: ``mhc_layer_pre_norm_fwd`` / ``mhc_layer_pre_fp8_fwd`` (OPS.md section 13) run their
  kernel (``mhc_stream_aggregate_out_kernel``) on the GPU; else they raise NotImplementedError there
  (no other GPU route; CPU inputs run the reference either way).  Off by default until a GPU run has
  checked the kernel.
* ``post_pipe``: the post op's backward with x and y on CUDA cores (n <= 4, 16-bit arrays, 16-byte
  vectors: ``mhc_layer_post_bwd`` / ``mhc_post_op_bwd``) loads each thread's next chunks through a cp.async
  ring (``mhc_stream_mix_distribute_bwd_kernel`` with STAGES: loads of the next token in flight during this
  token's block reduction), the same bits.  Off by default until the H200 has checked and measured it.
* ``boundary_bwd``: the fused boundary backward (OPS.md section 12): ``MHCStack(fuse_boundaries=True)``'s
  backward hands each layer's dy to the previous layer from the next layer's dx kernel and moves the post
  op's coefficient gradients into the layer's pre-piece backward (``mhc_boundary_bwd``,
  ``mhc_layer_pre_bwd(layer_out=...)``); on a GPU those two ops' new paths (``mhc_coeffs_mma_bwd_dy_kernel``,
  ``mhc_layer_post_pre_bwd_kernel``) run only under it, else NotImplementedError (CPU inputs run the reference
  either way).  Off by default: its GPU tests pass on the H200, but the sanitizers have not run on it and
  the fused backward measured slower there (benchmarks/h200_stack.md).
* ``lane``: a repeated :class:`mhc_cupy.torch.MHC` call without autograd (decoding) queues the general
  route's recorded launches itself, its coefficients and temporaries in one buffer
  (:mod:`mhc_cupy.torch._no_grad`: the same kernels and bits, half the host work, three allocations
  instead of seven).  Off by default until a GPU run has checked it (its launches are checked equal to
  the general route's on the CPU).  Read at each call.

When it is read: once, when what runs the kernels is built.  The coefficient path's layouts
(``ops.coeffs.fwd.mma_layout``, ``ops.coeffs.split_bwd.SplitBwd``) read ``wg_fwd`` / ``wg_dx`` when
a plan is made, and every plan cache keys on the choice in force: :mod:`mhc_cupy._dispatch` (plans
and the fast path's recorded launches) and :mod:`mhc_cupy._jax_kernels` (captured when JAX traces,
so a jitted function keeps the choice it was traced under).  The eager PyTorch ops' backward runs under
the choice its forward ran under (:func:`restored`), wherever autograd runs it.  ``MHC`` reads ``fused`` when it is
constructed (its forward may be traced by torch.compile, which cannot read a context variable): a
layer built outside the block keeps the library's path inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

__all__ = ["KernelChoice", "LIBRARY_CHOICE", "current", "kernel_choice", "restored"]

#: What ``None`` means for each variant: the library's own choice.
LIBRARY_CHOICE = {"wg_fwd": True, "wg_dx": True, "fused": True, "boundary": False, "small": False,
                  "layer_in": False, "boundary_bwd": False, "tail": False,
                  "post_pipe": False, "lane": False}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The variants asked for (see the module docstring); hashable, a plan-cache key as it is.

    Attributes:
        wg_fwd, wg_dx, fused, boundary, small, layer_in, boundary_bwd, tail, post_pipe, lane: True, False or None
            (default: the library's choice).

    Raises:
        TypeError: a variant that is not True, False or None (named).
    """

    wg_fwd: bool | None = None
    wg_dx: bool | None = None
    fused: bool | None = None
    boundary: bool | None = None
    small: bool | None = None
    layer_in: bool | None = None
    boundary_bwd: bool | None = None
    tail: bool | None = None
    post_pipe: bool | None = None
    lane: bool | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"KernelChoice.{f.name} must be True, False or None (the library's choice), "
                                f"got {v!r}")

    def runs(self, variant: str) -> bool:
        """Whether ``variant`` (a key of :data:`LIBRARY_CHOICE`) runs where it
        applies: its value, or for None :data:`LIBRARY_CHOICE`'s.  ValueError: not a variant."""
        if variant not in LIBRARY_CHOICE:
            raise ValueError(f"variant must be one of {', '.join(LIBRARY_CHOICE)}, got {variant!r}")
        v = getattr(self, variant)
        return LIBRARY_CHOICE[variant] if v is None else v


_CURRENT: contextvars.ContextVar[KernelChoice] = contextvars.ContextVar("mhc_cupy_kernel_choice",
                                                                        default=KernelChoice())


def current() -> KernelChoice:
    """The choice in force (outside any :func:`kernel_choice` block: ``KernelChoice()``, the library's)."""
    return _CURRENT.get()


def restored(choice: KernelChoice | None):
    """A context in which ``choice``, what :func:`current` gave a forward, is in force again: for its
    backward, which may run where the forward's block is not (after it, or in another thread: PyTorch
    runs a CUDA backward in its device thread, which does not see the caller's context variables).
    Free where ``choice`` is already in force (the usual case: both the library's) or None (not
    captured: a forward traced by torch.compile, which cannot read a context variable)."""
    return contextlib.nullcontext() if choice is None or choice is _CURRENT.get() else kernel_choice(choice)


@contextlib.contextmanager
def kernel_choice(choice: KernelChoice | None = None, **variants):
    """Within the block (this thread, this task), ``choice`` with ``variants`` replaced is in force;
    ``choice`` None: the one in force with ``variants`` replaced.  Yields the choice.

    Raises:
        TypeError: a variant that is not a field of :class:`KernelChoice`, or not True, False or None.
    """
    base = current() if choice is None else choice
    if not isinstance(base, KernelChoice):
        raise TypeError(f"choice must be a KernelChoice or None, got {type(base).__name__}")
    token = _CURRENT.set(dataclasses.replace(base, **variants))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
