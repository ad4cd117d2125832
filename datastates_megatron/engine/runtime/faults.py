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

``DSM_STALL_AT=<point>:<iteration>:<seconds>`` stalls a storage target for a while: the first time
``point`` is reached for ``iteration`` or a later one (``write``: a region of a rank file about to be
written), a stall of ``seconds`` begins, and that call and every call of the point until the stall
ends wait for its end; then the storage answers again.  ``DSM_STALL_RANK`` limits it to one rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["crash_point", "hold_point", "stall_point"]

_counts: dict[str, int] = {}
_lock = threading.Lock()
_stall_ends: dict[str, float] = {}  # point -> when its stall ends (time.monotonic)


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


def stall_point(point: str, rank: int | None = None, iteration: int = 0) -> None:
    """Wait while a ``DSM_STALL_AT`` stall of ``point`` is on (see the module's docstring)."""
    spec = os.environ.get("DSM_STALL_AT")
    if not spec:
        return
    name, first, seconds = spec.split(":")
    only_rank = os.environ.get("DSM_STALL_RANK")
    if (
        name != point
        or iteration < int(first)
        or (only_rank is not None and rank is not None and int(only_rank) != rank)
    ):
        return
    with _lock:
        end = _stall_ends.setdefault(point, time.monotonic() + float(seconds))
    left = end - time.monotonic()
    if left > 0:
        threading.Event().wait(left)
