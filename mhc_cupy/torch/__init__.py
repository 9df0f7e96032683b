"""PyTorch adapter: the mHC operators as differentiable torch functions.

``mhc_cupy.torch`` wraps the functional ``*_fwd`` / ``*_bwd`` API (OPS.md
sections 1-7) for autograd and ``torch.compile``:

    sinkhorn_knopp  rmsnorm  stream_mix  stream_aggregate  stream_distribute
    mhc_post_op     mhc_pre_op

Each takes the arguments of its ``*_fwd`` function (Sinkhorn and the pre op
also ``grad_mode``); gradients are exactly the functional ``*_bwd`` calls.

Two routes, same kernels, identical results:

* **eager** (``not torch.compiler.is_compiling()``): a
  ``torch.autograd.Function`` calls the functional API directly.  The
  ``torch.library`` dispatcher is bypassed because its per-call host cost
  (~60 us measured by QuACK) exceeds the kernels themselves (~10 us).
  Without any input that requires grad (or under ``torch.no_grad``) the
  functional API is called with no autograd node at all.
* **compiled** (inside ``torch.compile`` / ``torch.export``, while ``torch.jit.trace``
  records, or inputs that are tensor subclasses such as FakeTensor): ``torch.library.custom_op``
  operators ``torch.ops.mhc_cupy.<op>_fwd`` / ``<op>_bwd`` with
  ``register_fake`` shape functions and ``register_autograd``, so
  ``torch.compile(fullgraph=True)`` traces forward and backward without a
  graph break.

Both routes save only the op's *inputs* (backward recomputes statistics and
the Sinkhorn iteration, OPS.md) and share one backward; only the callee
differs (the kernel's planner, as the functional API runs it, vs the custom
op).  Both are generated from the op table (:mod:`mhc_cupy.torch._factory`).

Device and stream: CUDA tensors run on torch's current stream of their own
device (entered when it is not the current one); outputs are ``torch.empty``
tensors there (zero copy).  CPU tensors run the NumPy reference
(``mhc_cupy.reference``) and return CPU tensors.  Backward is deterministic
(no atomics).

Gradients are first order only: the backward is not itself differentiable,
so a second-order gradient through any of these ops (``create_graph=True``,
then a backward through the result) raises ``RuntimeError`` ("trying to
differentiate twice a function that was marked with @once_differentiable"
eagerly, also from a loss linear in the outputs such as ``out.sum()``; under
``torch.compile`` the custom op's missing double backward).

``torch.func`` transforms (grad, vmap, jacrev, jvp, ...) are not supported: every op (and so
``MHC`` / ``MHCHead``) raises ``NotImplementedError`` under one, saying what to use instead
(torch.autograd; leading dims for a batch).  ``torch.func.functional_call`` works.  Forward-mode
AD's dual tensors (``torch.autograd.forward_ad``) are refused the same way (a tangent is never dropped).

The package (no module imports another in a circle):

* :mod:`mhc_cupy.torch.functions`: the differentiable ops above and the fused
  layer pieces ``mhc_layer_pre`` / ``mhc_layer_post`` (OPS.md section 9), on
  :mod:`mhc_cupy.torch._factory` (what every op's adapter derives from the op table);
* :mod:`mhc_cupy.torch.layers`: the ``nn.Module`` :class:`MHC` and the
  stream helpers (``expand_streams``, ``collapse_streams``, ``identity_bias``,
  ``ExpandStreams``, ``CollapseStreams``), built on ``functions``; a repeated
  ``MHC`` call without autograd (decoding) queues the same launches with less host
  work (:mod:`mhc_cupy.torch._no_grad`);
* :mod:`mhc_cupy.torch.stack`: :class:`MHCStack`, a network's sequence of :class:`MHC` layers
  with stream recompute (paper section 4.3), built on ``layers``;
* :mod:`mhc_cupy.torch.reference`: the same ops and layer in plain torch ops
  (``sinkhorn_reference``, ``mhc_reference``, ``MHCReference``), the autograd
  oracles of the tests and the bench; not imported here.

Its modules import torch as a plain ``import torch`` (absolute imports: this
package is ``mhc_cupy.torch``); ``mhc_cupy/__init__.py`` never imports torch.
"""

from .._deps import require

require("torch", "torch", "mhc_cupy.torch")  # missing: an ImportError naming the extra

from . import functions, layers, stack  # noqa: E402
from .functions import *  # noqa: E402,F401,F403 - the differentiable ops (functions.__all__)
from .functions import NAMESPACE  # noqa: E402,F401
from .layers import *  # noqa: E402,F401,F403 - MHC and the stream helpers (layers.__all__)
from .stack import *  # noqa: E402,F401,F403 - MHCStack (stack.__all__)

__all__ = functions.__all__ + layers.__all__ + stack.__all__
