"""The run a save directory belongs to: one id, created in ``--save`` at the run's first start.

Why: node-local storage (``/dev/shm``, a local SSD) outlives jobs and is shared by every job on a
node.  A local checkpoint is only ever this run's when it is bound to the ``--save`` it promotes to:
the id names the run's own subdirectory of the node-local root (``run-<id>``) and is written into
every manifest, so another run's local checkpoint is never loaded or promoted (nor deleted, but
by :mod:`.reclaim` once that run ended cleanly with everything in its ``--save``), and several
runs may share one node-local root.  The file (``.datastates.run``, JSON) is written atomically by the
save directory's lock holder at the run's first start.  It also records the save directory's inode:
a copy of the directory (``cp -r``: a branch of the run, a restored backup) carries the file but not
the inode, and gets a new id -- a copy must never adopt the original run's node-local checkpoints.
(Inode, not path: a shared file system may be mounted at other paths on other nodes.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time

from ..errors import CorruptCheckpointError
from ..fs.durable import atomic_write
from ..names import RUN_ID_NAME, RUN_SUBDIR_PREFIX
from ..fs.safe_io import read_capped

__all__ = [
    "RUN_ID_MAX_BYTES",
    "ensure_run_id",
    "is_run_id",
    "local_tier_dir",
    "read_run_id",
    "run_subdir",
]

_ID = re.compile(r"^[0-7][0-9a-f]{15}\Z")  # below 2**63: it travels as an int64
RUN_ID_MAX_BYTES = 4096  # the run id document, on POSIX and object storage
log = logging.getLogger(__name__)


def is_run_id(text: str) -> bool:
    return bool(_ID.match(text))


def _read(save_dir: str) -> dict | None:
    path = os.path.join(save_dir, RUN_ID_NAME)
    try:
        raw = read_capped(path, RUN_ID_MAX_BYTES, "run id")
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
        run_id = doc["run_id"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not a run id file of datastates-megatron ({e})") from None
    if not isinstance(run_id, str) or not is_run_id(run_id):
        raise CorruptCheckpointError(f"{path}: run id {run_id!r:.40} is not 16 hex digits below 2**63")
    return doc


def read_run_id(save_dir: str) -> str | None:
    """The id recorded in ``save_dir``, or None when it has none yet; a file that is not one we
    wrote (a link, too large, not our JSON, an id out of range) raises
    :class:`CorruptCheckpointError` naming it."""
    doc = _read(save_dir)
    return None if doc is None else doc["run_id"]


def ensure_run_id(save_dir: str) -> str:
    """The id of ``save_dir``'s run, created on its first start, and anew in a copy of the
    directory (the caller holds the directory's one-writer lock, so no other writer races this)."""
    doc = _read(save_dir)
    inode = os.stat(save_dir).st_ino
    if doc is not None and doc.get("save_inode", inode) == inode:
        return doc["run_id"]
    if doc is not None:
        log.warning(
            "%s: is a copy of the save directory of run %s (the run id file came with it); this is a new "
            "run: it never uses that run's node-local checkpoints",
            save_dir,
            doc["run_id"],
        )
    run_id = f"{secrets.randbits(63):016x}"
    doc = {"run_id": run_id, "created": time.time(), "save_dir": os.path.abspath(save_dir), "save_inode": inode}
    atomic_write(os.path.join(save_dir, RUN_ID_NAME), (json.dumps(doc) + "\n").encode("utf-8"))
    return run_id


def run_subdir(local_root: str, run_id: str) -> str:
    """This run's directory under a node-local root that several runs may share."""
    return os.path.join(local_root, RUN_SUBDIR_PREFIX + run_id)


def local_tier_dir(local_root: str, save_dir: str) -> str | None:
    """The node-local tier directory of the run whose ``--save`` is ``save_dir`` (None before its
    first start): where ``datastates-ckpt`` and tests look for that run's local checkpoints."""
    run_id = read_run_id(save_dir)
    return run_subdir(local_root, run_id) if run_id else None
