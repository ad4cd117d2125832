"""How hard promotions hit the persistent tier: a per-node cap on rank files being copied at once,
and an optional per-copy bandwidth cap.

Without them every rank of every node starts its copy the moment a local checkpoint commits: at
16k ranks, 16k files created, written, fsynced and renamed into one directory of a parallel file
system in the same second.  :class:`PromoteSlots` lets at most ``slots`` ranks of a node copy at a
time: a copy holds an exclusive ``flock`` on one of ``slots`` slot files in the node's local tier
directory (``run-<id>/``, shared by the ranks of the node and by nothing else).  The kernel drops a
lock with its holder's last descriptor, so a rank that dies mid-copy never keeps a slot.
:class:`Pace` spaces a copy's blocks so that it moves at most ``mbps`` MB/s.

Thread-safety: a :class:`PromoteSlots` is used by one thread (a rank's promotion thread); a
:class:`Pace` by one copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time

from ..errors import CheckpointError
from ..fs.safe_io import open_for_write
from ..names import promote_slot_name

__all__ = ["PromoteSlots", "Pace"]

log = logging.getLogger(__name__)


class PromoteSlots:
    """At most ``slots`` holders at once among the processes sharing ``directory`` (0: no cap).
    ``rank`` picks the slot a holder waits on when all are taken, spreading the waiters.  A context
    manager; ``close()`` is idempotent."""

    def __init__(self, directory: str, slots: int, rank: int) -> None:
        self.directory = directory
        self.slots = slots
        self.rank = rank
        self._fds: list[int] = []

    def _open(self) -> list[int]:
        if not self._fds:  # slot files are created once (never through a link) and kept open
            self._fds = [open_for_write(os.path.join(self.directory, promote_slot_name(i))) for i in range(self.slots)]
        return self._fds

    @contextlib.contextmanager
    def held(self):
        """Hold a slot for the body: a free one if there is one, else wait for slot ``rank % slots``."""
        if self.slots <= 0:
            yield None
            return
        try:
            fds = self._open()
        except (OSError, CheckpointError) as e:  # a slot name taken by something not ours: copy uncapped
            log.warning("rank %d: no promotion slots in %s (%s); promoting without a cap", self.rank, self.directory, e)
            self.close()
            self.slots = 0
            yield None
            return
        first = self.rank % self.slots
        order = [(first + i) % self.slots for i in range(self.slots)]
        got = None
        for i in order:
            try:
                fcntl.flock(fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = i
                break
            except BlockingIOError:
                continue
        if got is None:
            t0 = time.perf_counter()
            fcntl.flock(fds[first], fcntl.LOCK_EX)  # every slot is copying: wait for this one
            got = first
            log.debug("rank %d: waited %.3f s for a promotion slot", self.rank, time.perf_counter() - t0)
        try:
            yield got
        finally:
            fcntl.flock(fds[got], fcntl.LOCK_UN)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Pace:
    """Called with each block a copy wrote: sleeps so that the copy averages at most ``mbps`` MB/s
    (``mbps`` > 0: without a cap there is no ``Pace``)."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self.done = 0
        self.t0 = time.perf_counter()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        ahead = self.done / self.rate - (time.perf_counter() - self.t0)
        if ahead > 0:
            time.sleep(ahead)
