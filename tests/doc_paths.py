"""What README.md and docs/*.md tell a user to run, extracted from the text: every
``datastates-ckpt`` subcommand, each flag given to it (and a flag's value when it is a literal
word: ``--format safetensors``), every script run with ``bash``, ``python`` or ``torchrun``
(``scripts/...``), every module run with ``-m datastates_megatron...``, every ``--lazy-ckpt*``
flag named anywhere, and every Python example (a ```` ```python ```` block: the item ``python
example N of FILE``; :func:`python_examples` gives its code).  ``tests/unit/test_documented_paths.py``
keeps its table of the tests that run them in step with this; :func:`why_not_fast` is its check
that a named test is there and is not ``slow``.

Commands are read from inline code spans and fenced code blocks (a line continued with ``\\``
joined to the next); a ``datastates-ckpt`` command's flags end at `` -- `` (the training flags that
follow are Megatron-LM's), a pipe, ``&&``, ``;``, a comment or a closing parenthesis."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CODE_SPAN = re.compile(r"```[^\n]*\n(.*?)```|`([^`]+)`", re.S)
_CLI = re.compile(r"\bdatastates-ckpt\s+([a-z]+)([^`\n|;&#)]*)")
_SCRIPT = re.compile(r"\b(?:bash|python3?|torchrun)\b[^`\n|;&#]*?\b(scripts/[\w.-]+\.(?:sh|py))\b")
_MODULE = re.compile(r"\b(?:python3?|torchrun)\b[^`\n|;&#]*?-m\s+(datastates_megatron[\w.]*)")
_LAZY_FLAG = re.compile(r"(?<![\w-])--lazy-ckpt(?:-[a-z0-9]+)*(?![\w*-])")
_FLAG = re.compile(r"^-{1,2}[a-zA-Z][\w-]*$")
_WORD = re.compile(r"^[a-z][a-z_]*$")  # a literal value (not a PLACEHOLDER, path or number)
_PYTHON = re.compile(r"```python\n(.*?)```", re.S)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(text: str) -> list[str]:
    """Every inline code span, and every line of every fenced block (continuations joined)."""
    out = []
    for m in _CODE_SPAN.finditer(text):
        if m.group(1) is not None:
            out += m.group(1).replace("\\\n", " ").splitlines()
        else:
            out.append(m.group(2).replace("\n", " "))
    return out


def _cli_items(command: str, subcommands: set[str]) -> list[str]:
    items = []
    for m in _CLI.finditer(command):
        sub, rest = m.group(1), m.group(2)
        if sub not in subcommands:
            continue
        items.append(f"datastates-ckpt {sub}")
        tokens = [t.strip("[]") for t in rest.split()]
        for i, token in enumerate(tokens):
            if token == "--":
                break  # the training flags of the run that wrote the checkpoint
            if _FLAG.match(token):
                items.append(f"datastates-ckpt {sub} {token}")
                if i + 1 < len(tokens) and _WORD.match(tokens[i + 1]):
                    items.append(f"datastates-ckpt {sub} {token} {tokens[i + 1]}")
    return items


def documented_paths(subcommands: set[str]) -> dict[str, list[str]]:
    """``{item: [where it is documented, "FILE:LINE"]}`` (see the module docstring)."""
    found: dict[str, list[str]] = {}
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()

        def add(item: str, at: int) -> None:
            where = f"{rel}:{text.count(chr(10), 0, at) + 1}"
            found.setdefault(item, [])
            if where not in found[item]:
                found[item].append(where)

        for n, m in enumerate(_PYTHON.finditer(text), 1):
            add(f"python example {n} of {rel}", m.start())
        for m in _LAZY_FLAG.finditer(text):
            add(m.group(0), m.start())
        for span in _CODE_SPAN.finditer(text):
            for command in _commands(span.group(0)):
                for item in _cli_items(command, subcommands):
                    add(item, span.start())
                for m in _SCRIPT.finditer(command):
                    add(m.group(1), span.start())
                for m in _MODULE.finditer(command):
                    add(f"-m {m.group(1)}", span.start())
    return found


def python_examples() -> dict[str, str]:
    """``{"python example N of FILE": its code}`` for every ```` ```python ```` block of the docs."""
    out = {}
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        for n, m in enumerate(_PYTHON.finditer(path.read_text(encoding="utf-8")), 1):
            out[f"python example {n} of {rel}"] = m.group(1)
    return out


# ---------------------------------------------------------------------------------------------- named tests
def _marks_slow(node: ast.AST) -> bool:
    """``pytest.mark.slow`` anywhere in this expression (a decorator, a ``pytestmark``, a
    ``pytest.param(..., marks=...)``)."""
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "slow"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for n in ast.walk(node)
    )


def _decorator_slow(d: ast.expr) -> bool:
    """A ``slow`` decorator; a ``parametrize`` is slow only when none of its literal parameters runs
    in the default set (``pytest.param(..., marks=pytest.mark.slow)`` on each)."""
    if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize":
        values = d.args[1] if len(d.args) > 1 else next((k.value for k in d.keywords if k.arg == "argvalues"), None)
        if isinstance(values, (ast.List, ast.Tuple)):
            literal = [e for e in values.elts if not isinstance(e, ast.Starred)]
            return bool(literal) and all(_marks_slow(e) for e in literal)
    return _marks_slow(d)


def _pytestmark_slow(body: list[ast.stmt]) -> bool:
    """A ``pytestmark = ...slow...`` among these statements (a module's or a class's)."""
    for node in body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and _marks_slow(node.value):
                return True
    return False


def why_not_fast(name: str) -> str | None:
    """None when ``name`` (``tests/PATH.py::test_function`` or ``::Class::test_method``) is a test
    function of that file that runs in the default set (not marked ``slow``, for the module, the
    class or any of its parameters); else why not."""
    path, _, qual = name.partition("::")
    file = ROOT / path
    if not qual or not path.startswith("tests/") or not file.is_file():
        return f"{name}: no such test file"
    tree = ast.parse(file.read_text(encoding="utf-8"))
    if _pytestmark_slow(tree.body):
        return f"{name}: the module is marked slow"
    scope, parts = tree.body, qual.split("::")
    for i, part in enumerate(parts):
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None or (i == len(parts) - 1) != isinstance(found, ast.FunctionDef):
            return f"{name}: no such test"
        if any(_decorator_slow(d) for d in found.decorator_list):
            return f"{name}: marked slow (or every one of its parameters is)"
        if isinstance(found, ast.ClassDef) and _pytestmark_slow(found.body):
            return f"{name}: its class is marked slow"
        scope = found.body
    if not parts[-1].startswith("test"):
        return f"{name}: not a test function"
    return None
