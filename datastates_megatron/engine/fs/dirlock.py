"""One writer per save directory: an exclusive ``flock`` on ``<save dir>/.datastates.lock``.

Why: two jobs given one ``--save`` would each run start-up cleanup and retention there, deleting
what the other is still writing.  The directory's writer takes this lock before any cleanup and
holds it until ``close()``.  The kernel drops a ``flock`` when its holder dies, so a killed job
never blocks the next one; the lock file itself stays (removing a lock file races with a process
that has just opened it).  After taking the lock the holder writes one JSON line (host, pid, start
time) into it, for the message the next job gets.  The file is opened with ``O_NOFOLLOW``: a
symlink put in its place is refused, never followed, and so is a file with other hard links (we
would truncate and write a file elsewhere).  On a file system without ``flock`` support the lock is
skipped with a warning.

A lock file deleted (or replaced) under a live holder lets a second job take a lock on the new
file: the holder's :meth:`SaveDirLock.check` (run before every commit) compares the inode it
locked with the one at the name now and, once they differ, refuses every later commit
(:class:`LockLostError`): the first job stops committing and never runs retention over the second
job's checkpoints.

Thread-safety: one owner; ``acquire``/``release`` from one thread; ``release`` is idempotent.
``check`` may run on another thread (the commit thread) while the lock is held; the owner joins
that thread before ``release``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time

from ..errors import FlushError, LockLostError, SaveDirBusyError
from ..names import LOCK_NAME

__all__ = ["SaveDirLock"]

log = logging.getLogger(__name__)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_text(raw: bytes, st: os.stat_result) -> str:
    """Who holds the lock, as the lock file says -- and, when the pid it names is gone on this host
    (a holder that forked, then died: its child inherited the descriptor and the lock), who
    actually does: the processes with the lock file open (``/proc/<pid>/fd``)."""
    try:
        h = json.loads(raw.decode("utf-8").splitlines()[0])
        text = f"host {h['host']}, pid {h['pid']}, since {h['started_iso']}"
        pid, host = int(h["pid"]), h["host"]
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError):
        return "holder unknown (the lock file names none yet)"
    if host != socket.gethostname() or _alive(pid):
        return text
    holders = _processes_with_open(st)
    who = f"pid(s) {', '.join(map(str, holders))}" if holders else "a process on this host that inherited it"
    return f"recorded as {text}, which is no longer running; the lock is held by {who} (a child it forked)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def _processes_with_open(st: os.stat_result, limit: int = 8) -> list[int]:
    """Pids (at most ``limit``; other than ours) with a descriptor on the inode of ``st``."""
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return found
    for pid in sorted(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to look at
        for fd in fds:
            try:
                other = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                found.append(pid)
                break
        if len(found) >= limit:
            break
    return found


class SaveDirLock:
    """The exclusive lock of one save directory.  A context manager."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None
        self._lost: str | None = None  # why the lock was lost (sticky)

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
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links"
            raise FlushError(
                f"{self.path}: the save directory's lock file is {what} (not made by us); refusing to "
                "write it: remove it if no job is running here"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            holder = _holder_text(os.pread(fd, 4096, 0), st)
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

    def check(self) -> None:
        """Raise :class:`LockLostError` unless the lock file at our name is still the inode we hold
        locked (run before every commit; an ``fstat`` and an ``lstat``).  Once lost, always lost."""
        if self._fd is None and self._lost is None:
            return  # not held (a file system without flock): nothing to compare
        if self._lost is None:
            held = os.fstat(self._fd)
            try:
                now = os.lstat(self.path)
            except FileNotFoundError:
                self._lost = "was removed"
            except OSError as e:
                self._lost = f"cannot be checked ({e.strerror})"
            else:
                if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                    self._lost = "was replaced by another file"
        if self._lost is not None:
            raise LockLostError(
                f"{self.path}: the save directory's lock file {self._lost} while this job (pid {os.getpid()}) "
                f"held it: another job may be writing to {self.directory} now, so this job stops committing "
                "there (nor deletes anything); restart it, and give each job its own --save"
            )

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
