"""Execute notebooks top to bottom: without Jupyter, or (``--write``) in a kernel, saving the outputs.

Without ``--write``: each notebook's code cells run in order in one namespace, as a kernel
would run them; a line starting with ``!`` runs in the shell and ``%`` magics are skipped.
CI uses nbmake (``python -m pytest -q --nbmake``); this is for GPU machines whose image has
no Jupyter.  Usage: python scripts/run_notebooks.py notebooks/*.ipynb

``--write``: run each notebook in a Jupyter kernel (nbclient, ipykernel; what nbmake uses),
in its own folder, importing mhc_cupy from this checkout, and save it with its outputs
(plots as PNG, 72 dpi by default; no execution timestamps).  The committed notebooks are
saved this way, so that a reader of the repository sees what they print.  A notebook whose
outputs exceed ``--max-kib`` is not written (an error): keep the saved files small.
Usage: python scripts/run_notebooks.py --write notebooks/*.ipynb
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(path: str) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    cells = json.load(open(path))["cells"]
    ns = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        lines = []
        for line in "".join(cell["source"]).splitlines():
            if line.lstrip().startswith("!"):
                lines.append(f"__import__('subprocess').run({line.lstrip()[1:]!r}, shell=True, check=True)")
            elif line.lstrip().startswith("%"):
                continue
            else:
                lines.append(line)
        try:
            exec(compile("\n".join(lines), f"{path}[cell {i}]", "exec"), ns)
        except Exception:
            print(f"FAILED in {path}, cell {i}:\n{''.join(cell['source'])}", file=sys.stderr)
            raise


def outputs_kib(nb) -> float:
    """Size of a notebook's saved outputs in KiB (as JSON)."""
    return sum(len(json.dumps(c.get("outputs", []))) for c in nb["cells"] if c["cell_type"] == "code") / 1024


def coalesce_streams(cell) -> None:
    """Join consecutive stdout (or stderr) outputs of a cell into one, as Jupyter shows them."""
    merged = []
    for out in cell.get("outputs", []):
        prev = merged[-1] if merged else None
        if (prev is not None and out["output_type"] == prev["output_type"] == "stream"
                and out["name"] == prev["name"]):
            prev["text"] += out["text"]
        else:
            merged.append(out)
    cell["outputs"] = merged


def execute_and_save(path: str, timeout: int = 1800, max_kib: float = 400.0, dpi: int = 72) -> None:
    """Run ``path`` in a fresh ``python3`` kernel and write it back with its outputs (figures
    at ``dpi``, consecutive stream outputs joined).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (nothing is written).
        ValueError: the outputs take more than ``max_kib`` KiB (nothing is written).
    """
    import tempfile

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="mhc_nb_rc_") as rc:
        with open(os.path.join(rc, "matplotlibrc"), "w") as f:
            f.write(f"figure.dpi: {dpi}\n")  # the inline backend's PNGs: smaller files
        env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel's inline PNG backend
        env.update(MATPLOTLIBRC=rc, PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))  # this checkout
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
        client.execute(env=env)
    for cell in nb.cells:
        if cell.cell_type == "code":
            coalesce_streams(cell)
    size = outputs_kib(nb)
    nbformat.validate(nb)
    if size > max_kib:
        raise ValueError(f"{path}: outputs of {size:.0f} KiB, more than --max-kib {max_kib:g}; not written")
    nbformat.write(nb, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Execute notebooks top to bottom: in this process (no Jupyter "
                                             "needed), or with --write in a Jupyter kernel, saving their outputs.")
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--write", action="store_true", help="run in a Jupyter kernel and save the outputs in place")
    ap.add_argument("--max-kib", type=float, default=400.0, help="--write: largest outputs per notebook (KiB)")
    ap.add_argument("--dpi", type=int, default=72, help="--write: resolution of the saved figures (default 72)")
    args = ap.parse_args(argv)
    failed = 0
    for p in args.notebooks:
        t = time.perf_counter()
        try:
            execute_and_save(p, max_kib=args.max_kib, dpi=args.dpi) if args.write else run(p)
            print(f"ok      {p} ({time.perf_counter() - t:.0f} s)")
        except Exception as e:  # report every notebook
            failed += 1
            print(f"FAILED  {p}: {type(e).__name__}: {str(e)[-2000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
