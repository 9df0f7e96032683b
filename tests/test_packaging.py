"""The wheel is pure Python and carries the CUDA sources (CPU only, runs in CI, < 60 s)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BINARY_SUFFIXES = (".so", ".pyd", ".dll", ".dylib", ".cubin", ".fatbin", ".ptx", ".o", ".a")
# What the build needs; copying just this keeps stale build/ folders and the
# working tree's caches out of the wheel and the test away from the checkout.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md",
                "README.rst", "LICENSE", "LICENSE.txt", "mhc_cupy", "kernels_cu")


def _build_wheel(src: Path, out: Path) -> Path:
    base = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(out),
            "--disable-pip-version-check", "-q"]
    attempts = [base + ["--no-build-isolation", "--no-index"], base]
    logs = []
    for cmd in attempts:
        p = subprocess.run(cmd, cwd=str(src), capture_output=True, text=True, timeout=300)
        logs.append(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
        wheels = sorted(out.glob("*.whl"))
        if p.returncode == 0 and wheels:
            return wheels[0]
    pytest.fail("could not build the wheel:\n" + "\n".join(logs))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")
    for name in BUILD_INPUTS:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        elif p.is_file():
            shutil.copy2(p, src / name)
    return _build_wheel(src, tmp / "dist")


@pytest.fixture(scope="module")
def names(wheel):
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_is_pure_python(wheel):
    assert wheel.name.startswith("mhc_cupy-"), wheel.name
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name


def test_wheel_has_kernel_sources(names):
    expected = {f"mhc_cupy/kernels_cu/{p.name}" for p in (REPO / "kernels_cu").iterdir()
                if p.suffix in (".cu", ".cuh")}
    assert any(n.endswith(".cu") for n in expected), "no .cu file in kernels_cu/"
    assert expected <= names, f"missing from wheel: {sorted(expected - names)}"
    assert "mhc_cupy/kernels_cu/__init__.py" in names


def test_wheel_has_every_module(names):
    assert "mhc_cupy/reference.py" in names
    assert "mhc_cupy/__init__.py" in names or not (REPO / "mhc_cupy/__init__.py").exists()
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "mhc_cupy").rglob("*.py")
                if "__pycache__" not in p.parts}
    missing = expected - names
    assert not missing, (f"modules missing from the wheel (add their package to "
                         f"[tool.setuptools] packages in pyproject.toml): {sorted(missing)}")


def test_wheel_has_no_binaries(names):
    bad = [n for n in names if n.lower().endswith(BINARY_SUFFIXES) or ".so." in n]
    assert not bad, f"compiled files in the wheel: {bad}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_wheel_metadata(wheel, names):
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(meta_name).decode()
    reqs = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist:")]
    base = [r for r in reqs if "extra ==" not in r]
    assert any(r.startswith("numpy") for r in base), reqs
    assert any(r.lower().replace("-", "_").startswith("ml_dtypes") for r in base), reqs
    assert not any(r.lower().split(";")[0].strip().split(" ")[0].rstrip("<>=!~") == "dlpack"
                   for r in reqs), "the PyPI package `dlpack` must not be a dependency"
    for extra in ("cuda12", "cuda13", "torch", "jax", "test", "notebooks"):
        assert f"Provides-Extra: {extra}" in meta, extra


def test_installed_wheel_finds_kernels(wheel, tmp_path):
    """Unpacked like an install, away from the checkout: the sources are reachable."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = textwrap.dedent(
        """
        import importlib, importlib.resources as r, sys
        kdir = r.files("mhc_cupy.kernels_cu")
        assert str(kdir).startswith(sys.argv[1]), str(kdir)
        files = [p.name for p in kdir.iterdir() if p.name.endswith(".cu")]
        assert files, "no .cu found through importlib.resources"
        import mhc_cupy
        where = list(mhc_cupy.__path__)
        assert where[0].startswith(sys.argv[1]), where
        try:
            src_mod = importlib.import_module("mhc_cupy._sources")
        except ModuleNotFoundError:
            src_mod = None
        if src_mod is not None:
            for f in files:
                text = src_mod.load_source(f)
                assert "__global__" in text, f
        print("OK", sorted(files))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    p = subprocess.run([sys.executable, "-c", code, str(site)], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


def test_kernels_come_from_the_imported_checkout(tmp_path):
    """A second checkout on PYTHONPATH runs its own kernels, not those of the installed one."""
    other = tmp_path / "other"
    shutil.copytree(REPO / "mhc_cupy", other / "mhc_cupy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "kernels_cu", other / "kernels_cu")
    code = "import mhc_cupy, mhc_cupy._sources as s; print(mhc_cupy.__file__); print(s.kernel_dir())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(other)
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    package_file, kdir = p.stdout.split()
    assert Path(package_file).is_relative_to(other), package_file
    assert Path(kdir) == (other / "kernels_cu").resolve(), kdir


# ------------------------------------------------------------------ README, CI, CLI, missing extras
def _readme_commands():
    """The shell commands of the README's "Two commands" block (comments dropped)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_readme_commands_each_work_alone():
    """Each command makes (or enters) its venv and pins torch in the same install, so
    run alone in a fresh shell it cannot resolve an extra to a CUDA build of PyTorch."""
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    for cmd, extra in zip(cmds, ("demo", "test")):
        assert cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch=="), cmd
        assert f'-e ".[cuda12,{extra}]"' in cmd, cmd
    pin = cmds[1].split("pip install ", 1)[1].split()[0]
    ci = (REPO / ".ci" / "run").read_text()
    assert f'pip install "{pin}" -e ".[cuda12,test]"' in ci  # CI installs what the README says
    assert cmds[1].endswith("python -m pytest -q --nbmake") and "python -m pytest -q --nbmake" in ci


