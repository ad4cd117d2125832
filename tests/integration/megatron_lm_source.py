"""What a Megatron-LM tree's routed functions take and what its patch passes, read from the source
with :mod:`ast` (no import: works for every tree, also one that needs Python 3.12)."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKPOINTING = "megatron/training/checkpointing.py"
ROUTED = ("save_checkpoint", "load_checkpoint")


def _function(tree: Path, name: str) -> ast.FunctionDef:
    module = ast.parse((tree / CHECKPOINTING).read_text())
    return next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name)


def parameters(tree: Path, name: str) -> list[str]:
    """The named parameters of ``megatron.training.checkpointing.<name>``, in order."""
    fn = _function(tree, name)
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]


def patch_call(tree: Path, name: str) -> tuple[list[str], list[str]] | None:
    """(positional argument names, keyword names) of the patched ``<name>``'s call of
    ``megatron_lm.<name>``; None when the function does not call it (not patched)."""
    for node in ast.walk(_function(tree, name)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == name
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "megatron_lm"
        ):
            return [ast.unparse(a) for a in node.args], [k.arg for k in node.keywords]
    return None
