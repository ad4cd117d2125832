"""Deleting what we wrote: retention's choice, one checkpoint (in an order a crash cannot turn into a trap),
the recycle pool's files.  Their one caller is the tier that owns the directory (:mod:`.tier`).

A checkpoint is deleted manifest first (then it is no longer committed), then its files, then the
directory; a crash half-way leaves a manifest-less directory that start-up cleanup removes.

Recycling: instead of unlinking the rank files of a deleted checkpoint, retention may move them
into ``<root>/.recycle/``, and the next save renames one into place and overwrites it.  At a
checkpoint every iteration this avoids freeing and re-allocating (and, on tmpfs, zeroing) a whole
checkpoint's worth of pages or blocks per iteration, the largest CPU cost of the local tier
(docs/BENCHMARKS.md).  Recycled files are never referenced by a manifest; the pool is bounded, emptied at
start-up and on close.

Only what we wrote is ever deleted (:mod:`.names`): a directory holding anything else keeps it,
and a symlink is never followed nor removed (``lstat`` first; skipped with a log line).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat

from ..names import (
    MANIFEST_NAME,
    RECYCLE_DIR,
    is_ours_in_iteration,
    is_recycled_name,
    is_tracker_temp,
    iter_dir,
    parse_rank_file_name,
    recycled_name,
)
from ..fs.safe_io import make_dir, real_dir
from ..fs.durable import fsync_dir

__all__ = [
    "KeepPolicy",
    "select_deletions",
    "delete_checkpoint",
    "deletion_failed",
    "remove_ours",
    "remove_stale_tracker_temps",
    "take_recycled",
    "trim_recycled",
    "unlink_ours",
]

log = logging.getLogger(__name__)


def _is_link(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _real_dir(path: str) -> bool:
    """A directory that is not a symlink (logged when it is one: we never follow it)."""
    if real_dir(path):
        return True
    if _is_link(path):
        log.warning("%s: is a symlink (not made by us); not following it, leaving it alone", path)
    return False


def unlink_ours(path: str) -> bool:
    """Unlink ``path`` if it is a regular file (the caller has checked that its name is ours);
    a symlink or anything else is left alone and logged.  Returns whether it was removed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        log.warning("%s: is %s (not made by us); leaving it alone", path, kind)
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


_failed: set[str] = set()  # paths whose deletion failed and was reported (bounded below)


def deletion_failed(path: str, err: OSError, rank: int | None = None) -> None:
    """Report a deletion the file system refused (by ``rank``, when known): a warning the first time
    for ``path``, then quietly (it is retried at every commit; a warning each time would grow with
    every commit)."""
    who = "" if rank is None else f"rank {rank}: "
    if path in _failed:
        log.debug("%s%s: still cannot delete: %s", who, path, err)
        return
    if len(_failed) < 100_000:
        _failed.add(path)
    log.warning("%s%s: could not delete (%s); left in place and retried later (reported once)", who, path, err)


def _remove_our_files(d: str, rank: int | None = None) -> list[str]:
    """Unlink the entries of ``d`` we wrote; returns those left (not ours, not plain files, or whose
    unlink the file system refused: logged with the path, left for the next cleanup)."""
    left = []
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return left  # vanished since it was listed: nothing of ours left to remove
    for name in names:
        path = os.path.join(d, name)
        try:
            removed = is_ours_in_iteration(name) and unlink_ours(path)
        except OSError as e:
            deletion_failed(path, e, rank)
            removed = False
        if not removed:
            left.append(name)
    return left


def remove_ours(d: str, rank: int | None = None) -> bool:
    """Unlink the entries of ``d`` we wrote, then ``d`` itself if nothing else is left in it
    (``rank``: who does it, for the messages)."""
    left = _remove_our_files(d, rank)
    if left:
        log.warning(
            "%s: keeps %d entr%s not written by us (%s); the directory stays",
            d,
            len(left),
            "y" if len(left) == 1 else "ies",
            ", ".join(sorted(left)[:5]),
        )
        return False
    try:
        os.rmdir(d)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("%s: could not remove the directory: %s", d, e)
        return False


