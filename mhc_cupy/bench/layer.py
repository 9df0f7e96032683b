"""Layer mode: the whole mHC layer, forward and forward + backward (``python -m mhc_cupy.bench --layer``).

What is timed, per (sublayer, tokens x C x n), every implementation on the same
inputs ``x [T, n, C]`` and upstream gradients ``g [T, n, C]`` (``R`` sets in turn, as
the op mode, so that the reads come from HBM), after warm-up:

* ``mhc_cupy``: ``mhc_cupy.torch.MHC(C, n, sublayer)`` (whatever the layer uses
  inside); as two rows (``--fused both``), fused and unfused (the separate ops), each
  built and timed under its kernel choice, see :func:`kernel_variants`.
* ``torch`` / ``torch.compile``: ``mhc_cupy.torch.reference.MHCReference`` (the same layer and
  parameters in plain torch ops), eager and ``torch.compile(dynamic=False)``.
* ``jax mhc_cupy``: ``mhc_cupy.jax.mhc_layer``; ``jax.jit``: the same maths in plain
  ``jax.numpy`` (:func:`mhc_cupy.bench.baselines.jnp_mhc_layer`), same parameters.
* ``transformer_engine``: TransformerEngine's Triton mHC
  (``mhc_generate_mix_and_aggregate`` + ``mhc_fused_expand_combine``, n = 4 only, its
  ``[T, 1, C, n]`` layout), when ``transformer_engine`` imports.

``fwd`` is the forward alone, without autograd (``torch.no_grad``; ``jax.jit`` of the
layer).  ``fwd+bwd`` is a training step of the layer: the forward with autograd, then
the gradients of x and of phi, alpha, bias for the upstream ``g``
(``torch.autograd.grad(out, [x, phi, alpha, bias], g)``; ``jax.jit`` of
``jax.vjp(layer, params, x)[1](g)``, which is ``jax.grad`` of ``<layer(params, x), g>``).
PyTorch rows: ``calls`` eager calls between two CUDA events, median of ``reps``
(``--graph``: captured into a CUDA graph and replayed, host overhead excluded); JAX
rows: wall clock + ``block_until_ready`` (the op mode's timers).  Without a GPU (the
CPU tests) every row is wall clock.  Peak memory: PyTorch rows
``torch.cuda.max_memory_allocated()`` during one call minus the memory allocated
before it (outputs included; memory that mhc_cupy takes from CuPy's pool is not seen
by PyTorch's counter); JAX rows XLA's compiled ``temp + output`` bytes.

Byte floor (:func:`layer_bytes`): the least HBM traffic of any implementation of the
layer around an opaque sublayer (the sublayer's own traffic not counted).  With
A = T·n·C·s (one ``[T, n, C]`` tensor), Y = T·C·s (one ``[T, C]`` tensor), s the
activation itemsize and P = 4·(n·C·m + 3 + m), m = n² + 2n (phi, alpha, bias):

* forward, 3A + 2Y + P: read x (A) and the parameters (P), write layer_in (Y);
  after the sublayer, read y (Y) and x again (A: out = H_res x + H_post y needs x,
  which cannot stay on chip across an opaque sublayer) and write out (A).  (The
  coefficients and the aggregate come from one read of x.)
* backward, 5A + 3Y + 2P: before the sublayer's backward, read g (A), x (A) and y (Y)
  (dH_res = g x^T, dH_post = g . y per token), write dy = H_post^T g (Y); after it,
  read d layer_in (Y), x (A) and g (A) (dx = H_res^T g + H_pre d layer_in + the
  coefficient path's part, which needs dH_pre = d layer_in . x first), write dx (A);
  read P, write dP.
* fwd+bwd: 8A + 5Y + 3P.

Accuracy (:func:`layer_accuracy`, once per shape on min(T, ACCURACY_TOKENS) tokens): the largest
error of out and dx against float64 autograd of ``MHCReference``, in ulps of the activation dtype
at max |reference|, for ``MHC`` and for plain torch at the activation dtype (tanh sublayer,
alpha 0.5: the issue's setting), and a reference level ("floor"): a layer whose sublayer takes and
returns the activation dtype, float64 everywhere else, out and dx rounded once (the roundings of
any layer in that dtype; not a strict bound, other roundings can cancel part of them).

The per-token coefficients (m float32 per token, under 0.1 % of A at these shapes)
are left out.  "% copy" is floor bytes / time over the device-to-device copy
bandwidth measured in the same run: 100 % would be a layer at the copy roofline.
"""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path

