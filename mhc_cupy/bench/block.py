"""Block mode: a pre-norm transformer block, plain residual vs mHC (``python -m mhc_cupy.bench --block``).

The block, in plain PyTorch (bf16 weights and activations by default):

    h = h + Attention(RMSNorm(h))      attention: fused QKV projection, causal
                                       F.scaled_dot_product_attention, output projection
    h = h + SwiGLU(RMSNorm(h))         W2 (silu(W1 h) * W3 h)

and the same block with each residual connection replaced by ``mhc_cupy.torch.MHC``
(n streams, default 4): ``x = MHC(C, n, sublayer=RMSNorm -> Attention)(x)``, then the
same with the MLP, on ``x [batch, seq, n, C]``.  A network expands its embedding into
the n streams once (``expand_streams``) and collapses them once at the end
(``collapse_streams``); that cost is per network, not per block, and is not timed.

Timed: a training step of one block, ``torch.autograd.grad(block(x), [x, *weights], g)``,
``calls`` eager calls between CUDA events (``--graph``: a CUDA graph replay), median
of ``reps``, after warm-up; wall clock without a GPU.  With ``torch.compile`` in the
baselines, both blocks are also timed compiled (``torch.compile(dynamic=False)``).
Overhead = mHC block time / plain block time - 1, eager against eager and compiled
against compiled.  ``floor share`` is the byte floor of the two mHC layers
(:func:`mhc_cupy.bench.layer.layer_bytes`, fwd+bwd) at the copy bandwidth over the
plain block's time: the least overhead a layer at the copy roofline could add.
"""

from __future__ import annotations

from pathlib import Path

from . import env
from .._kernel_choice import kernel_choice
from .layer import kernel_variants, layer_bytes, measure_torch, timing_words, torch_timer
from .report import gpu_targets, mode_report, run_rows, target

#: Default blocks: (C, heads, SwiGLU hidden size).
BLOCK_CONFIGS = ((4096, 32, 11008), (2048, 16, 5504))
BLOCK_BATCH, BLOCK_SEQ, BLOCK_N = 4, 4096, 4
#: Targets: mHC block overhead over the plain residual block (fwd+bwd), by C.
BLOCK_TARGETS = {4096: 0.12, 2048: 0.20}


