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
