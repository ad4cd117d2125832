"""``--lazy-ckpt*`` command-line flags: registration, start-up validation, and conversion to a config.

Works with Megatron-LM's parser (the patch in ``patches/`` calls :func:`add_lazy_ckpt_args` from
``parse_args``; it can also be passed as ``extra_args_provider``) and with a plain
:class:`argparse.ArgumentParser` that defines Megatron-like ``--save``/``--load`` flags.

Every function here is pure (no global state) and therefore thread-safe.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from typing import Any

from ..engine.errors import CheckpointError
from .config import LOCAL_FALLBACK_CHOICES, ON_ERROR_CHOICES, RECYCLE_CHOICES, LazyCkptConfig, OptionsError

__all__ = [
    "LazyCkptArgsError",
    "DIRECT_IO_CHOICES",
    "UNSUPPORTED_MEGATRON_FLAGS",
    "add_lazy_ckpt_args",
    "validate_lazy_ckpt_args",
    "config_from_args",
    "check_host_cache_fits",
]

logger = logging.getLogger(__name__)

DIRECT_IO_CHOICES = {"auto": "auto", "on": True, "off": False}  # flag value -> config value
# on/off/auto flags: (args attribute, flag, config field), each with DIRECT_IO_CHOICES
_AUTO_FLAGS = (
    ("lazy_ckpt_direct_io", "--lazy-ckpt-direct-io", "direct_io"),
    ("lazy_ckpt_source_writes", "--lazy-ckpt-source-writes", "source_writes"),
)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LazyCkptConfig)}

# Megatron-LM flags whose behaviour --lazy-ckpt cannot reproduce: (args attribute, flag, what to do).
# A flag counts as given when its value is neither None nor False.
UNSUPPORTED_MEGATRON_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("async_save", "--async-save", "--lazy-ckpt already overlaps checkpointing with training; drop --async-save"),
    (
        "non_persistent_save_interval",
        "--non-persistent-save-interval",
        "for a fast node-local tier use --lazy-ckpt-local-dir with --lazy-ckpt-persist-interval",
    ),
    ("save_retain_interval", "--save-retain-interval", "use --lazy-ckpt-keep-last / --lazy-ckpt-keep-every"),
    (
        "use_checkpoint_args",
        "--use-checkpoint-args",
        "lazy checkpoints store no pickled args; pass the model arguments explicitly",
    ),
    (
        "finetune",
        "--finetune",
        "use --pretrained-checkpoint (a Megatron checkpoint loaded natively when --load holds no lazy checkpoint yet)",
    ),
    ("no_load_optim", "--no-load-optim", "lazy checkpoints always restore the optimizer"),
    ("no_load_rng", "--no-load-rng", "lazy checkpoints always restore the RNG state"),
    ("no_save_optim", "--no-save-optim", "lazy checkpoints always contain the optimizer"),
    ("no_save_rng", "--no-save-rng", "lazy checkpoints always contain the RNG state"),
    ("override_ckpt_iteration", "--override-ckpt-iteration", "not supported by lazy checkpoints"),
    (
        "ckpt_convert_format",
        "--ckpt-convert-format",
        "convert without --lazy-ckpt (lazy checkpoints are not a conversion target)",
    ),
    ("moe_use_upcycling", "--moe-use-upcycling", "upcycle without --lazy-ckpt first"),
    (
        "perform_rl_step",
        "--perform-rl-step",
        "RL training reloads the model without its optimizer, which lazy checkpoints do not support",
    ),
    ("yaml_cfg", "--yaml-cfg", "the YAML config replaces every command-line argument, --lazy-ckpt included"),
)


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


def add_lazy_ckpt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``lazy-ckpt`` argument group to ``parser`` and return it (``extra_args_provider`` style).

    Idempotent: a parser that already has ``--lazy-ckpt`` is returned unchanged, so a patched
    Megatron-LM may also be given ``extra_args_provider=add_lazy_ckpt_args``.
    """
    if "--lazy-ckpt" in _option_strings(parser):
        return parser
    d = _DEFAULTS
    g = parser.add_argument_group(
        title="lazy-ckpt",
        description="DataStates-style lazy asynchronous checkpointing (datastates_megatron). "
        "Replaces Megatron's save/load when --lazy-ckpt is given.",
    )
    g.add_argument(
        "--lazy-ckpt",
        action="store_true",
        default=False,
        help="Save and load checkpoints with the lazy asynchronous checkpointer: save() "
        "returns at once and device->host copies overlap the next forward/backward. "
        "Requires --save; incompatible with --async-save.",
    )
    g.add_argument(
        "--lazy-ckpt-host-cache-gb",
        type=float,
        default=d["host_cache_gb"],
        metavar="GB",
        help="Host (pinned) cache shared by all in-flight checkpoints of this rank, in GiB (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-flush-threads",
        type=int,
        default=d["flush_threads"],
        metavar="N",
        help="Writer threads per rank, host cache -> storage (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-max-inflight",
        type=int,
        default=d["max_inflight"],
        metavar="N",
        help="Checkpoints that may be copying or flushing at once; a further save waits (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-keep-last",
        type=int,
        default=d["keep_last"],
        metavar="N",
        help="Keep the N newest committed checkpoints under --save, 0 keeps all (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-keep-every",
        type=int,
        default=d["keep_every"],
        metavar="N",
        help="Also keep every checkpoint whose iteration is a multiple of N, 0 for none (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-verify-on-load",
        action=argparse.BooleanOptionalAction,
        default=d["verify_on_load"],
        help="Re-check every checksum when loading (default: on).",
    )
    g.add_argument(
        "--lazy-ckpt-on-error",
        choices=ON_ERROR_CHOICES,
        default=d["on_error"],
        help="raise: a failed background save raises in the training loop; warn: it is "
        "logged, that iteration is not committed and training goes on "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-no-streaming",
        dest="lazy_ckpt_streaming",
        action="store_false",
        default=d["streaming"],
        help="Do not stream tensors larger than the host cache through it in chunks; the "
        "cache must then hold the largest shard (checked when the checkpointer starts).",
    )
    g.add_argument(
        "--lazy-ckpt-direct-io",
        choices=tuple(DIRECT_IO_CHOICES),
        default="auto",
        help="O_DIRECT writes: auto tries and falls back, on requires, off never (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-source-writes",
        choices=tuple(DIRECT_IO_CHOICES),
        default="auto",
        help="Write host-resident (CPU) shards straight from their memory, without a copy "
        "into the host cache; the pre-step gate then waits for those writes. auto: on "
        "tmpfs/ramfs (e.g. a --lazy-ckpt-local-dir in /dev/shm); on: always; off: never "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-mapped-writes",
        action=argparse.BooleanOptionalAction,
        default=d["mapped_writes"],
        help="Write rank files on tmpfs/ramfs (e.g. a --lazy-ckpt-local-dir in /dev/shm) "
        "through shared mappings kept between saves, hashing and copying in one pass; "
        "off: plain writes (default: on).",
    )
    g.add_argument(
        "--lazy-ckpt-timeout-s",
        type=float,
        default=d["timeout_s"],
        metavar="S",
        help="Longest wait on cache space, an in-flight slot or a peer rank before erroring (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-local-dir",
        type=str,
        default=d["local_dir"],
        metavar="DIR",
        help="Optional fast node-local tier (e.g. NVMe or /dev/shm); checkpoints land here "
        "first and every --lazy-ckpt-persist-interval-th one is promoted to --save "
        "(default: off).",
    )
    g.add_argument(
        "--lazy-ckpt-persist-interval",
        type=int,
        default=d["persist_interval"],
        metavar="N",
        help="With --lazy-ckpt-local-dir, promote every N-th local checkpoint to --save; "
        "the last one of a run is promoted at exit whatever N (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-promote-slots",
        type=int,
        default=d["promote_slots"],
        metavar="N",
        help="With --lazy-ckpt-local-dir, at most N ranks of a node copy to --save at once; 0: no cap "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-promote-mbps",
        type=float,
        default=d["promote_mbps"],
        metavar="MB_S",
        help="With --lazy-ckpt-local-dir, each rank's copy to --save moves at most MB_S MB/s; 0: no cap "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-local-keep-last",
        type=int,
        default=d["local_keep_last"],
        metavar="N",
        help="With --lazy-ckpt-local-dir, keep the N newest local checkpoints (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-local-fallback",
        choices=LOCAL_FALLBACK_CHOICES,
        default=d["local_fallback"],
        help="With --lazy-ckpt-local-dir, when a node lost its local copy (node replaced): "
        "'all' ranks restore from --save; 'rank': only the ranks lacking an intact "
        "local copy read --save, the others read locally (default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-replicas",
        type=int,
        default=d["replicas"],
        metavar="K",
        help="With --lazy-ckpt-local-dir, K partner ranks on other nodes also keep each rank's local "
        "checkpoint, so a lost node resumes from them instead of --save; 0: off (default: 1 when the "
        "nodes pair up, else 0). Megatron-LM's --replication --replication-jump J --replication-factor F "
        "mean the same (K = F-1, partners J ranks apart).",
    )
    g.add_argument(
        "--lazy-ckpt-recycle-files",
        choices=RECYCLE_CHOICES,
        default=d["recycle_files"],
        help="Where later saves overwrite retired rank files in place instead of freeing and "
        "re-allocating them: 'local' the node-local tier only; 'all' also --save (only "
        "when nothing outside this job reads checkpoints while it trains); 'off' "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--lazy-ckpt-convert-to",
        type=str,
        default=None,
        action=_ConvertTo,
        metavar="DIR",
        help="Load the checkpoint under --load, write it to DIR (new or empty) in Megatron's torch_dist "
        "format with Megatron-LM's own save (optimizer state fully reshardable: megatron-core loads it "
        "at any TP/PP/DP), then exit. Run with the layout that wrote the checkpoint. Implies --lazy-ckpt.",
    )
    return parser