def build_blocks(C: int, heads: int, ffn: int, n: int, device, dtype, mhc_kwargs=None):
    """(plain block, mHC block) with the same attention and MLP weights.

    Both are ``torch.nn.Module``; the plain block maps ``[B, S, C] -> [B, S, C]``, the mHC
    block ``[B, S, n, C] -> [B, S, n, C]`` (its MHC coefficients float32, the rest ``dtype``).
    ``mhc_kwargs`` go to both ``MHC`` constructors; they run the fused pieces unless built under
    ``kernel_choice(fused=False)`` (:mod:`mhc_cupy._kernel_choice`).
    """
    import copy

    import torch.nn.functional as F
    from torch import nn

    import mhc_cupy.torch as mt

    if C % heads:
        raise ValueError(f"C = {C} is not a multiple of heads = {heads}")
    kw = {"device": device, "dtype": dtype}

    class PreNorm(nn.Module):
        """RMSNorm, then bias-free projections C -> width_in (``inp``) and width_out -> C (``out``)."""

        def __init__(self, width_in, width_out):
            super().__init__()
            self.norm = nn.RMSNorm(C, eps=1e-5, **kw)
            self.inp = nn.Linear(C, width_in, bias=False, **kw)
            self.out = nn.Linear(width_out, C, bias=False, **kw)

    class Attention(PreNorm):  # causal multi-head self-attention
        def __init__(self):
            super().__init__(3 * C, C)

        def forward(self, h):
            B, S, _ = h.shape
            q, k, v = self.inp(self.norm(h)).view(B, S, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(o.transpose(1, 2).reshape(B, S, C))

    class SwiGLU(PreNorm):
        def __init__(self):
            super().__init__(2 * ffn, ffn)

        def forward(self, h):
            a, b = self.inp(self.norm(h)).chunk(2, dim=-1)
            return self.out(F.silu(a) * b)

    class PlainBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = Attention(), SwiGLU()

        def forward(self, h):
            h = h + self.attn(h)
            return h + self.mlp(h)

    class MHCBlock(nn.Module):
        def __init__(self, attn, mlp):
            super().__init__()
            self.attn = mt.MHC(C, n, sublayer=attn, device=device, **(mhc_kwargs or {}))
            self.mlp = mt.MHC(C, n, sublayer=mlp, device=device, **(mhc_kwargs or {}))

        def forward(self, x):
            return self.mlp(self.attn(x))

    plain = PlainBlock()
    return plain, MHCBlock(copy.deepcopy(plain.attn), copy.deepcopy(plain.mlp))


def block_case(C: int, heads: int, ffn: int, cfg, copy_GBps, on_gpu: bool, variants, compile_: bool) -> dict:
    """Time the plain and the mHC block at one configuration, the mHC block for each of ``variants``
    (:func:`mhc_cupy.bench.layer.kernel_variants`, built and timed under its choice); returns the
    result row."""
    import torch

    dev = torch.device("cuda" if on_gpu else "cpu")
    dt = getattr(torch, cfg.dtype)
    B, S, n = cfg.batch, cfg.seq, cfg.streams
    isz = torch.empty((), dtype=dt).element_size()
    floor = 2 * layer_bytes("fwd+bwd", B * S, C, n, isz)
    row = {"C": C, "heads": heads, "ffn": ffn, "batch": B, "seq": S, "n": n, "dtype": cfg.dtype,
           "mhc_floor_bytes": floor, "mhc_floor_us": floor / copy_GBps / 1e3 if copy_GBps else None,
           "copy_GBps": copy_GBps, "impls": {}, "overhead": {}}
    sets = 2

    def gen(shape, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dt)

    timer = torch_timer(on_gpu, cfg)

    def run(name, module, shape):
        xs = [gen(shape, 2 * k) for k in range(sets)]
        gs = [gen(shape, 2 * k + 1) for k in range(sets)]
        rows, _ = measure_torch(module, list(module.parameters()), xs, gs, cfg.min_calls, timer, on_gpu,
                                dirs=("fwd+bwd",))
        row["impls"][name] = rows["fwd+bwd"]
        v = rows["fwd+bwd"]
        env._log(f"  {name}: " + (f"fwd+bwd {v['us'] / 1e3:.3f} ms" if "us" in v else v["error"]))
        del xs, gs
        env._free_gpu_memory()

    for label in [""] + ([" compiled"] if compile_ else []):
        for i, (suffix, choice) in enumerate(variants):
            torch.manual_seed(0)  # the same weights for every variant and run
            with kernel_choice(choice):
                try:
                    plain, mhc = build_blocks(C, heads, ffn, n, dev, dt)
                except Exception as e:  # noqa: BLE001
                    row["impls"][f"mhc{suffix}{label}"] = env._error(e)
                    continue
                if label:
                    torch._dynamo.reset()
                    plain, mhc = torch.compile(plain, dynamic=False), torch.compile(mhc, dynamic=False)
                if i == 0:
                    run(f"plain{label}", plain, (B, S, C))
                run(f"mhc{suffix}{label}", mhc, (B, S, n, C))
                del plain, mhc
    for name, v in row["impls"].items():
        if name.startswith("mhc") and "us" in v:
            base = row["impls"].get("plain compiled" if name.endswith("compiled") else "plain", {})
            if "us" in base:
                row["overhead"][name] = v["us"] / base["us"] - 1.0
    plain = row["impls"].get("plain", {})
    if "us" in plain and row["mhc_floor_us"]:
        row["floor_share"] = row["mhc_floor_us"] / plain["us"]
    return row


def run_block(cfg) -> dict:
    """Run the block mode ``cfg`` asks for (parsed arguments); returns the result dict."""
    variants = kernel_variants(cfg.fused)
    result, on_gpu, compile_, t0 = env.torch_mode_start(cfg, "block", fused=cfg.fused, batch=cfg.batch,
                                                         seq=cfg.seq, n=cfg.streams,
                                                         configs=[list(c) for c in cfg.block_configs])
    copy = result["copy"]
    return run_rows(result, Path(cfg.out) / "block.json", cfg.block_configs,
                    lambda c: f"block C {c[0]}, {c[1]} heads, SwiGLU {c[2]}",
                    lambda c: block_case(*c, cfg, copy["GBps"], on_gpu, variants, compile_), evaluate_block_targets, t0)


@gpu_targets
def evaluate_block_targets(result: dict) -> list[dict]:
    """mHC block overhead (eager, the first mhc row: the fused pieces with ``--fused both``) over the plain block
    against the issue's targets; where that row failed, missed (not judged on the next variant)."""
    out = []
    for C, goal in BLOCK_TARGETS.items():
        name = f"mHC block overhead over plain residual, C {C} <= +{goal:.0%}"
        row = next((r for r in result.get("results", []) if r["C"] == C), None)
        first = None if row is None else next((k for k in row["impls"] if k.startswith("mhc")
                                               and not k.endswith("compiled")), None)
        if first is not None and "error" in row["impls"][first]:
            out.append({"name": name, "status": "missed", "measured": None,
                        "detail": f"{first} failed: {row['impls'][first]['error']}"})
            continue
        ov = None if first is None else row["overhead"].get(first)
        out.append(target(name, ov, goal, "" if ov is None else f"{ov:+.1%} ({first})"))
    return out


def format_block_report(result: dict) -> str:
    """The block mode's report (markdown): header, targets, table."""
    st, copy = result.get("meta", {}).get("settings", {}), result.get("copy", {})

    def cells(r, name, v):
        ov = r["overhead"].get(name)
        return [str(r["C"]), str(r["heads"]), str(r["ffn"]), name, f"{v['us'] / 1e3:.3f}" if "us" in v else "err",
                "" if ov is None else f"{ov:+.1%}",
                f"{r['floor_share']:.1%}" if name == "plain" and r.get("floor_share") else ""]

    return mode_report(
        result, "block",
        f"pre-norm block, {st.get('batch')} x {st.get('seq')} tokens, mHC n = {st.get('n')}; fwd+bwd of one block "
        f"({timing_words(result)}, median of {st.get('reps')}); overhead = mHC time / plain time - 1; floor share = "
        f"byte floor of the two mHC layers at the copy bandwidth ({copy.get('GBps', 0):.0f} GB/s) / plain block time",
        evaluate_block_targets, ("C", "heads", "SwiGLU", "impl", "fwd+bwd ms", "overhead", "floor share"), cells)
