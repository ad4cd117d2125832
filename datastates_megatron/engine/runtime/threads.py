"""Small building blocks for the engine's owned threads and context managers."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import queue
import threading
import time

from ..errors import CheckpointError

__all__ = ["QueueThread", "DaemonPool", "ClosingContext", "close_at_exit", "forget"]

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
    items queued before it are handled -- for at most ``timeout`` seconds when given, after which it
    logs what it gave up on (:meth:`_busy_with`) and returns.  ``put`` may be called from any thread.
    Every item put is *outstanding* until its ``_handle`` returns or raises: :meth:`drain` waits for
    none to be left (the commit thread's and the deleter's ``wait()``), :meth:`_outstanding_items`
    lists them, keyed as ``put`` was given (or in order)."""

    def __init__(self, name: str, daemon: bool = False) -> None:
        """``daemon``: only for work that a process exit may cut short at any point (idempotent,
        restart-safe); ``close()`` still joins it."""
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()  # guards _outstanding; notified as each item is done
        self._outstanding: dict = {}  # key -> item put and not yet handled, in order of putting
        self._keys = itertools.count()
        self._closed = False
        self._current: tuple | None = None  # (item, time.monotonic() it started): what close() gives up on
        self._thread = threading.Thread(target=self._run, name=name, daemon=daemon)
        self._thread.start()

    def put(self, item, key=None) -> None:
        """Queue ``item``; ``key`` names it among the outstanding items (default: its order)."""
        with self._idle:
            key = ("put", next(self._keys)) if key is None else key
            self._outstanding[key] = item
        self._queue.put((key, item))

    def drain(self, timeout: float | None) -> bool:
        """Wait until every item put so far is handled; whether that happened within ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._outstanding, timeout)

    def _outstanding_items(self) -> list:
        with self._idle:
            return list(self._outstanding.values())

    def close(self, timeout: float | None = None) -> bool:
        """Stop after the items queued so far; returns whether the thread ended (within ``timeout``
        seconds when given: a shutdown never waits without a bound on storage that does not answer)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error(
                "gave up after %.0f s waiting for thread %s to stop: %s; what it was doing is not done",
                timeout,
                self._thread.name,
                self._busy_with(),
            )
            return False
        return True

    def _busy_with(self) -> str:
        """What the thread is doing, for the line :meth:`close` logs when it gives up on it."""
        return f"{self._queue.qsize()} item(s) still queued"

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            key, item = entry
            self._current = (item, time.monotonic())
            try:
                self._handle(item)
            finally:
                self._current = None
                with self._idle:
                    self._outstanding.pop(key, None)
                    self._idle.notify_all()

    def _busy_for(self) -> tuple[object, float] | None:
        """The item being handled and for how many seconds (``None``: idle)."""
        current = self._current
        return None if current is None else (current[0], time.monotonic() - current[1])

    def _handle(self, item) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class DaemonPool(cf.Executor):
    """``workers`` named daemon threads running submitted calls in order of submission.

    For work a caller may have to abandon -- a read the storage never answers: unlike
    ``ThreadPoolExecutor``'s workers, which the interpreter joins at exit, a daemon thread stuck in
    such a call does not keep the process from exiting.  ``shutdown(wait=False)`` lets the threads
    end once their calls return.  Thread-safe."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn, /, *args, **kwargs) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit to a pool that was shut down")
            self._queue.put((fut, fn, args, kwargs))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._shut:
                self._shut = True
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)


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
