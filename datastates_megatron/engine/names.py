"""The names this package creates in a save directory: the only entries cleanup and retention delete.

Everything else -- Megatron-LM's own checkpoints, a user's notes, a file system's ``.nfs*`` entry,
any symlink -- is not ours and is never written, renamed or deleted.  "Ours" is decided from the
name alone (each writer below uses exactly these patterns); a symlink is never ours, whatever its
name, because we never create one.
"""

from __future__ import annotations

import re

from .format.global_index import INDEX_NAME
from .format.manifest import MANIFEST_NAME, TRACKER_NAME, parse_rank_file_name

__all__ = [
    "LOCK_NAME",
    "RUN_ID_NAME",
    "RECYCLE_DIR",
    "PROMOTING_SUFFIX",
    "is_ours_in_iteration",
    "is_recycled_name",
    "is_tracker_temp",
]

LOCK_NAME = ".datastates.lock"  # the one-writer lock of a save directory (:mod:`.dirlock`)
RUN_ID_NAME = ".datastates.run"  # the id of the run a save directory belongs to (:mod:`.run_id`)
RECYCLE_DIR = ".recycle"  # retired rank files waiting to be overwritten (:mod:`.retention`)
PROMOTING_SUFFIX = ".promoting"  # a rank file being copied to the persistent tier (:mod:`.tiers`)
_TMP = re.compile(r"\.tmp-\d+$")  # :func:`.manifest.atomic_write`'s temp file: ``<name>.tmp-<pid>``


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
    """A pool entry: ``<iteration, 7+ digits>-<rank file>`` (:func:`.retention.delete_checkpoint`;
    the pool directory is ours, so any ``<digits>-*.dsck`` in it is a file we retired)."""
    head, sep, rest = name.partition("-")
    return bool(sep) and head.isdigit() and len(head) >= 7 and rest.endswith(".dsck")


def is_tracker_temp(name: str) -> bool:
    """A temp file a crash interrupted in a tier's root: of a tracker update (``<tracker>.tmp-<pid>``)
    or of the run id's creation (``.datastates.run.tmp-<pid>``)."""
    return _is_temp_of(name, TRACKER_NAME) or _is_temp_of(name, RUN_ID_NAME)