def test_readme_op_kernel_table_names_real_kernels():
    """Every kernel the README's "Ops and their kernels" table names (``mhc_a_{fwd,bwd}_kernel``
    standing for two) is a __global__ function of kernels_cu/, every kernel the op plans
    launch is in the table, and every __global__ function is launched by some dry run
    (_kernels.dry_launches: what CI compiles and warmup loads)."""
    text = (REPO / "README.md").read_text().split("## Ops and their kernels", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) >= 10, rows
    defined = set()
    for f in (REPO / "kernels_cu").glob("*.cu"):
        defined |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)", f.read_text()))
    named = set()
    for word in re.findall(r"`(mhc_[\w{},]*kernel)`", "\n".join(rows)):
        brace = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", word)
        named |= {brace.group(1) + a + brace.group(3) for a in brace.group(2).split(",")} if brace else {word}
    assert named and not named - defined, f"README names kernels no .cu file defines: {sorted(named - defined)}"
    from mhc_cupy import _kernels

    launched = {expr.split("<")[0] for _, expr, *_ in _kernels.dry_launches(ns=(1, 4, 8, 17))}
    shorthand = set(re.findall(r"`(_\w+_kernel)`", text))  # "`_implicit_bwd_warp_kernel`" after its full sibling
    missing = {k for k in launched - named if not any(k.endswith(s) for s in shorthand)}
    assert not missing, f"kernels the op plans launch that the README table does not name: {sorted(missing)}"
    # a kernel no dry run reaches is neither compiled by CI nor warmed up (its first real use compiles)
    assert not defined - launched, f"kernels no dry run of the op plans launches: {sorted(defined - launched)}"


def test_readme_dropout_note_matches_the_demo_configs():
    pytest.importorskip("torch")
    from mhc_cupy import demo

    text = " ".join((REPO / "README.md").read_text().split())
    assert demo.TINY_PRESET["dropout"] == 0.0 and demo.GPU_PRESET["dropout"] > 0
    assert f"dropout {demo.GPU_PRESET['dropout']}" in text and "tiny CPU configuration has no dropout" in text
    assert "expected here: the training loss has dropout" not in text


def test_readme_functional_usage_says_it_records_no_graph():
    """The README's first snippet is the functional API: it says there that no autograd
    graph is recorded (a warning) and points at mhc_cupy.torch."""
    usage = " ".join((REPO / "README.md").read_text().split("## Usage", 1)[1].split("```python", 1)[0].split())
    assert "records no autograd graph" in usage and "mhc_cupy.AutogradNotRecordedWarning" in usage, usage
    assert "mhc_cupy.torch" in usage, usage