from .._kernel_choice import KernelChoice, kernel_choice
from . import env
from .report import format_targets, gpu_targets, write_json
from .specs import rotation
from .timing import _time_jax, _time_torch, _time_wall, copy_bandwidth, host_copy_bandwidth

#: Default (tokens, C, n): n = 4 at two model sizes, and n = 8 / 16 at the bytes of n = 4 at C 4096 / half.
LAYER_SHAPES = ((16384, 4096, 4), (32768, 7168, 4), (16384, 2048, 8), (8192, 1024, 16))
SUBLAYERS = ("identity", "tanh")
#: Baselines of the layer mode, in table order.
LAYER_BASELINES = ("torch", "torch.compile", "jax.jit", "transformer_engine")
JAX_OURS = "jax mhc_cupy"
#: Targets of the layer (issue: identity sublayer, bf16); (T, C, n) -> ms.
LAYER_TARGETS_MS = {"fwd+bwd": {(16384, 4096, 4): 2.0, (32768, 7168, 4): 6.5},
                    "fwd": {(16384, 4096, 4): 0.55, (32768, 7168, 4): 1.9}}
#: n > 4 fwd+bwd time over the n = 4 (16384 x 4096) time scaled to equal bytes.
STREAM_TARGETS = {(16384, 2048, 8): 1.4, (8192, 1024, 16): 2.5}
JAX_TARGET_SPEEDUP = 1.5
DIRS = ("fwd", "fwd+bwd")
#: Accuracy (issue: bf16, alpha 0.5, tanh sublayer): the largest error of out / dx against float64, in
#: ulps of the dtype at max |reference|, on min(T, ACCURACY_TOKENS) tokens of each shape's C and n.
ACCURACY_TARGETS_ULP = {"out": 0.6, "dx": 1.0}
ACCURACY_TOKENS, ACCURACY_ALPHA = 4096, 0.5


def layer_bytes(direction: str, T: int, C: int, n: int, itemsize: int) -> int:
    """Byte floor of one mHC layer call (see the module doc): "fwd" 3A + 2Y + P,
    "bwd" 5A + 3Y + 2P, "fwd+bwd" the sum 8A + 5Y + 3P."""
    A, Y = T * n * C * itemsize, T * C * itemsize
    m = n * n + 2 * n
    P = 4 * (n * C * m + 3 + m)
    table = {"fwd": 3 * A + 2 * Y + P, "bwd": 5 * A + 3 * Y + 2 * P}
    table["fwd+bwd"] = table["fwd"] + table["bwd"]
    if direction not in table:
        raise ValueError(f"direction must be one of {sorted(table)}, got {direction!r}")
    return table[direction]


def kernel_variants(choice: str) -> list[tuple[str, KernelChoice]]:
    """(label suffix, kernel choice) of each ``MHC`` variant to time, for ``--fused`` ``choice``:
    "both" (the fused pieces, " fused", and the separate ops, " unfused"), "true", "false", or
    "default" (one row, "", the library's choice).  Each variant is built and timed under
    ``mhc_cupy._kernel_choice.kernel_choice(its choice)``."""
    if choice == "default":
        return [("", KernelChoice())]
    pick = {"both": (True, False), "true": (True,), "false": (False,)}[choice]
    return [(" fused" if f else " unfused", KernelChoice(fused=f)) for f in pick]


def sublayers(name: str):
    """(torch module or None, jax function) of a sublayer name ("identity" or "tanh")."""
    import torch

    if name == "identity":
        return None, lambda y: y
    if name == "tanh":
        return torch.nn.Tanh(), _jnp_tanh
    raise ValueError(f"sublayer must be one of {SUBLAYERS}, got {name!r}")


def _jnp_tanh(y):
    import jax.numpy as jnp

    return jnp.tanh(y)


# ------------------------------------------------------------------------- plumbing
def torch_timer(on_gpu: bool, cfg):
    """``time(call, sets, calls) -> stats`` for PyTorch calls: CUDA events around eager calls
    (``cfg.graph``: a CUDA graph replay) on a GPU, wall clock on the CPU."""
    if on_gpu:
        return lambda call, sets, calls: _time_torch(lambda: call, sets, calls, cfg.warmup, cfg.reps,
                                                     graph=cfg.graph)
    return lambda call, sets, calls: _time_wall(call, sets, calls, cfg.warmup, cfg.reps, lambda last: None)


