"""Compile every kernel specialisation with NVRTC, without a GPU (runs in CI).

Also covers case P8 (broken / missing CUDA headers must give a readable error
quickly, never a hang) and the include-dir / library discovery helpers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from mhc_cupy import _headers, _nvrtc

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require_nvrtc():
    try:
        return _nvrtc.version()
    except _nvrtc.NVRTCNotFoundError as exc:
        if IN_CI:  # CI installs the [cuda12] extra: a missing NVRTC is a real failure there
            raise
        pytest.skip(f"libnvrtc not available: {exc}")


@pytest.fixture(scope="module")
def nvrtc_version():
    return _require_nvrtc()


# --------------------------------------------------------------------------- real kernels

def _arch_free(options):
    """The JIT's NVRTC options without any architecture flag (this test sets its own)."""
    out = []
    for o in options:
        if o.startswith(("-arch", "--gpu-architecture", "--gpu-name")):
            continue
        out.append(o)
    return out


def _specialisation_groups():
    """[(file name, [name expressions])] from the real kernel registry, or an error string."""
    try:
        from mhc_cupy._kernels import all_specialisations
        specs = list(all_specialisations())
    except Exception as exc:  # reported by test_registry_importable
        return None, f"{type(exc).__name__}: {exc}"
    groups: "OrderedDict[str, list[str]]" = OrderedDict()
    for fname, expr in specs:
        groups.setdefault(fname, [])
        if expr not in groups[fname]:
            groups[fname].append(expr)
    return list(groups.items()), None


_GROUPS, _GROUPS_ERROR = _specialisation_groups()


def test_registry_importable():
    assert _GROUPS_ERROR is None, (
        "mhc_cupy._kernels.all_specialisations() failed: " + str(_GROUPS_ERROR))
    assert _GROUPS, "all_specialisations() returned no specialisation"


def test_every_kernel_file_has_specialisations():
    if _GROUPS is None:
        pytest.fail(f"registry unavailable: {_GROUPS_ERROR}")
    listed = {f for f, _ in _GROUPS}
    on_disk = {p.name for p in (REPO / "kernels_cu").glob("*.cu")}
    assert listed <= on_disk, f"specialisations name missing files: {sorted(listed - on_disk)}"
    assert on_disk <= listed, f"kernel files with no specialisation: {sorted(on_disk - listed)}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "fname,exprs",
    _GROUPS or [pytest.param("<registry>", [], marks=pytest.mark.skip(
        reason=f"registry unavailable: {_GROUPS_ERROR}"))],
    ids=[g[0] for g in _GROUPS] if _GROUPS else ["registry-unavailable"],
)
def test_compile_all_specialisations(nvrtc_version, fname, exprs, arch):
    from mhc_cupy._jit import NVRTC_OPTIONS
    from mhc_cupy._sources import load_source

    source = load_source(fname)
    assert '#include "' not in source, f"{fname}: local includes must be inlined by load_source"
    t0 = time.perf_counter()
    res = _nvrtc.compile(source, fname, exprs, arch=arch, options=_arch_free(NVRTC_OPTIONS))
    dt = time.perf_counter() - t0
    cubin = res["cubin"]
    assert cubin[:4] == b"\x7fELF", f"{fname}/{arch}: NVRTC did not return a CUBIN"
    assert set(res["lowered_names"]) == set(exprs)
    for expr, mangled in res["lowered_names"].items():
        assert mangled, f"{fname}: no lowered name for {expr!r}"
        if "<" in expr:
            assert mangled.startswith("_Z"), f"{fname}: {expr!r} lowered to {mangled!r}"
        assert mangled.encode() in cubin, f"{fname}/{arch}: {mangled} not in the CUBIN"
    assert dt < 300, f"{fname}/{arch}: compile took {dt:.0f}s"


# --------------------------------------------------------------------------- small fixtures

TINY = textwrap.dedent(
    r"""
    #include <cuda_bf16.h>
    #include <cuda_fp16.h>
    template <typename T, int N, int V>
    __global__ void tiny_kernel(const T* __restrict__ x, float* __restrict__ y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = static_cast<float>(x[i]) * N + V;
    }
    """
)


def test_tiny_compile_cubin_and_ptx(nvrtc_version):
    exprs = ["tiny_kernel<__nv_bfloat16, 4, 8>", "tiny_kernel<__half, 2, 1>", "tiny_kernel<float, 1, 0>"]
    for arch in ARCHS:
        r = _nvrtc.compile(TINY, "tiny.cu", exprs, arch=arch, options=["-std=c++17"])
        assert r["cubin"][:4] == b"\x7fELF"
        assert all(v.startswith("_Z") for v in r["lowered_names"].values())
    r = _nvrtc.compile(TINY, "tiny.cu", exprs[:1], arch="compute_90", options=["-std=c++17"])
    assert b".entry" in r["ptx"] and r["lowered_names"][exprs[0]].encode() in r["ptx"]


def test_lowered_name_ignores_spaces(nvrtc_version):
    # P7: "k<T, 4, 8>" and "k<T,4,8>" name one kernel, so a cache keyed on it must agree.
    a, b = "tiny_kernel<__nv_bfloat16, 4, 8>", "tiny_kernel<__nv_bfloat16,4,8>"
    r = _nvrtc.compile(TINY, "tiny.cu", [a, b], arch="sm_90", options=["-std=c++17"])
    assert r["lowered_names"][a] == r["lowered_names"][b]


def test_syntax_error_is_compile_error(nvrtc_version):
    with pytest.raises(_nvrtc.NVRTCCompileError) as ei:
        _nvrtc.compile("__global__ void k( { }", "broken.cu", [], arch="sm_90")
    e = ei.value
    assert isinstance(e, RuntimeError)
    msg = str(e)
    assert "broken.cu" in msg and "error" in e.log
    assert f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]}" in msg


