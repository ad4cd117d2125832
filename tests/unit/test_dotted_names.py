"""Every dotted name of the package written in the repository's text resolves.

Code imports are checked by Python itself; a module path inside a string (a ``sitecustomize`` a test
writes for a child process, a ``python -m`` command, a docstring's ``:mod:``) is not, and a child
process ignores an error in ``sitecustomize``. After ``engine/`` moved into folders, one such string
still patched ``datastates_megatron.engine.writer``: the Slurm test's slowed writes silently stopped
being slow and the test passed or failed by chance.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

THIS = Path(__file__).resolve()
REPO = THIS.parents[2]
SOURCES = ("datastates_megatron", "tests", "scripts", "docs", ".ci", "README.md")
SUFFIXES = {".py", ".sh", ".md", ".sbatch", ".txt", ""}
DOTTED = re.compile(r"\bdatastates_megatron(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"\bfrom (datastates_megatron(?:\.\w+)*) import \(?\s*([A-Za-z_]\w*)")


def _files():
    for source in SOURCES:
        path = REPO / source
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            if file.is_file() and file.suffix in SUFFIXES and "__pycache__" not in file.parts and file != THIS:
                yield file


def _resolves(dotted: str) -> bool:
    """The longest module prefix exists, and the next part (if any) is an attribute or submodule."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            if end == len(parts):
                return True
            module = importlib.import_module(name)
            return hasattr(module, parts[end]) or importlib.util.find_spec(f"{name}.{parts[end]}") is not None
    return False


def test_every_dotted_name_of_the_package_in_the_repository_resolves():
    broken = set()
    for file in _files():
        try:
            text = file.read_text()
        except UnicodeDecodeError:
            continue
        for match in DOTTED.finditer(text):
            name = match.group(0).rstrip(".")
            if not _resolves(name):
                broken.add(f"{file.relative_to(REPO)}: {name}")
        for module, attr in FROM_IMPORT.findall(text):
            if not _resolves(f"{module}.{attr}"):
                broken.add(f"{file.relative_to(REPO)}: from {module} import {attr}")
    assert not broken, "\n".join(sorted(broken))


def test_a_moved_module_in_a_string_is_found(tmp_path):
    assert not _resolves("datastates_megatron.engine.writer")
    assert _resolves("datastates_megatron.engine.format.writer.RankFileWriter")
    assert FROM_IMPORT.findall("from datastates_megatron.engine import writer as _writer") == [
        ("datastates_megatron.engine", "writer")
    ]
