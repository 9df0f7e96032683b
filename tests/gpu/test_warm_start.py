"""A second process with a warm disk cache invokes no NVRTC compile; a broken header is reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_CODE = r"""
import json, sys, time
t0 = time.perf_counter()
import mhc_cupy
from mhc_cupy import _jit, _kernels
pairs = _kernels.specialisations(dtypes=("bfloat16", "float32"), ns=(4,), Cs=(4096,), aligned=(True,))
for f, e in pairs:
    # spell every name with blanks after commas: must hit the same cache entry
    _jit.get_function(f, e.replace(",", ", ").replace("<", " < "))
print(json.dumps(dict(_jit.stats, kernels=len(pairs), seconds=time.perf_counter() - t0)))
"""


def _run(cache_dir):
    env = dict(os.environ, MHC_CUPY_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_start_compiles_nothing(tmp_path):
    cold = _run(tmp_path)
    assert cold["compiles"] == cold["kernels"] > 10
    warm = _run(tmp_path)
    assert warm["compiles"] == 0
    assert warm["disk_hits"] == warm["kernels"]
    # import + loading every module, against the cold run's compiles: relative, so that a machine
    # loaded by parallel test workers slows both (an absolute 5 s bound is a timed test)
    assert warm["seconds"] < cold["seconds"] / 2, (warm, cold)


_BROKEN = r"""
import mhc_cupy
from mhc_cupy import _jit
try:
    _jit.get_function("stream.cu", "mhc_column_sum_kernel")
except mhc_cupy.KernelCompileError as e:
    print("RAISED")
    print(e)
"""


def test_broken_header_is_reported(tmp_path):
    """At run time, an include dir whose cuda_bf16.h is #error gives an
    error naming the header, the include dirs and the NVRTC version; no hang."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "cuda_bf16.h").write_text('#error "this cuda_bf16.h is broken on purpose"\n')
    env = dict(os.environ, MHC_CUPY_CACHE_DIR=str(tmp_path / "cache"), MHC_CUPY_INCLUDE_DIRS=str(inc))
    out = subprocess.run([sys.executable, "-c", _BROKEN], env=env, capture_output=True, text=True, timeout=120)
    assert "RAISED" in out.stdout, out.stdout + out.stderr
    msg = out.stdout
    assert "cuda_bf16.h" in msg and str(inc) in msg and "NVRTC" in msg and "broken on purpose" in msg
