"""Tests of ``mhc_cupy.bench``: on the CPU, everything that does not need a GPU.

* the byte model (``nbytes``, derived from ``SPECS``) against the issue's formula, against the
  formula table of benchmarks/README.md and against the bytes of the arrays the functional API
  really reads and writes (CPU path);
* argument parsing (defaults, --quick, flags, errors), the rotation and case plans;
* the report, JSON, plot and --merge writers on a fake result, and the targets;
* the baseline math (PyTorch and JAX, run on the CPU) against ``mhc_cupy.reference``,
  forward and backward, so the baselines compute the same function as our kernels:
  float32 inputs within float32 rounding (1e-4 of the scale: 20 Sinkhorn iterations and
  sums over C in float32), bf16 activations within one bf16 rounding of each activation
  output (2^-8) and float32 rounding of each coefficient output;
* ``python -m mhc_cupy.bench`` without a GPU: a clear message and a non-zero exit.

The ``--layer`` and ``--block`` modes are in tests/test_bench_layer.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import bench
from mhc_cupy import reference as R
from mhc_cupy.bench import cases, env, inputs, timing

REPO = Path(__file__).resolve().parents[1]
SMALL = [(3, 8, 4), (2, 5, 3), (4, 7, 1)]  # (T, C, n): n = 4, odd n and C, n = 1 (trivial Sinkhorn)


def _gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


# ---------------------------------------------------------------------------- byte model
def test_byte_model_stream_mix_formula():
    T, n, C = 4096, 4, 2560
    assert bench.nbytes("stream_mix", "fwd", T, C, n, 2) == 2 * T * n * C * 2 + T * n * n * 4
    assert bench.nbytes("stream_mix", "bwd", T, C, n, 2) == 3 * T * n * C * 2 + 2 * T * n * n * 4
    # 4096 x 2560 x 4 bf16: one [T, n, C] tensor is 84 MB, more than an H200's L2
    assert T * n * C * 2 == 83_886_080


# The byte model as benchmarks/README.md writes it.  With A = T*n*C*s (one [T, n, C] activation),
# Y = T*C*s (one [T, C] activation), K = 4*T (one float32 per token), m = n*n + 2n,
# P = 4*(n*C*m + 3 + m) (phi, alpha, bias), s the activation itemsize:
README_BYTES = {
    ("stream_mix", "fwd"): lambda A, Y, K, n, P: 2 * A + n * n * K,                 # x, M -> out
    ("stream_mix", "bwd"): lambda A, Y, K, n, P: 3 * A + 2 * n * n * K,             # g, x, M -> dx, dM
    ("stream_aggregate", "fwd"): lambda A, Y, K, n, P: A + Y + n * K,               # x, h -> out
    ("stream_aggregate", "bwd"): lambda A, Y, K, n, P: 2 * A + Y + 2 * n * K,       # g, x, h -> dx, dh
    ("stream_distribute", "fwd"): lambda A, Y, K, n, P: A + Y + n * K,              # y, h -> out
    ("stream_distribute", "bwd"): lambda A, Y, K, n, P: A + 2 * Y + 2 * n * K,      # g, y, h -> dy, dh
    ("mhc_post_op", "fwd"): lambda A, Y, K, n, P: 2 * A + Y + (n * n + n) * K,      # y, x, H_post, H_res -> out
    ("mhc_post_op", "bwd"): lambda A, Y, K, n, P: 3 * A + 2 * Y + 2 * (n * n + n) * K,  # g, y, x, H -> dy, dx, dH
    ("mhc_pre_op", "fwd"): lambda A, Y, K, n, P: A + Y + 2 * (n * n + 2 * n) * K,   # x, raw -> layer_in, H
    ("mhc_pre_op", "bwd"): lambda A, Y, K, n, P: 2 * A + Y + 3 * (n * n + 2 * n) * K,  # g, gH, x, raw -> dx, draw
    ("sinkhorn_knopp", "fwd"): lambda A, Y, K, n, P: 2 * n * n * K,                 # logits -> P
    ("sinkhorn_knopp", "bwd"): lambda A, Y, K, n, P: 3 * n * n * K,                 # g, logits -> dlogits
    ("rmsnorm", "fwd"): lambda A, Y, K, n, P: 2 * A,                                # x [T, n*C] -> out
    ("rmsnorm", "bwd"): lambda A, Y, K, n, P: 3 * A,                                # g, x -> dx
    ("mhc_coeffs", "fwd"): lambda A, Y, K, n, P: A + P + (n * n + 2 * n) * K,       # x, phi, alpha, bias -> h raw
    ("mhc_coeffs", "bwd"): lambda A, Y, K, n, P: 2 * A + 2 * P + (n * n + 2 * n) * K,  # gh, x, params -> dx, dparams
}


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("T,C,n", [(4096, 2560, 4), (1, 64, 8), (32768, 7168, 4)])
def test_byte_model_table_matches_specs(T, C, n, itemsize):
    """``nbytes`` (derived from ``SPECS``) equals the README's formula table, and ``BYTES`` is that model."""
    assert {k[0] for k in README_BYTES} == set(bench.SPECS) == {k[0] for k in bench.BYTES}
    A, Y, K = T * n * C * itemsize, T * C * itemsize, 4 * T
    P = 4 * (n * C * (n * n + 2 * n) + 3 + (n * n + 2 * n))
    for op in bench.SPECS:
        for d in ("fwd", "bwd"):
            want = README_BYTES[(op, d)](A, Y, K, n, P)
            assert bench.nbytes(op, d, T, C, n, itemsize) == want, (op, d)
            assert bench.BYTES[(op, d)](T, C, n, itemsize) == want, (op, d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", list(bench.SPECS))
def test_byte_model_matches_functional_api(op, dtype):
    """Inputs read once + outputs written once, counted on the arrays the functional API
    takes and returns (its CPU path returns the real output dtypes and shapes)."""
    T, C, n = 3, 8, 4
    s = bench.make_inputs(op, T, C, n, dtype, seed=0)
    outs = inputs._as_tuple(getattr(m, f"{op}_fwd")(*s["in"]))
    assert [o.shape for o in outs] == [a.shape for a in s["grads"]]
    assert [o.dtype for o in outs] == [a.dtype for a in s["grads"]]
    isz = np.dtype(inputs._np_dtype(dtype)).itemsize
    read = sum(a.nbytes for a in s["in"])
    assert read + sum(o.nbytes for o in outs) == bench.nbytes(op, "fwd", T, C, n, isz)
    grads = inputs._as_tuple(getattr(m, f"{op}_bwd")(*s["grads"], *s["in"]))
    assert [g.shape for g in grads] == [a.shape for a in s["in"]]
    assert [g.dtype for g in grads] == [a.dtype for a in s["in"]]
    moved = sum(a.nbytes for a in s["grads"]) + read + sum(g.nbytes for g in grads)
    assert moved == bench.nbytes(op, "bwd", T, C, n, isz)


def test_make_inputs_dtypes_and_values():
    s = bench.make_inputs("mhc_post_op", 5, 16, 4, "bfloat16", seed=3)
    assert [a.shape for a in s["in"]] == [(5, 16), (5, 4, 16), (5, 4), (5, 4, 4)]
    assert [a.dtype.name for a in s["in"]] == ["bfloat16", "bfloat16", "float32", "float32"]
    for a in s["in"] + s["grads"]:
        f = np.asarray(a, np.float64)
        assert np.isfinite(f).all() and np.count_nonzero(f) == f.size  # never time on zeros
    other = bench.make_inputs("mhc_post_op", 5, 16, 4, "bfloat16", seed=4)
    assert not np.array_equal(np.asarray(other["in"][1], np.float32), np.asarray(s["in"][1], np.float32))


# ---------------------------------------------------------------------- plans and CLI
@pytest.mark.parametrize("nbytes_call", [500_000, 4_200_000, 84_000_000, 6_600_000_000])
def test_rotation(nbytes_call):
    l2 = 50 * 2**20
    sets, calls = bench.rotation(nbytes_call, l2, min_calls=10)
    assert 2 <= sets <= 64
    assert calls % sets == 0 and calls >= 10 and calls - sets < 10
    if sets < 64:  # between two uses of a set, the others move at least 2 L2
        assert (sets - 1) * nbytes_call >= 2 * l2


def test_plan_cases_runs_sinkhorn_once_per_tokens_and_n():
    shapes = [(4096, 2560, 4), (4096, 4096, 4), (8192, 2560, 4)]
    cases = bench.plan_cases(["stream_mix", "sinkhorn_knopp"], shapes)
    assert [c for c in cases if c[0] == "stream_mix"] == [("stream_mix", T, C, n) for T, C, n in shapes]
    assert [c for c in cases if c[0] == "sinkhorn_knopp"] == [("sinkhorn_knopp", 4096, None, 4),
                                                              ("sinkhorn_knopp", 8192, None, 4)]


def test_parse_args_defaults():
    a = bench.parse_args([])
    assert a.ops == list(bench.DEFAULT_OPS)
    grid = [(T, C, 4) for T in (4096, 16384, 32768) for C in (2560, 4096, 7168)]
    assert a.shapes == grid + [(16384, 4096, 8)]  # n = 8 at one shape
    assert a.baselines == ["torch", "torch.compile", "jax.jit"]
    assert (a.dtype, a.reps, a.warmup, a.out, a.merge) == ("bfloat16", 30, 5, "bench_out", None)


def test_parse_args_quick():
    a = bench.parse_args(["--quick"])
    assert a.shapes == [(32768, 2560, 4)]
    assert a.reps == 10 and a.ops == list(bench.DEFAULT_OPS)
    assert bench.parse_args(["--quick", "--reps", "7"]).reps == 7


def test_parse_args_flags():
    a = bench.parse_args(["--ops", "stream_mix,sinkhorn_knopp", "--tokens", "1024,2048", "--C", "64", "--n", "4,8",
                          "--dtype", "bf16", "--reps", "3", "--no-baselines", "--extra-shapes", "", "--out", "x"])
    assert a.ops == ["stream_mix", "sinkhorn_knopp"]
    assert a.shapes == [(1024, 64, 4), (2048, 64, 4), (1024, 64, 8), (2048, 64, 8)]
    assert (a.dtype, a.reps, a.baselines, a.out) == ("bfloat16", 3, [], "x")
    assert bench.parse_args(["--baselines", "jax,compile"]).baselines == ["torch.compile", "jax.jit"]
    assert bench.parse_args(["--extra-shapes", "8x16x2"]).shapes[-1] == (8, 16, 2)


def test_parse_args_convention():
    """--convention deepseek takes no framework baselines (they are the paper maths; the paper convention of
    mhc_cupy is its baseline, timed in _case); paper is the default."""
    assert bench.parse_args([]).convention == "paper"
    a = bench.parse_args(["--convention", "deepseek"])
    assert (a.convention, a.baselines) == ("deepseek", [])
    from mhc_cupy.bench.specs import CONVENTION_OPS

    assert set(CONVENTION_OPS) <= set(bench.DEFAULT_OPS)


@pytest.mark.parametrize("argv", [["--ops", "bogus"], ["--dtype", "int8"], ["--tokens", "abc"], ["--C", "0"],
                                  ["--baselines", "numpy"], ["--extra-shapes", "1x2"], ["--reps", "0"],
                                  ["--convention", "v4"], ["--convention", "deepseek", "--layer"]])
def test_parse_args_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code != 0


@pytest.mark.parametrize("argv,msg", [
    (["--n", "0"], "--n: expected positive integers, got '0'"),
    (["--n", "40"], "--n: mHC takes n_streams in 1..32, got 40"),
    (["--n", "4,33"], "--n: mHC takes n_streams in 1..32, got 33"),
    (["--tokens", "-5"], "--tokens: expected positive integers, got '-5'"),
    (["--tokens", "abc"], "--tokens: expected comma-separated integers, got 'abc'"),
    (["--C", ","], "--C: expected positive integers, got ','"),
    (["--small", "--small-tokens", "0"], "--small-tokens: expected positive integers, got '0'"),
    (["--extra-shapes", "64x128x40"], "--extra-shapes: mHC takes n_streams in 1..32, got n = 40 in '64x128x40'"),
    (["--layer", "--shapes", "64x128x4,64x128x33"],
     "--shapes: mHC takes n_streams in 1..32, got n = 33 in '64x128x33'"),
    # a tolerance no error exceeds (nan) or every one does (< 0) turned the baselines' check off / on silently
    (["--check-tol", "nan"], "--check-tol: expected a number >= 0, got nan"),
    (["--check-tol=-1e-2"], "--check-tol: expected a number >= 0, got -0.01"),
])
def test_parse_args_int_lists_are_usage_errors(argv, msg, capsys):
    """--tokens / --C / --n / --small-tokens go through the parser's error like the other flags (usage and
    exit 2; were a bare message and exit 1), and --n is held to 1..32 as --streams (was not checked)."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: python -m mhc_cupy.bench") and err.rstrip().endswith(msg), err


# ---------------------------------------------------------------------------- writers
def _row(op, d, T, C, n, us, frac, base_us, errors=()):
    copy = 4000.0
    b = bench.nbytes(op, d, T, C or 1, n, 2)
    impls = {"mhc_cupy": {"us": us, "GBps": b / us / 1e3, "frac_of_copy": frac, "method": "cuda graph"}}
    speed = {}
    for impl, t in base_us.items():
        if impl in errors:
            impls[impl] = {"error": "RuntimeError: boom"}
            speed[impl] = None
        else:
            impls[impl] = {"us": t, "GBps": b / t / 1e3, "frac_of_copy": b / t / 1e3 / copy, "method": "cuda graph",
                           "max_rel_err": 1e-3}
            speed[impl] = t / us
    return {"op": op, "dir": d, "tokens": T, "C": C, "n": n, "dtype": "bfloat16", "bytes": b, "sets": 2,
            "calls_per_graph": 10, "copy_GBps": copy, "impls": impls, "speedup": speed}


def fake_result():
    base = {"torch": 300.0, "torch.compile": 150.0, "jax.jit": 140.0}
    rows = [
        _row("stream_mix", "fwd", 4096, 2560, 4, 100.0, 0.93, base),
        _row("stream_mix", "fwd", 32768, 2560, 4, 700.0, 0.95, {k: 7 * v for k, v in base.items()}),
        _row("stream_mix", "bwd", 4096, 2560, 4, 200.0, 0.80, base, errors=("jax.jit",)),
        # the target domain (T >= 16384, C >= 4096, n = 4); the rows above are outside it
        _row("stream_mix", "fwd", 16384, 4096, 4, 300.0, 0.91, {k: 3 * v for k, v in base.items()}),
        _row("stream_mix", "bwd", 16384, 4096, 4, 600.0, 0.84, {k: 3 * v for k, v in base.items()}),
        _row("sinkhorn_knopp", "fwd", 32768, None, 4, 9.5, 0.05, {"torch": 90.0, "torch.compile": 8.0}),
        _row("sinkhorn_knopp", "bwd", 32768, None, 4, 16.0, 0.04, {"torch": 200.0, "torch.compile": 30.0}),
    ]
    return {"schema": "mhc_cupy.bench/1",
            "meta": {"date": "2026-01-01T00:00:00+00:00", "argv": ["--quick"],
                     "device": {"name": "Fake GPU", "sm": "90", "l2_bytes": 50 << 20},
                     "versions": {"mhc_cupy": m.__version__}, "settings": {"dtype": "bfloat16", "reps": 3}},
            "copy": {"GBps": 4000.0, "kernel_GBps": 3900.0, "bytes": 4 << 30, "method": "fake"},
            "results": rows,
            "host_overhead_us": {"shape": {"tokens": 1, "C": 64, "n": 4, "dtype": "bfloat16"},
                                 "routes": {"native torch.add (no grad)": 5.0,
                                            "native torch.add (requires grad)": 8.0,
                                            "mhc_cupy.torch.stream_mix (no grad)": 9.0,
                                            "mhc_cupy.torch.stream_mix (requires grad)": 20.0},
                                 "per_op": {"stream_mix": {"fwd": 7.0, "bwd": 8.0}}},
            "targets": [], "skipped": ["jax baselines skipped: test"]}


def _targets(result):
    return {t["name"]: t for t in bench.evaluate_targets(result)}


def test_evaluate_targets():
    t = _targets(fake_result())
    mix_fwd = t["stream_mix fwd >= 90% of copy"]
    assert mix_fwd["status"] == "met" and mix_fwd["measured"] == pytest.approx(0.91)  # 4096x2560 not judged
    mix_bwd = t["stream_mix bwd >= 85% of copy"]
    assert mix_bwd["status"] == "missed" and "84.0%" in mix_bwd["detail"] and "16384x4096x4" in mix_bwd["detail"]
    assert t["mhc_pre_op fwd >= 90% of copy"]["status"] == "not measured"
    assert t["sinkhorn_knopp fwd at 32768 tokens (n 4) < 15 us"]["status"] == "met"
    sk_bwd = t["sinkhorn_knopp bwd at 32768 tokens (n 4) < 15 us"]
    assert sk_bwd["status"] == "missed" and sk_bwd["measured"] == 16.0
    assert t["stream_mix fwd faster than torch.compile"]["status"] == "met"
    sk_compile = t["sinkhorn_knopp fwd faster than torch.compile"]
    assert sk_compile["status"] == "missed" and sk_compile["measured"] == pytest.approx(8.0 / 9.5)
    assert t["mhc_cupy.torch host overhead (no grad) <= 2x torch.add"]["status"] == "met"
    grad = t["mhc_cupy.torch host overhead (requires grad) <= 2x torch.add"]
    assert grad["status"] == "missed" and grad["measured"] == pytest.approx(2.5)


def test_targets_count_a_failed_mhc_cupy_shape_as_missed():
    """An in-domain shape where mhc_cupy's own measurement failed (``error``, e.g. out of memory) was
    dropped from the targets, which then said "met" over the shapes that ran; now such a target is
    missed, naming the shape.  A shape where only torch.compile failed is still left out of its target."""
    res = fake_result()
    broken = _row("stream_mix", "fwd", 32768, 4096, 4, 1.0, 0.99, {"torch.compile": 900.0})
    broken["impls"]["mhc_cupy"] = {"error": "OutOfMemoryError: boom"}
    broken["speedup"] = {"torch.compile": None}
    sk = _row("sinkhorn_knopp", "bwd", 32768, None, 8, 9.0, 0.05, {})  # n = 8: not judged
    sk["impls"]["mhc_cupy"] = {"error": "RuntimeError: boom"}
    res["results"] += [broken, sk]
    t = _targets(res)
    for name in ("stream_mix fwd >= 90% of copy", "stream_mix fwd faster than torch.compile"):
        assert t[name]["status"] == "missed" and "mhc_cupy failed at 32768x4096x4" in t[name]["detail"], t[name]
    assert t["sinkhorn_knopp bwd at 32768 tokens (n 4) < 15 us"]["detail"] == "16.0 us"
    only_sk = fake_result()
    only_sk["results"] = [dict(r, impls={**r["impls"], "mhc_cupy": {"error": "RuntimeError: boom"}}, speedup={})
                          for r in only_sk["results"] if r["op"] == "sinkhorn_knopp"]
    t = _targets(only_sk)
    assert t["sinkhorn_knopp fwd at 32768 tokens (n 4) < 15 us"]["status"] == "missed"
    assert t["sinkhorn_knopp fwd faster than torch.compile"]["status"] == "missed"
    # torch.compile failed, mhc_cupy ran: that shape is not judged by the torch.compile target
    res = fake_result()
    res["results"][3]["impls"]["torch.compile"] = {"error": "RuntimeError: boom"}
    res["results"][3]["speedup"]["torch.compile"] = None
    t = _targets(res)
    assert t["stream_mix fwd faster than torch.compile"]["status"] == "not measured"
    assert t["stream_mix fwd >= 90% of copy"]["status"] == "met"


def test_convention_target():
    """--convention deepseek rows carry the paper convention's time of the same run: the 5% target
    judges the worst ratio over all shapes, and the table shows it as a speedup column."""
    res = fake_result()
    res["results"] = [_row("sinkhorn_knopp", "bwd", T, None, n, us, 0.04, {"mhc_cupy.paper": paper})
                      for T, n, us, paper in ((16384, 4, 9.6, 8.8), (16384, 8, 24.0, 23.1))]
    res["results"].append(_row("mhc_pre_op", "fwd", 16384, 4096, 4, 160.0, 0.9, {"mhc_cupy.paper": 158.0}))
    t = _targets(res)
    sk = t["sinkhorn_knopp bwd deepseek convention <= 1.05x the paper convention's time"]
    assert sk["status"] == "missed" and sk["measured"] == pytest.approx(9.6 / 8.8) and "16384x-x4" in sk["detail"]
    assert t["mhc_pre_op fwd deepseek convention <= 1.05x the paper convention's time"]["status"] == "met"
    assert not any("deepseek" in name for name in _targets(fake_result()))  # paper runs: no such target
    for r in res["results"]:
        r["convention"] = "deepseek"
    table = bench.format_table(res).splitlines()
    assert "paper" in table[1] and f"{8.8 / 9.6:.2f}x" in next(ln for ln in table if "16384x-x4" in ln)
    assert table[3].startswith("mhc_pre_op ds") and any(ln.startswith("ds: ") for ln in table)
    ds = fake_result()  # --merge of a paper run and a deepseek run of the same shapes keeps both rows
    ds["results"] = [dict(r, convention="deepseek") for r in ds["results"] if r["op"] == "sinkhorn_knopp"]
    merged = bench.merge_results([fake_result(), ds])
    assert len(merged["results"]) == len(fake_result()["results"]) + 2


def test_format_report_table_last():
    res = fake_result()
    res["targets"] = bench.evaluate_targets(res)
    text = bench.format_report(res)
    for s in ("Fake GPU", "4000 GB/s", "targets:", "MISSED", "host overhead", "mhc_cupy.torch.stream_mix (no grad)",
              "skipped: jax baselines skipped: test"):
        assert s in text, s
    table = bench.format_table(res)
    assert text.endswith(table)  # the table is printed last
    lines = table.splitlines()
    assert "speedup vs" in lines[0] and "compile" in lines[1] and "% copy" in lines[1]
    mix = [ln for ln in lines if ln.startswith("stream_mix") and "4096x2560x4" in ln]
    assert len(mix) == 2 and "3.00x" in mix[0] and "1.50x" in mix[0] and "93.0%" in mix[0]
    assert "err" in mix[1]  # the failed jax.jit baseline
    sk = [ln for ln in lines if ln.startswith("sinkhorn_knopp")]
    assert "32768x-x4" in sk[0] and sk[0].rstrip().endswith("-")  # no jax.jit number


def test_write_outputs_and_merge(tmp_path):
    pytest.importorskip("matplotlib")
    res = fake_result()
    res["targets"] = bench.evaluate_targets(res)
    paths = bench.write_outputs(res, tmp_path / "a")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(res))
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["txt"].read_text().startswith("mhc_cupy.bench")

    other = fake_result()
    other["results"] = [_row("stream_mix", "bwd", 16384, 4096, 4, 550.0, 0.90, {"torch": 900.0}),
                        _row("stream_aggregate", "fwd", 4096, 2560, 4, 50.0, 0.92, {"torch": 80.0})]
    other["host_overhead_us"]["routes"]["mhc_cupy.torch.stream_mix (requires grad)"] = 10.0
    (tmp_path / "b.json").write_text(json.dumps(other))
    out = tmp_path / "merged"
    assert bench.main(["--merge", str(paths["json"]), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    merged = json.loads((out / "bench.json").read_text())
    assert len(merged["results"]) == 8  # 7 + 2, one replaced
    t = {x["name"]: x for x in merged["targets"]}
    assert t["stream_mix bwd >= 85% of copy"]["status"] == "met"  # the later row replaced the 84 % one
    assert t["mhc_cupy.torch host overhead (requires grad) <= 2x torch.add"]["status"] == "met"
    assert len(merged["meta"]["merged_from"]) == 2
    assert (out / "bench.png").exists() and (out / "bench.txt").exists()


def test_merge_unreadable_file(tmp_path, capsys):
    assert bench.main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


# ----------------------------------------------------------------- baselines = reference
def _tol(kind, dtype):
    """Rounding of one output: activations once to their dtype, float32 coefficients."""
    return 2.0**-8 if (kind == "act" and dtype == "bfloat16") else 1e-4


def _check(got, ref, kinds, dtype, what):
    assert len(got) == len(ref) == len(kinds), what
    for i, (g, r, k) in enumerate(zip(got, ref, kinds)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, (what, i, g.shape, r.shape)
        scale = max(float(np.sqrt(np.mean(r**2))) if r.size else 0.0, 1e-30)
        err = np.abs(g - r)
        bound = _tol(k, dtype) * (np.abs(r) + scale)
        assert (err <= bound).all(), f"{what} output {i}: max err {err.max():.3e}, scale {scale:.3e}"


def _ref(op):
    return getattr(R, f"{op}_fwd"), getattr(R, f"{op}_bwd")


def _kinds(op, which):
    return [k for _, k, _ in bench.SPECS[op][which]]


def _torch_tensor(torch, a):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _torch_numpy(torch, t):
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,C,n", SMALL)
@pytest.mark.parametrize("op", list(bench.SPECS))
def test_torch_baseline_matches_reference(op, T, C, n, dtype):
    torch = pytest.importorskip("torch")
    s = bench.make_inputs(op, T, C, n, dtype, seed=T * 100 + n)
    fref, bref = _ref(op)
    ins = [_torch_tensor(torch, a) for a in s["in"]]
    gs = [_torch_tensor(torch, a) for a in s["grads"]]
    f = bench.torch_fwd(op)
    out = f(*ins)
    assert [o.dtype for o in out] == [t.dtype for t in gs]
    _check([_torch_numpy(torch, o) for o in out], inputs._as_tuple(fref(*s["in"])), _kinds(op, "outputs"), dtype,
           f"torch {op} fwd")
    grads = bench.torch_bwd(f, ins, gs)
    assert [g.dtype for g in grads] == [t.dtype for t in ins]
    _check([_torch_numpy(torch, g) for g in grads], inputs._as_tuple(bref(*s["grads"], *s["in"])),
           _kinds(op, "inputs"), dtype, f"torch {op} bwd")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,C,n", SMALL)
@pytest.mark.parametrize("op", list(bench.SPECS))
def test_jax_baseline_matches_reference(op, T, C, n, dtype):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    s = bench.make_inputs(op, T, C, n, dtype, seed=T * 100 + n + 1)
    fref, bref = _ref(op)
    ins = [jnp.asarray(a) for a in s["in"]]
    gs = [jnp.asarray(a) for a in s["grads"]]
    f = bench.jax_fwd(op)  # eagerly: the same jnp math the benchmark jits (XLA:CPU compiles Sinkhorn slowly)
    out = f(*ins)
    assert [o.dtype for o in out] == [g.dtype for g in gs]
    _check([np.asarray(o, np.float64) for o in out], inputs._as_tuple(fref(*s["in"])), _kinds(op, "outputs"), dtype,
           f"jax {op} fwd")
    grads = bench.jax_bwd(f, ins, gs)
    assert [g.dtype for g in grads] == [a.dtype for a in ins]
    _check([np.asarray(g, np.float64) for g in grads], inputs._as_tuple(bref(*s["grads"], *s["in"])),
           _kinds(op, "inputs"), dtype, f"jax {op} bwd")


def test_jax_one_pullback_for_all_input_sets():
    """The benchmark's JAX backward: set 0's VJP treedef around each set's residuals gives each
    set's own gradient, from a single trace."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    f = jax.jit(bench.jax_fwd("mhc_coeffs"))
    sets = [bench.make_inputs("mhc_coeffs", 3, 8, 4, "float32", seed=k) for k in range(3)]
    flat = [jax.tree_util.tree_flatten(jax.vjp(f, *[jnp.asarray(a) for a in s["in"]])[1]) for s in sets]
    treedef = flat[0][1]
    traces = []

    def pull(lv, g):
        traces.append(1)
        return jax.tree_util.tree_unflatten(treedef, lv)(g)

    b = jax.jit(pull)
    for (leaves, _), s in zip(flat, sets):
        g = tuple(jnp.asarray(a) for a in s["grads"])
        got = b(leaves, g)
        want = bench.jax_bwd(f, [jnp.asarray(a) for a in s["in"]], g)
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    assert len(traces) == 1


def test_baseline_sinkhorn_is_twenty_shifted_iterations():
    """Large logits (exp would overflow without the row-max shift) stay finite and match."""
    torch = pytest.importorskip("torch")
    L = (np.random.default_rng(0).standard_normal((4, 4, 4)) * 60).astype(np.float32)
    (P,) = bench.torch_fwd("sinkhorn_knopp")(torch.from_numpy(L))
    assert torch.isfinite(P).all()
    np.testing.assert_allclose(P.numpy(), R.sinkhorn_knopp_fwd(L, 20), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ no GPU
@pytest.mark.skipif(_gpu(), reason="a GPU is present: the benchmark would run")
def test_main_without_gpu_exits_with_a_message(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "mhc_cupy.bench", "--quick", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode != 0
    assert "needs a CUDA GPU" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()


def test_help_needs_no_gpu():
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0


def test_time_jax_and_per_call_on_cpu():
    """The JAX wall-clock timer and the host-overhead timer need no GPU."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    f = jax.jit(lambda a: a * 2)
    sets = [jnp.full(8, float(k)) for k in range(3)]
    seen = []

    def call(k):
        seen.append(k)
        return f(sets[k])

    r = timing._time_jax(call, 3, 6, 1, 4)
    assert r["samples"] == 4 and 0 < r["us_min"] <= r["us"] <= r["us_max"]
    assert seen[:6] == [0, 1, 2, 0, 1, 2]  # every set in turn
    assert bench.per_call_us(lambda: None, lambda last: None, calls=50, warmup=2) > 0


def test_run_orchestration_without_gpu(monkeypatch, tmp_path, capsys):
    """``main`` end to end with the GPU pieces replaced: our op runs on the CPU path (NumPy
    reference), the torch baselines run the real baseline math on CPU tensors, and the
    comparison, speedups, skipped-baseline message, JSON, report and targets are real."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    real_make = bench.make_inputs
    timed = []

    def fake_time(call, sets, calls, warmup, reps):
        for k in range(sets):
            call(k)
        timed.append((sets, calls))
        return {"us": 10.0, "us_min": 9.0, "us_max": 11.0, "samples": reps, "method": "fake"}

    def fake_torch_case(op, d, sets, R, calls, cfg, compiled):
        f = bench.torch_fwd(op)
        tin = [_torch_tensor(torch, a) for a in sets[0]["in"]]
        tg = [_torch_tensor(torch, a) for a in sets[0]["grads"]]
        out = f(*tin) if d == "fwd" else bench.torch_bwd(f, tin, tg)
        return {"us": 30.0 if compiled else 50.0, "us_min": 1.0, "us_max": 99.0, "samples": 2, "method": "fake"}, out

    def np_rel_err(ours, theirs):
        worst = 0.0
        for a, b in zip(inputs._as_tuple(ours), inputs._as_tuple(theirs), strict=True):
            b = _torch_numpy(torch, b) if isinstance(b, torch.Tensor) else b
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        return worst

    monkeypatch.setattr(env, "gpu_problem", lambda: None)
    monkeypatch.setattr(env, "_device_meta", lambda: {"name": "Fake GPU", "sm": "90", "l2_bytes": 1 << 16})
    monkeypatch.setattr(env, "_versions", lambda: {"mhc_cupy": m.__version__})
    monkeypatch.setattr(cases, "copy_bandwidth", lambda: {"GBps": 1000.0, "kernel_GBps": 900.0, "bytes": 2,
                                                          "method": "fake"})
    monkeypatch.setattr(env, "_sync", lambda: None)
    monkeypatch.setattr(env, "_free_gpu_memory", lambda: None)
    monkeypatch.setattr(env, "_torch_status", lambda: None)
    monkeypatch.setattr(env, "_jax_status", lambda: "no GPU backend (test)")
    monkeypatch.setattr(cases, "make_inputs", lambda *a, xp="numpy", **k: real_make(*a, **k))
    monkeypatch.setattr(cases, "_time_cupy", fake_time)
    monkeypatch.setattr(cases, "_torch_case", fake_torch_case)
    monkeypatch.setattr(cases, "_max_rel_err", np_rel_err)
    monkeypatch.setattr(cases, "host_overhead", lambda dtype, ops, torch_ok, jax_ok: {
        "shape": {"tokens": 1, "C": 64, "n": 4, "dtype": dtype},
        "routes": {"native torch.add (no grad)": 5.0, "mhc_cupy.torch.stream_mix (no grad)": 7.0}, "per_op": {}})

    out = tmp_path / "out"
    argv = ["--ops", "stream_mix,sinkhorn_knopp,mhc_pre_op", "--tokens", "8", "--C", "16,32", "--extra-shapes", "",
            "--reps", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["meta"]["settings"]["baselines"] == ["torch", "torch.compile"]
    assert any("jax" in s for s in res["skipped"])
    rows = res["results"]
    assert len(rows) == 2 * (2 + 2 + 1)  # Sinkhorn once: it does not depend on C
    assert {(r["op"], r["C"]) for r in rows if r["op"] == "sinkhorn_knopp"} == {("sinkhorn_knopp", None)}
    for r in rows:
        mine = r["impls"]["mhc_cupy"]
        assert mine["us"] == 10.0
        assert mine["GBps"] == pytest.approx(r["bytes"] / 10e-6 / 1e9)
        assert mine["frac_of_copy"] == pytest.approx(mine["GBps"] / 1000.0)
        assert r["speedup"] == {"torch": 5.0, "torch.compile": 3.0}
        assert r["impls"]["torch"]["max_rel_err"] < 1e-2, (r["op"], r["dir"])  # same math as ours
        assert r["sets"] >= 2 and r["calls_per_graph"] % r["sets"] == 0
    t = {x["name"]: x for x in res["targets"]}
    assert t["mhc_cupy.torch host overhead (no grad) <= 2x torch.add"]["status"] == "met"
    small = t["stream_mix fwd faster than torch.compile"]  # 8 tokens: outside the targets' domain
    assert small["status"] == "not measured" and bench.TARGET_DOMAIN in small["detail"]
    text = capsys.readouterr().out
    assert "speedup vs" in text and (out / "bench.png").exists() and (out / "bench.txt").exists()
