"""A workload for Nsight Compute: ``reps`` forward + backward passes of one ``mhc_cupy.torch.MHC`` layer
(identity sublayer, bf16 streams), or forwards only under ``torch.no_grad`` with ``--fwd``.  Profile it from
outside, e.g. the tensor-core coefficient backward of the third pass:

    ncu --clock-control none -k regex:mhc_coeffs_mma_bwd_kernel --launch-skip 2 --launch-count 1 --set full \\
        -o bwd python scripts/ncu_driver.py 8192 2048 4

GPU only.
"""

from __future__ import annotations

import argparse

import torch

import mhc_cupy.torch as mt

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("tokens", type=int)
p.add_argument("C", type=int)
p.add_argument("n", type=int)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--fwd", action="store_true", help="forwards only, under torch.no_grad")
a = p.parse_args()
torch.manual_seed(0)
x = torch.randn(a.tokens, a.n, a.C, device="cuda", dtype=torch.bfloat16, requires_grad=not a.fwd)
g = torch.randn_like(x)
layer = mt.MHC(a.C, a.n, torch.nn.Identity(), device="cuda")
for _ in range(a.reps):
    if a.fwd:
        with torch.no_grad():
            layer(x)
    else:
        layer(x).backward(g)
torch.cuda.synchronize()
