"""``--lazy-ckpt*`` command-line flags: registration, start-up validation, and conversion to a config.

Works with Megatron-LM's parser (the patch in ``patches/`` calls :func:`add_lazy_ckpt_args` from
``parse_args``; it can also be passed as ``extra_args_provider``) and with a plain
:class:`argparse.ArgumentParser` that defines Megatron-like ``--save``/``--load`` flags.

The flags are generated from the declarations on :class:`~..checkpointing.config.LazyCkptConfig`'s fields
(:mod:`..checkpointing.flag_spec`), plus the two switches declared here; Megatron-LM's own checkpoint flags are
mapped, refused or ignored by :mod:`.megatron_flags`.

Every function here is pure (no global state) and therefore thread-safe, except that
:func:`validate_lazy_ckpt_args` maps Megatron-LM's flags into ``args`` (:func:`.megatron_flags.adopt`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from ...engine.errors import CheckpointError
from . import megatron_flags
from ..checkpointing.config import LazyCkptConfig, OptionsError
from ..checkpointing.flag_spec import AUTO_VALUES, Option, default_text, describe, options_of

__all__ = [
    "LazyCkptArgsError",
    "UNSUPPORTED_MEGATRON_FLAGS",
    "LAZY_CKPT",
    "CONVERT_TO",
    "all_options",
    "add_lazy_ckpt_args",
    "validate_lazy_ckpt_args",
    "config_from_args",
    "check_host_cache_fits",
]

logger = logging.getLogger(__name__)

UNSUPPORTED_MEGATRON_FLAGS = megatron_flags.UNSUPPORTED

LAZY_CKPT = Option(
    "--lazy-ckpt",
    "Save and load checkpoints with the lazy asynchronous checkpointer: save() returns at once and "
    "device->host copies overlap the next forward/backward. Requires --save; incompatible with --async-save.",
    kind="switch",
    default=False,
)
CONVERT_TO = Option(
    "--lazy-ckpt-convert-to",
    "Load the checkpoint under --load, write it to DIR (new or empty) in Megatron's torch_dist format with "
    "Megatron-LM's own save (optimizer state fully reshardable: megatron-core loads it at any TP/PP/DP), then "
    "exit. Run with the layout that wrote the checkpoint. Implies --lazy-ckpt. Requires --load; DIR must "
    "differ from --save and --load.",
    type=str,
    metavar="DIR",
    doc='See "Layouts and migration".',
)

_CONFIG_OPTIONS = options_of(LazyCkptConfig)
_FLAGGED = tuple(o for o in _CONFIG_OPTIONS if o.flag)  # the config fields set by a flag of ours
_DEFAULTS = {o.field: o.default for o in _CONFIG_OPTIONS}


def all_options() -> tuple[Option, ...]:
    """Every ``--lazy-ckpt*`` flag, in ``--help`` and docs order."""
    return (LAZY_CKPT, *_FLAGGED, CONVERT_TO)


class LazyCkptArgsError(CheckpointError, ValueError):
    """An invalid ``--lazy-ckpt*`` flag or combination of flags; the message names the flags."""


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


class _ConvertTo(argparse.Action):
    """``--lazy-ckpt-convert-to`` turns ``--lazy-ckpt`` on: without it a patched Megatron-LM would
    ignore the flag and train instead of converting."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.lazy_ckpt = True


def _argparse_kwargs(opt: Option) -> dict[str, Any]:
    """``add_argument`` keywords for ``opt``; its help ends with the default (as the docs table says it)."""
    kw: dict[str, Any] = {"dest": opt.dest, "default": opt.default}
    if opt.kind == "switch":
        kw["action"] = "store_true"
    elif opt.kind == "negated":
        kw["action"] = "store_false"
    elif opt.kind == "both":
        kw["action"] = argparse.BooleanOptionalAction
    elif opt.kind == "auto":
        kw.update(choices=tuple(AUTO_VALUES), default=default_text(opt))
    else:
        kw.update({k: v for k, v in (("type", opt.type), ("metavar", opt.metavar)) if v is not None})
        if opt.choices is not None:
            kw["choices"] = opt.choices
    if opt is CONVERT_TO:
        kw["action"] = _ConvertTo
    kw["help"] = describe(opt) if opt.kind == "switch" else f"{describe(opt)} (default: {default_text(opt)})"
    kw["help"] = kw["help"].replace("%", "%%")
    return kw


def add_lazy_ckpt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``lazy-ckpt`` argument group to ``parser`` and return it (``extra_args_provider`` style).

    Idempotent: a parser that already has ``--lazy-ckpt`` is returned unchanged, so a patched
    Megatron-LM may also be given ``extra_args_provider=add_lazy_ckpt_args``.
    """
    if "--lazy-ckpt" in _option_strings(parser):
        return parser
    g = parser.add_argument_group(
        title="lazy-ckpt",
        description="DataStates-style lazy asynchronous checkpointing (datastates_megatron). "
        "Replaces Megatron's save/load when --lazy-ckpt is given.",
    )
    for opt in all_options():
        g.add_argument(opt.flag, **_argparse_kwargs(opt))
    return parser


def _given(value: Any) -> bool:
    return value is not None and value is not False


def _value(args: argparse.Namespace, opt: Option) -> Any:
    """``opt``'s config value in ``args`` (its default where ``args`` lacks it)."""
    if not hasattr(args, opt.dest):
        return opt.default
    return opt.to_config(getattr(args, opt.dest))


def _non_default_flags(args: argparse.Namespace) -> list[str]:
    return [o.flag for o in _FLAGGED if _value(args, o) != o.default]


