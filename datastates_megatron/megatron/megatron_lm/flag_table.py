"""The flag tables of docs/megatron.md, generated from the option declarations (:mod:`..checkpointing.flag_spec`)
and Megatron-LM's flags (:mod:`.megatron_flags`), so that the docs cannot drift from the code.

    python -m datastates_megatron.megatron.megatron_lm.flag_table            # print the generated blocks
    python -m datastates_megatron.megatron.megatron_lm.flag_table --write    # replace them in docs/megatron.md
    python -m datastates_megatron.megatron.megatron_lm.flag_table --check    # exit 1 when docs/megatron.md differs

Each block sits between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Callable

from . import megatron_flags
from .args import all_options
from ..checkpointing.flag_spec import Option, default_text

__all__ = ["DOC", "BLOCKS", "flags_table", "megatron_flags_text", "render", "main"]

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "megatron.md"


def _code(text: str) -> str:
    return f"`{text}`"


def _spelling(opt: Option) -> str:
    if opt.kind == "both":
        return " / ".join(_code(s) for s in opt.spellings)
    if opt.kind == "auto":
        return _code(f"{opt.flag} {{auto,on,off}}")
    if opt.choices:
        return _code(f"{opt.flag} {{{','.join(opt.choices)}}}")
    if opt.metavar:
        return _code(f"{opt.flag} {opt.metavar}")
    return _code(opt.flag)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def flags_table() -> str:
    """Every ``--lazy-ckpt*`` flag: spelling, default, Megatron-LM's equivalent, meaning."""
    rows = ["| Flag | Default | Megatron-LM equivalent | Meaning |", "|---|---|---|---|"]
    for opt in all_options():
        meaning = opt.help if opt.doc is None else f"{opt.help} {opt.doc}"
        megatron = _code(opt.megatron) if opt.megatron else ""
        rows.append(f"| {_spelling(opt)} | {_cell(default_text(opt))} | {_cell(megatron)} | {_cell(meaning)} |")
    local = [_code(o.flag) for o in all_options() if o.local_tier]
    note = f"{', '.join(local[:-1])} and {local[-1]} require `--lazy-ckpt-local-dir`."
    return "\n".join(rows) + "\n\n" + note


def megatron_flags_text() -> str:
    """The Megatron-LM flags ``--lazy-ckpt`` refuses (with what to do) and those it ignores."""
    refused = "\n".join(f"- `{flag}`: {hint}." for _, flag, hint in megatron_flags.UNSUPPORTED)
    ignored = ", ".join(_code(f) for f in megatron_flags.IGNORED)
    return (
        "Refused at start-up, each with a message naming the flag and what to do instead:\n\n"
        f"{refused}\n\n"
        "Ignored, with one warning at start-up naming those given (they are options of Megatron's own "
        "formats; they still apply when Megatron's own loader imports a checkpoint and to "
        f"`--lazy-ckpt-convert-to`'s save): {ignored}."
    )


BLOCKS: dict[str, Callable[[], str]] = {"flags": flags_table, "megatron-flags": megatron_flags_text}


def _pattern(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- BEGIN generated: {re.escape(name)} [^>]*-->\n)(.*?)(<!-- END generated: {re.escape(name)} -->)",
        re.DOTALL,
    )


def render(text: str) -> str:
    """``text`` (docs/megatron.md) with every generated block replaced by its current contents.
    Raises ``ValueError`` when a block's markers are missing."""
    for name, make in BLOCKS.items():
        pattern = _pattern(name)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- BEGIN generated: {name} ... -->' ... '<!-- END generated: {name} -->' block")
        body = make()
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)  # noqa: B023 - used at once
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m datastates_megatron.megatron.megatron_lm.flag_table", description=__doc__.split("\n")[0]
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the generated blocks in the document")
    mode.add_argument("--check", action="store_true", help="exit 1 when the document differs from the code")
    p.add_argument("--doc", type=pathlib.Path, default=DOC, help="the document (default: %(default)s)")
    a = p.parse_args(argv)
    if not (a.write or a.check):
        print("\n\n".join(make() for make in BLOCKS.values()))
        return 0
    try:
        text = a.doc.read_text(encoding="utf-8")
        new = render(text)
    except (OSError, ValueError) as e:
        print(f"flag_table: {a.doc}: {e}", file=sys.stderr)
        return 2
    if a.check:
        if new != text:
            print(f"flag_table: {a.doc} is out of date: run python -m {__spec__.name} --write", file=sys.stderr)
            return 1
        return 0
    if new != text:
        a.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
