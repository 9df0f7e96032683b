"""Data-parallel training of mHC layers with PyTorch DDP, FSDP2 or torch.compile of a DDP model.

Run with torchrun (gloo on CPU, NCCL on GPUs), e.g.::

    torchrun --nproc-per-node 2 examples/distributed.py --mode ddp
    torchrun --nproc-per-node 2 examples/distributed.py --mode fsdp2          # float32 everywhere
    torchrun --nproc-per-node 2 examples/distributed.py --mode fsdp2-bf16     # bf16 activations, fp32 mHC params
    torchrun --nproc-per-node 2 examples/distributed.py --mode ddp-compile
    torchrun --nproc-per-node 2 examples/distributed.py --mode ddp fsdp2 fsdp2-bf16 ddp-compile --check

The model: ``expand_streams`` -> a stack of :class:`mhc_cupy.torch.MHC`
layers around small MLP sublayers -> ``collapse_streams`` -> a linear head,
regression (MSE) on random data.  Every rank builds the same model (same
seed) and draws the same global batch, then trains on its own contiguous
slice of it: with a mean loss and equal slices, DDP's averaged gradient is
the full-batch gradient, so the training matches one process on the full
batch.

FSDP2 (``torch.distributed.fsdp.fully_shard``): each sublayer is its own
FSDP unit with the chosen mixed-precision policy (``fsdp2-bf16``: bf16
compute, and bf16 residual streams), each MHC layer's own parameters (phi,
alpha, bias) a unit whose policy keeps them float32 (mhc_cupy's coefficient
kernels take float32 phi / alpha / bias, OPS.md section 8), then the root.
That float32 policy sets ``cast_forward_inputs=False``: FSDP2 casts a unit's
floating-point inputs to its ``param_dtype`` by default, which would turn the
bf16 residual streams into float32 at every MHC layer.

``--check`` also trains the unwrapped model in one process on the full batch
(on every rank) and compares losses and parameters after the last step
(float32: 1e-5 relative; exits 1 on a mismatch).  In ``fsdp2-bf16`` the check
is that, in the forward, mHC's parameters are float32 while the residual
streams reaching each MHC layer and its sublayer's input are bfloat16, and
that the loss stays within 2e-2 of float32 training.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from mhc_cupy.torch import MHC, collapse_streams, expand_streams


class Net(nn.Module):
    """expand_streams -> MHC(MLP) x layers -> collapse_streams -> linear head; streams in ``stream_dtype``."""

    def __init__(self, dim: int, streams: int, layers: int, stream_dtype=torch.float32):
        super().__init__()
        self.n, self.stream_dtype = streams, stream_dtype
        self.blocks = nn.ModuleList(
            MHC(dim, streams, nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
                alpha_init=0.3)  # a larger alpha_init: coefficients that depend on x from the start
            for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        h = expand_streams(x.to(self.stream_dtype), self.n)
        for b in self.blocks:
            h = b(h)
        return self.head(collapse_streams(h.float()))


MODES = ("ddp", "fsdp2", "fsdp2-bf16", "ddp-compile")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", nargs="+", choices=MODES, default=["ddp"],
                    help="one or more, run one after the other (fsdp2-bf16: bf16 compute for the sublayers)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), divisible by the world size")
    ap.add_argument("--seq", type=int, default=5, help="tokens per sequence (default 5)")
    ap.add_argument("--dim", type=int, default=24, help="hidden size C (default 24)")
    ap.add_argument("--streams", type=int, default=4, help="residual streams n (default 4)")
    ap.add_argument("--layers", type=int, default=3, help="mHC layers, each around a small MLP (default 3)")
    ap.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor on GPU, aot_eager on CPU)")
    ap.add_argument("--check", action="store_true", help="compare with one process on the full batch")
    return ap.parse_args(argv)


def setup():
    """(rank, world, device) from torchrun's environment; gloo on CPU, NCCL on GPUs."""
    use_cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def wrap(model, mode, device, compile_backend):
    if mode in ("ddp", "ddp-compile"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if mode == "ddp-compile":
            backend = compile_backend or ("inductor" if device.type == "cuda" else "aot_eager")
            return torch.compile(ddp, backend=backend)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = torch.bfloat16 if mode == "fsdp2-bf16" else torch.float32
    sub_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    # float32 phi / alpha / bias; cast_forward_inputs=False keeps the streams in their own dtype (bf16)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block.sublayer, mp_policy=sub_policy)
        fully_shard(block, mp_policy=fp32_policy)  # phi, alpha, bias: float32
    fully_shard(model, mp_policy=fp32_policy)
    return model


def batches(args, device):
    gen = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        y = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        yield x.to(device), y.to(device)


def train(model, args, device, rank=0, world=1):
    """SGD on each rank's slice of every global batch; returns the global mean loss per step."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    per = args.batch // world
    losses = []
    for x, y in batches(args, device):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = nn.functional.mse_loss(model(xs).float(), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_params(model) -> dict:
    """Every parameter as a full (unsharded) float32 tensor on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out[name.replace("_orig_mod.", "").replace("module.", "")] = t.detach().float().cpu()
    return out


def dtype_probe(model):
    """Forward hooks recording, per MHC layer call, the dtypes in the forward: phi, alpha, bias, the
    residual streams it gets (after FSDP's input casts, whose pre-forward hooks run first) and its
    sublayer's input."""
    seen = []
    for block in model.blocks:
        def pre_hook(block, inputs):
            seen.append([block.phi.dtype, block.alpha.dtype, block.bias.dtype, inputs[0].dtype])

        def hook(sub, inputs, output):
            seen[-1].append(inputs[0].dtype)
        block.register_forward_pre_hook(pre_hook)
        block.sublayer.register_forward_hook(hook)
    return seen


def run_mode(mode, args, rank, world, device) -> bool:
    """Train with one wrapping; with --check compare with one process on the full batch."""
    torch.manual_seed(0)
    model = Net(args.dim, args.streams, args.layers).to(device)
    reference = copy.deepcopy(model) if args.check else None  # float32 throughout
    if mode == "fsdp2-bf16":
        model.stream_dtype = torch.bfloat16  # bf16 residual streams and sublayers, float32 mHC parameters
    probe = dtype_probe(model) if mode.startswith("fsdp2") else None
    wrapped = wrap(model, mode, device, args.compile_backend)
    losses = train(wrapped, args, device, rank, world)
    params = full_params(wrapped)
    if rank == 0:
        print(f"{mode}: {world} ranks on {device.type}, losses {['%.6f' % v for v in losses]}")
    if not args.check:
        return True
    ref_losses = train(reference, args, device)
    ref_params = full_params(reference)
    if mode == "fsdp2-bf16":
        coef = {d[i] for d in probe for i in range(3)}
        streams, low = {d[3] for d in probe}, {d[4] for d in probe}
        ok = coef == {torch.float32} and streams == low == {torch.bfloat16}
        ok &= all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses, ref_losses))
        diff = f"in the forward: mHC params {coef}, residual streams {streams}, sublayer inputs {low}"
    else:
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_err = max(float((params[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                        for k, v in ref_params.items())
        ok = loss_err <= 1e-5 and param_err <= 1e-5 and params.keys() == ref_params.keys()
        diff = f"max relative difference: loss {loss_err:.2e}, parameters {param_err:.2e}"
    if rank == 0:
        print(f"{mode} check against one process on the full batch: {'OK' if ok else 'MISMATCH'} ({diff}; "
              f"reference losses {['%.6f' % v for v in ref_losses]})")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = setup()
    try:
        if args.batch % world:
            raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
        ok = [run_mode(mode, args, rank, world, device) for mode in args.mode]
        return 0 if all(ok) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
