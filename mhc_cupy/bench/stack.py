"""Stack mode: a model of L pre-norm blocks, plain residual vs mHC (``python -m mhc_cupy.bench --stack``).

Each block is the block mode's (:func:`mhc_cupy.bench.block.build_blocks`: causal SDPA attention and
SwiGLU, each behind RMSNorm); the model is L of them, with different weights per block.  Variants,
all with the same weights:

* ``plain``: the blocks with plain residual connections, on ``h [B, S, C]``;
* ``mhc chain``: every residual replaced by an ``MHC`` layer (2L of them), applied one after the other
  on ``x [B, S, n, C]``;
* ``MHCStack``: the same 2L layers in one :class:`mhc_cupy.torch.MHCStack` (recompute off);
* ``MHCStack recompute``: with ``recompute="auto"`` (the paper's number of blocks, shrinking toward the output:
  ``MHCStack.blocks``, recorded as ``blocks``; section 4.3);
* ``MHCStack fused`` / ``MHCStack fused recompute``: the same with ``fuse_boundaries=True`` (each
  residual update with the next layer's pre piece, ``mhc_boundary_fwd``; OPS.md section 12);
* ``MHCStack fused bwd`` / ``MHCStack fused bwd recompute``: those under the kernel choice
  ``boundary_bwd=True`` (the fused boundary backward, OPS.md section 12; off by default: slower on the
  H200), in force for their forward and backward: the A/B of the fused backward in one run;
* with ``torch.compile`` among the baselines: ``plain compiled`` and ``mhc chain compiled``;
* with ``jax.jit`` among the baselines, the mHC layers alone in JAX (2L layers, the sublayer ``tanh``):
  ``jax mhc_stack``, :func:`mhc_cupy.jax.mhc_stack` (a ``lax.scan`` over the layers), ``jax mhc_stack
  unroll`` (``unroll=True``: a Python loop), against ``jax.jit stack``, a ``lax.scan`` of :func:`mhc_cupy.bench.baselines.jnp_mhc_layer` (the same maths in plain
  ``jax.numpy``) over the same stacked parameters; ``jax.jit`` of the forward and of its VJP (wall clock +
  ``block_until_ready``), ``speedup`` = jax.jit's time / mhc_stack's (``speedup unroll``: / the unrolled's).

Timed: a training step of the model, ``torch.autograd.grad(model(x), [x, *weights], g)`` (CUDA events
around ``calls`` eager calls, median of ``reps`` after warm-up; wall clock on the CPU), and the peak of
the memory PyTorch's allocator holds during one step beyond what it held before (weights and inputs
excluded: activations saved for backward and the gradients).  Overhead = time / plain time - 1 and
memory = peak / plain peak, eager against eager and compiled against compiled.  Each MHCStack row also
says whether its dx equals the chain's bitwise (``dx_equals_chain``: it must), but the fused ones,
whose next-layer coefficients may differ in the last float32 bits: they give ``dx_rel_diff``, max |dx -
chain dx| / max |chain dx|.
"""

from __future__ import annotations

from pathlib import Path

from .._kernel_choice import kernel_choice
from . import env
from .block import build_blocks
from .layer import measure_torch, timing_words, torch_timer
from .report import gpu_targets, mode_report, run_rows, target

#: Default models: (blocks L, C, heads, SwiGLU hidden size, batch, sequence) — the issue's two.
STACK_CONFIGS = ((8, 2048, 16, 5504, 4, 2048), (4, 4096, 32, 11008, 1, 4096))
#: Targets (model fwd+bwd over plain, n = 4): {(L, C): (time recompute off, time recompute on, memory on)}.
STACK_TARGETS = {(8, 2048): (0.10, 0.13, 1.25), (4, 4096): (0.06, None, 1.3)}
#: Target: JAX mhc_stack's jit(grad) at least this much faster than jax.jit of the same maths (n = 4).
JAX_STACK_SPEEDUP = 2.0


