"""One writer per save directory: an exclusive ``flock`` on ``<save dir>/.datastates.lock``.

Why: two jobs given one ``--save`` would each run start-up cleanup and retention there, deleting
what the other is still writing.  The directory's writer takes this lock before any cleanup and
holds it until ``close()``.  The kernel drops a ``flock`` when its holder dies, so a killed job
never blocks the next one; the lock file itself stays (removing a lock file races with a process
that has just opened it).  After taking the lock the holder writes one JSON line (host, pid, start
time) into it, for the message the next job gets.  The file is opened with ``O_NOFOLLOW``: a
symlink put in its place is refused, never followed.  On a file system without ``flock`` support
the lock is skipped with a warning.

Thread-safety: one owner; ``acquire``/``release`` from one thread; ``release`` is idempotent.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

from .errors import FlushError, SaveDirBusyError
from .names import LOCK_NAME

__all__ = ["SaveDirLock", "LOCK_NAME"]

log = logging.getLogger(__name__)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_text(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode("utf-8").splitlines()[0])
        return f"host {h['host']}, pid {h['pid']}, since {h['started_iso']}"
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError):
        return "holder unknown (the lock file names none yet)"


class SaveDirLock:
    """The exclusive lock of one save directory.  A context manager."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "SaveDirLock":
        """Take the lock or raise :class:`SaveDirBusyError` naming the holder (never waits)."""
        if self._fd is not None:
            return self
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            why = "it is a symlink (not ours; not followed)" if e.errno == errno.ELOOP else str(e)
            raise FlushError(f"{self.path}: cannot open the save directory's lock file: {why}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            holder = _holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            raise SaveDirBusyError(
                f"{self.directory}: save directory is in use by another writer ({holder}; lock {self.path}); "
                "two jobs must not share a --save directory: wait for it to end or use another directory"
            ) from e
        except OSError as e:
            os.close(fd)
            if e.errno not in _UNSUPPORTED:
                raise FlushError(f"{self.path}: cannot lock the save directory: {e}") from e
            log.warning("%s: this file system does not support flock (%s); one-writer check skipped", self.path, e)
            return self
        self._fd = fd
        self._write_holder()
        return self

    def _write_holder(self) -> None:
        started = time.time()
        line = (
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": started,
                    "started_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                }
            )
            + "\n"
        )
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, line.encode("utf-8"), 0)
        except OSError as e:  # informative only: the lock itself is held
            log.warning("%s: could not record the lock holder: %s", self.path, e)

    def release(self) -> None:
        """Drop the lock (the file stays); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "SaveDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