def test_readme_names_every_sanitizer_tool_of_the_gpu_check():
    tools = re.findall(r"compute-sanitizer --tool (\w+)", (REPO / "scripts" / "gpu_check.sh").read_text())
    assert {"memcheck", "racecheck", "synccheck", "initcheck"} <= set(tools), tools
    text = " ".join((REPO / "README.md").read_text().split())
    sentence = text.split("`bash scripts/gpu_check.sh` runs", 1)[1].split(".", 1)[0]
    assert all(t in sentence for t in tools), (tools, sentence)


@pytest.mark.parametrize("module,extra,blocked", [("mhc_cupy.torch", "torch", "torch"), ("mhc_cupy.jax", "jax", "jax"),
                                                   ("mhc_cupy.demo", "demo", "torch"),
                                                   ("mhc_cupy.demo", "demo", "matplotlib")])
def test_missing_extra_says_what_to_install(module, extra, blocked):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"  # as if not installed
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert f'pip install {blocked} (or, in the mhc_cupy checkout, pip install -e ".[{extra}]")' in out.stdout, \
        out.stdout + out.stderr
    assert out.stdout.startswith("ModuleNotFoundError") and blocked in out.stdout


def test_cli_without_command_prints_the_help(capsys):
    from mhc_cupy.__main__ import main

    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: python -m mhc_cupy" in out and "info" in out and "warmup" in out


