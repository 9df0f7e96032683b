"""``MHCStack``: a network's sequence of mHC layers, with stream recompute (paper section 4.3).

A stack of L :class:`~mhc_cupy.torch.MHC` layers computes x_{l+1} = H_res,l x_l + H_post,l^T
F_l(H_pre,l x_l) for l = 0 .. L-1 (paper Eq. 3), exactly as the layers applied one after the
other.  What it adds is memory: each mHC layer saves its input streams x_l ([..., n, C], n
times a plain residual's activation) for backward.  With ``recompute = L_r`` the stack keeps
x_l only at every L_r-th layer (the block boundaries; "auto": at the starts of ``stack.blocks``) and
rebuilds the others in backward,
block by block, with the residual update x_{j+1} = H_res,j x_j + H_post,j^T y_j from what the
layers save anyway (the sublayer outputs y_j and the per-token coefficients H_post,j, H_res,j):
the paper's recompute of the mHC pieces in blocks of L_r layers, L_r* = sqrt(n L / (n + 2))
(``recompute="auto"``: as many blocks, shrinking toward the output, :func:`block_sizes`).  The
sublayers are not recomputed (checkpoint them yourself if you want to).  The rebuilt streams are
bitwise the forward's (the same deterministic op on the same inputs), so gradients are bitwise
those without recompute.

Mechanism: the mHC pieces of each layer of a block (not its sublayer) run inside
``torch.autograd.graph.saved_tensors_hooks`` whose pack hook replaces a saved x_l of a
non-boundary layer with a handle, and whose unpack hook rebuilds it (the first unpack in a
block rebuilds all its streams; each is dropped after its last unpack).  Inside a block the mHC
pieces' saved tensors therefore bypass saved-tensor hooks of the caller's (e.g.
``torch.autograd.graph.save_on_cpu``); the sublayers' do not.  Eager PyTorch only: under ``torch.compile`` the stack runs
without recompute (the same values and gradients, with every layer's streams saved).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_pre_hooks
from torch.nn.utils.parametrize import is_parametrized

from .. import _checks, mhc_post_op_fwd
from .._kernel_choice import current as current_choice
from .._stack import block_sizes, recompute_blocks
from ..ops.layer import fold_post_dx
from . import _transforms
from ._link import stream_key, version as _version
from .functions import NextPre
from .layers import MHC, _as_f32, _check_tensor

__all__ = ["MHCStack", "block_sizes", "recompute_blocks"]


def _check_unchanged(t: Tensor, version, what: str, where: str) -> None:
    """RuntimeError (autograd's check of a saved tensor, and its message) if t changed in place since the
    forward (its version then: ``version``).  The stack's hooks bypass autograd's own check: the tensors
    from which backward rebuilds a block's streams (a frozen layer whose input needs no gradient saves
    neither its input streams nor its sublayer output: streams rebuilt from changed ones gave silently
    wrong gradients), and the other tensors a block's mHC pieces save (_Saved)."""
    if version is not None and t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{what} {tuple(t.shape)} {where} is at version {t._version}; expected version {version} instead.  "
            f"Change it only after backward, or change a copy")


#: where _check_unchanged says a tensor from which backward rebuilds streams is
_REBUILT = "of {} recompute block (from which backward rebuilds the block's later streams)"


class _Block:
    """One recompute block: its boundary streams, and what rebuilds each later one in backward."""

    def __init__(self, x: Tensor):
        self.x0 = x          # the boundary streams (stream 0), saved as they are
        self.version = _version(x)  # (checked before x0 is used)
        self.update = []     # update[k]: (y, its version, H_post, H_res, convention) of the block's k-th layer: k -> k + 1
        self.uses = []       # per stream of the block: saves of it not yet unpacked
        self.cache = {}      # streams rebuilt in backward and still to be unpacked

    def get(self, i: int) -> Tensor:
        """The block's i-th streams (i >= 1): rebuilt from the nearest held ones, kept until their
        last unpack (a later backward through a retained graph rebuilds them again)."""
        x = self.cache.pop(i, None)
        if x is None:
            j = max((k for k in self.cache if k < i), default=0)
            if j == 0:
                _check_unchanged(self.x0, self.version, "the input streams", _REBUILT.format("an MHCStack"))
            x = self.x0 if j == 0 else self.cache[j]
            for k in range(j, i):
                y, version, H_post, H_res, convention = self.update[k]
                _check_unchanged(y, version, "the sublayer output", _REBUILT.format(f"layer {k} of an MHCStack"))
                with torch.no_grad():  # (a backward with create_graph=True runs in grad mode; x0 may require grad)
                    x = mhc_post_op_fwd(y, x, H_post, H_res, convention=convention)
                if k + 1 < i and self.uses[k + 1] > 0:
                    self.cache[k + 1] = x
        self.uses[i] -= 1
        if self.uses[i] > 0:
            self.cache[i] = x
        return x


