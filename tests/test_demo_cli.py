"""``python -m mhc_cupy.demo`` as a command: clear errors for bad input, and output that reads
cleanly where it is not a terminal (notebooks, logs, CI)."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from mhc_cupy import demo  # noqa: E402

TINY = ["--device", "cpu", "--steps", "4", "--eval-every", "2", "--layers", "1", "--dim", "16", "--heads", "2",
        "--seq", "16", "--batch", "2", "--streams", "2"]


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_unreadable_text_is_one_line(tmp_path, what):
    """``--text`` naming a missing file or a folder: SystemExit with one line naming the flag
    and the path (was a FileNotFoundError traceback)."""
    path = tmp_path / "nonexistent" if what == "missing" else tmp_path
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--text", str(path), "--out", str(tmp_path / "o")])
    msg = str(e.value.code)
    assert msg == (f"python -m mhc_cupy.demo: --text {path}: cannot read it "
                   f"({'No such file or directory' if what == 'missing' else 'Is a directory'})")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch, terminal):
    """Where stderr is no terminal (a notebook: issue 41 item 16 saw ~60 chunks of progress bar in
    notebook 04) the demo prints no bar, only its evaluation lines; on a terminal the bar is there."""
    err = _Terminal()
    if terminal:
        monkeypatch.setattr("sys.stderr", err)
    demo.main(TINY + ["--out", str(tmp_path)])
    out, captured = capsys.readouterr()
    bar = err.getvalue() if terminal else captured
    assert "[mhc] step     2" in out and "[mhc] step     4" in out
    if terminal:
        assert "mhc: 100%" in bar and "4/4" in bar, bar
    else:
        assert "%|" not in bar and "it/s" not in bar and "s/it" not in bar, bar


def test_demo_trains_with_mhcstack_and_recompute_changes_no_loss(tmp_path, capsys):
    """The demo's mHC model is one MHCStack (issue 44 item 5); stream recompute (auto: the paper's
    L_r* = 2, so 3 blocks, of 2, 1, 1 of the 4 layers here) gives the same losses, bitwise, as the run without it."""
    argv = TINY + ["--layers", "2", "--streams", "4"]  # auto: sqrt(4 * 4 / 6) -> 2
    runs = {}
    for recompute in ("none", "auto", "3"):
        runs[recompute] = demo.main(argv + ["--recompute", recompute, "--out", str(tmp_path / recompute)])
        out = capsys.readouterr().out
        assert "mHC: one MHCStack of 4 MHC layers" in out
    assert runs["auto"]["mhc_stack"] == {"layers": 4, "recompute": "auto", "recompute_blocks": 2, "blocks": [2, 1, 1]}
    assert runs["none"]["mhc_stack"]["recompute_blocks"] is None and runs["3"]["mhc_stack"]["recompute_blocks"] == 3
    for recompute in ("auto", "3"):
        assert runs[recompute]["mhc"]["eval_loss"] == runs["none"]["mhc"]["eval_loss"]
        assert runs[recompute]["mhc"]["final_train_loss"] == runs["none"]["mhc"]["final_train_loss"]


@pytest.mark.parametrize("bad", ["0", "-1", "sqrt"])
def test_bad_recompute_is_one_line(tmp_path, bad):
    with pytest.raises(SystemExit, match="--recompute must be none, auto or a positive int"):
        demo.main(TINY + ["--recompute", bad, "--out", str(tmp_path)])


def test_cpu_run_uses_one_blas_thread(tmp_path, monkeypatch):
    """On the CPU the NumPy reference runs with one BLAS thread (threadpoolctl) and the limit is
    lifted afterwards: BLAS threads spinning against other load made the default run 2x slower
    (35.0 s against 16.7 s on 2 cores with one busy elsewhere)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen = []

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    real_train = demo.train

    def train(*args, **kwargs):
        seen.append(blas_threads())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(demo, "train", train)
    before = blas_threads()
    assert before, "threadpoolctl finds no BLAS (NumPy's is loaded)"
    if max(before) == 1:
        pytest.skip("BLAS runs one thread here already: nothing to limit")
    demo.main(TINY + ["--out", str(tmp_path)])
    assert seen and all(t == [1] * len(before) for t in seen), (seen, before)
    assert blas_threads() == before


@pytest.mark.parametrize("text", [b"", b"short"])
def test_empty_or_short_text_is_one_line(tmp_path, text):
    """An empty ``--text`` file gives the same one-line error as a short one (was a ValueError
    traceback from torch.frombuffer in split_data)."""
    path = tmp_path / "t.txt"
    path.write_bytes(text)
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--text", str(path), "--out", str(tmp_path / "o")])
    assert str(e.value.code) == f"text too short ({len(text)} bytes) for --seq 16"