def build_models(L: int, C: int, heads: int, ffn: int, n: int, device, dtype) -> dict:
    """{name: (module, input shape suffix)} of the variants above, sharing their weights."""
    from torch import nn

    import mhc_cupy.torch as mt

    plain_blocks, mhc_layers = [], []
    for _ in range(L):
        plain, mhc = build_blocks(C, heads, ffn, n, device, dtype)
        plain_blocks.append(plain)
        mhc_layers += [mhc.attn, mhc.mlp]
    return {
        "plain": nn.Sequential(*plain_blocks),
        "mhc chain": nn.Sequential(*mhc_layers),
        "MHCStack": mt.MHCStack(mhc_layers),
        "MHCStack recompute": mt.MHCStack(mhc_layers, recompute="auto"),
        "MHCStack fused": mt.MHCStack(mhc_layers, fuse_boundaries=True),
        "MHCStack fused recompute": mt.MHCStack(mhc_layers, recompute="auto", fuse_boundaries=True),
        "MHCStack fused bwd": mt.MHCStack(mhc_layers, fuse_boundaries=True),
        "MHCStack fused bwd recompute": mt.MHCStack(mhc_layers, recompute="auto", fuse_boundaries=True),
    }


#: The kernel choice each variant runs under (besides the run's ``--choose``), forward and backward.
VARIANT_CHOICE = {"MHCStack fused bwd": {"boundary_bwd": True}, "MHCStack fused bwd recompute": {"boundary_bwd": True}}


