"""Reclaiming the node-local directory of a run that is over.

Node-local storage outlives jobs: without this, every run leaves its ``run-<id>/`` behind for ever.
A run that ends cleanly (``close()`` after its last checkpoint was promoted) leaves a marker,
``run-<id>/.datastates.ended``, naming its ``--save``; a start of that run on the node removes the
marker again (the run is live).  The next run on the node -- whichever run it is -- removes such a
directory at its start-up, when all of these hold:

* it is a real directory (never a link: nothing is followed), owned by this user, named
  ``run-<16 hex digits>``, with a marker we wrote naming the same run;
* its one-writer lock is free (no job of that run uses it now; it is held during the removal);
* the run's ``--save`` is readable, still belongs to that run (its run id file), and its newest
  committed checkpoint is at least as new as every checkpoint in the directory (its own and the
  replicas it holds): nothing there is newer than ``--save``, and nothing is damaged.

Only what we wrote is removed (:mod:`..names`); anything else -- a user's file, a link -- stays, with
the directories that hold it, and is named in the log line.  Every removal is logged.

Thread-safety: start-up only (the node's local writer, before any commit thread exists).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time

from ..errors import CheckpointError, SaveDirBusyError
from ..format.manifest import read_manifest
from ..fs.dirlock import SaveDirLock
from ..fs.durable import atomic_write
from ..fs.safe_io import read_capped, real_dir
from ..names import (
    ENDED_NAME,
    LOCK_NAME,
    RECYCLE_DIR,
    REPLICAS_DIR,
    RUN_SUBDIR_PREFIX,
    is_ours_in_run_dir,
    iter_dir,
    iteration_of,
)
from .retention import remove_ours, trim_recycled, unlink_ours
from .run_id import is_run_id, read_run_id
from .tier import list_iterations, survey

__all__ = ["mark_ended", "unmark_ended", "reclaim_finished_runs"]

log = logging.getLogger(__name__)
_MARKER_MAX = 8192


def mark_ended(run_dir: str, run_id: str, save_dir: str) -> None:
    """The run ``run_id`` ended cleanly (its writer on this node, at ``close()``)."""
    where = save_dir if "://" in save_dir else os.path.abspath(save_dir)  # a URL: never reclaimed (read below)
    doc = {"run_id": run_id, "save_dir": where, "ended": time.time()}
    atomic_write(os.path.join(run_dir, ENDED_NAME), (json.dumps(doc) + "\n").encode("utf-8"))


def unmark_ended(run_dir: str) -> None:
    """The run is live again on this node (its writer, at start-up, holding the directory's lock)."""
    unlink_ours(os.path.join(run_dir, ENDED_NAME))


def _marker(run_dir: str, run_id: str) -> dict | None:
    """The marker of a run that ended cleanly, or ``None`` (absent, not ours, another run's)."""
    try:
        doc = json.loads(read_capped(os.path.join(run_dir, ENDED_NAME), _MARKER_MAX, "run end marker").decode())
    except (FileNotFoundError, CheckpointError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("run_id") != run_id or not isinstance(doc.get("save_dir"), str):
        return None
    return doc


def _newest_local(run_dir: str) -> tuple[int | None, str | None]:
    """The newest iteration committed in ``run_dir`` or its replica stores, and why it cannot be
    reclaimed when something there is damaged (``None``: nothing)."""
    roots = [run_dir]
    replicas = os.path.join(run_dir, REPLICAS_DIR)
    if real_dir(replicas):
        roots += [os.path.join(replicas, n) for n in sorted(os.listdir(replicas))]
    newest = None
    for root in roots:
        if not real_dir(root):
            continue
        found = survey(root)
        damaged = [it for it in found.damaged if real_dir(iter_dir(root, it))]  # a link is not ours: it stays
        if damaged:
            return None, f"{iter_dir(root, min(damaged))} has a manifest that does not read"
        if found.committed:
            newest = max(newest or 0, max(found.committed))
    return newest, None


def _blocker(run_dir: str, run_id: str) -> str | None:
    """Why ``run_dir`` must stay, or ``None`` when it may be reclaimed (its lock held by the caller)."""
    doc = _marker(run_dir, run_id)
    if doc is None:
        return "its run did not end cleanly (no end marker)"
    save_dir = doc["save_dir"]
    newest_local, damaged = _newest_local(run_dir)
    if damaged:
        return damaged
    try:
        if read_run_id(save_dir) != run_id:
            return f"its --save {save_dir} no longer belongs to run {run_id}"
        if newest_local is not None and not _committed_at_or_after(save_dir, newest_local):
            return f"it holds iteration {newest_local}, and {save_dir} holds no committed checkpoint as new"
    except (CheckpointError, OSError) as e:
        return f"its --save {save_dir} cannot be read here ({e})"
    return None


def _committed_at_or_after(save_dir: str, iteration: int) -> bool:
    """Whether ``save_dir`` holds a committed checkpoint of ``iteration`` or later: its manifests
    are read newest first, and only until one reads (not every manifest of a --save that keeps
    thousands)."""
    for it in reversed(list_iterations(save_dir)):
        if it < iteration:
            return False
        try:
            read_manifest(iter_dir(save_dir, it))
            return True
        except CheckpointError:  # not committed, or damaged: an older one may still cover it
            continue
    return False


def _remove_tree_of_ours(root: str) -> list[str]:
    """Remove what we wrote in a tier directory ``root`` (its ``iter_*`` directories' files of ours,
    its recycle pool, its top-level files of ours); returns the paths of what stays (not ours)."""
    left = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not is_ours_in_run_dir(name):
            left.append(path)  # a link is never ours, nor followed
        elif iteration_of(name) is not None and stat.S_ISDIR(st.st_mode):
            if not remove_ours(path):
                left.append(path)
        elif name == RECYCLE_DIR and stat.S_ISDIR(st.st_mode):
            trim_recycled(root, keep=0)
            if not _rmdir(path):
                left.append(path)
        elif name == REPLICAS_DIR and stat.S_ISDIR(st.st_mode):
            for store in sorted(os.listdir(path)):
                sub = os.path.join(path, store)
                if os.path.islink(sub) or not real_dir(sub):
                    left.append(sub)
                    continue
                left += _remove_tree_of_ours(sub)
                if not _rmdir(sub):
                    left.append(sub)
            if not _rmdir(path):
                left.append(path)
        elif name in (LOCK_NAME,):
            continue  # last: the lock is held until the directory is empty
        elif stat.S_ISREG(st.st_mode):
            if not unlink_ours(path):
                left.append(path)
        else:
            left.append(path)
    return left


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def _reclaim(local_base: str, name: str) -> str | None:
    """Remove ``local_base/name`` if it may be reclaimed; returns why not (``None``: removed, logged)."""
    run_dir, run_id = os.path.join(local_base, name), name[len(RUN_SUBDIR_PREFIX) :]
    st = os.lstat(run_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return "not a directory of this user"
    why = _blocker(run_dir, run_id)  # read-only first: a directory that stays is not written (its lock)
    if why is not None:
        return why
    lock = SaveDirLock(run_dir)
    try:
        lock.acquire()
    except SaveDirBusyError:
        return "in use"
    except CheckpointError as e:
        return str(e)
    try:
        why = _blocker(run_dir, run_id)  # again under the lock: the run may have started again meanwhile
        if why is not None:
            return why
        newest, _ = _newest_local(run_dir)
        left = _remove_tree_of_ours(run_dir)
        lock.release()
        if not left:
            unlink_ours(os.path.join(run_dir, LOCK_NAME))
            left = [] if _rmdir(run_dir) else [os.path.join(run_dir, n) for n in os.listdir(run_dir)]
    finally:
        lock.release()
    if left:
        log.warning(
            "%s: removed what this package wrote of run %s, which ended cleanly with every checkpoint in its "
            "--save; kept %d entr%s not written by it: %s",
            run_dir,
            run_id,
            len(left),
            "y" if len(left) == 1 else "ies",
            ", ".join(left[:5]),
        )
    else:
        log.info(
            "%s: removed the node-local directory of run %s (ended cleanly; its newest checkpoint here, "
            "iteration %s, is in its --save)",
            run_dir,
            run_id,
            newest,
        )
    return None


def reclaim_finished_runs(local_base: str, own_run_id: str) -> list[str]:
    """Start-up of a node's local writer: remove the ``run-<id>/`` directories under ``local_base`` of
    other runs that ended cleanly with nothing newer than their ``--save`` (see the module's
    docstring); returns those reclaimed (wholly or but for what is not ours)."""
    try:
        names = sorted(os.listdir(local_base))
    except FileNotFoundError:
        return []
    done = []
    for name in names:
        run_id = name[len(RUN_SUBDIR_PREFIX) :]
        if not name.startswith(RUN_SUBDIR_PREFIX) or not is_run_id(run_id) or run_id == own_run_id:
            continue
        try:
            why = _reclaim(local_base, name)
        except OSError as e:  # a refused removal never stops a start-up
            why = f"removal failed: {e}"
            log.warning("%s: %s", os.path.join(local_base, name), why)
        if why is None:
            done.append(os.path.join(local_base, name))
        else:
            log.debug("%s: not reclaimed: %s", os.path.join(local_base, name), why)
    return done