def test_cli_help_is_plain_text_and_warmup_says_it_needs_a_gpu(capsys):
    """``python -m mhc_cupy --help`` had the module docstring's reST markup (double backquotes);
    ``warmup --help`` did not say that it needs a GPU (issue 41 item 15)."""
    from mhc_cupy.__main__ import main

    helps = {}
    for argv in (["--help"], ["info", "--help"], ["warmup", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "``" not in out and "**" not in out and ":func:" not in out, out
        helps[argv[0]] = " ".join(out.split())
    assert "info" in helps["--help"] and "warmup" in helps["--help"] and "needs a CUDA GPU" in helps["--help"]
    assert "without a GPU" in helps["info"]
    warm = helps["warmup"]
    assert "Needs a CUDA GPU" in warm and "exits with code 2" in warm and "(default: bfloat16,float32)" in warm
    with pytest.raises(SystemExit) as e:
        main(["warmup", "--n", "four"])
    assert e.value.code == 2 and "warmup --n: expected comma-separated integers, got 'four'" in capsys.readouterr().err
    # values it cannot compile for are named before it looks for a GPU (it said "needs a CUDA GPU" first)
    for argv, says in ((["warmup", "--n", "0"], "ns has n = 0 streams; supported n is 1 to 32"),
                       (["warmup", "--dtypes", "bf16"], "dtypes has 'bf16'; each needs to be one of bfloat16")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_notebooks_remove_their_temporary_folders():
    """Every temporary folder a notebook makes (NAME = tempfile.mkdtemp(...)) is removed
    (shutil.rmtree(NAME ...)): nbmake runs them in the test suite and the GPU check, and
    they must leave no mhc_demo_* / mhc_bench_* folders behind."""
    import json

    made = 0
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        assert code.count("mkdtemp(") == len(re.findall(r"\b\w+ = tempfile\.mkdtemp\(", code)), nb.name
        for name in re.findall(r"\b(\w+) = tempfile\.mkdtemp\(", code):
            made += 1
            assert re.search(rf"shutil\.rmtree\({name}\b", code), f"{nb.name}: {name} = tempfile.mkdtemp() not removed"
    assert made >= 2  # notebooks 03 (bench) and 04 (demo)


def _usage_snippets():
    """The ```python blocks of the README's Usage section (the ones it says run as written)."""
    usage = (REPO / "README.md").read_text().split("## Usage", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in usage.split("```python\n")[1:]]


def _extras():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {k: {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in v} for k, v in deps.items()}


def test_readme_usage_snippets_name_what_they_need():
    """Each Usage snippet's first line names the install it needs (issue 41 item 15: the JAX one
    failed in command 1's venv, whose demo extra has no jax, though the README said they all ran),
    that extra holds every framework the snippet imports, and what it says of command 1's venv
    (the demo extra) is true."""
    import ast

    extras, snippets = _extras(), _usage_snippets()
    assert len(snippets) >= 4
    for code in snippets:
        first = code.splitlines()[0]
        m = re.fullmatch(r'# needs [^:]+: pip install -e (?:\.|"\.\[(\w+)\]")( .*)?', first)
        assert m, f"the snippet's first line does not name its install: {first!r}"
        have = extras[m.group(1)] if m.group(1) else set()
        imported = {a.name.split(".")[0] for node in ast.walk(ast.parse(code))
                    if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(code))
                     if isinstance(node, ast.ImportFrom) and node.module}
        frameworks = imported & {"torch", "jax", "cupy", "matplotlib", "tqdm"}
        assert frameworks <= have, (first, frameworks - have)
        in_demo = frameworks <= extras["demo"]
        if "command 1's venv has it" in first:
            assert in_demo, first
        if "command 1's venv does not have it" in first:
            assert not in_demo, first
        assert frameworks <= extras["test"] or not frameworks, first  # command 2's venv runs them all


def test_readme_usage_snippets_run_as_written():
    """The Usage snippets, in order, on the CPU (each in a fresh namespace)."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    for code in _usage_snippets():
        exec(compile(code, "README.md snippet", "exec"), {"__name__": "readme_snippet"})


def test_warmup_arguments_checked_before_the_gpu(monkeypatch):
    """``mhc_cupy.warmup`` (public): a single dtype name was iterated as its characters ("dtypes has 'b'"),
    ``ns=4`` raised "'int' object is not iterable", ``ns=("4",)`` a raw '<=' TypeError, and ns of 4.0 / True
    or a grad_f32 of "yes" (its characters) passed the checks to the kernel planners; now one value is taken
    as one, and the rest are TypeErrors naming the argument, all before it looks for a GPU."""
    import numpy as np

    import mhc_cupy

    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)  # as on a machine without one, GPU or not
    for kw in (dict(dtypes="bfloat16"), dict(ns=4), dict(ns=[4, np.int64(8)]), dict(grad_f32=True)):
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):  # the checks passed
            mhc_cupy.warmup(**kw)
    for kw, msg in ((dict(ns=(4.0,)), "ns must be an int, got float 4.0"),
                    (dict(ns=(True,)), "ns must be an int, got bool True"),
                    (dict(ns=("4",)), "ns must be an int, got str '4'"),
                    (dict(ns=b"4"), "ns must be an int or a sequence of them, got bytes"),
                    (dict(dtypes=None), "dtypes must be a dtype name .str. or a sequence of them, got NoneType"),
                    (dict(grad_f32="yes"), "grad_f32 must be a bool or a sequence of them, got str 'yes'"),
                    (dict(grad_f32=(1,)), "grad_f32 must be a bool, got int 1")):
        with pytest.raises(TypeError, match=f"^{msg}"):
            mhc_cupy.warmup(**kw)


def test_gpu_input_without_cupy_says_what_to_install(monkeypatch):
    """A GPU input (a torch CUDA tensor, a JAX GPU array, a GPU DLPack producer) where CuPy is not installed
    (mhc-cupy without its cuda12 / cuda13 extra) raised a bare "No module named 'cupy'" from inside the
    dispatch; now the ModuleNotFoundError names the argument (or the producer) and the CuPy wheels and extras."""
    import sys

    import numpy as np

    import mhc_cupy
    from mhc_cupy import _interop

    class GPUProducer:  # a DLPack producer whose array is on a CUDA device
        def __dlpack__(self, **kw):
            raise BufferError("not exported in this test")

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    x, M = np.zeros((3, 4, 8), np.float32), np.zeros((3, 4, 4), np.float32)
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if not installed
    hint = (r"needs CuPy, which is not installed: for CUDA 12 pip install cupy-cuda12x \(or, in the mhc_cupy checkout, "
            r"pip install -e \"\.\[cuda12\]\"\), for CUDA 13 pip install cupy-cuda13x")
    with pytest.raises(ModuleNotFoundError, match=r"^a GPUProducer on a GPU \(DLPack / CUDA array interface\) " + hint):
        mhc_cupy.stream_mix_fwd(GPUProducer(), M)
    info = _interop._Numpy.info  # x read as if it were on a GPU (no GPU tensor on this machine): the dispatch's GPU path
    monkeypatch.setattr(_interop._Numpy, "info", lambda self, a: info(self, a)._replace(device=("cuda", 0)))
    with pytest.raises(ModuleNotFoundError, match=r"^x is on cuda:0: the GPU path " + hint):
        mhc_cupy.stream_mix_fwd(x, M)