def _given(value: Any) -> bool:
    return value is not None and value is not False


# (args attribute, flag, config field) for the flags that map one-to-one onto LazyCkptConfig.
_FLAG_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("lazy_ckpt_host_cache_gb", "--lazy-ckpt-host-cache-gb", "host_cache_gb"),
    ("lazy_ckpt_flush_threads", "--lazy-ckpt-flush-threads", "flush_threads"),
    ("lazy_ckpt_max_inflight", "--lazy-ckpt-max-inflight", "max_inflight"),
    ("lazy_ckpt_keep_last", "--lazy-ckpt-keep-last", "keep_last"),
    ("lazy_ckpt_keep_every", "--lazy-ckpt-keep-every", "keep_every"),
    ("lazy_ckpt_verify_on_load", "--lazy-ckpt-verify-on-load", "verify_on_load"),
    ("lazy_ckpt_on_error", "--lazy-ckpt-on-error", "on_error"),
    ("lazy_ckpt_streaming", "--lazy-ckpt-no-streaming", "streaming"),
    ("lazy_ckpt_mapped_writes", "--lazy-ckpt-mapped-writes", "mapped_writes"),
    ("lazy_ckpt_timeout_s", "--lazy-ckpt-timeout-s", "timeout_s"),
    ("lazy_ckpt_local_dir", "--lazy-ckpt-local-dir", "local_dir"),
    ("lazy_ckpt_persist_interval", "--lazy-ckpt-persist-interval", "persist_interval"),
    ("lazy_ckpt_local_keep_last", "--lazy-ckpt-local-keep-last", "local_keep_last"),
    ("lazy_ckpt_local_fallback", "--lazy-ckpt-local-fallback", "local_fallback"),
    ("lazy_ckpt_recycle_files", "--lazy-ckpt-recycle-files", "recycle_files"),
    ("lazy_ckpt_replicas", "--lazy-ckpt-replicas", "replicas"),
    ("lazy_ckpt_promote_slots", "--lazy-ckpt-promote-slots", "promote_slots"),
    ("lazy_ckpt_promote_mbps", "--lazy-ckpt-promote-mbps", "promote_mbps"),
)


