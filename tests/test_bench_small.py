"""``python -m mhc_cupy.bench --small`` (issue 43's benchmark): arguments and a tiny end-to-end run on the
CPU (every implementation timed eagerly; no graph replay without a GPU; targets not measured)."""

from __future__ import annotations

import json

import pytest

import mhc_cupy.bench as bench


def test_parse_args_small():
    from mhc_cupy.bench.small import SMALL_C, SMALL_TOKENS

    a = bench.parse_args(["--small"])
    assert (a.mode, a.small_tokens, a.small_C, a.baselines, a.sizes_given) == (
        "small", list(SMALL_TOKENS), SMALL_C, ["torch", "torch.compile"], False)
    a = bench.parse_args(["--small", "--small-tokens", "1,3", "--small-C", "40", "--no-baselines"])
    assert (a.small_tokens, a.small_C, a.baselines, a.sizes_given) == ([1, 3], 40, [], True)
    for bad in (["--small", "--small-tokens", "0"], ["--small", "--small-C", "0"], ["--small", "--stack"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_small_mode_runs_tiny(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "o"
    argv = ["--small", "--small-tokens", "1,3", "--small-C", "24", "--streams", "2", "--reps", "2", "--warmup", "1",
            "--min-calls", "2", "--baselines", "torch", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads((out / "small.json").read_text())
    assert res["schema"] == "mhc_cupy.bench.small/1" and [r["tokens"] for r in res["results"]] == [1, 3]
    for row in res["results"]:
        assert set(row["impls"]) == {"mhc_cupy", "mhc_cupy MHCStack, per layer", "mhc_cupy MHCStack fused, per layer",
                                     "mhc_cupy small", "mhc_cupy tail", "mhc_cupy tail lane", "mhc_cupy lane",
                                     "mhc_cupy lane off",
                                     "mhc_cupy MHCStack lane, per layer", "torch"} and (row["C"], row["n"]) == (24, 2)
        if torch.cuda.is_available():  # the lane taken: layer_in, its one buffer and the output (the general route: 7)
            assert row["impls"]["mhc_cupy lane"]["allocations"] == 3 < row["impls"]["mhc_cupy lane off"]["allocations"]
        for name, v in row["impls"].items():  # graph replay where a GPU runs them, not on the CPU
            gpu = torch.cuda.is_available()
            assert v["eager_us"] > 0 and (v["graph_us"] > 0 if gpu else "graph_us" not in v), v
            # the driver floor of mhc_cupy's rows (GPU only): every call launches and allocates
            if gpu and name.startswith("mhc_cupy"):
                assert v["launches"] >= 1 and v["allocations"] >= 1 and v["driver_floor_us"] > 0, v
            else:
                assert "driver_floor_us" not in v, v
    assert all(t["status"] == "not measured" for t in res["targets"])  # C 24, not 7168
    text = (out / "small.md").read_text()
    assert "| 3 | mhc_cupy |" in text and "eager us" in text


def test_small_mode_no_baselines_times_mhc_cupy_only(tmp_path):
    """--no-baselines: only mhc_cupy's rows (the eager torch MHCReference was timed all the same)."""
    pytest.importorskip("torch")
    out = tmp_path / "o"
    argv = ["--small", "--small-tokens", "1", "--small-C", "16", "--streams", "2", "--reps", "1", "--warmup", "1",
            "--min-calls", "1", "--no-baselines", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads((out / "small.json").read_text())
    assert [set(r["impls"]) for r in res["results"]] == [{"mhc_cupy", "mhc_cupy MHCStack, per layer",
                                                          "mhc_cupy MHCStack fused, per layer", "mhc_cupy small",
                                                          "mhc_cupy tail", "mhc_cupy tail lane", "mhc_cupy lane",
                                                          "mhc_cupy lane off",
                                                          "mhc_cupy MHCStack lane, per layer"}]
    assert res["meta"]["settings"]["compile"] is False


def test_host_counts_counts_replayed_and_planned_launches_and_allocations(monkeypatch):
    """host_counts: the launches of one call, through the replay path's cuLaunchKernel and through
    _jit.launch (noted to _replay), and the allocations PyTorch's allocator counts (faked here)."""
    torch = pytest.importorskip("torch")
    from mhc_cupy import _replay
    from mhc_cupy.bench.small import host_counts

    calls, stats = [], {"allocation.all.allocated": 0}

    class Driver:
        @staticmethod
        def launchKernel(*args):
            calls.append(args)

    monkeypatch.setattr(_replay, "_driver", Driver)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(stats))

    def call():  # 3 replayed launches, 2 planned ones, 4 allocations
        for _ in range(3):
            _replay._driver_launch()(0, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)
        for _ in range(2):
            _replay.note(None, (1, 1, 1), (32, 1, 1), (), 0)
        stats["allocation.all.allocated"] += 4

    assert host_counts(call) == {"launches": 5, "allocations": 4}
    assert len(calls) == 6 and _replay._driver is Driver  # the warm-up call too; the driver put back


def test_small_targets_include_eager_against_torch_compile():
    """Issue 43's third small target, eager <= torch.compile's (module doc of mhc_cupy.bench.small), is judged:
    the worst ratio of mhc_cupy's eager time over torch.compile's at T <= 64, C 7168 (it was not evaluated)."""
    from mhc_cupy.bench.small import SMALL_C, evaluate_small_targets

    def row(T, ours, compiled):
        impls = {"mhc_cupy": {"eager_us": ours, "graph_us": 5.0}}
        if compiled is not None:
            impls["torch.compile"] = {"eager_us": compiled, "graph_us": 9.0}
        return {"tokens": T, "C": SMALL_C, "n": 4, "dtype": "bfloat16", "impls": impls}

    name = f"layer forward, T <= 64, C {SMALL_C}, eager per call <= torch.compile's"
    res = {"results": [row(1, 20.0, 40.0), row(64, 25.0, 20.0), row(4096, 90.0, 30.0)]}  # T 4096: not judged
    t = {x["name"]: x for x in evaluate_small_targets(res)}
    assert t[name]["status"] == "missed" and t[name]["measured"] == pytest.approx(1.25) and "T 64" in t[name]["detail"]
    res["results"][1] = row(64, 15.0, 20.0)
    assert {x["name"]: x for x in evaluate_small_targets(res)}[name]["status"] == "met"
    res["results"][1] = row(64, 15.0, None)  # no torch.compile row at one judged T
    assert {x["name"]: x for x in evaluate_small_targets(res)}[name]["status"] == "not measured"


def test_graph_time_is_a_replay_or_nothing(monkeypatch):
    """``graph us`` is a CUDA-graph replay's time: where the capture fails, the timer falls back to eager calls
    between events (its ``method`` says so), and that number was reported as graph us all the same (and judged
    against the 8 us replay target); now the row records the method instead and no graph_us."""
    from types import SimpleNamespace

    from mhc_cupy.bench import small, timing

    cfg = SimpleNamespace(min_calls=4, warmup=1, reps=3)
    got = []

    def fake(prepare, sets, calls, warmup, reps, graph=True):
        got.append((sets, calls, warmup, reps, graph, prepare()(0)))
        return {"us": 42.0, "method": method}

    monkeypatch.setattr(timing, "_time_torch", fake)
    method = "cuda graph"
    assert small.graph_time(lambda: "out", cfg) == {"graph_us": 42.0}
    assert got == [(1, 4, 1, 3, True, "out")]
    method = "events, eager calls (graph capture failed: RuntimeError: no)"
    assert small.graph_time(lambda: "out", cfg) == {"graph_method": method}
    t = small.evaluate_small_targets({"results": [{"tokens": 1, "C": small.SMALL_C, "n": 4, "impls": {
        "mhc_cupy": {"eager_us": 20.0, "graph_method": method}}}]})
    assert t[0]["name"].endswith("graph per call <= 8 us") and t[0]["status"] == "not measured"


def test_targets_of_a_run_without_a_gpu_are_not_judged():
    """The --layer / --block / --stack / --small targets are the CUDA kernels': a run recorded without a GPU
    (meta.device.sm None, wall clock of the NumPy reference, which the CPU message invites with tiny sizes)
    leaves them not measured, saying so; `--small --small-tokens 1,8` on the CPU printed "MISSED ... eager per
    call <= 30 us: worst 15136.3 us".  A GPU run, and a result without device metadata, are judged as before."""
    from mhc_cupy.bench import block, layer, small, stack

    res = {"results": [{"tokens": 1, "C": small.SMALL_C, "n": 4, "impls": {
        "mhc_cupy": {"eager_us": 15000.0, "graph_us": 5.0}, "torch.compile": {"eager_us": 300.0}}}]}
    judged = small.evaluate_small_targets(res)
    assert {t["status"] for t in judged} == {"met", "missed"}
    assert small.evaluate_small_targets({**res, "meta": {"device": {"name": "H200", "sm": "90"}}}) == judged
    cpu = {**res, "meta": {"device": {"name": "CPU (no CUDA GPU: wall clock)", "sm": None}}}
    for evaluate in (small.evaluate_small_targets, stack.evaluate_stack_targets, block.evaluate_block_targets,
                     layer.evaluate_layer_targets):  # each mode's (the others' rows have other keys: none here)
        got = evaluate(cpu if evaluate is small.evaluate_small_targets else {**cpu, "results": []})
        assert got and all(t["status"] == "not measured" and t["measured"] is None and "this run had none"
                           in t["detail"] for t in got), (evaluate.__name__, got)
    assert [t["name"] for t in small.evaluate_small_targets(cpu)] == [t["name"] for t in judged]
