"""Show that a refactor left the coefficient path's launches and machine code unchanged, on the CPU.

``manifest`` writes a JSON manifest of one source tree:

* launches: every launch the op plans make (``mhc_cupy._kernels.dry_launches`` on fake pointers)
  over a grid of settings (activation dtype, n, C odd / aligned, aligned / misaligned pointers,
  activation / float32 incoming gradients, without / with wgmma): per setting a SHA-256 over each
  launch's name expression, grid, block, dynamic shared memory and argument values with their types
  (the kernel file is left out: a split moves kernels between files);
* kernels: every distinct specialisation of the coefficient path (``mhc_coeffs_*`` / ``mhc_head_*``;
  ``--prefixes`` names other kernel families, e.g. ``mhc_boundary_ mhc_rmsnorm_ mhc_stream_``)
  that those launches name, compiled for sm_80 and sm_90a: per
  kernel the SHA-256 of its SASS (the cubin's ``.text.<mangled name>`` section: no cuobjdump is
  needed), its registers, parameter bank size, and ptxas's static shared memory and spill stores.

``compare A B`` says whether two manifests agree and exits 1 naming what differs.  The
specialisations of one kernel template are compiled in one NVRTC program per architecture with the
JIT's options, the kernels without template parameters of a file in another: a program then holds
what the JIT's (one name expression, with the file's plain kernels) holds as far as shared memory
goes (ptxas pads every kernel's static shared memory to the largest alignment of the module's
``extern __shared__`` arrays), and a kernel's SASS does not depend on the rest.  The records are
cached in ``$MHC_CUPY_CACHE_DIR/compare_build`` (key: the inlined source, the name expression, the
architecture, the NVRTC version and options, the CUDA headers).

    python scripts/compare_build.py manifest --tree /tmp/base --out base.json
    python scripts/compare_build.py manifest --out new.json
    python scripts/compare_build.py compare base.json new.json
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import struct
import sys
import time
from pathlib import Path

NS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 32)  # every backward kind, wgmma range and vector width
CS = (4096, 7, 6)  # 16-byte rows, odd rows, rows of 2-element vectors
DTYPES = ("bfloat16", "float16", "float32")
ARCHS = ("sm_80", "sm_90a")
PATH = ("mhc_coeffs_", "mhc_head_")  # the coefficient path's kernels: --prefixes' default


def _launches(ns, cs):
    """{setting: (launch count, digest)} and {name expression: kernel file}."""
    from mhc_cupy import _kernels

    cases, files = {}, {}
    for wg, dt, n, C, al, gf in itertools.product((False, True), DTYPES, ns, cs, (True, False), (False, True)):
        h, count = hashlib.sha256(), 0
        for f, expr, grid, block, args, smem in _kernels.dry_launches((dt,), (n,), (C,), (al,), (gf,), (wg,)):
            files[expr] = f
            h.update(repr((expr, grid, block, smem, [(type(a).__name__, a if a is None else a.item() if hasattr(
                a, "item") else a) for a in args])).encode())
            count += 1
        cases[f"wgmma={wg} {dt} n={n} C={C} aligned={al} grad_f32={gf}"] = [count, h.hexdigest()]
    return cases, files


def _sections(elf: bytes) -> dict:
    """{section name: bytes} of a little-endian ELF64 file (a cubin)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    return {elf[names + h[0]:elf.index(b"\0", names + h[0])].decode():
            elf[h[4]:h[4] + h[5]] if h[1] != 8 else b"\0" * h[5] for h in heads}  # SHT_NOBITS: its size


def _registers(s: dict) -> dict:
    """{function name: registers} from the EIATTR_REGCOUNT entries of .nv.info (symbol index, count)."""
    sym, strtab, info, out, o = s[".symtab"], s[".strtab"], s[".nv.info"], {}, 0
    while o < len(info):
        fmt, attr = info[o], info[o + 1]
        size = struct.unpack_from("<H", info, o + 2)[0] if fmt == 4 else 2 if fmt == 3 else 0
        if attr == 0x2F:
            idx, count = struct.unpack_from("<II", info, o + 4)
            name = struct.unpack_from("<I", sym, 24 * idx)[0]
            out[strtab[name:strtab.index(b"\0", name)].decode()] = count
        o += 2 + (2 + size if fmt == 4 else size)
    return out


def _ptxas(log: str) -> dict:
    """{mangled name: (static shared bytes, spill store bytes)} from a ptxas -v log: the kernel's own
    static shared memory, whatever else its module holds (a cubin's .nv.shared sections are padded to
    the module's largest alignment)."""
    out, name, spill = {}, None, 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name, spill = m.group(1), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        if "Used" in line and name:
            m = re.search(r"(\d+) bytes smem", line)
            out[name] = (int(m.group(1)) if m else 0, spill)
    return out


