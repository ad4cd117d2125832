"""A missing runtime dependency (issue 35: ``pip install --no-deps`` without numba was a raw traceback):
one line naming it and the pip command, for the CLI and for a script that uses the library
(``LazyCheckpointer``, the engine); a library import gets an ``ImportError`` with that message.  numba
is made unimportable the way a missing package is (``sys.modules[name] = None``) in a fresh
interpreter.  What needs only Python needs nothing else (issue 42): importing the package,
``datastates-ckpt patch``, ``where``, ``--version`` and ``scripts/apply_patches.sh`` run in a virtual
environment that has none of torch, numpy, numba or tqdm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from datastates_megatron import _deps

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def _one_line(err: str, *names: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1, err
    for name in names:
        assert re.search(rf"needs .*\b{name}\b.*not installed", err), err
    assert "pip install 'numba>=" in err or "pip install numba" in err, err
    return err


def test_runtime_names_are_pyprojects_dependencies():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert tuple(re.split(r"[<>=!~\s\[;]", d, maxsplit=1)[0] for d in deps) == _deps.RUNTIME


@pytest.mark.parametrize(
    "use", ["from datastates_megatron import LazyCheckpointer", "import datastates_megatron.engine.manager"]
)
def test_using_the_library_without_numba_is_one_line_and_exit_1(use):
    r = _python(f"import sys; sys.modules['numba'] = None; {use}")
    assert r.returncode == 1 and r.stdout == ""
    _one_line(r.stderr, "numba")


def test_cli_without_numba_is_one_line_and_exit_1():
    r = _python(
        "import sys; sys.modules['numba'] = None; sys.argv = ['datastates-ckpt', 'ls', '.']\n"
        "from datastates_megatron.cli import main\nsys.exit(main())"
    )
    assert r.returncode == 1 and r.stdout == ""
    _one_line(r.stderr, "numba")


def test_library_import_raises_import_error_with_the_message():
    r = _python(
        "import sys; sys.modules['numba'] = None\n"
        "try:\n    from datastates_megatron import LazyCheckpointer\n"
        "except ImportError as e:\n    print(type(e).__mro__[1].__name__, e)\n"
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("ImportError datastates-megatron needs numba"), r.stdout
    _one_line(r.stdout.split(" ", 1)[1], "numba")


def test_require_names_every_missing_module_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(_deps.MissingDependencyError, match=r"export needs psutil, which is not installed in .*: "):
        _deps.require(["numpy", "psutil"], "export", extra="megatron")
    with pytest.raises(
        ImportError, match=r"pip install .*psutil.* \(or pip install 'datastates-megatron\[megatron\]'\)"
    ):
        _deps.require(["psutil"], "export", extra="megatron")
    _deps.require(["numpy"], "x")  # present: nothing raised


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python with the stdlib only: a virtual environment without pip, torch, numpy, numba or tqdm."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    probe = "import importlib.util as u; print([m for m in ('torch', 'numpy', 'numba', 'tqdm') if u.find_spec(m)])"
    found = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert found.stdout == "[]\n", found  # the premise: none of them is there
    return py


def _bare(py: Path | None, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``py argv...`` (``argv`` alone when ``py`` is None) with the source tree as the only addition."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env}
    command = [str(py), *argv] if py is not None else list(argv)
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd="/")


def _megatron_tree(tmp_path: Path) -> tuple[Path, str] | None:
    """The files the patch changes, copied from an unpatched tree of a tested version, if one is here."""
    from datastates_megatron.megatron.megatron_lm import patching, versions

    trees = {Path(d).name: Path(d) for d in os.environ.get("MEGATRON_LM_PRISTINE_DIRS", "").split(os.pathsep) if d}
    for row in versions.TESTED:
        if row.source in trees and (trees[row.source] / "megatron").is_dir():
            copy = tmp_path / row.source
            for rel in ("megatron/core/package_info.py", *patching.PATCHED_FILES):
                (copy / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(trees[row.source] / rel, copy / rel)
            return copy, row.version
    return None


def test_the_package_where_and_version_need_only_python(bare_python):
    from datastates_megatron import __version__

    r = _bare(bare_python, "-c", "import datastates_megatron as d; print(d.__version__, d.LazyCkptConfig.__name__)")
    assert r.returncode == 0 and r.stdout == f"{__version__} LazyCkptConfig\n", r.stderr
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "--version")
    assert r.returncode == 0 and r.stdout == f"datastates-ckpt (datastates-megatron) {__version__}\n", r.stderr
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "where", "launch")
    assert r.returncode == 0 and r.stdout == f"{ROOT / 'datastates_megatron' / 'launch'}\n", r.stderr
    # a command that reads checkpoints says what is missing, in one line, before it runs
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "ls", "/")
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert re.search(r"needs torch, numpy, numba, tqdm, which are not installed", r.stderr), r.stderr


def test_patching_needs_only_python(bare_python, tmp_path):
    """``datastates-ckpt patch`` and ``scripts/apply_patches.sh`` from a login node: Python and git."""
    untested = tmp_path / "mlm-0.12"
    (untested / "megatron" / "core").mkdir(parents=True)
    (untested / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 0\n")
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "patch", str(untested))
    assert r.returncode == 2 and "Megatron-LM 0.12.0 is not tested; tested versions: " in r.stderr, r.stderr
    script = str(ROOT / "scripts" / "apply_patches.sh")
    r = _bare(None, script, str(untested), PYTHON=str(bare_python))
    assert r.returncode == 2 and "Megatron-LM 0.12.0 is not tested; tested versions: " in r.stderr, r.stderr
    tree = _megatron_tree(tmp_path)
    if tree is None:
        pytest.skip("no unpatched Megatron-LM tree here (MEGATRON_LM_PRISTINE_DIRS): the untested one was refused")
    copy, version = tree
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "patch", str(copy), "--check")
    assert r.returncode == 0 and r.stdout.startswith(f"applies cleanly: Megatron-LM {version} "), r.stdout + r.stderr
    r = _bare(None, script, str(copy), PYTHON=str(bare_python))
    assert r.returncode == 0 and r.stdout.startswith(f"applied: Megatron-LM {version} "), r.stdout + r.stderr
    r = _bare(bare_python, "-m", "datastates_megatron.cli", "patch", str(copy), "--revert")
    assert r.returncode == 0 and r.stdout.startswith(f"reverted: Megatron-LM {version} "), r.stdout + r.stderr
