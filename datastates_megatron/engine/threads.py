"""Small building blocks for the engine's owned threads and context managers."""

from __future__ import annotations

import logging
import queue
import threading

from .errors import CheckpointError

__all__ = ["QueueThread", "ClosingContext"]

log = logging.getLogger(__name__)


class QueueThread:
    """A named, non-daemon thread that handles queued items in order until ``close()``.

    Subclasses implement ``_handle(item)``; ``close()`` is idempotent and joins the thread after the
    items queued before it are handled.  ``put`` may be called from any thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    def put(self, item) -> None:
        self._queue.put(item)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def _handle(self, item) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class ClosingContext:
    """``with obj:`` calls ``obj.close()``; an error while closing after another error is logged
    rather than allowed to hide the first one."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as e:
            log.error("error while closing after another error: %s", e)