class _Slot:
    """One layer's call inside a block (``MHC._stack_slot``): its input, the block's i-th streams,
    is saved as a handle (i >= 1), and its residual update's inputs are recorded."""

    def __init__(self, block: _Block, i: int, x: Tensor):
        self.block, self.i = block, i
        self.key = stream_key(x)  # not x: autograd keeps the pack hook alive
        self.out_key = self.out_ref = None  # the block's (i + 1)-th streams, once recorded (key, weak reference)
        block.uses.append(0)

    def pack(self, t: Tensor):
        if stream_key(t) == self.key:  # x, or x_link (a view), unchanged
            self.block.uses[self.i] += 1
            return (self.block, self.i)
        # (t itself: an output of the node that saves it, H_res, would hold that node); with its version: a hook
        # bypasses autograd's check that a saved tensor is unchanged at backward (phi changed in place by an
        # optimizer step or an EMA before it, a sublayer output changed after the forward), done in _unpack
        return _Saved(t.detach(), _version(t))

    def saving(self):
        """The context around the mHC pieces: nothing to change at the block's boundary (i = 0)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack) if self.i else contextlib.nullcontext()

    def record(self, x: Tensor, y: Tensor, H_post: Tensor, H_res: Tensor, convention: str, out: Tensor) -> None:
        """The layer's call on x returned out: the block's next streams if x was its i-th (a forward
        pre-hook may have given the layer others, or changed them in place)."""
        self.block.update.append((y.detach(), _version(y), H_post.detach(), H_res.detach(), convention))
        self.out_key = stream_key(out) if stream_key(x) == self.key else None
        self.out_ref = weakref.ref(out) if self.out_key is not None else None

    def leads_to(self, x: Tensor) -> bool:
        """x, what the layer call returned (forward hooks included), is the block's (i + 1)-th streams.
        Only while the layer's output lives: once freed (a forward hook returned another tensor), another
        tensor may take its address and so its key (two forward hooks, the second's result where the first
        freed the output), and backward would rebuild the output for it."""
        return self.out_key is not None and self.out_ref() is not None and stream_key(x) == self.out_key


class _Saved:
    """A tensor the mHC pieces of a block's layer saved (not its streams), detached (sharing its version
    counter), with its version then."""

    __slots__ = ("t", "version")

    def __init__(self, t: Tensor, version):
        self.t, self.version = t, version


def _unpack(saved):
    if isinstance(saved, tuple):
        return saved[0].get(saved[1])
    _check_unchanged(saved.t, saved.version, saved.t.type(), "saved by an mHC layer of an MHCStack recompute block")
    return saved.t


def _check_layers(layers, n_streams=None, dim=None) -> None:
    """TypeError / ValueError naming the element: ``layers`` empty, an element not an MHC, or its n, C not
    ``n_streams``, ``dim`` (default: layers[0]'s)."""
    if not len(layers):
        raise ValueError("layers must hold at least one MHC layer, got an empty sequence")
    for i, layer in enumerate(layers):
        if not isinstance(layer, MHC):
            raise TypeError(f"layers[{i}] must be an mhc_cupy.torch.MHC, got {type(layer).__name__}")
        if n_streams is None:
            n_streams, dim = layer.n_streams, layer.dim
        elif (layer.n_streams, layer.dim) != (n_streams, dim):
            raise ValueError(f"layers[{i}] has n_streams={layer.n_streams}, dim={layer.dim}; the stack has "
                             f"n_streams={n_streams}, dim={dim}: a stack needs one n and C")


class MHCStack(nn.Module):
    """A sequence of mHC layers applied in order, with optional stream recompute.

    ``forward(x, *args, **kwargs)`` equals ``for layer in layers: x = layer(x, *args, **kwargs)``
    in value and gradient (bitwise, with or without recompute): the extra arguments go to
    every sublayer, and each layer gets what the previous call returned, forward hooks and
    pre-hooks included (where a hook gives a layer other streams, or changes them in place, a new
    recompute block starts there; under ``torch.inference_mode`` an in-place change is not seen).

    Args:
        layers: a non-empty sequence of :class:`MHC` (any convention; all of one n and C).  They
            become ``stack.layers`` (an ``nn.ModuleList``): their parameters are the stack's, so
            ``MHC.from_deepseek`` layers and existing checkpoints load as they are.  ``len(stack)``,
            ``stack[i]`` and iteration reach the layers too.
        recompute: None (default: every layer saves its input streams), an int L_r >= 1 (save the
            streams at every L_r-th layer only and rebuild the rest in backward), or "auto" (as many
            blocks as the paper's L_r* = sqrt(n L / (n + 2)) gives, section 4.3, shrinking toward the
            output, where the backward starts with every sublayer's activations held: ``stack.blocks``,
            :func:`block_sizes`).  While a recomputing forward runs, its layers hold its block's
            state (``MHC._stack_slot``): run them in one thread at a time (two threads' forwards
            through the same layers would record into each other's blocks).
        fuse_boundaries: run each layer's residual update and the next layer's pre piece as one op
            (``mhc_boundary_fwd``, OPS.md section 12: the streams are read once less per boundary;
            eager only, between layers of one convention that run the fused layer pieces: not
            layers built under ``kernel_choice(fused=False)``, nor into a layer whose phi, alpha or bias is
            parametrized (``torch.nn.utils.parametrize``) or that has forward pre-hooks, which run after the
            previous layer read its parameters and may change them: an old-style weight norm, a max-norm clip,
            FSDP2's unshard; nor into a layer whose phi, alpha or bias changed otherwise before its call:
            those compute their pre piece themselves).  The streams and the gradients' formulas
            are the same; the next layer's coefficients may differ in the last float32 bits.
            Default False.  The fused kernel itself runs only where the kernel choice says ``boundary=True``
            (``mhc_cupy._kernel_choice``; off by default, OPS.md section 12 gives its status); otherwise
            the boundary op runs the two ops' kernels (the chain's bits).  Under the kernel choice
            ``boundary_bwd=True`` (n <= 4; off by default, slower on the H200) the
            backward across each boundary is fused too: the next layer's dx kernel also writes this
            layer's d layer_out, and this layer's pre-piece backward computes its residual update's
            coefficient gradients (``mhc_boundary_bwd``, OPS.md section 12, "Fused boundary backward"),
            with the unfused stack's formulas (bitwise on the CPU).

    Shapes:
        x [..., n, C] (bfloat16 / float16 / float32) -> [..., n, C], dtype of x.

    Raises:
        ValueError: empty ``layers``; layers of different n or C; ``recompute`` not None / a
        positive int / "auto" (TypeError for a non-int).  TypeError: ``layers`` not iterable, or an
        element not an MHC (also at each forward, as ValueError for layers of another n or C or none: ``stack.layers``
        may have changed); ``fuse_boundaries`` not a bool; x (in forward) not a tensor.  Assigning ``stack.recompute`` or
        ``stack.fuse_boundaries`` later checks the value the same way.  NotImplementedError: called under a ``torch.func`` transform
        (as :class:`MHC`).
    """

    def __init__(self, layers: Sequence[MHC], recompute: Union[None, int, str] = None, fuse_boundaries: bool = False):
        super().__init__()
        if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"layers must be a sequence of MHC modules, got one {type(layers).__name__}")
        try:
            layers = list(layers)
        except TypeError:
            raise TypeError(f"layers must be a sequence of MHC modules, got {type(layers).__name__} {layers!r}") from None
        _check_layers(layers)
        self.layers = nn.ModuleList(layers)
        self.n_streams, self.dim = layers[0].n_streams, layers[0].dim
        self.recompute = recompute
        self.fuse_boundaries = fuse_boundaries

    @property
    def recompute(self) -> Union[None, int, str]:
        """The ``recompute`` setting (see the class docstring); an assignment is checked as the argument
        and takes effect at the next forward."""
        return self._recompute

    @recompute.setter
    def recompute(self, value) -> None:
        recompute_blocks(value, self.n_streams, len(self.layers))  # raises for a bad value
        self._recompute = value

    @property
    def block_layers(self):
        """L_r, the layers per recompute block, of ``recompute`` and the current number of layers (for "auto"
        the paper's L_r*, whose number of blocks ``blocks`` takes); None where nothing is recomputed."""
        return recompute_blocks(self._recompute, self.n_streams, len(self.layers))

    @property
    def blocks(self):
        """The layers of each recompute block, first to last, of ``recompute`` and the current number of
        layers (``mhc_cupy.torch.block_sizes``: "auto" shrinks them toward the output); None where nothing is
        recomputed."""
        return block_sizes(self._recompute, self.n_streams, len(self.layers))

    @property
    def fuse_boundaries(self) -> bool:
        """The ``fuse_boundaries`` setting; an assignment is checked as the argument."""
        return self._fuse_boundaries

    @fuse_boundaries.setter
    def fuse_boundaries(self, value) -> None:
        self._fuse_boundaries = _checks.flag("fuse_boundaries", value)

    def _next_pre(self, l: int):
        """Layer l + 1's pre piece to run inside layer l's residual update (both run the fused layer
        pieces, under one convention), or None."""
        if l + 1 == len(self.layers):
            return None
        layer, nxt = self.layers[l], self.layers[l + 1]
        if not (layer._fused and nxt._fused) or nxt.convention != layer.convention:
            return None
        if nxt._forward_pre_hooks or _global_forward_pre_hooks or any(
                is_parametrized(nxt, name) for name in ("phi", "alpha", "bias")):
            # a forward pre-hook runs after this reading of nxt's parameters and may change them (a weight norm,
            # a max-norm clip, FSDP2's unshard), in ways NextPre.take cannot see (through .data); a parametrized
            # one is another tensor at each read, which take refuses: no boundary op computing it for nothing
            return None
        fuse_bwd = fold_post_dx(self.n_streams) and current_choice().runs("boundary_bwd")
        params = nxt.phi, nxt.alpha, nxt.bias  # (nxt's call checks that it reads these, unchanged: NextPre.take)
        return NextPre(*(_as_f32(p) for p in params), nxt.settings, fuse_bwd, params)

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        if _transforms.active():  # as the layers would, before the recompute slots look at x's storage
            _transforms.refuse()
        _check_tensor(x, self.n_streams, self.dim)  # (as the layers would, before the recompute slots look at x)
        _check_layers(self.layers, self.n_streams, self.dim)  # (stack.layers may have changed since)
        if torch.compiler.is_compiling():
            # traced without the saved-tensor hooks (no recompute) and without the boundary op (eager
            # only), nor the per-call layer attributes below (torch 2.11's Dynamo cannot trace
            # ``__dict__.pop``): the layers in sequence
            for layer in self.layers:
                x = layer(x, *args, **kwargs)
            return x
        sizes = self.blocks if torch.is_grad_enabled() else None
        starts = set(itertools.accumulate(sizes[:-1], initial=0)) if sizes else None
        fuse = self.fuse_boundaries
        slot = nxt = None
        for l, layer in enumerate(self.layers):
            if not isinstance(x, Tensor):  # (a hook's output: the layer's error, before the slots look at it)
                _check_tensor(x, self.n_streams, self.dim)
            if starts is not None:  # a new block where one starts, or where a hook changed the streams
                i = slot.i + 1 if slot is not None and l not in starts and slot.leads_to(x) else 0
                slot = layer._stack_slot = _Slot(_Block(x) if i == 0 else slot.block, i, x)
            given, nxt = nxt, self._next_pre(l) if fuse else None
            if starts is None and given is None and nxt is None:  # (nothing to hand over: no attributes to set)
                x = layer(x, *args, **kwargs)
                continue
            layer._pre_given, layer._pre_next = given, nxt
            try:
                x = layer(x, *args, **kwargs)
            finally:
                for name in ("_stack_slot", "_pre_given", "_pre_next"):
                    layer.__dict__.pop(name, None)
        return x

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> MHC:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def extra_repr(self) -> str:
        return (f"n_streams={self.n_streams}, dim={self.dim}, layers={len(self.layers)}, recompute={self.recompute!r}"
                + (", fuse_boundaries=True" if self.fuse_boundaries else ""))