# --------------------------------------------------------------------------- P8

def _expected_package(major):
    return {12: "nvidia-cuda-runtime-cu12", 13: "nvidia-cuda-runtime"}[major]


def test_p8_error_header(nvrtc_version, tmp_path):
    bad = tmp_path / "bad_include"
    bad.mkdir()
    (bad / "cuda_bf16.h").write_text('#error "deliberately broken cuda_bf16.h"\n')
    dirs = [str(bad)] + _headers.wheel_include_dirs()
    t0 = time.perf_counter()
    with pytest.raises(_nvrtc.NVRTCCompileError) as ei:
        _nvrtc.compile(TINY, "p8_error.cu", ["tiny_kernel<float, 1, 0>"], arch="sm_90",
                       options=["-std=c++17"], include_dirs=dirs)
    assert time.perf_counter() - t0 < 30
    e, msg = ei.value, str(ei.value)
    assert "p8_error.cu" in msg
    assert "cuda_bf16.h" in msg and str(bad / "cuda_bf16.h") in msg  # names the header
    assert "deliberately broken" in msg  # full log
    for d in dirs:  # names every include dir searched
        assert d in msg
    assert f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]}" in msg
    assert re.search(r"CUDA header(s)? version", msg)  # header version (here: unknown)
    for d in _headers.wheel_include_dirs():
        v = _headers.header_version(d)
        if v:
            assert f"CUDA headers {v}" in msg
    assert e.include_dirs == dirs and e.nvrtc_version == nvrtc_version


def test_p8_empty_include_dir(nvrtc_version, tmp_path):
    empty = tmp_path / "empty_include"
    empty.mkdir()
    t0 = time.perf_counter()
    with pytest.raises(_nvrtc.NVRTCCompileError) as ei:
        _nvrtc.compile(TINY, "p8_empty.cu", ["tiny_kernel<float, 1, 0>"], arch="sm_90",
                       options=["-std=c++17"], include_dirs=[str(empty)])
    assert time.perf_counter() - t0 < 30
    e, msg = ei.value, str(ei.value)
    assert "cuda_bf16.h" in e.missing_headers
    assert "cuda_bf16.h" in msg and str(empty) in msg
    assert _expected_package(nvrtc_version[0]) in msg, msg
    assert f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]}" in msg


def test_p8_never_hangs(nvrtc_version, tmp_path):
    """Both P8 failures, in a child process with a hard time limit."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "cuda_bf16.h").write_text("#error broken\n")
    (tmp_path / "empty").mkdir()
    code = textwrap.dedent(
        f"""
        import sys
        from mhc_cupy import _nvrtc
        src = {TINY!r}
        for d in ({str(bad)!r}, {str(tmp_path / 'empty')!r}):
            try:
                _nvrtc.compile(src, "p8.cu", [], arch="sm_90", include_dirs=[d])
            except _nvrtc.NVRTCCompileError as e:
                assert "cuda_bf16.h" in str(e)
            else:
                sys.exit("no error for " + d)
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


def test_error_helpers_without_compile():
    log = 'k.cu(1): catastrophic error: cannot open source file "cuda_fp16.h"\n'
    e = _nvrtc.NVRTCCompileError.from_log("k.cu", log, include_dirs=[], nvrtc_version=(12, 9))
    assert e.missing_headers == ["cuda_fp16.h"]
    assert "nvidia-cuda-runtime-cu12" in str(e) and "NVRTC 12.9" in str(e)
    msg13 = _nvrtc.format_compile_error("k.cu", log, nvrtc_version=(13, 0))
    assert "nvidia-cuda-runtime==13" in msg13


def test_error_class_importable_without_cupy():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # any `import cupy` now raises ImportError
        from mhc_cupy._nvrtc import NVRTCCompileError
        assert issubclass(NVRTCCompileError, RuntimeError)
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, (
        "mhc_cupy._nvrtc must import without CuPy (is mhc_cupy/__init__.py importing cupy "
        "eagerly?)\n" + p.stdout + p.stderr)


# --------------------------------------------------------------------------- discovery

def test_include_dirs_override_first_unique_existing(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "cuda_bf16.h").write_text("// stub\n")
    missing = tmp_path / "does_not_exist"
    monkeypatch.setenv(_headers.ENV_INCLUDE_DIRS,
                       os.pathsep.join([str(a), str(missing), str(b), str(a)]))
    dirs = _headers.include_dirs()
    assert dirs[:2] == [str(a), str(b)]
    assert str(missing) not in dirs
    assert len({os.path.realpath(d) for d in dirs}) == len(dirs)
    assert all(os.path.isdir(d) for d in dirs)
    assert _headers.find_header("cuda_bf16.h", dirs) == str(b / "cuda_bf16.h")
    assert _headers.find_header("no_such_header.h", dirs) is None


def test_include_dirs_toolkit_env(tmp_path, monkeypatch):
    monkeypatch.delenv(_headers.ENV_INCLUDE_DIRS, raising=False)
    tk = tmp_path / "cuda"
    (tk / "include").mkdir(parents=True)
    (tk / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12080\n")
    monkeypatch.setenv("CUDA_PATH", str(tk))
    dirs = _headers.include_dirs()
    assert str(tk / "include") in dirs
    assert _headers.header_version(str(tk / "include")) == "12.8"


def test_wheel_headers_found(nvrtc_version):
    dirs = _headers.include_dirs()
    for h in _headers.REQUIRED_HEADERS:
        assert _headers.find_header(h, dirs), f"{h} not found in {dirs}"