def validate_lazy_ckpt_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> LazyCkptConfig | None:
    """Fail at start-up on an invalid ``--lazy-ckpt`` combination.

    With ``--lazy-ckpt``, first maps Megatron-LM's local-checkpoint flags onto ours in ``args`` and
    warns once about Megatron checkpoint flags in ``argv`` (default: ``sys.argv``) that it ignores
    (:func:`.megatron_flags.adopt`).  Raises :class:`LazyCkptArgsError` listing every problem
    found, each naming its flags. Without ``--lazy-ckpt`` it only warns when ``--lazy-ckpt-*``
    options were set (they would be ignored) and returns ``None``; with it, returns the one
    :class:`LazyCkptConfig` it built (start-up builds no other). Whether the host cache holds the largest shard under
    ``--lazy-ckpt-no-streaming`` is known only once the model exists: see :func:`check_host_cache_fits`.
    """
    if not getattr(args, "lazy_ckpt", False):
        ignored = _non_default_flags(args)
        if ignored:
            logger.warning(
                "%s given without --lazy-ckpt: ignored, Megatron's own checkpointing is used", ", ".join(ignored)
            )
        return None

    problems: list[str] = []
    if not getattr(args, "save", None):
        problems.append("--lazy-ckpt requires --save (the persistent checkpoint directory)")
    for attr, flag, hint in UNSUPPORTED_MEGATRON_FLAGS:
        if _given(getattr(args, attr, None)):
            problems.append(f"--lazy-ckpt cannot be combined with {flag}: {hint}")
    problems += megatron_flags.url_save_problems(args)
    mapping = megatron_flags.adopt(args, _DEFAULTS, argv)
    problems += mapping
    convert_to = getattr(args, "lazy_ckpt_convert_to", None)
    if convert_to is not None:
        if not getattr(args, "load", None):
            problems.append("--lazy-ckpt-convert-to requires --load (the checkpoint to convert)")
        same = [
            f for f, d in (("--save", args.save), ("--load", getattr(args, "load", None))) if d and _same(d, convert_to)
        ]
        if same:
            problems.append(f"--lazy-ckpt-convert-to must be another directory than {' and '.join(same)}")
    cause = config = None
    if not mapping:  # the config would repeat the mapping's problems
        try:
            config = config_from_args(args)
        except OptionsError as e:  # the config's own checks, reworded with the flags' names
            cause = e
            problems += [_with_flags(f"{field} {text}") for field, text in e.problems if field != "save_dir"]
    if problems:
        raise LazyCkptArgsError("invalid --lazy-ckpt arguments:\n  - " + "\n  - ".join(problems)) from cause
    return config


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


_BY_FIELD = {o.field: o for o in _CONFIG_OPTIONS}
# config field -> the flag that sets it, for messages (Megatron's where none of ours does)
_FLAG_OF = {o.field: o.flag or (o.megatron or "").split()[0] for o in _CONFIG_OPTIONS if o.flag or o.megatron}
_FIELD_WORD = re.compile(r"\b(" + "|".join(sorted(_FLAG_OF, key=len, reverse=True)) + r")\b")


def _with_flags(message: str) -> str:
    """``message`` with every config field name outside quotes (values, paths) replaced by its flag."""
    parts = re.split(r"('[^']*'|\"[^\"]*\")", message)
    return "".join(p if i % 2 else _FIELD_WORD.sub(lambda m: _FLAG_OF[m.group(1)], p) for i, p in enumerate(parts))


def config_from_args(args: argparse.Namespace) -> LazyCkptConfig:
    """Build the :class:`LazyCkptConfig` for parsed ``args`` (``--save``, ``--load``, ``--lazy-ckpt-*``,
    and Megatron-LM's local-checkpoint flags: :func:`.megatron_flags.mapped_fields`).

    Options missing from ``args`` (a parser without the lazy-ckpt group) take the config defaults.
    Raises :class:`OptionsError` (a ``ValueError``) from the config's checks, naming config fields;
    :func:`validate_lazy_ckpt_args` reports the same problems under the flags' names.
    """
    fields = {o.field: _value(args, o) for o in _CONFIG_OPTIONS if o.field not in ("save_dir", "load_dir")}
    try:
        fields.update(megatron_flags.mapped_fields(args, _DEFAULTS))
    except megatron_flags.MappingError as e:
        raise OptionsError("LazyCkptConfig", [("megatron", p) for p in e.problems]) from None
    if fields.get("host_copy") == "auto" and hasattr(args, "inprocess_restart"):  # Megatron-LM's own flag:
        fields["host_copy"] = bool(args.inprocess_restart)  # a host copy is what its restart restores from
    return LazyCkptConfig(save_dir=getattr(args, "save", None), load_dir=getattr(args, "load", None), **fields)


def check_host_cache_fits(config: LazyCkptConfig, largest_shard_bytes: int, *, what: str = "largest tensor") -> None:
    """Raise :class:`LazyCkptArgsError` when streaming is off and one shard exceeds the host cache.

    ``largest_shard_bytes`` is the size of the biggest tensor (shard) one rank will copy into the
    cache; ``what`` names it in the message. Does nothing when streaming is on.
    """
    if config.streaming or largest_shard_bytes <= config.host_cache_bytes:
        return
    need_gb = largest_shard_bytes / (1 << 30)
    raise LazyCkptArgsError(
        f"--lazy-ckpt-no-streaming needs the host cache to hold the {what} "
        f"({largest_shard_bytes} bytes = {need_gb:.3f} GiB) but --lazy-ckpt-host-cache-gb is "
        f"{config.host_cache_gb:g}: raise --lazy-ckpt-host-cache-gb to at least {need_gb:.3f} "
        f"or drop --lazy-ckpt-no-streaming"
    )
