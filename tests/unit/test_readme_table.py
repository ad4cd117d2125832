"""tests/README.md's module -> tests table names every module of the package (a folder stands for its
``__init__.py``), no module that is gone, and only test files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import datastates_megatron

PACKAGE = Path(datastates_megatron.__file__).parent
TESTS = Path(__file__).resolve().parents[1]
_ROW = re.compile(r"^\| `([^`]+)` \| (.+) \|$")


def _table(text: str) -> dict[str, list[str]]:
    section = text.split("\n## Module -> tests\n", 1)[1]
    rows = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return rows


def _modules() -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            out.add(f"{rel.parent.as_posix()}/" if rel.parent != Path(".") else "__init__.py")
        else:
            out.add(rel.as_posix())
    return out


def _problems(rows: dict[str, list[str]], modules: set[str], tests: Path) -> list[str]:
    problems = [f"{m}: no row in tests/README.md" for m in sorted(modules - rows.keys())]
    problems += [f"{m}: a row, but no such module" for m in sorted(rows.keys() - modules)]
    for module, named in sorted(rows.items()):
        if not named:
            problems.append(f"{module}: no test file named")
        problems += [f"{module}: {t} does not exist" for t in named if not (tests / t).is_file()]
        problems += [f"{module}: {t} is not a test file" for t in named if not Path(t).name.startswith("test_")]
    return problems


def test_every_module_has_tests_in_the_readme_and_every_named_test_exists():
    rows = _table((TESTS / "README.md").read_text(encoding="utf-8"))
    assert _problems(rows, _modules(), TESTS) == []


def test_the_check_finds_a_missing_module_a_gone_one_and_a_missing_test(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("")
    text = "# x\n\n## Module -> tests\n\n| `a.py` | `unit/test_a.py` |\n| `gone.py` | `unit/test_a.py` `unit/test_b.py` |\n"
    assert _problems(_table(text), {"a.py", "new.py", "gone.py"}, tmp_path) == [
        "new.py: no row in tests/README.md",
        "gone.py: unit/test_b.py does not exist",
    ]
    assert _problems(_table(text), {"a.py"}, tmp_path)[0] == "gone.py: a row, but no such module"
