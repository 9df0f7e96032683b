"""Train a small byte-level transformer with mHC residual connections: ``python -m mhc_cupy.demo``.

A decoder-only transformer (causal self-attention + MLP blocks, pre-norm
inside each sublayer) whose every sublayer is wrapped by :class:`mhc_cupy.torch.MHC`
with n = 4 residual streams (paper: arXiv 2512.24880), all of them in one
:class:`mhc_cupy.torch.MHCStack` with stream recompute (``--recompute``, default "auto": the paper's
number of blocks, shrinking toward the output; the same losses as without, less activation memory),
trained on real text:
by default the documentation shipped with CPython (``pydoc_data.topics``,
about 0.47 MB), byte-level tokens (vocabulary 256), so it runs offline.  The
last 5% of the bytes are held out.

* On a GPU (torch CUDA and a CuPy GPU): the toolkit's CUDA kernels through
  ``mhc_cupy.torch``; parameters float32, sublayers under bfloat16 autocast,
  residual streams in bfloat16 (coefficients always float32).  Default
  config: d_model 256, 6 layers, 4 heads, seq 256, batch 32, 1000 steps.
* Without a GPU (or ``--device cpu``): the same code on CPU tensors, where
  every mHC op runs the float64 NumPy reference; float32 everywhere; a tiny
  config (d_model 64, 2 layers, seq 64, batch 8, 200 steps) that finishes in
  well under two minutes on two cores.  ``--tiny`` selects the tiny config on
  any device.
* ``--baseline`` also trains the same model with plain residual connections
  (same initial sublayer weights, seed and data order) and compares held-out
  losses at equal steps.

* Data-parallel: ``torchrun --nproc-per-node N -m mhc_cupy.demo`` trains with
  ``DistributedDataParallel`` (NCCL on GPUs, one per rank; gloo on CPU).
  Every rank draws the same global batch of ``--batch`` sequences and trains
  on its own contiguous slice (``--batch`` must be divisible by N), so the
  training equals one process at the same global batch up to float rounding;
  held-out evaluation is split over the ranks.  Only rank 0 prints progress
  and writes the outputs.

Writes ``loss_curve.png`` and ``summary.json`` into ``--out`` (default ``demo_out/``).
Progress: one line per held-out evaluation (stdout), and a progress bar on stderr when
stderr is a terminal (not in a notebook, a log file or CI).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

from ._deps import require

for _module in ("torch", "matplotlib", "tqdm"):  # missing: an ImportError naming the extra
    require(_module, "demo", "python -m mhc_cupy.demo")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from .torch import MHC, MHCStack, collapse_streams, expand_streams
from ._checks import MAX_N
from ._stack import block_sizes, recompute_blocks

GPU_PRESET = dict(dim=256, layers=6, heads=4, seq=256, batch=32, steps=1000, lr=2e-3, eval_every=100,
                  eval_batches=4, dropout=0.1)
TINY_PRESET = dict(dim=64, layers=2, heads=4, seq=64, batch=8, steps=200, lr=3e-3, eval_every=25,
                   eval_batches=4, dropout=0.0)


@dataclass
class Config:
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    steps: int
    lr: float
    eval_every: int
    eval_batches: int
    dropout: float
    streams: int = 4
    seed: int = 0
    weight_decay: float = 0.1
    warmup: int = 0
    grad_clip: float = 1.0
    recompute: object = "auto"  # MHCStack's stream recompute: None, an int L_r or "auto"


# ------------------------------------------------------------------- data
def load_text(path=None) -> bytes:
    """The corpus as bytes: ``path`` or CPython's bundled documentation (pydoc_data.topics)."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def split_data(data: bytes, held_out: float = 0.05):
    # (torch.frombuffer refuses an empty buffer: empty data gives two empty parts)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)
    cut = int(len(t) * (1.0 - held_out))
    return t[:cut], t[cut:]


