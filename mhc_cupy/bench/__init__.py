"""Benchmarks: ``python -m mhc_cupy.bench`` (``--help`` for the flags; benchmarks/README.md).

Every op, forward and backward, at tokens x C x n (bf16 activations by
default), against the same math in PyTorch eager, ``torch.compile`` and
``jax.jit`` on the same inputs, with a byte model that turns times into GB/s
and a fraction of the device-to-device copy bandwidth measured in the same run.

How each number is taken
------------------------
* **Cache.** Every call reads a different input set: ``R = 1 + ceil(2 L2 / B)``
  sets (B = the op's bytes per call, L2 read from the device; 2 <= R <= 64),
  used in turn, so at least 2 L2 of other traffic separates two uses of one
  set and every read comes from HBM.  The last R outputs are kept alive too, so
  outputs rotate as well.  The rotation is inside what is replayed: one CUDA
  graph holds ``calls`` consecutive calls (a multiple of R) on sets
  0, 1, ..., R-1, 0, 1, ...  (Only Sinkhorn at <= ~16k tokens moves so few
  bytes that the cap R = 64 leaves its sets partly in L2; it is latency-bound.)
* **mhc_cupy.** The functional ``*_fwd`` / ``*_bwd`` calls on CuPy inputs,
  captured into one CUDA graph (``calls`` calls) after warm-up; the graph is
  replayed between two CUDA events ``reps`` times; a sample is one replay's
  time / ``calls``; the number reported is the median sample (min and max are
  in the JSON).  Graph replay excludes the host cost of the Python call, which
  is measured separately (host overhead).
* **torch / torch.compile.** The baseline math below, eager or compiled
  (``torch.compile(dynamic=False)``, default mode, recompiled per shape),
  captured into a ``torch.cuda.CUDAGraph`` the same way and timed with
  ``torch.cuda.Event`` (so both are PyTorch's GPU time without its host
  overhead); if capture fails, ``calls`` eager calls between two events (the
  JSON says which).  Backward: the forward runs outside the timed region (on
  the capture stream, ``R`` autograd graphs kept), and only
  ``torch.autograd.grad(out, inputs, g, retain_graph=True)`` is timed.
* **jax.jit.** The same math in ``jnp`` under ``jax.jit``; wall clock over
  ``calls`` dispatches followed by ``jax.block_until_ready``, per call, median
  of ``reps``.  This includes JAX's per-call dispatch (a few us): it is hidden
  when the GPU work per call is longer, not for Sinkhorn at small sizes.
  Backward: ``out, vjp = jax.vjp(f, *inputs)`` per input set outside the timed
  region; the timed call is one jitted pullback applied to each set's residuals.
* **Copy bandwidth.** ``cupy.copyto`` between two 2 GiB buffers, run eagerly
  (not in a graph: a graph turns the copy into a copy-engine node, measured at
  2.77 TB/s against 4.25 TB/s eagerly on an H200) between CUDA events, median
  of 20, counting bytes read + bytes written.
* **Byte model** (``nbytes``, from the op specs ``SPECS``): each input read
  once, each output written once; activations at the activation itemsize,
  coefficients and their gradients float32.  GB/s = bytes / time; "% of copy" = that over the copy bandwidth.

Every baseline output is compared with ours on the first input set (relative
L2 error, reported as ``max_rel_err``), so a baseline that computes different
math is caught.

Modules: ``specs`` (op specs, byte model, rotation, case plan), ``baselines``
(each op's maths for PyTorch and jax.numpy), ``inputs`` (random inputs, DLPack
sharing), ``timing`` (timers, copy bandwidth), ``env`` (GPU / framework probes),
``cases`` (the op benchmark), ``report`` (targets, report, JSON, plot, merge),
``cli`` (the command line).
"""

from .baselines import jax_bwd, jax_fwd, torch_bwd, torch_fwd
from .cases import host_overhead, run_benchmarks
from .cli import build_parser, main, parse_args
from .env import gpu_problem
from .inputs import make_inputs
from .report import (BANDWIDTH_TARGET_OPS, BANDWIDTH_TARGETS, HOST_TARGET_RATIO, TARGET_DOMAIN, evaluate_targets,
                     format_host, format_report, format_table, format_targets, in_target_domain, merge_results,
                     write_json, write_outputs, write_plot)
from .specs import (BASELINES, BYTES, DEFAULT_OPS, IMPLS, SPECS, nbytes, plan_cases, rotation, shape_of, shape_str,
                    uses_C)
from .timing import copy_bandwidth, per_call_us, time_ms

__all__ = [
    "BANDWIDTH_TARGET_OPS", "BANDWIDTH_TARGETS", "BASELINES", "BYTES", "DEFAULT_OPS", "HOST_TARGET_RATIO", "IMPLS",
    "SPECS", "TARGET_DOMAIN", "build_parser", "copy_bandwidth", "evaluate_targets", "format_host", "format_report",
    "format_table", "format_targets", "gpu_problem", "host_overhead", "in_target_domain", "jax_bwd", "jax_fwd",
    "main", "make_inputs", "merge_results", "nbytes", "parse_args", "per_call_us", "plan_cases", "rotation",
    "run_benchmarks", "shape_of", "shape_str", "time_ms", "torch_bwd", "torch_fwd", "uses_C", "write_json",
    "write_outputs", "write_plot",
]