def _value(args: argparse.Namespace, attr: str, field: str) -> Any:
    return getattr(args, attr, _DEFAULTS[field])


def _non_default_flags(args: argparse.Namespace) -> list[str]:
    flags = [flag for attr, flag, field in _FLAG_FIELDS if _value(args, attr, field) != _DEFAULTS[field]]
    flags += [flag for attr, flag, _ in _AUTO_FLAGS if getattr(args, attr, "auto") != "auto"]
    return flags


def validate_lazy_ckpt_args(args: argparse.Namespace) -> None:
    """Fail at start-up on an invalid ``--lazy-ckpt`` combination.

    Raises :class:`LazyCkptArgsError` listing every problem found, each naming its flags. Without
    ``--lazy-ckpt`` it only warns when ``--lazy-ckpt-*`` options were set (they would be ignored).
    Whether the host cache holds the largest shard under ``--lazy-ckpt-no-streaming`` is known only
    once the model exists: see :func:`check_host_cache_fits`.
    """
    if not getattr(args, "lazy_ckpt", False):
        ignored = _non_default_flags(args)
        if ignored:
            logger.warning(
                "%s given without --lazy-ckpt: ignored, Megatron's own checkpointing is used", ", ".join(ignored)
            )
        return

    problems: list[str] = []
    if not getattr(args, "save", None):
        problems.append("--lazy-ckpt requires --save (the persistent checkpoint directory)")
    for attr, flag, hint in UNSUPPORTED_MEGATRON_FLAGS:
        if _given(getattr(args, attr, None)):
            problems.append(f"--lazy-ckpt cannot be combined with {flag}: {hint}")
    convert_to = getattr(args, "lazy_ckpt_convert_to", None)
    if convert_to is not None:
        if not getattr(args, "load", None):
            problems.append("--lazy-ckpt-convert-to requires --load (the checkpoint to convert)")
        same = [
            f for f, d in (("--save", args.save), ("--load", getattr(args, "load", None))) if d and _same(d, convert_to)
        ]
        if same:
            problems.append(f"--lazy-ckpt-convert-to must be another directory than {' and '.join(same)}")
    if _value(args, "lazy_ckpt_local_dir", "local_dir") is None:
        for attr, flag, field in _FLAG_FIELDS:
            if field in _LOCAL_TIER_FIELDS and _value(args, attr, field) != _DEFAULTS[field]:
                problems.append(f"{flag} only applies to a local tier: it requires --lazy-ckpt-local-dir")
    cause = None
    try:
        config_from_args(args)
    except OptionsError as e:  # the config's own checks, reworded with the flags' names
        cause = e
        problems += [_with_flags(f"{field} {text}") for field, text in e.problems if field != "save_dir"]
    if problems:
        raise LazyCkptArgsError("invalid --lazy-ckpt arguments:\n  - " + "\n  - ".join(problems)) from cause


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


