"""docs/api.md lists every public member of the public classes (and every engine error)."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest

import datastates_megatron
from datastates_megatron.engine import errors
from datastates_megatron.engine.manager import CheckpointManager

API = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _section(text: str, name: str) -> str:
    """The part of docs/api.md under ``## `name``` (or ``## name``), up to the next ``## `` heading."""
    match = re.search(rf"^## `?{name}`?\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert match, f"docs/api.md has no '## {name}' section"
    return match.group(1)


def _public_members(cls) -> set[str]:
    members = {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    if dataclasses.is_dataclass(cls):
        members -= {f.name for f in dataclasses.fields(cls)}  # the fields: the generated flag table
    return members


@pytest.mark.parametrize(
    "cls", [getattr(datastates_megatron, n) for n in ("LazyCheckpointer", "LazyCkptConfig")] + [CheckpointManager]
)
def test_every_public_member_is_documented(cls):
    section = _section(API.read_text(encoding="utf-8"), cls.__name__)
    missing = sorted(m for m in _public_members(cls) if not re.search(rf"`{m}[`(]", section))
    assert not missing, f"docs/api.md, section {cls.__name__}, does not document {missing}"


def test_documented_signatures_match_the_code():
    text = API.read_text(encoding="utf-8")
    for cls in (datastates_megatron.LazyCheckpointer, CheckpointManager):
        section = _section(text, cls.__name__)
        for name in _public_members(cls):
            member = vars(cls)[name]
            if isinstance(member, property):
                continue
            params = [p for p in inspect.signature(member).parameters if p != "self"]
            shown = re.search(rf"`{name}\(([^)]*)\)`", section)
            assert shown, f"{cls.__name__}.{name}: docs/api.md shows no call"
            documented = [p.split("=")[0].strip(" *") for p in shown.group(1).split(",") if p.strip(" *")]
            assert documented == params, f"{cls.__name__}.{name}: docs {documented}, code {params}"


def test_every_engine_error_is_listed():
    section = _section(API.read_text(encoding="utf-8"), "Errors")
    classes = [n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.CheckpointError)]
    assert sorted(c for c in classes if f"`{c}`" not in section) == []
