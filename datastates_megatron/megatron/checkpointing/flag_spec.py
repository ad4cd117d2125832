"""The declaration of one ``--lazy-ckpt*`` option, kept in the metadata of its config field.

Every option is declared once, on its :class:`~.config.LazyCkptConfig` field (name, type and
default) with :func:`option` (flag, help, choices, Megatron-LM equivalent); the argparse group
(:mod:`..megatron_lm.args`), the flag-to-field mapping and the flag table of docs/megatron.md (:mod:`..megatron_lm.flag_table`)
are all derived from it -- as Megatron-LM builds its own flags from dataclasses
(``ArgumentGroupFactory``).  Fields without a flag of ours (``save_dir``: Megatron's ``--save``)
say where their value comes from.  Immutable values: thread-safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KINDS", "AUTO_VALUES", "Option", "option", "options_of", "default_text", "describe"]

# how a flag is spelled on the command line:
#   value:  --flag VALUE (``type``, ``metavar`` or ``choices``)
#   switch: --flag turns it on (store_true)
#   negated: --flag turns a default-on field off (the field is named for the positive)
#   both:   --flag / --no-flag (argparse.BooleanOptionalAction)
#   auto:   --flag {auto,on,off}, meaning "auto" / True / False
KINDS = ("value", "switch", "negated", "both", "auto")
AUTO_VALUES = {"auto": "auto", "on": True, "off": False}  # flag value -> config value


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: ``flag`` (None: no flag of ours) and its ``help`` -- the argparse help, and the
    meaning column of the docs table (``doc``, when given, is appended there only).

    ``field``/``default`` are filled in from the config field by :func:`options_of`; ``dest`` is the
    ``argparse`` attribute (``lazy_ckpt_<field>``).  ``default_doc`` says the default in words where
    the value alone does not (``None`` meaning "off", or computed at start-up).  ``megatron`` names
    the Megatron-LM flags that set the same value (mapped by :mod:`..megatron_lm.megatron_flags`).
    ``local_tier``: only meaningful with ``--lazy-ckpt-local-dir``."""

    flag: str | None
    help: str
    kind: str = "value"
    type: type | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default_doc: str | None = None
    megatron: str | None = None
    local_tier: bool = False
    doc: str | None = None
    field: str | None = None
    default: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.flag}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def dest(self) -> str:
        if self.field:
            return "lazy_ckpt_" + self.field
        return (self.flag or "").lstrip("-").replace("-", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling of the flag (``--x`` and ``--no-x`` for kind ``both``)."""
        if self.flag is None:
            return ()
        if self.kind == "both":
            return (self.flag, "--no-" + self.flag[2:])
        return (self.flag,)

    def to_config(self, value: Any) -> Any:
        """The config value of the parsed ``value``."""
        return AUTO_VALUES.get(value, value) if self.kind == "auto" else value


def option(default: Any, flag: str | None = None, help: str = "", **spec: Any) -> Any:
    """A config field's default, with its :class:`Option` in the field's metadata."""
    return dataclasses.field(default=default, metadata={"option": Option(flag, help, **spec)})


def options_of(config_type: type) -> tuple[Option, ...]:
    """The options of ``config_type``'s fields, in field order, each with its field and default.
    Raises ``TypeError`` for a field declared without :func:`option` (every field says where it
    comes from)."""
    out = []
    for f in dataclasses.fields(config_type):
        spec = f.metadata.get("option")
        if spec is None:
            raise TypeError(f"{config_type.__name__}.{f.name} is declared without option(): say its flag")
        out.append(dataclasses.replace(spec, field=f.name, default=f.default))
    return tuple(out)


def default_text(opt: Option) -> str:
    """The default as the docs and ``--help`` show it."""
    if opt.default_doc is not None:
        return opt.default_doc
    value = opt.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "off"
    if opt.kind == "auto":
        return next(k for k, v in AUTO_VALUES.items() if v == value and type(v) is type(value))
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}" if value >= 100 else str(value)
    return str(value)


def describe(opt: Option) -> str:
    """``opt``'s help with the Megatron-LM flags that set the same value (``--help`` says both)."""
    return f"{opt.help} Megatron-LM: {opt.megatron}." if opt.megatron else opt.help
