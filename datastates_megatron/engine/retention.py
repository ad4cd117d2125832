"""Retention: which committed checkpoints to delete, and deleting one so a crash never leaves a trap.

A checkpoint is deleted manifest first (then it is no longer committed), then its files, then the
directory; a crash half-way leaves a manifest-less directory that start-up cleanup removes.

Recycling: instead of unlinking the rank files of a deleted checkpoint, retention may move them
into ``<root>/.recycle/``, and the next save renames one into place and overwrites it.  At a
checkpoint every iteration this avoids freeing and re-allocating (and, on tmpfs, zeroing) a whole
checkpoint's worth of pages or blocks per iteration -- measured as the largest CPU cost of the
local tier.  Recycled files are never referenced by a manifest; the pool is bounded, emptied at
start-up and on close.
"""

from __future__ import annotations

import logging
import os
import shutil

from .manifest import MANIFEST_NAME, TRACKER_NAME, iter_dir, parse_rank_file_name
from .writer import fsync_dir

__all__ = [
    "select_deletions", "delete_checkpoint", "remove_uncommitted", "remove_stale_tracker_temps",
    "RECYCLE_DIR", "take_recycled", "trim_recycled",
]

RECYCLE_DIR = ".recycle"

log = logging.getLogger(__name__)


def select_deletions(commit_order: list[int], keep_last: int, keep_every: int, protected: set[int]) -> list[int]:
    """Iterations to delete.  ``commit_order``: committed iterations, oldest commit first; the newest
    commit (the latest checkpoint) and ``protected`` ones (still being written) are always kept.
    ``keep_last=0`` keeps everything."""
    if keep_last <= 0 or not commit_order:
        return []
    keep = set(commit_order[-keep_last:]) | {commit_order[-1]} | protected
    if keep_every > 0:
        keep |= {it for it in commit_order if it % keep_every == 0}
    return [it for it in commit_order if it not in keep]


def delete_checkpoint(root: str, iteration: int, recycle: bool = False) -> None:
    """Uncommit (manifest first), then remove the files -- or, with ``recycle``, move the rank files
    into the recycle pool -- then the directory."""
    d = iter_dir(root, iteration)
    manifest = os.path.join(d, MANIFEST_NAME)
    if os.path.exists(manifest):
        os.unlink(manifest)
        fsync_dir(d)
    from .faults import crash_point

    crash_point("retention_files")
    if recycle:
        pool = os.path.join(root, RECYCLE_DIR)
        try:
            os.makedirs(pool, exist_ok=True)
            for name in os.listdir(d):
                if name.endswith(".dsck"):
                    os.rename(os.path.join(d, name), os.path.join(pool, f"{iteration:07d}-{name}"))
        except OSError as e:  # recycling is an optimisation: fall back to deleting
            log.warning("%s: could not recycle rank files (%s); deleting them", d, e)
    shutil.rmtree(d, ignore_errors=True)


def _retired_by(pool_name: str) -> int | None:
    """Rank whose file a pool entry was (``delete_checkpoint`` names it ``<iteration>-<rank file>``)."""
    parsed = parse_rank_file_name(pool_name.partition("-")[2])
    return parsed[0] if parsed is not None else None


def take_recycled(root: str, dst: str) -> bool:
    """Move one file of ``root``'s recycle pool to ``dst`` (atomic rename; ranks sharing the pool may
    race for a file, the loser tries the next).  ``False`` when the pool is empty.

    A file the same rank retired comes first: that rank's process may still have it mapped
    (:mod:`.mapped_files`), and its size fits that rank's next save."""
    pool = os.path.join(root, RECYCLE_DIR)
    try:
        names = sorted(os.listdir(pool))
    except FileNotFoundError:
        return False
    mine = parse_rank_file_name(os.path.basename(dst))
    if mine is not None:
        names.sort(key=lambda n: _retired_by(n) != mine[0])  # stable: oldest first within each part
    for name in names:
        try:
            os.rename(os.path.join(pool, name), dst)
            return True
        except FileNotFoundError:
            continue  # taken by another rank
    return False


def trim_recycled(root: str, keep: int) -> None:
    """Unlink pool files beyond the ``keep`` newest (``keep=0``: empty the pool)."""
    pool = os.path.join(root, RECYCLE_DIR)
    try:
        names = sorted(os.listdir(pool))
    except FileNotFoundError:
        return
    for name in names[: max(0, len(names) - keep)]:
        try:
            os.unlink(os.path.join(pool, name))
        except FileNotFoundError:
            pass


def remove_uncommitted(root: str, iterations: list[int], referenced: dict[int, set[str]], keep_names: set[str]) -> list[str]:
    """Start-up cleanup: remove directories that never got a manifest, and files in committed
    directories that their manifest does not name (a crashed re-save).  A directory whose manifest
    exists but is unreadable is kept (and logged): it may be repairable, and it is never loaded."""
    removed = []
    for it in iterations:
        d = iter_dir(root, it)
        if it not in referenced:
            if os.path.exists(os.path.join(d, MANIFEST_NAME)):
                log.warning("%s: manifest is unreadable; leaving the directory alone (it is not loadable)", d)
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            continue
        for name in os.listdir(d):
            if name == MANIFEST_NAME or name in referenced[it] or name in keep_names:
                continue
            path = os.path.join(d, name)
            if os.path.isfile(path):
                os.unlink(path)
                removed.append(path)
    return removed


def remove_stale_tracker_temps(root: str) -> list[str]:
    """Start-up cleanup: temp files of a tracker update that a crash interrupted (``atomic_write``
    names them ``<tracker>.tmp-<pid>``); the tracker itself is untouched."""
    prefix = TRACKER_NAME + ".tmp-"
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError as e:
            log.warning("%s: could not remove a stale tracker temp file: %s", path, e)
    return removed
