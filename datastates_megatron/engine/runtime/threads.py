"""Small building blocks for the engine's owned threads and context managers."""

from __future__ import annotations

import logging
import queue
import threading

from ..errors import CheckpointError

__all__ = ["QueueThread", "ClosingContext", "close_at_exit", "forget"]

log = logging.getLogger(__name__)


_open_at_exit: list = []  # objects to close at interpreter exit, newest last
_exit_lock = threading.Lock()
_exit_registered = False


def close_at_exit(obj) -> None:
    """At interpreter exit, before Python joins non-daemon threads, drain and close ``obj`` (newest
    first): pending checkpoints are committed or their failure is logged, never silently left
    partial, and the process does not hang on our threads.  ``obj.close()`` calls :func:`forget`."""
    global _exit_registered
    with _exit_lock:
        _open_at_exit.append(obj)
        if not _exit_registered:
            try:
                threading._register_atexit(_close_all)  # runs before threading's shutdown joins threads
                _exit_registered = True
            except (AttributeError, RuntimeError):  # pragma: no cover - interpreter already exiting
                pass


def forget(obj) -> None:
    """``obj`` was closed: drop it from the exit list (so its memory can be freed)."""
    with _exit_lock:
        for i, o in enumerate(_open_at_exit):
            if o is obj:
                del _open_at_exit[i]
                break


def _close_all() -> None:
    while True:
        with _exit_lock:
            if not _open_at_exit:
                return
            target = _open_at_exit.pop()
        try:
            target.close()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting: report, do not raise
            log.error("pending checkpoint work could not be completed at interpreter exit: %s", e)


class QueueThread:
    """A named thread (non-daemon unless asked) that handles queued items in order until ``close()``.

    Subclasses implement ``_handle(item)``; ``close()`` is idempotent and joins the thread after the
    items queued before it are handled.  ``put`` may be called from any thread."""

    def __init__(self, name: str, daemon: bool = False) -> None:
        """``daemon``: only for work that a process exit may cut short at any point (idempotent,
        restart-safe); ``close()`` still joins it."""
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=daemon)
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
