"""Every name this package creates on disk, in one module that imports nothing of ours.

A save directory holds ``iter_<7+ digits>/`` checkpoint directories (each: ``manifest.json``, the
commit point, ``global_index.dsgi`` and one ``r<rank>-<token>-<seq>.dsck`` per rank), Megatron's
tracker ``latest_checkpointed_iteration.txt``, the lock ``.datastates.lock``, the run id
``.datastates.run`` and the recycle pool ``.recycle/``; a node-local root holds one ``run-<id>/``
per run, with its ``replicas/r<rank>/`` stores and ``.promote-slot-<i>`` locks.  The writers build
these names here and the readers parse them here, so that a name changes in one place.

These are also the only entries cleanup and retention delete.  Everything else -- Megatron-LM's
own checkpoints, a user's notes, a file system's ``.nfs*`` entry, any symlink -- is not ours and is
never written, renamed or deleted.  "Ours" is decided from the name alone (each writer uses exactly
these patterns); a symlink is never ours, whatever its name, because we never create one.

Stdlib only (:mod:`os`, :mod:`re`): the CLI's help text and the layering test import it freely.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "MANIFEST_NAME",
    "TRACKER_NAME",
    "INDEX_NAME",
    "RANK_FILE_SUFFIX",
    "LOCK_NAME",
    "RUN_ID_NAME",
    "RECYCLE_DIR",
    "PROMOTING_SUFFIX",
    "RUN_SUBDIR_PREFIX",
    "REPLICAS_DIR",
    "PROMOTE_SLOT_PREFIX",
    "ENDED_NAME",
    "iter_dir",
    "iteration_of",
    "rank_file_name",
    "rank_file_names",
    "rank_file_parts",
    "LONGEST_RANK_FILE_NAME",
    "parse_rank_file_name",
    "save_id",
    "temp_name",
    "recycled_name",
    "replica_store_name",
    "replica_store_rank",
    "promote_slot_name",
    "is_ours_in_iteration",
    "is_ours_in_run_dir",
    "is_recycled_name",
    "is_tracker_temp",
]

MANIFEST_NAME = "manifest.json"  # a checkpoint's commit point (:mod:`.format.manifest`)
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker: the latest iteration
INDEX_NAME = "global_index.dsgi"  # a checkpoint's map of global keys to rank files (:mod:`.format.global_index`)
RANK_FILE_SUFFIX = ".dsck"  # one rank's file of one save (:mod:`.format.file_format`)
LOCK_NAME = ".datastates.lock"  # the one-writer lock of a save directory (:mod:`.fs.dirlock`)
RUN_ID_NAME = ".datastates.run"  # the id of the run a save directory belongs to (:mod:`.tiers.run_id`)
RECYCLE_DIR = ".recycle"  # retired rank files waiting to be overwritten (:mod:`.tiers.retention`)
PROMOTING_SUFFIX = ".promoting"  # a rank file being copied to the persistent tier or received as a replica
RUN_SUBDIR_PREFIX = "run-"  # + run id: a run's own subdirectory of a node-local root (:mod:`.tiers.run_id`)
REPLICAS_DIR = "replicas"  # in a run's node-local directory: the replicas kept for other ranks
PROMOTE_SLOT_PREFIX = ".promote-slot-"  # + slot number: a node's promotion locks (:mod:`.tiers.promote_throttle`)
ENDED_NAME = ".datastates.ended"  # a node-local run directory whose run ended cleanly (:mod:`.tiers.reclaim`)

# ``\Z``, not ``$``: "$" also matches before a final newline ("iter_0000001\n" is not ours)
_ITER = re.compile(r"^iter_([0-9]{7,})\Z")
_TMP = re.compile(r"\.tmp-[0-9]+\Z")  # :func:`temp_name`: ``<name>.tmp-<pid>``
_SLOT = re.compile(r"\.promote-slot-[0-9]+\Z")


def iter_dir(root: str, iteration: int) -> str:
    """The checkpoint directory of ``iteration`` under ``root``: ``iter_<7+ digits>``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_of(ckpt_dir: str) -> int | None:
    """The iteration an ``iter_*`` directory's name stands for, ``None`` for any other name."""
    match = _ITER.match(os.path.basename(os.path.normpath(ckpt_dir)))
    return int(match.group(1)) if match else None


def rank_file_name(rank: int, token: str, seq: int) -> str:
    """Rank ``rank``'s file of save ``seq`` of the run with token ``token``."""
    return f"r{rank:05d}-{token}-{seq:06d}{RANK_FILE_SUFFIX}"


def rank_file_names(ranks: range, token: str, seq: int) -> list[str]:
    """:func:`rank_file_name` of each of ``ranks``, the pattern formatted once (64k names in a manifest)."""
    head, digits, tail = rank_file_parts(token, seq)
    return list(map((head + f"%0{digits}d" + tail.replace("%", "%%")).__mod__, ranks))


