"""Two-GPU measurements: JAX token-sharded mhc_layer and the data-parallel demo.

Usage (repo root, a machine with >= 2 GPUs):
    python scripts/multigpu_bench.py [--tokens 32768] [--n 4] [--C 2048] [--demo-steps 200] [--out DIR]

1. JAX: ``jit(value_and_grad)`` of ``mhc_cupy.jax.mhc_layer`` (identity
   sublayer, bf16 streams) on x [tokens, n, C], unsharded on one GPU and with
   the token dim sharded over 2 GPUs (``NamedSharding(mesh, P("data"))``):
   median time of 20 calls after warm-up, the ratio (target <= 0.6), and the
   all-gather count of the compiled 2-GPU program (target 0).
2. torch: the demo under ``torchrun --nproc-per-node 1`` and ``2`` (NCCL),
   once at the same global batch and once at the same batch per GPU
   (weak scaling); tokens/s of each and the ratios (target >= 1.8).
Prints one JSON object (also written to ``--out``/multigpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def jax_layer(tokens: int, n: int, C: int, reps: int = 20, platform: str = "gpu") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import mhc_cupy.jax as mj

    devs = jax.devices(platform)[:2]
    params = jax.device_put(mj.mhc_init(jax.random.PRNGKey(0), C, n), devs[0])
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (tokens, n, C), jnp.bfloat16), devs[0])

    def loss(p, x):
        return jnp.sum(mj.mhc_layer(p, x, lambda h: h).astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def timed(*args):
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    one = timed(params, x)
    mesh = Mesh(np.array(devs), ("data",))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    two = timed(ps, xs)
    hlo = f.lower(ps, xs).compile().as_text()
    (l1, (gp1, gx1)), (l2, (gp2, gx2)) = f(params, x), f(ps, xs)
    rel = max(float(np.abs(np.asarray(gp2[k], np.float64) - np.asarray(gp1[k], np.float64)).max()
                    / np.abs(np.asarray(gp1[k], np.float64)).max()) for k in gp1)
    return {"shape": [tokens, n, C], "dtype": "bfloat16", "ms_1gpu": one, "ms_2gpu": two, "ratio": two / one,
            "target_ratio": 0.6, "all_gathers": len(re.findall(r" all-gather(?:-start)?\(", hlo)),
            "all_reduces": len(re.findall(r" all-reduce(?:-start)?\(", hlo)),
            "grad_x_sharding": str(gx2.sharding.spec), "param_grad_max_rel_diff": rel}


def demo(nproc: int, batch: int, steps: int, out: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES=",".join(map(str, range(nproc))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mhc_cupy.demo", "--steps", str(steps), "--batch", str(batch), "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    s = json.loads((out / "summary.json").read_text())
    return {"ranks": s["ranks"], "global_batch": batch, "tokens_per_s": s["mhc"]["tokens_per_s"],
            "final_eval_loss": s["mhc"]["final_eval_loss"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--C", type=int, default=2048)
    ap.add_argument("--demo-steps", type=int, default=200)
    ap.add_argument("--demo-batch", type=int, default=32, help="the demo's global batch on one GPU")
    ap.add_argument("--skip", nargs="*", default=(), choices=("jax", "demo"))
    ap.add_argument("--jax-platform", default="gpu",
                    help="cpu: a smoke test with XLA_FLAGS=--xla_force_host_platform_device_count=2")
    ap.add_argument("--out", default="multigpu_out")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    if "jax" not in args.skip:
        res["jax_mhc_layer"] = jax_layer(args.tokens, args.n, args.C, platform=args.jax_platform)
        print(json.dumps(res["jax_mhc_layer"]), flush=True)
    if "demo" not in args.skip:
        b = args.demo_batch
        d1 = demo(1, b, args.demo_steps, out / "demo_1gpu")
        d2 = demo(2, b, args.demo_steps, out / "demo_2gpu_same_global_batch")
        d2w = demo(2, 2 * b, args.demo_steps, out / "demo_2gpu_same_batch_per_gpu")
        res["demo"] = {"1gpu": d1, "2gpu_same_global_batch": d2, "2gpu_same_batch_per_gpu": d2w,
                       "speedup_same_global_batch": d2["tokens_per_s"] / d1["tokens_per_s"],
                       "speedup_same_batch_per_gpu": d2w["tokens_per_s"] / d1["tokens_per_s"],
                       "target_speedup": 1.8}
    print(json.dumps(res, indent=2))
    (out / "multigpu.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