def stack_case(L: int, C: int, heads: int, ffn: int, batch: int, seq: int, cfg, on_gpu: bool,
               compile_: bool) -> dict:
    """Time and measure every variant at one configuration; returns the result row."""
    import torch

    import mhc_cupy.torch as mt

    dev = torch.device("cuda" if on_gpu else "cpu")
    dt = getattr(torch, cfg.dtype)
    n = cfg.streams
    row = {"L": L, "C": C, "heads": heads, "ffn": ffn, "batch": batch, "seq": seq, "n": n, "dtype": cfg.dtype,
           "recompute_blocks": mt.stack.recompute_blocks("auto", n, 2 * L),
           "blocks": list(mt.stack.block_sizes("auto", n, 2 * L) or []), "impls": {}, "overhead": {},
           "memory": {}}
    timer = torch_timer(on_gpu, cfg)

    def gen(shape, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dt)

    torch.manual_seed(0)
    models = build_models(L, C, heads, ffn, n, dev, dt)
    if compile_:
        torch._dynamo.reset()
        models["plain compiled"] = torch.compile(models["plain"], dynamic=False)
        models["mhc chain compiled"] = torch.compile(models["mhc chain"], dynamic=False)
    chain_dx = {}
    for name, model in models.items():
        shape = (batch, seq, C) if name.startswith("plain") else (batch, seq, n, C)
        xs, gs = [gen(shape, 0)], [gen(shape, 1)]
        with kernel_choice(**VARIANT_CHOICE.get(name, {})):
            rows, firsts = measure_torch(model, list(model.parameters()), xs, gs, cfg.min_calls, timer, on_gpu,
                                         dirs=("fwd+bwd",))
        v = row["impls"][name] = rows["fwd+bwd"]
        if name.startswith("MHCStack") and "dx" in firsts and "dx" in chain_dx:
            a, b = firsts["dx"].float(), chain_dx["dx"].float()
            if "fused" in name:  # the next layers' coefficients to float32 rounding
                v["dx_rel_diff"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            else:  # the same maths, bitwise
                v["dx_equals_chain"] = bool(torch.equal(a, b))
        elif name == "mhc chain" and "dx" in firsts:
            chain_dx["dx"] = firsts["dx"]
        peak = v.get("peak_bytes")
        env._log(f"  {name}: " + (f"fwd+bwd {v['us'] / 1e3:.3f} ms" if "us" in v else v["error"])
                 + (f", peak {peak / 2**30:.2f} GiB" if peak else ""))
        del xs, gs
        env._free_gpu_memory()
    if "jax.jit" in cfg.baselines:
        row["jax"] = jax_stack_rows(2 * L, C, batch, seq, n, cfg)
    for name, v in row["impls"].items():
        base = row["impls"].get("plain compiled" if name.endswith("compiled") else "plain", {})
        if name.startswith("plain") or "us" not in v or "us" not in base:
            continue
        row["overhead"][name] = v["us"] / base["us"] - 1.0
        if v.get("peak_bytes") and base.get("peak_bytes"):
            row["memory"][name] = v["peak_bytes"] / base["peak_bytes"]
    return row


def jax_stack_rows(layers: int, C: int, batch: int, seq: int, n: int, cfg) -> dict:
    """``jax mhc_stack`` and ``jax.jit stack`` (module docstring): {impl: {"fwd": row, "fwd+bwd": row}}
    and ``speedup`` {direction: jax.jit's time / mhc_stack's}."""
    import jax
    import jax.numpy as jnp

    import mhc_cupy.jax as mj

    from .baselines import jnp_mhc_layer
    from .layer import measure_jax

    params = mj.mhc_stack_init(jax.random.PRNGKey(0), layers, dim=C, n_streams=n)
    kx, kg = jax.random.split(jax.random.PRNGKey(1))
    dt = getattr(jnp, cfg.dtype)
    x = jax.random.normal(kx, (batch, seq, n, C), jnp.float32).astype(dt)
    g = jax.random.normal(kg, (batch, seq, n, C), jnp.float32).astype(dt)
    impls = {"jax mhc_stack": lambda p, x: mj.mhc_stack(p, x, jnp.tanh),
             "jax mhc_stack unroll": lambda p, x: mj.mhc_stack(p, x, jnp.tanh, unroll=True),
             "jax.jit stack": lambda p, x: jax.lax.scan(lambda h, pl: (jnp_mhc_layer(pl, h, jnp.tanh), None), x, p)[0]}
    out = {}
    for name, fn in impls.items():
        out[name] = measure_jax(fn, params, [x], [g], cfg.min_calls, cfg)[0]
        env._log(f"  {name}: " + ", ".join(f"{d} {r['us'] / 1e3:.3f} ms" if "us" in r else f"{d} error"
                                         for d, r in out[name].items()))
    base = out["jax.jit stack"]
    for key, name in (("speedup", "jax mhc_stack"), ("speedup unroll", "jax mhc_stack unroll")):
        ours = out[name]
        out[key] = {d: base[d]["us"] / ours[d]["us"] for d in ours if "us" in ours[d] and "us" in base.get(d, {})}
    return out


def run_stack(cfg) -> dict:
    """Run the stack mode ``cfg`` asks for (parsed arguments); returns the result dict."""
    result, on_gpu, compile_, t0 = env.torch_mode_start(cfg, "stack", n=cfg.streams, configs=[list(c) for c in cfg.stack_configs])
    if "jax.jit" in cfg.baselines:
        why = env._jax_status() if on_gpu else env._import_status("jax")
        if why:
            result["skipped"].append(f"jax rows skipped: {why}")
            env._log(result["skipped"][-1])
            cfg.baselines = [b for b in cfg.baselines if b != "jax.jit"]
    return run_rows(result, Path(cfg.out) / "stack.json", cfg.stack_configs,
                    lambda c: f"stack of {c[0]} blocks, C {c[1]}, {c[4]} x {c[5]} tokens",
                    lambda c: stack_case(*c, cfg, on_gpu, compile_), evaluate_stack_targets, t0)


@gpu_targets
def evaluate_stack_targets(result: dict) -> list[dict]:
    """Model overhead and memory over plain against the issue's targets (n = 4)."""
    out = []
    for (L, C), goals in STACK_TARGETS.items():
        row = next((r for r in result.get("results", []) if (r["L"], r["C"]) == (L, C) and r["n"] == 4), None)
        checks = (("time over plain, recompute off", "MHCStack", "overhead", goals[0]),
                  ("time over plain, recompute on", "MHCStack recompute", "overhead", goals[1]),
                  ("peak memory vs plain, recompute on", "MHCStack recompute", "memory", goals[2]))
        for what, impl, kind, goal in checks:
            if goal is None:
                continue
            name = f"{L} blocks, C {C}: {what} <= " + (f"+{goal:.0%}" if kind == "overhead" else f"{goal:.2f}x")
            got = None if row is None else row[kind].get(impl)
            out.append(target(name, got, goal, "" if got is None else f"{got:+.1%}" if kind == "overhead"
                              else f"{got:.2f}x"))
    # every n = 4 configuration with JAX rows (the slowest speedup; one where mhc_stack failed: missed)
    rows = [r for r in result.get("results", []) if r["n"] == 4 and "jax" in r]
    name = f"JAX mhc_stack (lax.scan) jit(grad) >= {JAX_STACK_SPEEDUP:g}x faster than jax.jit of the same maths"
    failed = [r for r in rows if "error" in r["jax"].get("jax mhc_stack", {}).get("fwd+bwd", {})]
    speeds = [(r["jax"]["speedup"]["fwd+bwd"], r) for r in rows if "fwd+bwd" in r["jax"].get("speedup", {})]
    if failed:
        out.append({"name": name, "status": "missed", "measured": None, "detail": "mhc_stack failed at " + ", ".join(
            f"{r['L']} blocks, C {r['C']}" for r in failed)})
    else:
        got, r = min(speeds, key=lambda v: v[0]) if speeds else (None, None)
        out.append(target(name, got, JAX_STACK_SPEEDUP, "" if got is None else
                          f"{got:.2f}x at {r['L']} blocks, C {r['C']} (slowest of {len(speeds)})", higher=True))
    return out


def format_stack_report(result: dict) -> str:
    """The stack mode's report (markdown): header, targets, table."""
    st = result.get("meta", {}).get("settings", {})

    def cells(r, name, v):
        ov, mem, peak = r["overhead"].get(name), r["memory"].get(name), v.get("peak_bytes")
        if "recompute" in name and r.get("blocks"):  # (recompute="auto": its blocks, first to last)
            name = f"{name} ({', '.join(map(str, r['blocks']))})"
        return [str(r["L"]), str(r["C"]), f"{r['batch']} x {r['seq']}", name,
                f"{v['us'] / 1e3:.3f}" if "us" in v else "err", "" if ov is None else f"{ov:+.1%}",
                "" if not peak else f"{peak / 2**30:.2f}", "" if mem is None else f"{mem:.2f}x"]

    text = mode_report(
        result, "stack",
        f"L pre-norm blocks (attention + SwiGLU), mHC n = {st.get('n')} around every sublayer; fwd+bwd of the model "
        f"({timing_words(result)}, median of {st.get('reps')}); overhead = time / plain time - 1; memory = peak "
        "allocator bytes of a step beyond weights and inputs / plain's",
        evaluate_stack_targets, ("L", "C", "tokens", "impl", "fwd+bwd ms", "overhead", "peak GiB", "memory"), cells)
    jax_rows = [r for r in result.get("results", []) if "jax" in r]
    if not jax_rows:
        return text
    lines = ["", "JAX, the 2L mHC layers alone (sublayer tanh; lax.scan over the layers, unroll: a Python loop; "
             "jax.jit, wall clock + block_until_ready): speedup = jax.jit stack's time / that row's", "",
             "| L | C | tokens | impl | fwd ms | fwd+bwd ms | speedup fwd / fwd+bwd |", "|---|---|---|---|---|---|---|"]
    for r in jax_rows:
        for name, key in (("jax mhc_stack", "speedup"), ("jax mhc_stack unroll", "speedup unroll"),
                          ("jax.jit stack", None)):
            v = r["jax"].get(name)
            if v is None:  # (a result file from before the unroll rows)
                continue
            sp = r["jax"].get(key, {})
            ms = [f"{v[d]['us'] / 1e3:.3f}" if "us" in v.get(d, {}) else "err" for d in ("fwd", "fwd+bwd")]
            spd = " / ".join(f"{sp[d]:.2f}x" if d in sp else "-" for d in ("fwd", "fwd+bwd")) if key else ""
            lines.append(f"| {r['L']} | {r['C']} | {r['batch']} x {r['seq']} | {name} | {ms[0]} | {ms[1]} | {spd} |")
    return text + "\n".join(lines) + "\n"