_LOCAL_TIER_FIELDS = ("persist_interval", "local_keep_last", "local_fallback", "replicas")
# config field -> its flag, for messages
_FLAG_OF = {field: flag for _, flag, field in (*_FLAG_FIELDS, *_AUTO_FLAGS)} | {
    "save_dir": "--save",
    "load_dir": "--load",
}
_FIELD_WORD = re.compile(r"\b(" + "|".join(sorted(_FLAG_OF, key=len, reverse=True)) + r")\b")


def _with_flags(message: str) -> str:
    """``message`` with every config field name outside quotes (values, paths) replaced by its flag."""
    parts = re.split(r"('[^']*'|\"[^\"]*\")", message)
    return "".join(p if i % 2 else _FIELD_WORD.sub(lambda m: _FLAG_OF[m.group(1)], p) for i, p in enumerate(parts))


def config_from_args(args: argparse.Namespace) -> LazyCkptConfig:
    """Build the :class:`LazyCkptConfig` for parsed ``args`` (``--save``, ``--load``, ``--lazy-ckpt-*``).

    Options missing from ``args`` (a parser without the lazy-ckpt group) take the config defaults.
    Raises :class:`OptionsError` (a ``ValueError``) from the config's checks, naming config fields;
    :func:`validate_lazy_ckpt_args` reports the same problems under the flags' names.
    """
    fields = {field: _value(args, attr, field) for attr, _, field in _FLAG_FIELDS}
    for attr, _, field in _AUTO_FLAGS:
        value = getattr(args, attr, "auto")
        fields[field] = DIRECT_IO_CHOICES.get(value, value)
    fields.update(_megatron_replication(args, fields["replicas"]))
    return LazyCkptConfig(save_dir=getattr(args, "save", None), load_dir=getattr(args, "load", None), **fields)


def _megatron_replication(args: argparse.Namespace, replicas: int | None) -> dict:
    """Megatron-LM's own ``--replication --replication-jump J --replication-factor F`` (its local
    checkpoints' cliques) as our partner replication: ``replicas = F - 1``, ``J`` ranks apart."""
    if not getattr(args, "replication", False):
        return {}
    factor = getattr(args, "replication_factor", None) or 2
    if replicas is not None and replicas != factor - 1:
        raise OptionsError(
            "LazyCkptConfig",
            [("replicas", f"is {replicas} but --replication-factor {factor} means {factor - 1}: give one of them")],
        )
    return {"replicas": factor - 1, "replication_jump": getattr(args, "replication_jump", None)}


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