def rank_file_parts(token: str, seq: int) -> tuple[str, int, str]:
    """``(head, digits, tail)``: :func:`rank_file_name` of a rank is ``head``, the rank in at least
    ``digits`` decimal digits (zero-padded), then ``tail`` (for a formatter of many names at once)."""
    return "r", 5, rank_file_name(0, token, seq)[len("r00000") :]


# the longest rank file name we write (a rank below 100000, a 16-digit token, a sequence below 10**6)
LONGEST_RANK_FILE_NAME = rank_file_name(99999, "f" * 16, 999999)


def _ascii_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_rank_file_name(name: str) -> tuple[int, str, int] | None:
    """``(rank, run token, save sequence)`` of a :func:`rank_file_name`, or None for another name.
    Token and sequence identify the save: every rank's file of one save shares them."""
    parts = name.removesuffix(RANK_FILE_SUFFIX).split("-") if name.endswith(RANK_FILE_SUFFIX) else []
    if (
        len(parts) != 3
        or not parts[0].startswith("r")
        or not _ascii_digits(parts[0][1:])
        or not _ascii_digits(parts[2])
    ):
        return None
    return int(parts[0][1:]), parts[1], int(parts[2])


def save_id(name: str) -> tuple[int, int] | None:
    """``(run token as an integer, save sequence)`` of a rank file name whose token is one
    ``CheckpointManager`` agrees on (16 hex digits, below 2**63: it fits an int64 collective);
    None for any other name."""
    parsed = parse_rank_file_name(name)
    if parsed is None:
        return None
    token = parsed[1]
    if len(token) != 16 or any(c not in "0123456789abcdef" for c in token) or int(token, 16) >= 1 << 63:
        return None
    return int(token, 16), parsed[2]


def temp_name(path: str, pid: int) -> str:
    """The temp file an atomic replace of ``path`` writes first (:func:`.fs.durable.atomic_write`)."""
    return f"{path}.tmp-{pid}"


def recycled_name(iteration: int, name: str) -> str:
    """A retired rank file ``name`` of ``iteration`` in the recycle pool."""
    return f"{iteration:07d}-{name}"


def replica_store_name(src: int) -> str:
    """The directory under :data:`REPLICAS_DIR` holding the replicas of rank ``src``'s files."""
    return f"r{src:05d}"


def replica_store_rank(name: str) -> int | None:
    """The source rank of a replica directory name ``r<rank, 5+ digits>``, else None (not ours)."""
    digits = name[1:]
    return int(digits) if name.startswith("r") and len(digits) >= 5 and _ascii_digits(digits) else None


def promote_slot_name(slot: int) -> str:
    """The lock file of promotion slot ``slot`` in a node's local tier directory."""
    return f"{PROMOTE_SLOT_PREFIX}{slot}"


def _is_temp_of(name: str, base: str) -> bool:
    m = _TMP.search(name)
    return m is not None and name[: m.start()] == base


def _is_rank_file(name: str) -> bool:
    return parse_rank_file_name(name) is not None


def is_ours_in_iteration(name: str) -> bool:
    """Whether an entry of an ``iter_*`` directory is one we create: the manifest, the global index
    or the temp file of either, a rank file, or a rank file being promoted."""
    if name in (MANIFEST_NAME, INDEX_NAME):
        return True
    if _is_temp_of(name, MANIFEST_NAME) or _is_temp_of(name, INDEX_NAME):
        return True
    if name.endswith(PROMOTING_SUFFIX):
        return _is_rank_file(name[: -len(PROMOTING_SUFFIX)])
    return _is_rank_file(name)


def is_recycled_name(name: str) -> bool:
    """A pool entry: :func:`recycled_name` (the pool directory is ours, so any
    ``<7+ digits>-*.dsck`` in it is a file we retired)."""
    head, sep, rest = name.partition("-")
    return bool(sep) and head.isdigit() and len(head) >= 7 and rest.endswith(RANK_FILE_SUFFIX)


def is_tracker_temp(name: str) -> bool:
    """A temp file a crash interrupted in a tier's root: of a tracker update (``<tracker>.tmp-<pid>``)
    or of the run id's creation (``.datastates.run.tmp-<pid>``)."""
    return _is_temp_of(name, TRACKER_NAME) or _is_temp_of(name, RUN_ID_NAME)


def is_ours_in_run_dir(name: str) -> bool:
    """Whether an entry of a node-local run directory (``run-<id>/``) is one we create: an ``iter_*``
    directory, the recycle pool, the replica stores, the lock, the end marker, a promotion slot, the
    tracker or the temp file of the tracker or of the end marker."""
    return (
        iteration_of(name) is not None
        or name in (RECYCLE_DIR, REPLICAS_DIR, LOCK_NAME, ENDED_NAME, TRACKER_NAME)
        or bool(_SLOT.match(name))
        or is_tracker_temp(name)
        or _is_temp_of(name, ENDED_NAME)
    )