@pytest.mark.parametrize("flag,bad,msg", [
    ("--streams", "33", "--streams must be in 1..32, got 33"),
    ("--lr", "nan", "--lr must be a finite positive number, got nan"),
    ("--lr", "inf", "--lr must be a finite positive number, got inf"),
    ("--lr", "-1", "--lr must be a finite positive number, got -1.0"),
    ("--lr", "0", "--lr must be a finite positive number, got 0.0"),
    ("--eval-every", "0", "--eval-every must be >= 1, got 0"),
    ("--eval-every", "-1", "--eval-every must be >= 1, got -1"),
])
def test_bad_streams_lr_eval_every_are_one_line(tmp_path, flag, bad, msg):
    """--streams outside 1..32 and a non-finite or non-positive --lr stop with one line (were tracebacks
    from mhc_cupy._checks and torch's AdamW); --eval-every 0 or < 0 is refused (was taken as 1)."""
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + [flag, bad, "--out", str(tmp_path)])
    assert str(e.value.code) == msg
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("heads", ["0", "-2"])
def test_heads_below_one_is_one_line(tmp_path, heads):
    """--heads 0 or < 0 stops with the line of the other sizes (were a ZeroDivisionError and a
    RuntimeError from the attention's view)."""
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--heads", heads, "--out", str(tmp_path)])
    assert str(e.value.code) == "--steps, --batch, --seq, --layers, --dim, --heads and --streams must be >= 1"


@pytest.mark.parametrize("what", ["file", "below a file"])
def test_unwritable_out_is_one_line(tmp_path, what):
    """``--out`` naming an existing file, or a folder below one: SystemExit with one line naming the flag
    and the path, as ``--text`` (was a FileExistsError / NotADirectoryError traceback from os.makedirs)."""
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" if what == "file" else tmp_path / "f" / "o"
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--out", str(path)])
    msg = str(e.value.code)
    assert msg.startswith(f"python -m mhc_cupy.demo: --out {path}: cannot create it (") and "\n" not in msg, msg


def test_too_few_steps_to_time_print_no_nan(tmp_path, capsys):
    """With no step past the untimed first 3, tokens/s is None in summary.json, and the log lines and the
    results said "nan tok/s"; now "- tok/s" and "tok/s not timed"."""
    summary = demo.main(TINY + ["--steps", "2", "--eval-every", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert summary["mhc"]["tokens_per_s"] is None
    assert "nan" not in out and "- tok/s" in out and "tok/s not timed" in out, out


@pytest.mark.parametrize("seed,ok", [("-1", True), (str(2**64 - 3), True), (str(2**64 - 2), False),
                                     (str(-2**63 - 1), False), ("99999999999999999999999", False)])
def test_seed_outside_torchs_range_is_one_line(tmp_path, seed, ok):
    """A --seed torch.manual_seed cannot take (it also seeds with seed + 1 and seed + 2) stopped with a
    ValueError traceback ("Overflow when unpacking long long") after the corpus was read; now one line
    before anything runs. Seeds in the range, negative ones included, train as before."""
    argv = TINY + ["--steps", "1", "--eval-every", "1", "--seed", seed, "--out", str(tmp_path)]
    if ok:
        demo.main(argv)
        return
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert str(e.value.code) == (f"--seed must be in {-2**63}..{2**64 - 3} (torch's seed range, with the seed + 1 "
                                 f"and seed + 2 the demo also uses), got {seed}")
    assert not (tmp_path / "summary.json").exists()


def test_lr_past_float32_is_one_line(tmp_path):
    """--lr 1e39 is finite but no float32: torch's AdamW raised "value cannot be converted to type float
    without overflow" from inside its step; now one line before anything runs."""
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--lr", "1e39", "--out", str(tmp_path)])
    assert str(e.value.code) == "--lr must be at most 3.403e+38 (the float32 parameters' range), got 1e+39"


def test_non_finite_loss_is_one_line(tmp_path):
    """A learning rate that sends the loss to NaN / inf stopped with a FloatingPointError traceback; now
    SystemExit with its one line (what diverged, where) and a hint."""
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + ["--lr", "1e10", "--out", str(tmp_path)])
    msg = str(e.value.code)
    assert msg.startswith("python -m mhc_cupy.demo: ") and "non-finite loss" in msg and "\n" not in msg, msg
    assert msg.endswith("(try a smaller --lr)"), msg
