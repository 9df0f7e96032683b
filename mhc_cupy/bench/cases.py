"""The op benchmark: every op, fwd and bwd, against its baselines (``run_benchmarks``)."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

from . import env
from .baselines import jax_fwd, torch_bwd, torch_fwd
from .inputs import _cupy_to_jax, _cupy_to_torch, _max_rel_err, make_inputs
from .report import evaluate_targets, write_json
from .specs import CONVENTION_OPS, ITEMSIZE, PAPER, nbytes, plan_cases, rotation, shape_str
from .timing import _time_cupy, _time_jax, _time_torch, copy_bandwidth, per_call_us

def _case(op, T, C, n, dtype, cfg, copy_GBps, l2, baselines) -> list[dict]:
    """Time one (op, shape) for every implementation; returns the fwd and bwd rows."""
    import mhc_cupy as m

    isz = ITEMSIZE[dtype]
    Cb = C if C is not None else 1
    # --convention deepseek: the ops that take it run under it (the others are the same maths)
    convention = getattr(cfg, "convention", "paper") if op in CONVENTION_OPS else "paper"
    fwd_bytes = nbytes(op, "fwd", T, Cb, n, isz)
    R, calls = rotation(fwd_bytes, l2, cfg.min_calls)
    sets = [make_inputs(op, T, Cb, n, dtype, seed=k, xp="cupy") for k in range(R)]
    env._sync()
    rows = {}
    for d in ("fwd", "bwd"):
        b = nbytes(op, d, T, Cb, n, isz)
        rows[d] = {"op": op, "dir": d, "tokens": T, "C": C, "n": n, "dtype": dtype, "bytes": b, "sets": R,
                   "calls_per_graph": calls, "copy_GBps": copy_GBps, "impls": {}}
        if convention != "paper":
            rows[d]["convention"] = convention

    def record(d, impl, res):
        if "us" in res:
            res["GBps"] = rows[d]["bytes"] / (res["us"] * 1e-6) / 1e9
            res["frac_of_copy"] = res["GBps"] / copy_GBps
        rows[d]["impls"][impl] = res

    fwd_fn, bwd_fn = getattr(m, f"{op}_fwd"), getattr(m, f"{op}_bwd")
    ours = {}
    # under --convention deepseek, the same op under the paper convention is the baseline (same run, same inputs)
    impls = (("mhc_cupy", {}),) if convention == "paper" else (("mhc_cupy", {"convention": convention}), (PAPER, {}))
    for impl, kw in impls:
        for d, fn in (("fwd", lambda k, kw=kw: fwd_fn(*sets[k]["in"], **kw)),
                      ("bwd", lambda k, kw=kw: bwd_fn(*sets[k]["grads"], *sets[k]["in"], **kw))):
            try:
                record(d, impl, _time_cupy(fn, R, calls, cfg.warmup, cfg.reps))
                if impl == "mhc_cupy":
                    ours[d] = fn(0)
            except Exception as e:  # noqa: BLE001 - report and go on
                record(d, impl, env._error(e))
                env._log(f"  {impl} {op} {d} failed: {rows[d]['impls'][impl]['error']}")

    for impl in baselines:
        for d in ("fwd", "bwd"):
            try:
                if impl in ("torch", "torch.compile"):
                    res, out = _torch_case(op, d, sets, R, calls, cfg, compiled=impl == "torch.compile")
                else:
                    res, out = _jax_case(op, d, sets, R, calls, cfg)
                if d in ours:
                    res["max_rel_err"] = _max_rel_err(ours[d], out)
                    if res["max_rel_err"] > cfg.check_tol:
                        env._log(f"  WARNING: {impl} {op} {d} differs from mhc_cupy by {res['max_rel_err']:.2e} "
                             f"(relative L2)")
                del out
            except Exception as e:  # noqa: BLE001
                res = env._error(e)
                env._log(f"  {impl} {op} {d} failed: {res['error']}")
            record(d, impl, res)
            env._free_gpu_memory()
    del sets, ours
    env._free_gpu_memory()
    for d in ("fwd", "bwd"):
        mine = rows[d]["impls"].get("mhc_cupy", {})
        rows[d]["speedup"] = {impl: (rows[d]["impls"][impl]["us"] / mine["us"]
                                     if "us" in mine and "us" in rows[d]["impls"].get(impl, {}) else None)
                              for impl in (*baselines, *([PAPER] if PAPER in rows[d]["impls"] else []))}
    return [rows["fwd"], rows["bwd"]]


def _torch_case(op, d, sets, R, calls, cfg, compiled: bool):
    import torch

    f = torch_fwd(op)
    if compiled:
        torch._dynamo.reset()  # a fresh static-shape compile per shape (no recompile limit, no dynamic kernels)
        f = torch.compile(f, dynamic=False)
    tin = [[_cupy_to_torch(a) for a in s["in"]] for s in sets]
    tg = [[_cupy_to_torch(a) for a in s["grads"]] for s in sets]
    torch.cuda.synchronize()
    if d == "fwd":
        def prepare():
            def call(k):
                with torch.no_grad():
                    return f(*tin[k])
            return call
        res = _time_torch(prepare, R, calls, cfg.warmup, cfg.reps)
        with torch.no_grad():
            out = f(*tin[0])
        return res, out

    state = {}

    def prepare():  # on the capture stream: the backward then runs there too
        state["ins"] = [[t.detach().requires_grad_() for t in tin[k]] for k in range(R)]
        state["outs"] = [f(*state["ins"][k]) for k in range(R)]

        def call(k):
            return torch.autograd.grad(state["outs"][k], state["ins"][k], tg[k], retain_graph=True)
        return call
    res = _time_torch(prepare, R, calls, cfg.warmup, cfg.reps)
    out = torch_bwd(f, tin[0], tg[0])
    state.clear()
    return res, out


def _jax_case(op, d, sets, R, calls, cfg):
    import jax

    dev = jax.devices("gpu")[0]
    jin = [[_cupy_to_jax(a, dev) for a in s["in"]] for s in sets]
    jg = [[_cupy_to_jax(a, dev) for a in s["grads"]] for s in sets]
    f = jax.jit(jax_fwd(op))
    if d == "fwd":
        res = _time_jax(lambda k: f(*jin[k]), R, calls, cfg.warmup, cfg.reps)
        return res, f(*jin[0])
    # The residuals of each set as jax.vjp saves them; one jitted pullback for all sets
    # (a VJP object as a jit argument would retrace per set: its treedef names its own
    # closure, so set 0's treedef is rebuilt around every set's residual leaves).
    flat = [jax.tree_util.tree_flatten(jax.vjp(f, *jin[k])[1]) for k in range(R)]
    treedef = flat[0][1]
    if any(len(lv) != treedef.num_leaves for lv, _ in flat):
        raise RuntimeError("jax.vjp residuals differ in structure between input sets")
    leaves = [lv for lv, _ in flat]
    grads = [tuple(g) for g in jg]
    del flat
    b = jax.jit(lambda lv, g: jax.tree_util.tree_unflatten(treedef, lv)(g))
    res = _time_jax(lambda k: b(leaves[k], grads[k]), R, calls, cfg.warmup, cfg.reps)
    out = b(leaves[0], grads[0])
    return res, out


def host_overhead(dtype: str, ops, torch_ok: bool, jax_ok: bool, calls: int = 2000) -> dict:
    """Host cost per call of tiny calls (tokens 1, C 64, n 4) through every front end."""
    import cupy as cp

    import mhc_cupy as m

    T, C, n = 1, 64, 4
    sync_cp = lambda last: cp.cuda.Device().synchronize()  # noqa: E731
    routes, per_op = {}, {}
    x, M = make_inputs("stream_mix", T, C, n, dtype, seed=0, xp="cupy")["in"]
    routes["functional stream_mix_fwd, cupy inputs"] = per_call_us(lambda: m.stream_mix_fwd(x, M), sync_cp, calls)
    for op in ops:
        s = make_inputs(op, T, C, n, dtype, seed=1, xp="cupy")
        f, b = getattr(m, f"{op}_fwd"), getattr(m, f"{op}_bwd")
        try:
            per_op[op] = {"fwd": per_call_us(lambda: f(*s["in"]), sync_cp, calls),
                          "bwd": per_call_us(lambda: b(*s["grads"], *s["in"]), sync_cp, calls)}
        except Exception as e:  # noqa: BLE001
            per_op[op] = env._error(e)
    if torch_ok:
        import torch

        import mhc_cupy.torch as mt

        sync_t = lambda last: torch.cuda.synchronize()  # noqa: E731
        xt, Mt = _cupy_to_torch(x), _cupy_to_torch(M)
        xg = xt.detach().requires_grad_()
        routes["native torch.add (no grad)"] = per_call_us(lambda: torch.add(xt, xt), sync_t, calls)
        routes["native torch.add (requires grad)"] = per_call_us(lambda: torch.add(xg, xg), sync_t, calls)
        routes["mhc_cupy.torch.stream_mix (no grad)"] = per_call_us(lambda: mt.stream_mix(xt, Mt), sync_t, calls)
        routes["mhc_cupy.torch.stream_mix (requires grad)"] = per_call_us(lambda: mt.stream_mix(xg, Mt), sync_t, calls)
        routes["functional stream_mix_fwd, torch inputs"] = per_call_us(lambda: m.stream_mix_fwd(xt, Mt), sync_t,
                                                                        calls)
    if jax_ok:
        import jax

        import mhc_cupy.jax as mj

        sync_j = jax.block_until_ready
        dev = jax.devices("gpu")[0]
        xj, Mj = _cupy_to_jax(x, dev), _cupy_to_jax(M, dev)
        jit_op = jax.jit(lambda a, b: mj.stream_mix(a, b))
        jit_native = jax.jit(jax_fwd("stream_mix"))
        jit_add = jax.jit(lambda a: a + a)
        routes["mhc_cupy.jax.stream_mix (eager)"] = per_call_us(lambda: mj.stream_mix(xj, Mj), sync_j, calls)
        routes["native jnp x + x (eager)"] = per_call_us(lambda: xj + xj, sync_j, calls)
        routes["jax.jit(f), f calls mhc_cupy.jax.stream_mix"] = per_call_us(lambda: jit_op(xj, Mj), sync_j, calls)
        routes["jax.jit(f), f = stream_mix in native jnp"] = per_call_us(lambda: jit_native(xj, Mj), sync_j, calls)
        routes["jax.jit(f), f = x + x"] = per_call_us(lambda: jit_add(xj), sync_j, calls)
    return {"shape": {"tokens": T, "C": C, "n": n, "dtype": dtype}, "routes": routes, "per_op": per_op,
            "method": f"wall clock per call, median of 5 bursts of {calls // 5} calls after 100 warm-up calls, "
                      f"each burst ended by a device sync"}


def run_benchmarks(cfg) -> dict:
    """Run everything ``cfg`` (parsed arguments) asks for; returns the result dict."""
    t0 = time.perf_counter()
    skipped = []
    baselines = list(cfg.baselines)
    torch_ok = jax_ok = False
    if any(b.startswith("torch") for b in baselines) or not cfg.no_host:
        why = env._torch_status()
        torch_ok = why is None
        if why:
            skipped.append(f"torch baselines and torch host-overhead routes skipped: {why}")
    if "jax.jit" in baselines or not cfg.no_host:
        why = env._jax_status()
        jax_ok = why is None
        if why:
            skipped.append(f"jax baselines and jax host-overhead routes skipped: {why}")
    baselines = [b for b in baselines if (torch_ok if b.startswith("torch") else jax_ok)]
    for s in skipped:
        env._log(s)

    device = env._device_meta()
    l2 = int(device.get("l2_bytes") or 64 << 20)
    result = {
        "schema": "mhc_cupy.bench/1",
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "argv": list(cfg.argv), "device": device, "versions": env._versions(),
                 "settings": {"dtype": cfg.dtype, "reps": cfg.reps, "warmup": cfg.warmup, "min_calls": cfg.min_calls,
                              "baselines": baselines, "shapes": [list(s) for s in cfg.shapes], "ops": list(cfg.ops),
                              "convention": getattr(cfg, "convention", "paper"),
                              "l2_bytes_used_for_rotation": l2}},
        "copy": {}, "results": [], "host_overhead_us": {}, "targets": [], "skipped": skipped,
    }
    env._log(f"device: {device['name']} (sm_{device['sm']}, L2 {l2 / 2**20:.0f} MiB)")
    result["copy"] = copy_bandwidth()
    copy_GBps = result["copy"]["GBps"]
    env._log(f"device-to-device copy: {copy_GBps:.0f} GB/s (eager cupy.copyto; copy kernel "
         f"{result['copy']['kernel_GBps']:.0f} GB/s)")

    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for op, T, C, n in plan_cases(cfg.ops, cfg.shapes):
        rows = _case(op, T, C, n, cfg.dtype, cfg, copy_GBps, l2, baselines)
        result["results"].extend(rows)
        for r in rows:
            env._log(f"[{time.perf_counter() - t0:7.1f} s] {_progress_line(r)}")
        write_json(result, out_dir / "bench.json")  # partial results survive a timeout
        env._free_gpu_memory()

    if not cfg.no_host:
        env._log("host overhead ...")
        result["host_overhead_us"] = host_overhead(cfg.dtype, cfg.ops, torch_ok, jax_ok)
    result["targets"] = evaluate_targets(result)
    result["meta"]["wall_s"] = time.perf_counter() - t0
    return result


def _progress_line(r) -> str:
    parts = []
    for impl, v in r["impls"].items():
        parts.append(f"{impl} {v['us']:.1f} us" + (f" ({v['frac_of_copy']:.0%})" if impl == "mhc_cupy" else "")
                     if "us" in v else f"{impl} error")
    return f"{r['op']} {r['dir']} {shape_str(r['tokens'], r['C'], r['n'])}: " + " | ".join(parts)

