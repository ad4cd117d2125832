"""Checkpoints we did not write (Megatron-LM's own) in a save directory: recognised here, and only here.

Why: a run pointed at a ``--save`` that already holds Megatron's native checkpoint must neither
delete it nor silently train from iteration 0 beside it.  Start-up, the resume path and
``datastates-ckpt ls`` all ask :func:`find_foreign`.

A directory named like Megatron's (``iter_NNNNNNN`` or ``release``) with no manifest of ours is a
foreign checkpoint when it holds entries we did not write (:mod:`.names`): format ``torch_dist``
(``.metadata``, ``*.distcp``, ``common.pt``, ``metadata.json``), ``torch`` (the legacy format:
``mp_rank_*/model_optim_rng.pt``) or ``unknown``.  The tracker file alone proves nothing: we write
the same ``latest_checkpointed_iteration.txt``; it only says which foreign directory Megatron would
load.  Reads only; never follows a symlink into a deletion (nothing here deletes).
"""

from __future__ import annotations

import logging
import os
import re
from typing import NamedTuple

from ..errors import CheckpointError, ForeignCheckpointError
from ..format.manifest import read_tracker_text
from ..names import MANIFEST_NAME
from ..names import is_ours_in_iteration

__all__ = ["FORMATS", "ForeignCheckpoint", "find_foreign", "foreign_format", "refuse_newer_foreign", "tracker_text"]

log = logging.getLogger(__name__)
FORMATS = ("torch_dist", "torch", "unknown")
_NAME = re.compile(r"^iter_(\d{7,})$")
_TORCH_DIST = {".metadata", "common.pt", "metadata.json"}


class ForeignCheckpoint(NamedTuple):
    iteration: int | None  # None: Megatron's ``release`` directory
    format: str  # one of FORMATS
    path: str

    @property
    def tracker_name(self) -> str:
        """What Megatron's tracker file holds to name this checkpoint."""
        return "release" if self.iteration is None else str(self.iteration)


def foreign_format(d: str) -> str | None:
    """The format of the foreign checkpoint in directory ``d``; None when ``d`` holds our manifest,
    or only entries we write (an uncommitted save of ours), or cannot be listed."""
    try:
        names = os.listdir(d)
    except OSError:
        return None
    if MANIFEST_NAME in names:
        return None
    others = [n for n in names if not is_ours_in_iteration(n)]
    if not others:
        return None
    if any(n in _TORCH_DIST or n.endswith(".distcp") for n in others):
        return "torch_dist"
    if any(n.startswith("mp_rank_") and os.path.isfile(os.path.join(d, n, "model_optim_rng.pt")) for n in others):
        return "torch"
    return "unknown"


def tracker_text(root: str) -> str | None:
    """The tracker file's text, or None when it is missing or not a file we can trust."""
    try:
        return read_tracker_text(root)  # O_NOFOLLOW, regular file, size-capped (:mod:`.safe_io`)
    except CheckpointError:
        return None


# how a Megatron-LM run continues from such a checkpoint as a lazy run (docs/megatron.md, "Layouts and migration")
_HOW_TO_CONTINUE = {
    "--save": "; to continue that run with lazy checkpoints, pass this directory as --load and a new one as --save",
    "--load": "; a --load holding only Megatron-LM checkpoints (no lazy one) is imported with Megatron-LM's loader",
}


def find_foreign(root: str) -> list[ForeignCheckpoint]:
    """Every foreign checkpoint directory directly under ``root`` (``release`` first, then by iteration)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        m = _NAME.match(name)
        if not m and name != "release":
            continue
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        fmt = foreign_format(path)
        if fmt is not None:
            out.append(ForeignCheckpoint(int(m.group(1)) if m else None, fmt, path))
    return sorted(out, key=lambda f: (f.iteration is not None, f.iteration or 0))


def _newer(f: ForeignCheckpoint, latest_ours: int | None, tracker: str | None) -> bool:
    """Whether a run resuming here would skip ``f``: Megatron would have loaded it instead of ours.
    An ``unknown`` directory counts only when the tracker names it (stray files are not a checkpoint)."""
    named = tracker == f.tracker_name
    if f.format == "unknown" and not named:
        return False
    if f.iteration is None:
        return named or latest_ours is None
    return latest_ours is None or f.iteration > latest_ours


def refuse_newer_foreign(
    root: str, latest_ours: int | None, *, option: str = "--save", warn: bool = True
) -> list[ForeignCheckpoint]:
    """Raise :class:`ForeignCheckpointError` when ``root`` holds a foreign checkpoint newer than our
    latest committed iteration ``latest_ours`` (None: we have none); log the older ones (left alone)
    when ``warn``.  Returns every foreign checkpoint found."""
    found = find_foreign(root)
    if not found:
        return found
    tracker = tracker_text(root)
    newer = [f for f in found if _newer(f, latest_ours, tracker)]
    if newer:
        f = newer[-1]
        what = "release" if f.iteration is None else f"iteration {f.iteration}"
        ours = "no checkpoint of ours" if latest_ours is None else f"our latest committed iteration is {latest_ours}"
        raise ForeignCheckpointError(
            f"{root}: holds a checkpoint not written by datastates-megatron: {what} in format {f.format} "
            f"({f.path}), newer than ours ({ours}); refusing to start, which would ignore it and train from "
            f"{'scratch' if latest_ours is None else f'iteration {latest_ours}'}. Nothing was changed. Use another "
            f"{option} directory{_HOW_TO_CONTINUE.get(option, '')}"
        )
    if warn:
        for f in found:
            log.warning(
                "%s: holds files not written by datastates-megatron (format %s); left alone, and a resume "
                "loads our latest checkpoint, not this one",
                f.path,
                f.format,
            )
    return found
