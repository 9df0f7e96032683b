"""The on-disk kernel cache (``mhc_cupy._jit``), without a GPU: kernels are compiled
for sm_90.  Who may write the cache, what a bad entry does, what the key covers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from mhc_cupy import _headers, _jit

FILE, EXPR, TARGET = "stream.cu", "mhc_column_sum_kernel", "sm_90"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder (not yet created) and a stand-in NVRTC that counts compiles."""
    d = tmp_path / "cache"
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", str(d))
    monkeypatch.setattr(_jit, "_warned", set())
    calls = []

    def fake_compile(source, name, exprs, arch, options, include_dirs, heading):
        calls.append((name, tuple(exprs), arch))
        return {"cubin": b"\x7fELF" + hashlib.sha256(source.encode() + arch.encode()).digest() * 8,
                "lowered_names": {e: "_Z" + e for e in exprs}, "log": ""}

    monkeypatch.setattr(_jit._nvrtc, "compile", fake_compile)
    return d, calls


def _entries(d):
    return sorted(p.name for p in d.iterdir())


def _get():
    return _jit.kernel_binary(FILE, EXPR, TARGET)


def test_real_compile_then_disk_hit(tmp_path, monkeypatch):
    """With the real NVRTC: the first call compiles a cubin, the second reads it back."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", str(tmp_path / "c"))
    before = dict(_jit.stats)
    mangled, code = _get()
    assert code[:4] == b"\x7fELF" and mangled and mangled.encode() in code
    assert _jit.stats["compiles"] == before["compiles"] + 1
    assert _get() == (mangled, code)
    assert _jit.stats["compiles"] == before["compiles"] + 1 and _jit.stats["disk_hits"] == before["disk_hits"] + 1


def test_cache_dir_expands_home_and_is_absolute(tmp_path, monkeypatch):
    """A quoted "~/..." (or a Dockerfile ENV) reaches the process unexpanded: it made a folder named
    "~" in the current one.  "~" is expanded, a relative path made absolute (so info names it)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", "~/kc")
    assert _jit.cache_dir() == tmp_path / "home" / "kc"
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", "rel/kc")
    assert _jit.cache_dir() == tmp_path / "rel" / "kc"
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", "")
    assert _jit.cache_dir() == tmp_path / "home" / ".cache" / "mhc_cupy"


def test_folder_created_0700_and_entry_reused(cache):
    d, calls = cache
    first = _get()
    assert (d.stat().st_mode & 0o777) == 0o700
    (entry,) = _entries(d)
    assert entry.endswith(".bin") and not entry.startswith(".")
    assert _get() == first and len(calls) == 1


def _corrupt(path, how):
    data = path.read_bytes()
    head, code = data.split(b"\n", 1)
    meta = json.loads(head)
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[:-10])
    elif how == "empty binary":
        path.write_bytes(json.dumps(dict(meta, size=0, sha256=hashlib.sha256(b"").hexdigest())).encode() + b"\n")
    elif how == "json list":
        path.write_bytes(b"[]\n" + code)
    elif how == "bad json":
        path.write_bytes(b"{not json\n" + code)
    elif how == "no header":
        path.write_bytes(code.replace(b"\n", b""))
    elif how == "digest mismatch":
        path.write_bytes(head + b"\n" + code[:-1] + bytes([code[-1] ^ 1]))
    elif how == "no mangled name":
        path.write_bytes(json.dumps(dict(meta, mangled="")).encode() + b"\n" + code)
    elif how == "not utf-8":
        path.write_bytes(b"\xff\xfe\n" + code)
    elif how == "deeply nested json":  # json.loads raises RecursionError, not ValueError
        path.write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n" + code)


@pytest.mark.parametrize("how", ["empty", "truncated", "empty binary", "json list", "bad json", "no header",
                                 "digest mismatch", "no mangled name", "not utf-8", "deeply nested json"])
def test_bad_entry_is_a_miss_and_is_replaced(cache, how):
    d, calls = cache
    good = _get()
    (entry,) = _entries(d)
    _corrupt(d / entry, how)
    assert _get() == good and len(calls) == 2  # dropped and recompiled
    assert _entries(d) == [entry]
    assert _get() == good and len(calls) == 2  # the rewritten entry is good


def test_symlinked_entry_is_not_followed(cache, tmp_path):
    d, calls = cache
    good = _get()
    (entry,) = _entries(d)
    planted = tmp_path / "planted"
    shutil.copy(d / entry, planted)  # a well-formed entry, but reached through a link
    os.unlink(d / entry)
    os.symlink(planted, d / entry)
    assert _get() == good and len(calls) == 2
    assert not (d / entry).is_symlink()


def test_entry_writable_by_others_is_dropped(cache):
    d, calls = cache
    _get()
    (entry,) = _entries(d)
    os.chmod(d / entry, 0o666)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        _get()
    assert len(calls) == 2 and (d / entry).stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another user needs root")
def test_entry_owned_by_another_user_is_dropped(cache):
    d, calls = cache
    _get()
    (entry,) = _entries(d)
    os.chown(d / entry, 12345, -1)
    with pytest.warns(RuntimeWarning, match="owned by uid 12345"):
        _get()
    assert len(calls) == 2 and (d / entry).stat().st_uid == os.getuid()


