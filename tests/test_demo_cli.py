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
