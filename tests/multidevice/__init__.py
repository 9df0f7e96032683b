"""Multi-device checks that need their own processes (run from tests/test_multidevice.py
and tests/gpu/test_multidevice_gpu.py): JAX with 2 devices, torch.distributed with 2 ranks."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run(args, env=None, timeout=300) -> str:
    """Run ``python args...`` from the repo root with mhc_cupy importable; fail with its output."""
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [full.get("PYTHONPATH")] if p])
    full.update(env or {})
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def pytest_cases(module: str, env=None, timeout=300) -> str:
    """Run tests/multidevice/<module> with pytest in a subprocess; every case must pass (none skipped)."""
    out = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(HERE / module)], env, timeout)
    assert " skipped" not in out, out[-3000:]
    return out


def torchrun(script_args, nproc=2, env=None, timeout=300) -> str:
    """``torchrun --standalone --nproc-per-node nproc script_args...`` (one thread per rank)."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    return run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script_args], env,
               timeout)


#: Collective opcodes of XLA's HLO text (an async collective is counted once, at its "-start").
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast", "reduce-scatter")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(")


def count_collectives(hlo: str) -> dict:
    """{opcode: count} of the collective instructions in HLO text (``compiled.as_text()``).

    Every instruction line is ``name = type opcode(operands), attributes``.  A combined collective
    (XLA's combiners merge several into one whose type is a tuple, printed with ``/*index=5*/``
    comments past five elements) counts as one instruction; ``-start`` counts, ``-done`` does not.
    """
    counts: dict = {}
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))
        if m is None:
            continue
        op = m.group("op")
        op = op[:-len("-start")] if op.endswith("-start") else op
        if op in COLLECTIVES:
            counts[op] = counts.get(op, 0) + 1
    return counts
