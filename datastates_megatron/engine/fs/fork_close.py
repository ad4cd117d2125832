"""Descriptors a forked child closes at once.

A host copy (:mod:`..tiers.host_copy`) is a memfd: its memory is freed only when its last descriptor
closes.  A child forked by the trainer (a DataLoader worker, a checkpoint worker) inherits every
descriptor -- ``O_CLOEXEC`` only acts at ``exec`` -- and would hold each copy, and each descriptor a
save in flight holds of it, for as long as it lives.  Descriptors registered here (:func:`opened`,
closed through :func:`close`) are closed in the child right after the fork.
"""

from __future__ import annotations

import os
import threading

__all__ = ["close", "opened"]

_fds: set[int] = set()
_lock = threading.Lock()


def opened(fd: int) -> int:
    """Register ``fd`` (returned): a forked child closes it at once."""
    with _lock:
        _fds.add(fd)
    return fd


def close(fd: int) -> None:
    """Close ``fd``, registered by :func:`opened` (its number is forgotten first: never reused while listed)."""
    with _lock:
        _fds.discard(fd)
        os.close(fd)


def _in_child() -> None:
    """After a fork, in the child (one thread): close every registered descriptor, without the lock
    (another thread of the parent may have held it at the fork)."""
    global _lock
    fds = list(_fds)
    _fds.clear()
    _lock = threading.Lock()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_in_child)