def _ignored_twice(calls, match):
    with pytest.warns(RuntimeWarning, match=match) as rec:
        _get()
        _get()
    assert len([w for w in rec if "kernel cache" in str(w.message)]) == 1  # one warning, not one per kernel
    assert len(calls) == 2  # nothing read from or written to the folder


def test_group_writable_folder_is_ignored_with_one_warning(cache):
    d, calls = cache
    d.mkdir(mode=0o700)
    os.chmod(d, 0o770)
    _ignored_twice(calls, "writable by group or others")
    assert _entries(d) == []


def test_folder_of_another_user_is_ignored(cache, monkeypatch):
    d, calls = cache
    d.mkdir(mode=0o700)
    monkeypatch.setattr(_jit.os, "getuid", lambda: os.stat(d).st_uid + 1)
    _ignored_twice(calls, "not by this user")
    assert _entries(d) == []


def test_symlinked_folder_is_ignored(cache, tmp_path, monkeypatch):
    _, calls = cache
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    monkeypatch.setenv("MHC_CUPY_CACHE_DIR", str(tmp_path / "link"))
    _ignored_twice(calls, "a symlink")
    assert _entries(real) == []


def test_failed_write_leaves_no_temporary_file(cache, monkeypatch):
    d, calls = cache

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_jit.os, "replace", refuse)
    mangled, code = _get()
    assert code[:4] == b"\x7fELF"
    assert _entries(d) == []  # neither an entry nor a leaked temporary file
    monkeypatch.undo()


def test_key_covers_the_bytes_of_included_cuda_headers(cache, tmp_path, monkeypatch):
    """An in-place upgrade of the runtime-headers wheel (same folder, new bytes) is a miss."""
    _, calls = cache
    wheel = _headers.find_header("cuda_bf16.h")
    if wheel is None:
        pytest.skip("no CUDA headers")
    inc = tmp_path / "include"
    shutil.copytree(os.path.dirname(wheel), inc)
    monkeypatch.setenv(_headers.ENV_INCLUDE_DIRS, str(inc))
    _headers._digest.cache_clear()
    _get()
    for k, name in enumerate(("cuda_bf16.hpp", "cuda_fp16.h", "vector_types.h"), start=2):  # direct and transitive
        with open(inc / name, "a") as f:
            f.write("\n// upgraded\n")
        _headers._digest.cache_clear()  # a new process
        _get()
        assert len(calls) == k, f"editing {name} did not change the key"
    _headers._digest.cache_clear()
    _get()
    assert len(calls) == 4  # unchanged headers: a hit


def test_digest_follows_includes(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n#include <c.h>\n')
    (tmp_path / "b.h").write_text("int b;\n")
    (tmp_path / "c.h").write_text("#include <a.h>\n")  # a cycle ends
    src = "#include <a.h>\n#include <nv/target>\n"
    d0 = _headers.digest(src, [str(tmp_path)])
    (tmp_path / "b.h").write_text("int b2;\n")
    _headers._digest.cache_clear()
    assert _headers.digest(src, [str(tmp_path)]) != d0


def test_target_arch(monkeypatch):
    """A device NVRTC supports gets its own cubin (sm_90 with its arch-specific instructions); a newer one PTX of the newest older
    architecture (the driver compiles it); an older one a clear error."""
    monkeypatch.setattr(_jit._nvrtc, "supported_archs", lambda: [75, 80, 86, 89, 90])
    monkeypatch.setattr(_jit, "nvrtc_version", lambda: (12, 4))
    assert _jit.target_arch("90") == "sm_90a" and _jit.target_arch("80") == "sm_80"  # sm_90a: wgmma
    assert _jit.target_arch("100") == "compute_90"
    with pytest.raises(RuntimeError, match="NVRTC 12.4 cannot compile for this GPU .sm_70.; it supports sm_75"):
        _jit.target_arch("70")


@pytest.mark.parametrize("files", [0, 1])
def test_folder_in_place_of_an_entry_is_a_miss(cache, files):
    """A folder where the entry should be is a miss on every call (was IsADirectoryError); an empty
    one is replaced by the entry, one with files in it is left alone (the kernel compiles each time)."""
    d, calls = cache
    good = _get()
    (entry,) = _entries(d)
    os.unlink(d / entry)
    os.mkdir(d / entry, 0o700)
    if files:
        (d / entry / "keep").write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match="a folder" + (".*could not remove it" if files else "")):
        assert _get() == good and len(calls) == 2
    assert (d / entry).is_dir() == bool(files) and _entries(d) == [entry]  # no leaked temporary file
    assert _get() == good and len(calls) == 2 + files  # rewritten: a hit; else another miss


def test_fifo_entry_does_not_block(cache):
    """Opening an entry never waits (a FIFO in the folder is not a regular file)."""
    d, calls = cache
    _get()
    (entry,) = _entries(d)
    os.unlink(d / entry)
    os.mkfifo(d / entry, 0o600)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert _get()[1][:4] == b"\x7fELF" and len(calls) == 2
    assert (d / entry).is_file()