def torch_peak_bytes(call, on_gpu: bool):
    """Bytes PyTorch's allocator holds at the peak of one ``call(0)`` beyond what it held before."""
    if not on_gpu:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def torch_training_step(fn, params):
    """``step(x, g)``: the forward with autograd and the gradients of x and ``params`` for ``g``."""
    import torch

    def step(x, g):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(fn(x), [x, *params], g)
    return step


def measure_torch(fn, params, xs, gs, calls: int, timer, on_gpu: bool, dirs=DIRS) -> tuple[dict, dict]:
    """Time ``fn`` (x -> out) in each of ``dirs``; returns (rows, first outputs) where rows maps
    a direction to its stats (with ``peak_bytes``) or ``{"error"}`` and the outputs are
    ``{"out": fn(xs[0]), "dx": dx of set 0}`` for the cross-check."""
    import torch

    step = torch_training_step(fn, params)

    def fwd(k):
        with torch.no_grad():
            return fn(xs[k])

    calls_of = {"fwd": fwd, "fwd+bwd": lambda k: step(xs[k], gs[k])}
    rows, firsts = {}, {}
    for d in dirs:
        call = calls_of[d]
        try:
            rows[d] = timer(call, len(xs), calls)
            rows[d]["peak_bytes"] = torch_peak_bytes(call, on_gpu)
            first = call(0)
            firsts["out" if d == "fwd" else "dx"] = first if d == "fwd" else first[0]
        except Exception as e:  # noqa: BLE001 - report and go on
            rows[d] = env._error(e)
        env._free_gpu_memory()
    return rows, firsts


def torch_to_jax(t):
    """A torch tensor as a JAX array (zero-copy through DLPack where possible; bf16 as int16 bits)."""
    import jax
    import jax.numpy as jnp
    import torch

    bf16 = t.dtype == torch.bfloat16
    src = t.detach().contiguous()
    src = src.view(torch.int16) if bf16 else src
    try:
        j = jax.dlpack.from_dlpack(src)
    except Exception:  # noqa: BLE001 - no zero-copy import: go through the host
        j = jnp.asarray(src.cpu().numpy())
    return jax.lax.bitcast_convert_type(j, jnp.bfloat16) if bf16 else j