@dataclasses.dataclass(frozen=True)
class KeepPolicy:
    """Which committed checkpoints a tier's retention keeps (as Orbax's preservation policies): the
    newest commit and the ``protected`` ones always; with ``keep_last`` > 0 the ``keep_last`` newest
    commits and, with ``keep_every`` > 0, every iteration that is a multiple of it; ``keep_last=0``
    keeps everything.  One per tier: the tier applies it, nothing else re-implements it."""

    keep_last: int = 0
    keep_every: int = 0

    def deletions(self, commit_order: list[int], protected: set[int]) -> list[int]:
        """Iterations to delete of ``commit_order`` (committed iterations, oldest commit first)."""
        return select_deletions(commit_order, self.keep_last, self.keep_every, protected)


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


def delete_checkpoint(root: str, iteration: int, recycle: bool = False, rank: int | None = None) -> None:
    """Uncommit (manifest first), then remove our files -- or, with ``recycle``, move the rank files
    into the recycle pool -- then the directory if nothing else is in it."""
    d = iter_dir(root, iteration)
    if not _real_dir(d):
        return
    if unlink_ours(os.path.join(d, MANIFEST_NAME)):
        fsync_dir(d)
    from ..runtime.faults import crash_point

    crash_point("retention_files")
    pool = os.path.join(root, RECYCLE_DIR)
    if recycle and not _is_link(pool):
        try:
            make_dir(pool)
            for name in os.listdir(d):
                src = os.path.join(d, name)
                st = os.lstat(src)
                # a file with other hard links (a ``cp -al`` backup) is unlinked, never rewritten
                if parse_rank_file_name(name) is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    os.rename(src, os.path.join(pool, recycled_name(iteration, name)))
        except OSError as e:  # recycling is an optimisation: fall back to deleting
            log.warning("%s: could not recycle rank files (%s); deleting them", d, e)
    remove_ours(d, rank)


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
    if _is_link(pool):
        return False
    try:
        names = sorted(n for n in os.listdir(pool) if is_recycled_name(n))
    except FileNotFoundError:
        return False
    if os.path.lexists(dst):
        return False  # something (not ours: a planted link) holds the name; a rename would replace it
    mine = parse_rank_file_name(os.path.basename(dst))
    if mine is not None:
        names.sort(key=lambda n: _retired_by(n) != mine[0])  # stable: oldest first within each part
    for name in names:
        try:
            st = os.lstat(os.path.join(pool, name))
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                continue  # not ours, or linked from elsewhere: a save must never write into another file
            os.rename(os.path.join(pool, name), dst)
            return True
        except FileNotFoundError:
            continue  # taken by another rank
    return False


def trim_recycled(root: str, keep: int) -> None:
    """Unlink pool files beyond the ``keep`` newest (``keep=0``: empty the pool)."""
    pool = os.path.join(root, RECYCLE_DIR)
    if not _real_dir(pool):
        return
    try:
        names = sorted(n for n in os.listdir(pool) if is_recycled_name(n))
    except FileNotFoundError:
        return
    for name in names[: max(0, len(names) - keep)]:
        try:
            unlink_ours(os.path.join(pool, name))
        except OSError as e:  # the pool only holds space: never worth failing for
            deletion_failed(os.path.join(pool, name), e)


def remove_stale_tracker_temps(root: str) -> list[str]:
    """Start-up cleanup: temp files of a tracker update that a crash interrupted (``atomic_write``
    names them ``<tracker>.tmp-<pid>``); the tracker itself is untouched."""
    try:
        names = [n for n in os.listdir(root) if is_tracker_temp(n)]
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        try:
            if unlink_ours(path):
                removed.append(path)
        except OSError as e:
            log.warning("%s: could not remove a stale tracker temp file: %s", path, e)
    return removed
