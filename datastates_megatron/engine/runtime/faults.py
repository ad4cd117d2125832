"""Crash-injection points for the fault tests: ``DSM_CRASH_AT=<point>[:<n>]`` kills this process with
SIGKILL (a real ``kill -9``) the n-th time (default 1st) it reaches ``point``.  Unset: a dict lookup.

Points: ``flush`` (after a region is written), ``before_finish`` (data written, file not finished),
``before_manifest`` (all ranks durable, manifest not written), ``before_tracker`` (manifest written),
``retention`` / ``retention_files`` (while deleting an old checkpoint), ``promote`` (a local file
copied to the persistent tier, not yet renamed into place), ``replicate`` (a local checkpoint
committed, its replication not started).

``DSM_HOLD_AT=<point>[:<n>]`` instead blocks the calling thread for good the n-th time: a job stalled
at a known place (``save``: the start of a save), for a test to kill once the background work it
waits for is done.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["crash_point", "hold_point"]

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _reached(variable: str, point: str, rank: int | None = None) -> bool:
    """Whether ``point`` is reached for the n-th time that ``$variable`` (``<point>[:<n>]``) names,
    on the rank ``$DSM_CRASH_RANK`` names (any rank when unset)."""
    spec = os.environ.get(variable)
    if not spec:
        return False
    name, _, nth = spec.partition(":")
    if name != point:
        return False
    only_rank = os.environ.get("DSM_CRASH_RANK")
    if only_rank is not None and rank is not None and int(only_rank) != rank:
        return False
    key = f"{variable}:{point}"
    with _lock:
        _counts[key] = _counts.get(key, 0) + 1
        return _counts[key] == int(nth or 1)


def crash_point(point: str, rank: int | None = None) -> None:
    if _reached("DSM_CRASH_AT", point, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def hold_point(point: str) -> None:
    if _reached("DSM_HOLD_AT", point):
        threading.Event().wait()
