"""Execute notebooks top to bottom without Jupyter (for machines that lack it).

Each notebook's code cells run in order in one namespace, as a kernel would run
them; a line starting with ``!`` runs in the shell and ``%`` magics are skipped.
CI uses nbmake (``python -m pytest -q --nbmake``); this is for GPU machines
whose image has no Jupyter.  Usage: python scripts/run_notebooks.py notebooks/*.ipynb
"""

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("MPLBACKEND", "Agg")


def run(path: str) -> None:
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


if __name__ == "__main__":
    failed = 0
    for p in sys.argv[1:]:
        t = time.perf_counter()
        try:
            run(p)
            print(f"ok      {p} ({time.perf_counter() - t:.0f} s)")
        except Exception as e:  # report every notebook
            failed += 1
            print(f"FAILED  {p}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