def _f32_torch(a, device):
    """A float32 torch copy of a torch or JAX array (for comparisons)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().float()
    return torch.from_numpy(np.asarray(a).astype(np.float32)).to(device)


def rel_err(theirs, ours, device) -> float:
    """||theirs - ours|| / ||ours|| in float32."""
    a, b = _f32_torch(theirs, device), _f32_torch(ours, device)
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else num


def ulps(got, ref, dtype) -> float:
    """max |got - ref| in units of ``dtype``'s ulp at max |ref| (its eps times the power of two at or
    below max |ref|); 0 where ref is all zeros and got equals it."""
    import torch

    err = float((got.double() - ref.double()).abs().max())
    top = float(ref.double().abs().max())
    if top == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / (torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top)))


def layer_accuracy(T: int, C: int, n: int, dtype, device) -> dict:
    """Largest error of the layer's out and dx against float64, in ulps (:func:`ulps`): ``MHC`` (what
    it runs by default) and ``MHCReference`` in plain torch at ``dtype`` (parameters float32), both
    against float64 autograd of ``MHCReference`` on the same inputs and parameters; tanh sublayer,
    alpha = ACCURACY_ALPHA (the issue's setting: the coefficient path's share of dx is not negligible)."""
    import torch

    import mhc_cupy.torch as mt
    from mhc_cupy.torch.reference import MHCReference

    gen = torch.Generator(device=device).manual_seed(12345)
    x, g = (torch.randn((T, n, C), generator=gen, device=device).to(dtype) for _ in range(2))
    torch.manual_seed(1)
    layer = mt.MHC(C, n, sublayer=torch.nn.Tanh(), device=device)
    with torch.no_grad():
        layer.alpha.fill_(ACCURACY_ALPHA)
    ref64 = MHCReference.from_layer(layer).double()

    def out_dx(module, xin, gin):
        xin = xin.detach().requires_grad_()
        out = module(xin)
        return out.detach(), torch.autograd.grad(out, [xin], gin)[0]

    want = out_dx(ref64, x.double(), g.double())
    res = {"tokens": T, "sublayer": "tanh", "alpha": ACCURACY_ALPHA}
    for impl, module in (("mhc_cupy", layer), ("torch", MHCReference.from_layer(layer))):
        got = out_dx(module, x, g)
        res[impl] = {k: ulps(a, b, dtype) for k, a, b in zip(("out", "dx"), got, want)}
    # the reference level ("floor"): float64 throughout, but the sublayer takes and returns the
    # activation dtype (as in any layer of a model in that dtype) and out / dx are rounded once
    floor = MHCReference.from_layer(layer).double()
    floor.sublayer = _dtype_io(floor.sublayer, dtype)
    got = out_dx(floor, x.double(), g.double())
    res["floor"] = {k: ulps(a.to(dtype), b, dtype) for k, a, b in zip(("out", "dx"), got, want)}
    return res


def _dtype_io(sublayer, dtype):
    """``sublayer`` (float64) fed ``dtype``-rounded inputs, its outputs rounded to ``dtype`` (autograd: the
    gradients crossing it are rounded likewise): :func:`layer_accuracy`'s floor."""
    import torch

    class DtypeIO(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = sublayer

        def forward(self, z):
            return self.inner(z.to(dtype).double()).to(dtype).double()

    return DtypeIO()


def measure_jax(layer_fn, params, xs, gs, calls: int, cfg) -> tuple[dict, dict]:
    """Time ``layer_fn(params, x)`` under ``jax.jit`` (fwd) and ``jax.jit`` of its VJP (fwd+bwd)."""
    import jax

    fwd = jax.jit(layer_fn)
    step = jax.jit(lambda p, x, g: jax.vjp(layer_fn, p, x)[1](g))
    calls_of = {"fwd": (fwd, lambda k: (params, xs[k])), "fwd+bwd": (step, lambda k: (params, xs[k], gs[k]))}
    rows, firsts = {}, {}
    for d in DIRS:
        f, args = calls_of[d]
        try:
            rows[d] = _time_jax(lambda k: f(*args(k)), len(xs), calls, cfg.warmup, cfg.reps)
            rows[d]["peak_bytes"] = _xla_bytes(f, args(0))
            first = f(*args(0))
            firsts["out" if d == "fwd" else "dx"] = first if d == "fwd" else first[1]
        except Exception as e:  # noqa: BLE001
            rows[d] = env._error(e)
        env._free_gpu_memory()
    return rows, firsts


def _xla_bytes(f, args):
    """XLA's temp + output bytes of the compiled ``f(*args)``, or None where not reported."""
    try:
        ma = f.lower(*args).compile().memory_analysis()
        return int(ma.temp_size_in_bytes + ma.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _te_layer(layer, sublayer):
    """TransformerEngine's mHC with ``layer``'s parameter values, on its ``[T, 1, C, n]`` layout:
    (fn(x_te) -> out_te, params, x -> x_te)."""
    from transformer_engine.pytorch.triton import mhc as te_mhc

    n, C = layer.n_streams, layer.dim
    m = n * n + 2 * n
    # vec(x) in TE's layout is c * n + i (streams fastest); ours is i * C + c
    phi = layer.phi.detach().reshape(n, C, m).permute(2, 1, 0).reshape(m, C * n).contiguous().requires_grad_()
    alpha = layer.alpha.detach().clone().requires_grad_()
    beta = layer.bias.detach().reshape(1, m).clone().requires_grad_()

    def fn(x_te):
        layer_in, H_post, H_res = te_mhc.mhc_generate_mix_and_aggregate(x_te, phi, alpha, beta)
        y = layer_in if sublayer is None else sublayer(layer_in)
        return te_mhc.mhc_fused_expand_combine(y.to(x_te.dtype), None, H_post, x_te, H_res)

    def to_te(x):  # [T, n, C] -> [T, 1, C, n]
        return x.transpose(-1, -2).unsqueeze(1).contiguous()

    return fn, [phi, alpha, beta], to_te


def _te_status() -> str | None:
    try:
        from transformer_engine.pytorch.triton import mhc as te_mhc  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"TransformerEngine's mHC is not importable ({type(e).__name__}: {str(e)[:160]})"
    return None


# ------------------------------------------------------------------------------ one case
def layer_case(sublayer_name: str, T: int, C: int, n: int, cfg, copy_GBps, l2: int, baselines, on_gpu: bool,
               variants: list) -> dict:
    """Time one (sublayer, shape) for every implementation (``variants``: :func:`kernel_variants`);
    returns the result row."""
    import torch

    import mhc_cupy.torch as mt
    from mhc_cupy.torch.reference import MHCReference

    dev = torch.device("cuda" if on_gpu else "cpu")
    dt = getattr(torch, cfg.dtype)
    isz = torch.empty((), dtype=dt).element_size()
    floor = {d: layer_bytes(d, T, C, n, isz) for d in DIRS}
    R, calls = rotation(floor["fwd"], l2, cfg.min_calls)
    row = {"sublayer": sublayer_name, "tokens": T, "C": C, "n": n, "dtype": cfg.dtype, "floor_bytes": floor,
           "floor_us": ({d: b / copy_GBps / 1e3 for d, b in floor.items()} if copy_GBps else None),
           "sets": R, "calls": calls, "copy_GBps": copy_GBps, "impls": {}}

    def gen(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn((T, n, C), generator=g, device=dev, dtype=torch.float32).to(dt)

    xs = [gen(2 * k) for k in range(R)]
    gs = [gen(2 * k + 1) for k in range(R)]
    sub_t, sub_j = sublayers(sublayer_name)
    timer = torch_timer(on_gpu, cfg)
    ref_out = {}

    def record(impl, rows, firsts, vs=None):
        for d, r in rows.items():
            if "us" in r and copy_GBps:
                r["GBps"] = floor[d] / (r["us"] * 1e-6) / 1e9
                r["frac_of_copy"] = r["GBps"] / copy_GBps
        entry = dict(rows)
        vs = ref_out if vs is None else vs
        errs = {k: rel_err(v, vs[k], dev) for k, v in firsts.items() if k in vs}
        if errs:
            entry["max_rel_err"] = errs
            if max(errs.values()) > cfg.check_tol:
                env._log(f"  WARNING: {impl} differs from mhc_cupy by {errs} (relative L2)")
        row["impls"][impl] = entry
        env._log(f"  {impl}: " + ", ".join(f"{d} {r['us'] / 1e3:.3f} ms" if "us" in r else f"{d} error"
                                         for d, r in rows.items()))

    torch.manual_seed(0)  # the same parameters in every run
    base = None
    for suffix, choice in variants:
        with kernel_choice(choice):
            layer = mt.MHC(C, n, sublayer=sub_t, device=dev)
            if base is None:
                base = layer
            else:
                layer.load_state_dict(base.state_dict())
            rows, firsts = measure_torch(layer, list(layer.parameters()), xs, gs, calls, timer, on_gpu)
        first = not ref_out
        ref_out.update(firsts if first else {})
        record("mhc_cupy" + suffix, rows, firsts, vs={} if first else None)
        del layer
    params = [base.phi, base.alpha, base.bias]

    if "torch" in baselines or "torch.compile" in baselines:
        ref = MHCReference.from_layer(base)
        rparams = [ref.phi, ref.alpha, ref.bias]
        if "torch" in baselines:
            record("torch", *measure_torch(ref, rparams, xs, gs, calls, timer, on_gpu))
        if "torch.compile" in baselines:
            torch._dynamo.reset()
            record("torch.compile", *measure_torch(torch.compile(ref, dynamic=False), rparams, xs, gs, calls, timer,
                                                   on_gpu))
        del ref
    if "jax.jit" in baselines:  # (jax importable: main() has checked)
        import mhc_cupy.jax as mj

        from .baselines import jnp_mhc_layer

        jparams = {k: torch_to_jax(p.detach().contiguous()) for k, p in zip(("phi", "alpha", "bias"), params)}
        jxs, jgs = [torch_to_jax(x) for x in xs], [torch_to_jax(g) for g in gs]
        record(JAX_OURS, *measure_jax(lambda p, x: mj.mhc_layer(p, x, sub_j), jparams, jxs, jgs, calls, cfg))
        record("jax.jit", *measure_jax(lambda p, x: jnp_mhc_layer(p, x, sub_j), jparams, jxs, jgs, calls, cfg))
        del jxs, jgs
    if "transformer_engine" in baselines:
        try:
            if n != 4:
                raise ValueError(f"TransformerEngine's mHC supports n = 4 only (n = {n})")
            fn, tparams, to_te = _te_layer(base, sub_t)
            rows, firsts = measure_torch(fn, tparams, [to_te(x) for x in xs], [to_te(g) for g in gs], calls, timer,
                                         on_gpu)
            # back to [T, n, C] for the comparison (TE's TF32 GEMM: expect ~1e-3)
            firsts = {k: v.squeeze(1).transpose(-1, -2) for k, v in firsts.items()}
            record("transformer_engine", rows, firsts)
        except Exception as e:  # noqa: BLE001
            row["impls"]["transformer_engine"] = env._error(e)
            env._log(f"  transformer_engine failed: {row['impls']['transformer_engine']['error']}")
    del xs, gs, base
    env._free_gpu_memory()
    if sublayer_name == cfg.sublayers[0]:  # once per shape (it does not depend on the timed sublayer)
        try:
            acc = row["accuracy"] = layer_accuracy(min(T, ACCURACY_TOKENS), C, n, dt, dev)
            env._log("  accuracy (ulps out / dx): " + ", ".join(f"{i} {acc[i]['out']:.2f} / {acc[i]['dx']:.2f}"
                                                              for i in ("mhc_cupy", "torch", "floor")))
        except Exception as e:  # noqa: BLE001 - report and go on
            row["accuracy"] = env._error(e)
            env._log(f"  accuracy failed: {row['accuracy']['error']}")
        env._free_gpu_memory()
    return row


# ------------------------------------------------------------------------------- the run
def reference_of(impl: str, impls) -> str | None:
    """The mhc_cupy row a row is compared with: the first ``jax mhc_cupy*`` row for JAX rows,
    the first ``mhc_cupy*`` row otherwise."""
    prefix = JAX_OURS if impl.startswith("jax") else "mhc_cupy"
    return next((i for i in impls if i.startswith(prefix)), None)


def run_layer(cfg) -> dict:
    """Run the layer mode ``cfg`` asks for (parsed arguments); returns the result dict."""
    import torch

    t0 = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    skipped, baselines = [], list(cfg.baselines)
    if "jax.jit" in baselines:
        why = env._jax_status() if on_gpu else env._import_status("jax")
        if why:
            skipped.append(f"jax rows skipped: {why}")
            baselines.remove("jax.jit")
    if "transformer_engine" in baselines:
        why = _te_status()
        if why:
            skipped.append(f"transformer_engine skipped: {why}")
            baselines.remove("transformer_engine")
    for s in skipped:
        env._log(s)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = kernel_variants(cfg.fused)
    if on_gpu:
        device = env._device_meta()
        copy = copy_bandwidth()
        l2 = int(device.get("l2_bytes") or 64 << 20)
    else:
        device = {"name": "CPU (no CUDA GPU: wall clock)", "sm": None}
        copy = host_copy_bandwidth()
        l2 = 0
    result = {
        "schema": "mhc_cupy.bench.layer/1",
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "argv": list(cfg.argv), "device": device, "versions": env._versions(),
                 "settings": {"mode": "layer", "dtype": cfg.dtype, "reps": cfg.reps, "warmup": cfg.warmup,
                              "min_calls": cfg.min_calls, "graph": cfg.graph, "fused": cfg.fused,
                              "baselines": baselines, "shapes": [list(s) for s in cfg.shapes],
                              "sublayers": list(cfg.sublayers)}},
        "copy": copy, "results": [], "targets": [], "skipped": skipped,
    }
    env._log(f"device: {device['name']}; copy {copy['GBps']:.0f} GB/s")
    for sub in cfg.sublayers:
        for T, C, n in cfg.shapes:
            env._log(f"[{time.perf_counter() - t0:7.1f} s] layer {sub} {T}x{C}x{n}")
            result["results"].append(layer_case(sub, T, C, n, cfg, copy["GBps"], l2, baselines, on_gpu, variants))
            write_json(result, out_dir / "layer.json")  # partial results survive a timeout
    result["targets"] = evaluate_layer_targets(result)
    result["meta"]["wall_s"] = time.perf_counter() - t0
    return result


# ------------------------------------------------------------------------------ targets
def _ms(row, impl, d):
    v = row["impls"].get(impl, {}).get(d, {})
    return v["us"] / 1e3 if "us" in v else None


@gpu_targets
def evaluate_layer_targets(result: dict) -> list[dict]:
    """The issue's layer targets (identity sublayer, bfloat16 rows) against the ``mhc_cupy`` row of what MHC
    runs by default (the fused pieces), else the first one; the accuracy (tanh sublayer, measured on the run's
    first sublayer's row) from the bfloat16 row of its shape that has it."""
    bf16 = [r for r in result.get("results", []) if r.get("dtype") == "bfloat16"]
    rows = {(r["tokens"], r["C"], r["n"]): r for r in bf16 if r["sublayer"] == "identity"}
    out = []

    def add(name, status, measured, detail):
        out.append({"name": name, "status": status, "measured": measured, "detail": detail})

    def ours(r):
        return "mhc_cupy fused" if "mhc_cupy fused" in r["impls"] else reference_of("mhc_cupy", r["impls"])

    for d, goals in LAYER_TARGETS_MS.items():
        for shape, goal in goals.items():
            name = f"layer {d}, {'x'.join(map(str, shape))} <= {goal:g} ms"
            r = rows.get(shape)
            t = _ms(r, ours(r), d) if r else None
            if t is None:
                add(name, "not measured", None, "")
            else:
                floor = (r.get("floor_us") or {}).get(d)
                add(name, "met" if t <= goal else "missed", t,
                    f"{t:.3f} ms" + (f" (byte floor {floor / 1e3:.3f} ms)" if floor else ""))
    base = rows.get((16384, 4096, 4))
    for shape, goal in STREAM_TARGETS.items():
        name = f"layer fwd+bwd n = {shape[2]} ({shape[0]}x{shape[1]}) <= {goal:g}x the n = 4 time at equal bytes"
        r = rows.get(shape)
        t = _ms(r, ours(r), "fwd+bwd") if r else None
        t4 = _ms(base, ours(base), "fwd+bwd") if base else None
        if t is None or t4 is None:
            add(name, "not measured", None, "needs 16384x4096x4 and the shape itself")
            continue
        scale = r["floor_bytes"]["fwd+bwd"] / base["floor_bytes"]["fwd+bwd"]
        ratio = t / (t4 * scale)
        add(name, "met" if ratio <= goal else "missed", ratio,
            f"{t:.3f} ms vs {t4:.3f} ms x {scale:.2f} (bytes) = {ratio:.2f}x")
    accuracy = next((r["accuracy"] for r in bf16 if (r["tokens"], r["C"], r["n"]) == (16384, 4096, 4)
                     and "mhc_cupy" in r.get("accuracy", {})), None)
    acc = accuracy["mhc_cupy"] if accuracy else None
    for k, goal in ACCURACY_TARGETS_ULP.items():
        name = f"layer {k} vs float64 <= {goal:g} ulp (16384x4096x4, tanh sublayer, alpha {ACCURACY_ALPHA:g})"
        if acc is None:
            add(name, "not measured", None, "needs 16384x4096x4 in bfloat16")
        else:
            torch_ulp = accuracy["torch"][k]
            floor = accuracy.get("floor")  # absent in results of older runs
            floor_words = f"; float64 with a bf16-in/out sublayer: {floor[k]:.2f}" if floor else ""
            add(name, "met" if acc[k] <= goal else "missed", acc[k],
                f"{acc[k]:.2f} ulp (plain torch in bf16: {torch_ulp:.2f}{floor_words}) on "
                f"{accuracy['tokens']} tokens")
    name = f"JAX mhc_layer jit(grad) >= {JAX_TARGET_SPEEDUP:g}x faster than jax.jit of plain jnp (16384x4096x4)"
    mine = reference_of(JAX_OURS, base["impls"]) if base else None
    t, tp = (_ms(base, mine, "fwd+bwd"), _ms(base, "jax.jit", "fwd+bwd")) if mine else (None, None)
    if t is None or tp is None:
        add(name, "not measured", None, "")
    else:
        add(name, "met" if tp / t >= JAX_TARGET_SPEEDUP else "missed", tp / t,
            f"{t:.3f} ms vs {tp:.3f} ms = {tp / t:.2f}x")
    return out


# ------------------------------------------------------------------------------ report
def _fmt_ms(v) -> str:
    if v is None:
        return "-"
    if "error" in v:
        return "err"
    return f"{v['us'] / 1e3:.3f}"


def _fmt_frac(v) -> str:
    return f"{v['frac_of_copy']:.0%}" if v and "frac_of_copy" in v else "-"


def _fmt_mib(v) -> str:
    return f"{v['peak_bytes'] / 2**20:.0f}" if v and v.get("peak_bytes") is not None else "-"


def format_layer_table(result: dict) -> str:
    """Markdown table: one line per (sublayer, shape, implementation)."""
    head = ("| sublayer | T x C x n | impl | fwd ms | fwd+bwd ms | fwd % copy | fwd+bwd % copy | peak MiB fwd+bwd "
            "| ours faster by (fwd / fwd+bwd) | rel err out / dx |")
    lines = [head, "|" + "---|" * 10]
    for r in result.get("results", []):
        shape = f"{r['tokens']}x{r['C']}x{r['n']}"
        floor = r.get("floor_us")
        lines.append(f"| {r['sublayer']} | {shape} | byte floor | "
                     + (f"{floor['fwd'] / 1e3:.3f} | {floor['fwd+bwd'] / 1e3:.3f}" if floor else "- | -")
                     + " | 100% | 100% | | | |")
        for impl, v in r["impls"].items():
            if "error" in v and "fwd" not in v:
                lines.append(f"| {r['sublayer']} | {shape} | {impl} | err | err | | | | | |")
                continue
            ref = reference_of(impl, r["impls"])
            speed = []
            for d in DIRS:
                t, tr = _ms(r, impl, d), (_ms(r, ref, d) if ref and ref != impl else None)
                speed.append(f"{t / tr:.2f}x" if t and tr else "-")
            errs = v.get("max_rel_err", {})
            err = " / ".join(f"{errs[k]:.1e}" if k in errs else "-" for k in ("out", "dx")) if errs else ""
            lines.append(f"| {r['sublayer']} | {shape} | {impl} | {_fmt_ms(v.get('fwd'))} "
                         f"| {_fmt_ms(v.get('fwd+bwd'))} "
                         f"| {_fmt_frac(v.get('fwd'))} | {_fmt_frac(v.get('fwd+bwd'))} | {_fmt_mib(v.get('fwd+bwd'))} "
                         f"| {' / '.join(speed) if ref != impl else ''} | {err} |")
    acc = [(r, r["accuracy"]) for r in result.get("results", []) if "mhc_cupy" in r.get("accuracy", {})]
    if acc:
        lines += ["", f"accuracy: largest error against float64 in ulps of max |reference| (tanh sublayer, alpha "
                      f"{ACCURACY_ALPHA:g}, min(T, {ACCURACY_TOKENS}) tokens), out / dx", "",
                  "| T x C x n | mhc_cupy | plain torch | floor: float64, sublayer in / out rounded |",
                  "|---|---|---|---|"]
        for r, a in acc:
            cells = [f"{a[i]['out']:.2f} / {a[i]['dx']:.2f}" if i in a else "-" for i in ("mhc_cupy", "torch", "floor")]
            lines.append(f"| {r['tokens']}x{r['C']}x{r['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing_words(result: dict) -> str:
    """How the PyTorch and JAX rows of a layer or block result were timed, in words."""
    meta = result.get("meta", {})
    if not meta.get("device", {}).get("sm"):
        threads = meta.get("settings", {}).get("torch_threads")
        return "wall clock (no CUDA GPU)" + (f", PyTorch on {threads} thread{'s' * (threads > 1)}" if threads else "")
    graph = meta.get("settings", {}).get("graph")
    return (f"{'CUDA graph replay' if graph else 'eager calls between CUDA events'} (PyTorch rows), "
            f"wall clock + block_until_ready (JAX rows)")


def format_layer_report(result: dict) -> str:
    """The layer mode's report (markdown): header, byte model, targets, table."""
    meta, copy = result.get("meta", {}), result.get("copy", {})
    st = meta.get("settings", {})
    lines = [f"# mhc_cupy.bench --layer  {meta.get('date', '')}  {meta.get('device', {}).get('name', '?')}  "
             f"dtype {st.get('dtype', '?')}", ""]
    if copy:
        lines.append(f"copy bandwidth: {copy['GBps']:.0f} GB/s ({copy.get('method', '')})  ")
    lines.append("byte floor: fwd 3A + 2Y + P, fwd+bwd 8A + 5Y + 3P (A one [T, n, C] tensor, Y one [T, C] tensor, "
                 "P phi + alpha + bias; the sublayer's own traffic not counted); % copy = floor bytes / time / copy "
                 "bandwidth  ")
    lines.append(f"timing: {timing_words(result)}; median of {st.get('reps')}  ")
    lines.append("ours faster by = that row's time / the mhc_cupy row's time of the same framework (> 1: ours "
                 "faster); rel err = relative L2 distance of out and dx from the mhc_cupy row")
    for s in result.get("skipped", []):
        lines.append(f"\nskipped: {s}")
    lines += ["", "```", format_targets(result.get("targets") or evaluate_layer_targets(result)), "```", "",
              format_layer_table(result)]
    return "\n".join(lines)
