"""Retention's deletions, off the commit thread (as Orbax's deleter): the commit thread decides what
goes, this thread removes it.

Why: deleting a retired checkpoint costs one unlink per rank file (N on the persistent tier's
writer), and on the commit thread it delays the next commit by that much.  The order a crash cannot
turn into a trap is :func:`.retention.delete_checkpoint`'s (manifest first), unchanged.

Thread-safety: ``submit``/``pending``/``drain`` from any thread; deletions run on the owned thread
``dsm-delete-r{rank}[-local]``, in submission order; ``close()`` (idempotent) finishes the queue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .errors import CacheTimeoutError
from .faults import crash_point
from .manifest import iter_dir
from .retention import deletion_failed, delete_checkpoint, trim_recycled
from .threads import QueueThread

__all__ = ["Deleter"]

log = logging.getLogger(__name__)


class Deleter(QueueThread):
    """The deletions of one tier directory ``root`` (its writer's).  ``owned()`` says whether the
    directory is still this job's (its lock): once not, nothing more is deleted.  ``pool_keep``:
    retired rank files kept for reuse after each deletion (``None``: no recycling)."""

    def __init__(
        self, name: str, root: str, rank: int, *, recycle: bool, pool_keep: int, owned: Callable[[], bool]
    ) -> None:
        self.root, self.rank, self.recycle, self.pool_keep, self.owned = root, rank, recycle, pool_keep, owned
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: set[int] = set()
        super().__init__(f"dsm-delete-r{rank}" + ("-local" if name == "local" else ""))

    def submit(self, iteration: int) -> None:
        """Delete checkpoint ``iteration`` (once: a repeated request while it waits is dropped)."""
        with self._lock:
            if iteration in self._pending:
                return
            self._pending.add(iteration)
        self.put(iteration)

    def pending(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def drain(self, timeout: float) -> None:
        """Block until every submitted deletion is done (or has failed)."""
        with self._idle:
            if not self._idle.wait_for(lambda: not self._pending, timeout):
                raise CacheTimeoutError(
                    f"rank {self.rank}: {len(self._pending)} deletion(s) not done after {timeout:.0f}s"
                )

    def _handle(self, iteration: int) -> None:
        try:
            if not self.owned():
                return
            crash_point("retention", self.rank)
            delete_checkpoint(self.root, iteration, recycle=self.recycle)
            log.info("rank %d: retention deleted %s", self.rank, iter_dir(self.root, iteration))
            if self.recycle:
                trim_recycled(self.root, keep=self.pool_keep)
        except OSError as e:  # tried again when retention next selects it
            deletion_failed(iter_dir(self.root, iteration), e)
        except Exception as e:  # noqa: BLE001 - a deletion never stops the thread that makes the next ones
            log.error("rank %d: deleting %s failed: %r", self.rank, iter_dir(self.root, iteration), e)
        finally:
            with self._idle:
                self._pending.discard(iteration)
                self._idle.notify_all()
