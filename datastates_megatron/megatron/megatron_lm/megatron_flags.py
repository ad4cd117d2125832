"""Megatron-LM's own checkpoint flags under ``--lazy-ckpt``: mapped, refused, or ignored with a warning.

* **Mapped.** Megatron-LM's local checkpoints -- ``--non-persistent-save-interval M
  --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR`` -- are our node-local tier:
  Megatron's loop saves non-persistently every M iterations and persistently every
  ``--save-interval S``; both land in ``DIR`` and those at multiples of S are promoted to ``--save``
  (``persist_interval = S``).  ``--replication --replication-jump J --replication-factor F`` are
  our partner replicas (``replicas = F - 1``, ``J`` ranks apart).
* **Refused** (:data:`UNSUPPORTED`): what a lazy checkpoint cannot reproduce; each with what to do.
* **Ignored** (:data:`IGNORED`): options of Megatron's own formats; one warning names those given.

:func:`adopt` writes the mapped values into the ``--lazy-ckpt-*`` attributes and turns Megatron's
local checkpoints off in ``args`` (else its ``validate_args`` would require nvidia-resiliency-ext and
``pretrain`` would start a ``LocalCheckpointManager`` of its own).  The patch and the runtime hook
call it (through :func:`.args.validate_lazy_ckpt_args`) right after parsing, before Megatron's
``validate_args``.  Pure functions apart from :func:`adopt`'s documented change of ``args``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ...engine.storage.url import is_object_url

__all__ = [
    "UNSUPPORTED",
    "IGNORED",
    "LOCAL_PATH_UNDER_SAVE",
    "MappingError",
    "mapped_fields",
    "adopt",
    "ignored_given",
    "url_save_problems",
]

logger = logging.getLogger(__name__)

# Megatron-LM flags whose behaviour --lazy-ckpt cannot reproduce: (args attribute, flag, what to do).
# A flag counts as given when its value is neither None nor False.
UNSUPPORTED: tuple[tuple[str, str, str], ...] = (
    ("async_save", "--async-save", "--lazy-ckpt already overlaps checkpointing with training; drop --async-save"),
    ("save_retain_interval", "--save-retain-interval", "use --lazy-ckpt-keep-last / --lazy-ckpt-keep-every"),
    (
        "use_checkpoint_args",
        "--use-checkpoint-args",
        "lazy checkpoints store no pickled args; pass the model arguments explicitly",
    ),
    ("no_save_optim", "--no-save-optim", "lazy checkpoints always contain the optimizer"),
    ("no_save_rng", "--no-save-rng", "lazy checkpoints always contain the RNG state"),
    (
        "override_ckpt_iteration",
        "--override-ckpt-iteration",
        "not supported by lazy checkpoints (a flag of Megatron-LM core_v0.19 and later)",
    ),
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

# Options of Megatron's own checkpoint formats and writers: a lazy checkpoint has its own.  They still
# apply where Megatron's own loader imports a checkpoint and to --lazy-ckpt-convert-to's save.
IGNORED: tuple[str, ...] = (
    "--ckpt-format",
    "--auto-detect-ckpt-format",
    "--ckpt-fully-parallel-save",
    "--no-ckpt-fully-parallel-save",
    "--ckpt-fully-parallel-load",
    "--ckpt-assume-constant-structure",
    "--dist-ckpt-strictness",
    "--dist-ckpt-optim-fully-reshardable",
    "--distrib-optim-fully-reshardable-mem-efficient",
    "--dist-ckpt-save-pre-mcore-014",
    "--dist-ckpt-workers",
    "--dist-ckpt-format",
    "--use-dist-ckpt",
    "--use-persistent-ckpt-worker",
    "--non-persistent-local-ckpt-algo",
)

_ADOPTED = "_lazy_ckpt_adopted"  # set on args by adopt(): it ran (its warning is given once)


# Megatron-LM flags whose files Megatron-LM itself writes under --save as a local path (os.path.join,
# open): with --save on object storage they would make a local directory named "s3:".  (args
# attribute, flag, what to do); a flag counts as given as in UNSUPPORTED.
LOCAL_PATH_UNDER_SAVE: tuple[tuple[str, str, str], ...] = (
    ("log_progress", "--log-progress", "Megatron-LM appends to --save/progress.txt"),
    ("save_wgrads_interval", "--save-wgrads-interval", "Megatron-LM writes the gradients under --save"),
    ("save_dgrads_interval", "--save-dgrads-interval", "Megatron-LM writes the gradients under --save"),
    ("save_activations_interval", "--save-activations-interval", "Megatron-LM writes the activations under --save"),
    (
        "save_tokens_per_expert_interval",
        "--save-tokens-per-expert-interval",
        "Megatron-LM writes the expert token counts under --save",
    ),
)


def url_save_problems(args: argparse.Namespace) -> list[str]:
    """The Megatron-LM flags given with ``--save`` on object storage that would write under it as a
    local path (:data:`LOCAL_PATH_UNDER_SAVE`; ``--wandb-project`` without ``--wandb-save-dir``,
    whose default is ``--save/wandb``), each as a problem naming the flag."""
    save = getattr(args, "save", None)
    if not save or not is_object_url(save):
        return []
    problems = [
        f"--save {save} is on object storage but {flag} is given: {why}; drop {flag}"
        for attr, flag, why in LOCAL_PATH_UNDER_SAVE
        if getattr(args, attr, None) not in (None, False)
    ]
    if getattr(args, "wandb_project", None) and not getattr(args, "wandb_save_dir", None):
        problems.append(
            f"--save {save} is on object storage but --wandb-project is given without --wandb-save-dir: "
            "Megatron-LM writes W&B's files under --save/wandb; give --wandb-save-dir DIR"
        )
    return problems


class MappingError(ValueError):
    """Megatron's flags and ours disagree, or Megatron's ask for what has no equivalent; ``problems``
    lists each, naming the flags."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _lazy(args: argparse.Namespace, field: str, default: Any) -> Any:
    return getattr(args, "lazy_ckpt_" + field, default)


