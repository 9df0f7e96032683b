"""``python -m mhc_cupy.bench`` outside the op mode, on the CPU: ``--merge`` of saved layer and block
results (the committed H200 files included) and the CPU timing of ``--layer`` / ``--block``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mhc_cupy import bench

REPO = Path(__file__).resolve().parents[1]
SAVED = REPO / "benchmarks"


@pytest.mark.parametrize("name,mode", [("h200_layer.json", "layer"), ("h200_block.json", "block")])
def test_merge_reads_the_mode_from_the_files(tmp_path, capsys, name, mode):
    """``--merge`` of a committed layer / block result without --layer / --block merges it in its own
    mode (was KeyError: 'op'): the report is the committed one's, rows and targets kept."""
    out = tmp_path / "out"
    assert bench.main(["--merge", str(SAVED / name), "--out", str(out)]) == 0
    saved = json.loads((SAVED / name).read_text())
    merged = json.loads((out / f"{mode}.json").read_text())
    assert not (out / "bench.json").exists()
    assert merged["schema"] == saved["schema"] and merged["results"] == saved["results"]
    assert [t["status"] for t in merged["targets"]] == [t["status"] for t in saved["targets"]]
    committed = (SAVED / name.replace(".json", ".md")).read_text()
    table = [ln for ln in (out / f"{mode}.md").read_text().splitlines() if ln.startswith("| ")]
    assert len(table) > 5 and all(ln in committed for ln in table)  # the committed file's tables, as rendered then
    assert f"written: {out / (mode + '.json')}" in capsys.readouterr().out


def test_merge_with_the_matching_flag_and_two_files(tmp_path):
    copy = tmp_path / "again.json"
    shutil.copy(SAVED / "h200_block.json", copy)
    out = tmp_path / "out"
    assert bench.main(["--block", "--merge", str(SAVED / "h200_block.json"), str(copy), "--out", str(out)]) == 0
    merged = json.loads((out / "block.json").read_text())
    assert len(merged["meta"]["merged_from"]) == 2
    assert len(merged["results"]) == len(json.loads(copy.read_text())["results"])  # the same rows: replaced


@pytest.mark.parametrize("argv,message", [
    (["--layer", "--merge", "h200_block.json"],
     r"h200_block.json: a --block \(block.json\) result, to merge with --block, not --layer"),
    (["--block", "--merge", "h200.json"],
     r"h200.json: an op benchmark \(bench.json\) result, to merge with no mode flag, not --block"),
    (["--merge", "h200.json", "h200_layer.json"], "cannot merge results of different modes: .*h200.json needs no "
                                                  "mode flag; .*h200_layer.json needs --layer"),
    (["--merge", "README.md"], "cannot read .*README.md: Expecting value"),
    (["--merge", "list.json"], "list.json is not a result of python -m mhc_cupy.bench .its schema is None"),
])
def test_merge_mismatch_is_one_clear_line(tmp_path, capsys, argv, message):
    """Files of another mode than the flag, mixed modes or files that are no results: exit code 2
    and one line naming the file and the flag it needs, no traceback."""
    import re

    (tmp_path / "list.json").write_text("[1, 2]")
    argv = [str(tmp_path / a) if a == "list.json" else str(SAVED / a) if a.endswith((".json", ".md")) else a
            for a in argv]
    assert bench.main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m mhc_cupy.bench --merge: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["layer", "block"])