def get_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Random windows (inputs, next-byte targets) [batch, seq], drawn with ``gen`` (CPU)."""
    idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    win = torch.stack([data[i:i + seq + 1] for i in idx.tolist()])
    return win[:, :-1], win[:, 1:]


def eval_windows(data: torch.Tensor, n: int, seq: int):
    """n fixed, evenly spaced held-out windows (same for every model and every evaluation)."""
    starts = torch.linspace(0, len(data) - seq - 2, n).long().tolist()
    win = torch.stack([data[i:i + seq + 1] for i in starts])
    return win[:, :-1], win[:, 1:]


# ------------------------------------------------------------------ model
class CausalSelfAttention(nn.Module):
    """Pre-norm causal multi-head self-attention [B, T, C] -> [B, T, C]."""

    def __init__(self, dim, heads, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    """Pre-norm GELU MLP (hidden 4C) [B, T, C] -> [B, T, C]."""

    def __init__(self, dim, dropout=0.0):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))


class Residual(nn.Module):
    """The plain residual connection x + F(x) (the baseline)."""

    def __init__(self, sublayer):
        super().__init__()
        self.sublayer = sublayer

    def forward(self, x):
        return x + self.sublayer(x).to(x.dtype)


class TinyGPT(nn.Module):
    """Byte-level decoder-only transformer; ``residual="mhc"`` wraps each sublayer in MHC.

    The sublayers, embeddings and head are created (and drawn from the RNG)
    before any MHC parameter, so the mHC model and the baseline built from
    the same seed start from identical sublayer weights.  The residual
    streams are kept in ``stream_dtype`` (bfloat16 on GPU, for both models).
    """

    def __init__(self, cfg: Config, residual: str = "mhc", stream_dtype=torch.float32, vocab: int = 256):
        super().__init__()
        self.residual, self.n, self.stream_dtype = residual, cfg.streams, stream_dtype
        self.tok = nn.Embedding(vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        subs = []
        for _ in range(cfg.layers):
            subs += [CausalSelfAttention(cfg.dim, cfg.heads, cfg.dropout), MLP(cfg.dim, cfg.dropout)]
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        # GPT-2 init: matrices N(0, 0.02), output projections scaled down by depth.
        named = list(self.named_parameters()) + [(n, p) for s in subs for n, p in s.named_parameters()]
        for name, p in named:
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
        if residual == "mhc":
            self.blocks = MHCStack([MHC(cfg.dim, cfg.streams, s) for s in subs], recompute=cfg.recompute)
        elif residual == "plain":
            self.blocks = nn.ModuleList(Residual(s) for s in subs)
        else:
            raise ValueError(f"residual must be 'mhc' or 'plain', got {residual!r}")

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        h = (self.tok(idx) + self.pos(torch.arange(T, device=idx.device))).to(self.stream_dtype)
        if self.residual == "mhc":
            h = collapse_streams(self.blocks(expand_streams(h, self.n)).float())
        else:
            for b in self.blocks:
                h = b(h)
        logits = self.head(self.norm(h.float()))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model, weight_decay):
    """Weight decay on 2-D sublayer / embedding matrices only (not on mHC's phi, alpha, bias, norms)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_mhc = name.split(".")[-1] in ("phi", "alpha", "bias") and ".sublayer." not in name
        (decay if p.dim() == 2 and not is_mhc else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------- data-parallel
class DataParallel:
    """The torch.distributed process group of a torchrun launch (one rank per process).

    :meth:`from_env` returns None for a plain (single-process) run.  NCCL on
    GPUs (rank r on ``cuda:LOCAL_RANK``), gloo on CPU.
    """

    def __init__(self, rank: int, world: int, local_rank: int, backend: str):
        self.rank, self.world, self.local_rank, self.backend = rank, world, local_rank, backend

    @classmethod
    def from_env(cls, use_gpu: bool):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        backend = "nccl" if use_gpu else "gloo"
        if use_gpu:
            torch.cuda.set_device(local)
        dist.init_process_group(backend, rank=rank, world_size=world)
        return cls(rank, world, local, backend)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def slice(self, t):
        """This rank's contiguous share of a global batch (the batch is divisible by the world size)."""
        per = len(t) // self.world
        return t[self.rank * per:(self.rank + 1) * per]

    def share(self, n: int):
        """[lo, hi) of this rank's share of n items (the last ranks may get fewer)."""
        per = -(-n // self.world)
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)

    def all_reduce(self, t):
        import torch.distributed as dist

        dist.all_reduce(t)

    def wrap(self, model, device):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def barrier(self):
        import torch.distributed as dist

        dist.barrier()

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


# --------------------------------------------------------------- training
def gpu_available() -> bool:
    """torch sees a CUDA device and CuPy can run kernels on it."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def lr_at(step, cfg: Config):
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, t))))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_finite(values, what):
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"{what}: non-finite loss {bad[0]} (NaN/inf); stopping")


@torch.no_grad()
def evaluate(model, xs, ys, batch, autocast, dp=None):
    """Mean held-out loss over the windows ``xs, ys``; data-parallel: each rank its share, summed."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=xs.device)
    lo, hi = dp.share(len(xs)) if dp else (0, len(xs))
    for i in range(lo, hi, batch):
        j = min(i + batch, hi)
        with autocast():
            total += model(xs[i:j], ys[i:j]).double() * (j - i)
    if dp:
        dp.all_reduce(total)
    model.train()
    loss = float(total) / len(xs)
    _check_finite([loss], "held-out")
    return loss


def train(name, model, cfg: Config, train_data, eval_xy, device, autocast, log_every=10, warm_steps=3, dp=None):
    """Train ``model`` for cfg.steps; returns its history (losses, eval losses, tokens/s, wall time).

    ``dp`` (:class:`DataParallel`): ``model`` is DDP-wrapped, each rank trains
    on its slice of every global batch; logged losses are averaged over the
    ranks and tokens/s counts the global batch.
    """
    from tqdm import tqdm

    main = dp is None or dp.main
    net = getattr(model, "module", model)  # evaluation: the plain module (no DDP hooks)

    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # data order: identical for every model
    torch.manual_seed(cfg.seed + 2)  # dropout
    ex, ey = (t.to(device) for t in eval_xy)
    hist = {"step": [], "train_loss": [], "eval_step": [], "eval_loss": []}
    pending = []
    timed_tokens, timed_s, t_start = 0, 0.0, time.perf_counter()
    hist["eval_step"].append(0)
    hist["eval_loss"].append(evaluate(net, ex, ey, cfg.batch, autocast, dp))
    # The bar only on a terminal: in a notebook, a log file or CI each refresh would be one more chunk of
    # output; the evaluation lines below report the progress there.
    bar = tqdm(range(cfg.steps), desc=name, dynamic_ncols=True, file=sys.stderr,
               disable=not (main and _is_terminal(sys.stderr)))
    _sync(device)
    t0 = time.perf_counter()
    for step in bar:
        x, y = get_batch(train_data, cfg.batch, cfg.seq, gen)
        if dp:
            x, y = dp.slice(x), dp.slice(y)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with autocast():
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        pending.append(loss.detach())
        done = step + 1
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        if len(pending) == log_every or is_eval:
            values = torch.stack(pending).float()
            if dp:
                dp.all_reduce(values)
                values /= dp.world
            values = values.tolist()  # one host sync per log interval
            _check_finite(values, f"{name} step {done}")
            hist["step"] += list(range(done - len(values) + 1, done + 1))
            hist["train_loss"] += values
            pending = []
            _sync(device)
            t1 = time.perf_counter()
            if done > warm_steps:  # skip the first steps (kernel compilation / cache loads)
                counted = min(len(values), done - warm_steps)
                timed_tokens += counted * cfg.batch * cfg.seq
                timed_s += (t1 - t0) * counted / len(values)
            tok_s = f"{timed_tokens / timed_s:,.0f}" if timed_s > 0 else "-"  # (the first steps are not timed)
            bar.set_postfix(loss=f"{values[-1]:.3f}", tok_s=tok_s)
            if is_eval:
                ev = evaluate(net, ex, ey, cfg.batch, autocast, dp)
                hist["eval_step"].append(done)
                hist["eval_loss"].append(ev)
                if main:
                    bar.write(f"[{name}] step {done:5d}  batch {values[-1]:.4f}  held-out {ev:.4f}  "
                              f"{tok_s} tok/s")
            _sync(device)
            t0 = time.perf_counter()
    bar.close()
    hist["tokens_per_s"] = timed_tokens / timed_s if timed_s > 0 else None
    hist["wall_s"] = time.perf_counter() - t_start
    tail = hist["train_loss"][-min(20, len(hist["train_loss"])):]
    hist["final_train_loss"] = sum(tail) / len(tail)  # mean of the last (up to) 20 steps
    hist["final_eval_loss"] = hist["eval_loss"][-1]
    hist["params"] = sum(p.numel() for p in model.parameters())
    return hist


def plot(histories, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"mhc": "tab:blue", "baseline": "tab:orange"}
    for name, h in histories.items():
        c = colors.get(name)
        k = max(1, len(h["train_loss"]) // 50)  # running mean over ~2% of the steps
        tl = h["train_loss"]
        smooth = [sum(tl[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(tl))]
        ax.plot(h["step"], smooth, color=c, alpha=0.5, lw=1,
                label=f"{name} train (running mean of {k} step{'s' if k > 1 else ''})")
        ax.plot(h["eval_step"], h["eval_loss"], color=c, marker="o", ms=3, lw=2, label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------- CLI
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mhc_cupy.demo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="training steps (GPU 1000, tiny 200)")
    ap.add_argument("--batch", type=int, help="sequences per step (GPU 32, tiny 8)")
    ap.add_argument("--seq", type=int, help="tokens (bytes) per sequence (GPU 256, tiny 64)")
    ap.add_argument("--layers", type=int, help="transformer blocks, each attention + MLP (GPU 6, tiny 2)")
    ap.add_argument("--dim", type=int, help="d_model, C (GPU 256, tiny 64)")
    ap.add_argument("--heads", type=int, help="attention heads (GPU 4, tiny 4); must divide --dim")
    ap.add_argument("--streams", type=int, default=4, help="mHC residual streams n (default 4)")
    ap.add_argument("--recompute", default="auto",
                    help="MHCStack's stream recompute: none, a block size L_r, or auto (default: as many blocks as the "
                         "paper's L_r* = sqrt(n L / (n + 2)) gives over the 2 x --layers mHC layers, shrinking toward "
                         "the output)")
    ap.add_argument("--lr", type=float, help="peak AdamW learning rate (GPU 2e-3, tiny 3e-3)")
    ap.add_argument("--eval-every", type=int, help="steps between held-out evaluations (GPU 100, tiny 25)")
    ap.add_argument("--text", help="train on this file (bytes) instead of CPython's documentation")
    ap.add_argument("--out", default="demo_out", help="output directory (default demo_out/)")
    ap.add_argument("--tiny", action="store_true", help="the tiny (CPU) configuration, on any device")
    ap.add_argument("--baseline", action="store_true", help="also train with plain residual connections and compare")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda if torch and CuPy both see a GPU, else cpu")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    return ap.parse_args(argv)


def make_config(args, device) -> Config:
    preset = dict(TINY_PRESET if (args.tiny or device.type == "cpu") else GPU_PRESET)
    for k in ("steps", "batch", "seq", "layers", "dim", "heads", "lr", "eval_every"):
        v = getattr(args, k)
        if v is not None:
            preset[k] = v
    recompute = {"none": None, "auto": "auto"}.get(args.recompute.lower(), args.recompute)
    if isinstance(recompute, str) and recompute != "auto":
        if not recompute.isdigit() or int(recompute) < 1:
            raise SystemExit(f"--recompute must be none, auto or a positive int, got {args.recompute!r}")
        recompute = int(recompute)
    cfg = Config(**preset, streams=args.streams, seed=args.seed, recompute=recompute)
    cfg.warmup = min(50, cfg.steps // 10)
    if cfg.eval_every < 1:
        raise SystemExit(f"--eval-every must be >= 1, got {cfg.eval_every}")
    cfg.eval_every = min(cfg.eval_every, cfg.steps)
    if min(cfg.steps, cfg.batch, cfg.seq, cfg.layers, cfg.dim, cfg.heads, cfg.streams) < 1:
        raise SystemExit("--steps, --batch, --seq, --layers, --dim, --heads and --streams must be >= 1")
    if cfg.dim % cfg.heads:
        raise SystemExit(f"--dim {cfg.dim} must be divisible by --heads {cfg.heads}")
    if cfg.streams > MAX_N:
        raise SystemExit(f"--streams must be in 1..{MAX_N}, got {cfg.streams}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise SystemExit(f"--lr must be a finite positive number, got {cfg.lr}")
    if cfg.lr > _F32_MAX:  # AdamW's step in the float32 parameters: RuntimeError from torch's optimizer
        raise SystemExit(f"--lr must be at most {_F32_MAX:.4g} (the float32 parameters' range), got {cfg.lr}")
    if not _SEED_MIN <= cfg.seed <= _SEED_MAX:  # seed, seed + 1 and seed + 2 go to torch.manual_seed
        raise SystemExit(f"--seed must be in {_SEED_MIN}..{_SEED_MAX} (torch's seed range, with the seed + 1 and "
                         f"seed + 2 the demo also uses), got {cfg.seed}")
    return cfg


#: Largest float32: a larger --lr overflows AdamW's float32 step.
_F32_MAX = 3.4028234663852886e38
#: torch.manual_seed takes -2**63 .. 2**64 - 1; the demo seeds with seed, seed + 1 and seed + 2.
_SEED_MIN, _SEED_MAX = -2**63, 2**64 - 3


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not gpu_available():
        raise SystemExit("--device cuda: no usable GPU (needs torch.cuda.is_available() and a CuPy GPU)")
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpu_available())
    dp = DataParallel.from_env(use_gpu)  # launched by torchrun with more than one process
    device = torch.device("cuda", dp.local_rank) if use_gpu and dp else torch.device("cuda" if use_gpu else "cpu")
    quiet = contextlib.redirect_stdout(io.StringIO()) if dp and not dp.main else contextlib.nullcontext()
    try:
        with quiet:  # only rank 0 prints
            try:
                result = _run(args, device, use_gpu, dp)
            except FloatingPointError as e:  # a NaN / inf loss (too large an --lr): one line, not a traceback
                raise SystemExit(f"python -m mhc_cupy.demo: {e} (try a smaller --lr)") from None
        if dp:  # every rank done (rank 0 writes its files last) before the process group goes
            dp.barrier()
        return result
    finally:
        if dp:
            dp.close()


def _run(args, device, use_gpu, dp) -> dict:
    cfg = make_config(args, device)
    if dp:
        if cfg.batch % dp.world:
            raise SystemExit(f"--batch {cfg.batch} must be divisible by the number of ranks ({dp.world})")
        print(f"data-parallel: {dp.world} ranks (DistributedDataParallel, {dp.backend}); global batch "
              f"{cfg.batch}, {cfg.batch // dp.world} sequences per rank")

    try:
        data = load_text(args.text)
    except OSError as e:  # missing, a folder, no permission: one line, not a traceback
        raise SystemExit(f"python -m mhc_cupy.demo: --text {args.text}: cannot read it ({e.strerror or e})") from None
    train_data, held_out = split_data(data)
    if len(held_out) < cfg.seq + 2 or len(train_data) < cfg.seq + 2:
        raise SystemExit(f"text too short ({len(data)} bytes) for --seq {cfg.seq}")
    eval_xy = eval_windows(held_out, cfg.eval_batches * cfg.batch, cfg.seq)

    if use_gpu:
        stream_dtype = torch.bfloat16

        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)

        dev_name = torch.cuda.get_device_name(device)
        backend = "mhc_cupy CUDA kernels (CuPy/NVRTC) via mhc_cupy.torch"
        print(f"mhc_cupy demo on GPU: {dev_name}; bf16 autocast, bf16 residual streams, float32 coefficients")
    else:
        stream_dtype = torch.float32

        def autocast():
            return torch.autocast("cpu", enabled=False)

        dev_name = platform.processor() or platform.machine()
        backend = "NumPy float64 reference (CPU path, no kernels)"
        print("mhc_cupy demo on CPU: no GPU kernels, every mHC op runs "
              "the NumPy reference; tiny configuration" + ("" if args.device == "cpu" else
                                                             " (no usable GPU found)"))
    src = args.text or "CPython documentation (pydoc_data.topics)"
    print(f"corpus: {src}, {len(data):,} bytes ({len(held_out):,} held out); config: "
          + ", ".join(f"{k}={v}" for k, v in asdict(cfg).items()))

    L_r = recompute_blocks(cfg.recompute, cfg.streams, 2 * cfg.layers)
    blocks = block_sizes(cfg.recompute, cfg.streams, 2 * cfg.layers)
    print(f"mHC: one MHCStack of {2 * cfg.layers} MHC layers (each block's attention and MLP); stream recompute "
          + (f"in blocks of {', '.join(map(str, blocks))} layers" if blocks else "off"))

    is_main = dp is None or dp.main  # only rank 0 writes the outputs
    if is_main:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:  # a file there, a read-only place: one line naming the flag, as --text
            raise SystemExit(f"python -m mhc_cupy.demo: --out {args.out}: cannot create it "
                             f"({e.strerror or e})") from None
    t_all = time.perf_counter()
    histories = {}
    runs = [("mhc", "mhc")] + ([("baseline", "plain")] if args.baseline else [])
    threads = torch.get_num_threads()
    limits = contextlib.ExitStack()
    if not use_gpu:
        # The NumPy reference's BLAS has its own thread pool; a second (torch) pool on
        # the same cores makes both spin against each other: one torch thread is
        # faster (measured on 2 cores: 90 ms per step against 180 ms).
        torch.set_num_threads(1)
        # and one BLAS thread (threadpoolctl, the demo extra): the reference's matrices are small, and
        # BLAS threads spin against any other load (2 cores, one busy elsewhere: 35.0 s against 16.7 s
        # for the default run; idle: 18.0 against 16.6 s, with half the CPU time)
        with contextlib.suppress(ImportError):
            from threadpoolctl import threadpool_limits

            limits.enter_context(threadpool_limits(1, user_api="blas"))
    try:
        for name, residual in runs:
            torch.manual_seed(cfg.seed)
            model = TinyGPT(cfg, residual, stream_dtype).to(device=device, dtype=torch.float32)
            histories[name] = train(name, dp.wrap(model, device) if dp else model, cfg, train_data, eval_xy,
                                    device, autocast, dp=dp)
            del model
    finally:
        torch.set_num_threads(threads)
        limits.close()
    wall = time.perf_counter() - t_all

    summary = {
        "config": asdict(cfg), "device": device.type, "device_name": dev_name, "backend": backend,
        "stream_dtype": str(stream_dtype).replace("torch.", ""),
        "corpus": src, "corpus_bytes": len(data), "held_out_bytes": len(held_out),
        "steps": cfg.steps, "wall_s": wall, "ranks": dp.world if dp else 1,
        "mhc_stack": {"layers": 2 * cfg.layers, "recompute": cfg.recompute, "recompute_blocks": L_r,
                      "blocks": list(blocks) if blocks else None},
        "notes": {"final_train_loss": "mean over the last 20 training steps",
                  "final_eval_loss": "held-out loss after the last step",
                  "tokens_per_s": "training steps only (no evaluation), after the first 3 steps"},
    }
    for name, h in histories.items():
        summary[name] = {k: h[k] for k in ("params", "final_train_loss", "final_eval_loss", "tokens_per_s",
                                           "wall_s", "eval_step", "eval_loss")}
    if "baseline" in histories:
        m, b = histories["mhc"], histories["baseline"]
        summary["comparison"] = {
            "held_out_at_equal_steps": [{"step": s, "mhc": a, "baseline": c, "mhc_minus_baseline": a - c}
                                        for s, a, c in zip(m["eval_step"], m["eval_loss"], b["eval_loss"])],
            "final_held_out_mhc_minus_baseline": m["final_eval_loss"] - b["final_eval_loss"],
        }
    png = os.path.join(args.out, "loss_curve.png")
    title = (f"mHC (n={cfg.streams}) byte-level LM, {cfg.layers}x{cfg.dim}, {device.type}"
             + (" vs plain residual" if args.baseline else ""))
    if is_main:
        plot(histories, png, title)
    js = os.path.join(args.out, "summary.json")
    if is_main:
        with open(js, "w") as f:
            json.dump(summary, f, indent=2)

    print("\nresults (train = mean batch loss of the last 20 steps; held-out = cross-entropy in nats/byte on the "
          "last 5% of the corpus):")
    for name, h in histories.items():
        tps = h["tokens_per_s"]
        print(f"  {name:8s}: train {h['final_train_loss']:.4f}  held-out {h['final_eval_loss']:.4f}  "
              + (f"{tps:,.0f} tok/s" if tps else "tok/s not timed (the first 3 steps are not)")
              + f"  ({h['params']:,} params, {h['wall_s']:.1f} s)")
    if "baseline" in histories:
        print("  held-out at equal steps:    step      mhc  baseline  mhc - baseline")
        for row in summary["comparison"]["held_out_at_equal_steps"]:
            print(f"  {'':26s}{row['step']:6d}  {row['mhc']:7.4f}  {row['baseline']:8.4f}  "
                  f"{row['mhc_minus_baseline']:+14.4f}")
    print(f"wrote {png} and {js} ({wall:.1f} s)")
    return summary


if __name__ == "__main__":
    main()