def _record(cubin: bytes, log: dict, mangled: str) -> dict:
    s = _sections(cubin)
    text = s[f".text.{mangled}"]
    return {"sass": hashlib.sha256(text).hexdigest(), "sass_bytes": len(text), "registers": _registers(s)[mangled],
            "static_shared": log[mangled][0], "spill_stores": log[mangled][1],
            "param_bank": len(s.get(f".nv.constant0.{mangled}", b""))}


def _compile(by_file: dict, archs) -> dict:
    """{arch: {name expression: record}}: one NVRTC program per (file, kernel template) and
    architecture (the module docstring says why), records cached in $MHC_CUPY_CACHE_DIR/compare_build."""
    from mhc_cupy import _headers, _jit, _nvrtc, _sources

    cache = _jit.cache_dir() / "compare_build"
    cache.mkdir(parents=True, exist_ok=True)
    dirs, opts = _headers.include_dirs(), [*_jit.NVRTC_OPTIONS, "--ptxas-options=-v"]
    out = {}
    for arch in archs:
        out[arch] = {}
        for (fname, template), exprs in sorted(by_file.items()):
            source = _sources.load_source(fname)
            base = repr(("per template", source, arch, opts, _nvrtc.version(), _headers.digest(source, dirs)))
            keys = {e: hashlib.sha256((base + e).encode()).hexdigest() for e in exprs}
            todo = [e for e in exprs if not (cache / f"{keys[e]}.json").is_file()]
            if todo:
                t0 = time.perf_counter()
                res = _nvrtc.compile(source, fname, todo, arch=arch, options=opts, include_dirs=dirs)
                log = _ptxas(res["log"])
                for e in todo:
                    record = _record(res["cubin"], log, res["lowered_names"][e])
                    (cache / f"{keys[e]}.json").write_text(json.dumps(record))
                print(f"  {arch} {fname} {template or '(plain kernels)'}: compiled {len(todo)} in "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for e in exprs:
                out[arch][e] = json.loads((cache / f"{keys[e]}.json").read_text())
    return out


def manifest(args) -> dict:
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import mhc_cupy

    tree = Path(mhc_cupy.__file__).resolve().parents[1]
    assert tree == Path(args.tree).resolve(), f"imported mhc_cupy from {tree}, not from --tree {args.tree}"
    cases, files = _launches(tuple(args.ns), tuple(args.cs))
    prefixes = tuple(args.prefixes)
    path = sorted(e for e in files if e.startswith(prefixes))
    defined = set()
    for f in (tree / "kernels_cu").glob("*.cu"):
        defined |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)",
                                  f.read_text()))
    missing = sorted(k for k in defined if k.startswith(prefixes) and not any(e.split("<")[0] == k for e in path))
    assert not missing, f"kernels named {prefixes} that no launch of the grid names: {missing}"
    by_file = {}  # (file, template name or "" for the plain kernels) -> name expressions
    for e in path:
        by_file.setdefault((files[e], e.split("<")[0] if "<" in e else ""), []).append(e)
    kernels = {} if args.no_compile else _compile(by_file, args.archs)
    return {"tree": str(tree), "grid": {"ns": args.ns, "Cs": args.cs, "dtypes": DTYPES, "prefixes": prefixes},
            "launches": cases, "launch_count": sum(c for c, _ in cases.values()), "files": {e: files[e] for e in path},
            "kernels": kernels}


def compare(a: dict, b: dict) -> list[str]:
    """What differs between two manifests (the kernel files aside)."""
    bad = [f"launches differ at {k}: {a['launches'].get(k)} / {b['launches'].get(k)}"
           for k in sorted(set(a["launches"]) | set(b["launches"])) if a["launches"].get(k) != b["launches"].get(k)]
    for arch in sorted(set(a["kernels"]) | set(b["kernels"])):
        ka, kb = a["kernels"].get(arch, {}), b["kernels"].get(arch, {})
        bad += [f"{arch} {e}: {ka.get(e)} / {kb.get(e)}" for e in sorted(set(ka) | set(kb)) if ka.get(e) != kb.get(e)]
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="write a tree's manifest")
    m.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="source tree (default: this one)")
    m.add_argument("--out", required=True)
    m.add_argument("--ns", type=int, nargs="+", default=list(NS))
    m.add_argument("--cs", type=int, nargs="+", default=list(CS))
    m.add_argument("--archs", nargs="+", default=list(ARCHS))
    m.add_argument("--prefixes", nargs="+", default=list(PATH), help="the kernels compiled: names starting so")
    m.add_argument("--no-compile", action="store_true", help="launches only")
    c = sub.add_parser("compare", help="compare two manifests")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "manifest":
        Path(args.out).write_text(json.dumps(manifest(args), indent=1, sort_keys=True) + "\n")
        return 0
    a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
    bad = compare(a, b)
    for line in bad[:50]:
        print(line)
    kernels = {arch: len(v) for arch, v in a["kernels"].items()}
    print(f"{'DIFFERENT' if bad else 'identical'}: {len(a['launches'])} settings, {a['launch_count']} / "
          f"{b['launch_count']} launches, kernels compiled {kernels}; {len(bad)} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