def mapped_fields(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """The config fields Megatron-LM's local-checkpoint flags in ``args`` set (none of them given:
    ``{}``).  ``defaults``: the config's defaults, to tell a ``--lazy-ckpt-*`` flag given from one
    left alone.  Raises :class:`MappingError` when both spell the same option differently, or
    for non-persistent checkpoints that are not Megatron's ``local`` type."""
    problems: list[str] = []
    out: dict[str, Any] = {}
    kind = getattr(args, "non_persistent_ckpt_type", None)
    every = getattr(args, "non_persistent_save_interval", None)
    local_dir = _lazy(args, "local_dir", None)
    if kind not in (None, "local"):
        problems.append(
            f"--lazy-ckpt cannot write --non-persistent-ckpt-type {kind} checkpoints: use "
            "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR (our node-local tier)"
        )
    elif kind == "local":
        theirs = getattr(args, "non_persistent_local_ckpt_dir", None)
        if theirs is None:
            problems.append("--non-persistent-ckpt-type local requires --non-persistent-local-ckpt-dir DIR")
        elif local_dir is not None and local_dir != theirs:
            problems.append(
                f"--lazy-ckpt-local-dir {local_dir} and --non-persistent-local-ckpt-dir {theirs} name two node-local "
                "directories: give one of them"
            )
        else:
            out["local_dir"] = local_dir = theirs
    if every and local_dir is None and kind is None:
        problems.append(
            "--non-persistent-save-interval with --lazy-ckpt needs a node-local tier: add "
            "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR (or --lazy-ckpt-local-dir DIR)"
        )
    if (every or kind == "local") and not problems:
        save_interval = getattr(args, "save_interval", None)
        ours = _lazy(args, "persist_interval", defaults["persist_interval"])
        if not save_interval:
            problems.append(
                "Megatron-LM's non-persistent checkpoints with --lazy-ckpt need --save-interval S: the node-local "
                "checkpoints whose iteration is a multiple of S are promoted to --save"
            )
        elif ours not in (defaults["persist_interval"], save_interval):
            problems.append(
                f"--lazy-ckpt-persist-interval {ours} and --save-interval {save_interval} both set how often "
                "node-local checkpoints are persisted (with --non-persistent-save-interval): give one of them"
            )
        else:
            out["persist_interval"] = save_interval
    if getattr(args, "replication", False):
        factor = getattr(args, "replication_factor", None) or 2
        replicas = _lazy(args, "replicas", None)
        if local_dir is None:
            problems.append(
                "--replication replicates node-local checkpoints: add --non-persistent-ckpt-type local "
                "--non-persistent-local-ckpt-dir DIR (or --lazy-ckpt-local-dir DIR)"
            )
        elif replicas is not None and replicas != factor - 1:
            problems.append(
                f"--lazy-ckpt-replicas is {replicas} but --replication-factor {factor} means {factor - 1}: "
                "give one of them"
            )
        else:
            out["replicas"] = factor - 1
            out["replication_jump"] = getattr(args, "replication_jump", None)
    if problems:
        raise MappingError(problems)
    return out


def adopt(args: argparse.Namespace, defaults: dict[str, Any], argv: Sequence[str] | None = None) -> list[str]:
    """Map Megatron-LM's local-checkpoint flags onto ours, in ``args``, and turn Megatron's own off
    (``non_persistent_ckpt_type``, ``replication``); log one warning naming the Megatron
    checkpoint flags given in ``argv`` (default: ``sys.argv``) that ``--lazy-ckpt`` ignores.
    Idempotent (the second call changes and logs nothing).  Returns the problems found (each
    naming its flags); ``args`` is changed only when there are none."""
    if getattr(args, _ADOPTED, False):
        return []
    try:
        fields = mapped_fields(args, defaults)
    except MappingError as e:
        return e.problems
    for field, value in fields.items():
        setattr(args, "lazy_ckpt_" + field, value)
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        args.non_persistent_ckpt_type = None
    if getattr(args, "replication", False):
        args.replication, args.replication_jump = False, None
    setattr(args, _ADOPTED, True)
    # every rank parses the same flags: rank 0 says it (torch.distributed is not started yet)
    info, warning = (logging.INFO, logging.WARNING) if os.environ.get("RANK", "0") == "0" else (logging.DEBUG,) * 2
    if fields:
        logger.log(
            info,
            "Megatron-LM's local-checkpoint flags mapped onto the lazy checkpointer's node-local tier: %s",
            ", ".join(f"{k}={v}" for k, v in sorted(fields.items())),
        )
    ignored = ignored_given(sys.argv[1:] if argv is None else argv)
    if ignored and getattr(args, "lazy_ckpt_convert_to", None) is None:
        logger.log(
            warning,
            "%s: ignored with --lazy-ckpt (lazy checkpoints have a format of their own); they apply only when "
            "Megatron's own loader imports a checkpoint and to --lazy-ckpt-convert-to",
            ", ".join(ignored),
        )
    return []


def ignored_given(argv: Sequence[str]) -> list[str]:
    """The :data:`IGNORED` flags in ``argv`` (``--flag`` or ``--flag=value``; Megatron-LM's parser
    takes no abbreviations), each once, in :data:`IGNORED` order."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return [flag for flag in IGNORED if flag in given]