def test_cpu_rows_time_pytorch_on_one_thread(tmp_path, monkeypatch, mode):
    """Without a GPU, --layer / --block time every row with PyTorch on one intra-op thread, restored
    after the run, and say so.  Two PyTorch threads spinning against the NumPy reference's BLAS pool
    and other busy processes made a CPU run report a forward slower than forward + backward (issue 41
    item 17: 28.4 / 10.7 ms; plain torch's forward 292 ms against 6 ms on one thread, measured)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the CPU timing path")
    from mhc_cupy.bench import layer, timing

    seen = []

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return timing._time_wall(*args, **kw)

    monkeypatch.setattr(layer, "_time_wall", spy)
    torch.set_num_threads(2)  # what a 2-core machine starts with
    out = tmp_path / "o"
    sizes = (["--layer", "--shapes", "8x4x2", "--sublayers", "identity", "--baselines", "torch"] if mode == "layer" else
             ["--block", "--block-configs", "8:2:8", "--batch", "1", "--seq", "2", "--streams", "2", "--no-baselines"])
    assert bench.main(sizes + ["--fused", "default", "--reps", "2", "--warmup", "1", "--dtype", "float32",
                               "--out", str(out)]) == 0
    assert seen and set(seen) == {1}, seen
    assert torch.get_num_threads() == 2
    res = json.loads((out / f"{mode}.json").read_text())
    assert res["meta"]["settings"]["torch_threads"] == 1
    assert "wall clock (no CUDA GPU), PyTorch on 1 thread" in (out / f"{mode}.md").read_text()


def test_choose_puts_kernel_variants_in_force_for_the_run(tmp_path, monkeypatch):
    """``--choose VARIANT=BOOL,...``: the kernel choice in force while a mode runs (and only then); a bad
    variant or value is a usage error naming the option."""
    from mhc_cupy._kernel_choice import KernelChoice, current
    from mhc_cupy.bench import cli

    seen = []
    monkeypatch.setitem(cli._MODES, "small", (lambda cfg: seen.append(current()) or {"meta": {"settings": {}}},
                                               *cli._MODES["small"][1:]))
    monkeypatch.setattr(cli, "_write_mode", lambda cfg, result: 0)
    argv = ["--small", "--small-tokens", "1", "--small-C", "8", "--choose", "small=true, boundary=false",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert seen == [KernelChoice(small=True, boundary=False)] and current() == KernelChoice()
    for bad in ("small", "small=yes", "bogus=true"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--choose", bad])


_SCHEMA_OF = {"ops": "mhc_cupy.bench/1", **{m: f"mhc_cupy.bench.{m}/1" for m in ("layer", "block", "stack", "small")}}


@pytest.mark.parametrize("mode", list(_SCHEMA_OF))
@pytest.mark.parametrize("body,field", [
    ({}, "no field 'meta'"),                                        # the schema alone
    ({"results": [{"tokens": 1}], "meta": {}}, "no field '"),     # a row without its shape
    ({"results": "rows", "meta": {}}, "Error: "),                   # results not a list of rows
    ({"results": None, "meta": {}}, "Error: "),
    ({"results": [], "meta": []}, "Error: "),                       # meta not an object
])
def test_merge_of_an_incomplete_result_is_one_clear_line(tmp_path, capsys, mode, body, field):
    """A file with a mode's schema but a missing or malformed field raised a KeyError / TypeError /
    AttributeError traceback from the merge or the report; now exit code 2, one line naming the file and
    the field, nothing written."""
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"schema": _SCHEMA_OF[mode], **body}))
    assert bench.main(["--merge", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m mhc_cupy.bench --merge: {path}: ") and len(err.strip().splitlines()) == 1, err
    assert "missing or malformed field" in err and field in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["file", "below a file", "a folder where the json goes"])
@pytest.mark.parametrize("name", ["h200.json", "h200_layer.json"])
def test_merge_to_an_unwritable_out_is_one_line(tmp_path, capsys, what, name):
    """``--out`` naming a file, a folder below one, or a folder whose result file is a folder: exit code 2
    and one line naming the flag (was a FileExistsError / NotADirectoryError / IsADirectoryError traceback)."""
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "below a file": tmp_path / "f" / "o", "a folder where the json goes": tmp_path / "o"}[what]
    if what == "a folder where the json goes":
        (out / ("bench.json" if name == "h200.json" else "layer.json")).mkdir(parents=True)
    assert bench.main(["--merge", str(SAVED / name), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m mhc_cupy.bench: --out {out}: cannot ") and len(err.strip().splitlines()) == 1, err


def test_tiny_run_to_an_unwritable_out_stops_before_running(tmp_path, capsys, monkeypatch):
    """A mode's run checks --out before it starts (it writes its partial results there): one line, exit
    code 2, the run not started (was a FileExistsError traceback from inside the run)."""
    from mhc_cupy.bench import cli

    (tmp_path / "f").write_text("x")
    monkeypatch.setitem(cli._MODES, "layer", (lambda cfg: pytest.fail("the run started"), *cli._MODES["layer"][1:]))
    assert bench.main(["--layer", "--shapes", "4x8x2", "--reps", "1", "--warmup", "0", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m mhc_cupy.bench: --out {tmp_path / 'f'}: cannot create it (") and \
        len(err.strip().splitlines()) == 1, err
