"""A missing runtime dependency (issue 35: ``pip install --no-deps`` without numba was a raw traceback):
one line naming it and the pip command, for the CLI and for ``python -c 'import datastates_megatron'``;
a library import gets an ``ImportError`` with that message.  numba is made unimportable the way a
missing package is (``sys.modules[name] = None``) in a fresh interpreter."""

from __future__ import annotations

import os
import re
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


def test_import_without_numba_is_one_line_and_exit_1():
    r = _python("import sys; sys.modules['numba'] = None; import datastates_megatron")
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
        "try:\n    import datastates_megatron\n"
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
