"""One writer per save prefix on object storage: the lock object ``<prefix>/.datastates.lock``,
created with ``If-None-Match: *`` (:meth:`.base.Storage.create`).

What differs from the POSIX lock (:mod:`..fs.dirlock`): no kernel drops the lock when its holder dies,
so the lock is a *lease*.  Its body records the holder (host, pid, start time, a random nonce, the
job id from ``DSM_JOB_ID``/``SLURM_JOB_ID``) and when the lease ends; a thread of the holder
renews it every third of the lease with a conditional replace (``If-Match`` its own tag).  A second
job is refused (:class:`.errors.SaveDirBusyError` naming the holder) while the lease runs; once it
has run out (the holder died) the lock is taken over with ``If-Match`` on the stale tag, so two
jobs racing for it cannot both win.  A requeued job (the same job id: Slurm keeps it across a
requeue) takes its own dead incarnation's lock at once.  Outside Slurm, after ``kill -9``, the
refusal names the holder's token (its random nonce) and the variable that takes its lock over now,
``DSM_TAKE_OVER_LOCK=<token>``: that holder's lock only (another holder since is refused), never
one whose pid still runs on this host, and as a conditional replace (two takers cannot both win).
A holder on another host that was in fact alive loses the lock at its next check (its
:class:`.errors.LockLostError`): it stops committing, it never writes over the new holder.

Lock loss is detected as on POSIX: :meth:`ObjectLock.check` (before every commit and deletion)
compares the lock object's tag with the one this holder wrote last; once another job has replaced
or removed it, :class:`.errors.LockLostError` -- sticky -- and nothing more is committed or deleted.

Thread-safety: ``acquire``/``release`` from the owner's thread; ``check`` from the commit and
deleter threads; the renewal thread is owned and joined by ``release``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid

from ..errors import CheckpointError, LockLostError, OptionsError, SaveDirBusyError
from ..names import LOCK_NAME
from .base import ObjectExistsError, ObjectMissingError, ObjectStorageError, Storage

__all__ = ["ObjectLock", "LOCK_NAME", "DEFAULT_LEASE_S", "TAKE_OVER_ENV"]

log = logging.getLogger(__name__)
DEFAULT_LEASE_S = 300.0
#: the variable naming a dead holder whose lock a job takes over at once (the token its refusal names)
TAKE_OVER_ENV = "DSM_TAKE_OVER_LOCK"
_TOKEN = re.compile(r"^[0-9a-f]{32}\Z")
LOCK_MAX_BYTES = 4096  # a lock body is ~250 bytes; a larger object is not ours and is never fetched


def job_id() -> str:
    """This job's id across a requeue (``DSM_JOB_ID``, else Slurm's), ``""`` when unknown."""
    return os.environ.get("DSM_JOB_ID") or os.environ.get("SLURM_JOB_ID") or ""


class ObjectLock:
    """The lease lock of one save prefix on ``storage``.  A context manager."""

    def __init__(self, storage: Storage, *, lease_s: float = DEFAULT_LEASE_S, clock=time.time) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.storage = storage
        self.lease_s = lease_s
        self._clock = clock
        self._nonce = uuid.uuid4().hex
        self._etag: str | None = None
        self._lost: str | None = None
        self._lock = threading.Lock()  # guards _etag and _lost
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.storage.url(LOCK_NAME)

    @property
    def held(self) -> bool:
        return self._etag is not None

    def _body(self) -> bytes:
        now = self._clock()
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "job": job_id(),
                "nonce": self._nonce,
                "started_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
                "expires": now + self.lease_s,
            }
        ).encode("utf-8")

    def acquire(self) -> ObjectLock:
        """Take the lock, or raise :class:`SaveDirBusyError` naming the holder (never waits)."""
        if self._etag is not None:
            return self
        take_over()  # a malformed value is refused even when the lock is free
        try:
            self._etag = self.storage.create(LOCK_NAME, self._body()).etag
        except ObjectExistsError:
            self._take_over()
        self._renewer = threading.Thread(target=self._renew_loop, name="dsm-lock-renew", daemon=True)
        self._renewer.start()
        return self

    def _take_over(self) -> None:
        info = self.storage.head(LOCK_NAME)
        try:
            holder = (
                json.loads(self.storage.read_capped(LOCK_NAME, LOCK_MAX_BYTES, "lock", info.size)) if info else None
            )
        except (ValueError, CheckpointError):  # unparsable, over its cap (never fetched), or gone
            holder = None
        if info is None:  # released meanwhile: try once more, as a first taker
            self._etag = self.storage.create(LOCK_NAME, self._body()).etag
            return
        text = _holder_text(holder)
        expired = isinstance(holder, dict) and isinstance(holder.get("expires"), (int, float))
        expired = expired and holder["expires"] < self._clock()
        same_job = isinstance(holder, dict) and bool(job_id()) and holder.get("job") == job_id()
        named = self._named_take_over(holder, info.etag, text) if not (expired or same_job) else False
        if not (expired or same_job or named):
            token = _holder_token(holder, info.etag)
            running = _running_here(holder)
            how = (
                ""
                if token is None or running
                else f"; if it is dead (killed with kill -9), take its lock over now with {TAKE_OVER_ENV}={token}"
                + (" (that pid is not running on this host)" if running is False else "")
            )
            raise SaveDirBusyError(
                f"{self.storage.url()}: save location is in use by another writer ({text}; lock {self.url}); "
                f"two jobs must not share a --save location{how}; else wait for it to end (its lease runs out "
                f"{self.lease_s:.0f}s after its last renewal if it died) or use another location"
            )
        why = (
            "a previous run of this job" if same_job else f"named by {TAKE_OVER_ENV}" if named else "its lease ran out"
        )
        try:
            self._etag = self.storage.replace_if(LOCK_NAME, self._body(), info.etag).etag
        except (ObjectExistsError, ObjectMissingError) as e:
            raise SaveDirBusyError(
                f"{self.storage.url()}: another job took the lock ({self.url}) first; use another --save location"
            ) from e
        log.warning("%s: took over the lock of %s (%s)", self.url, text, why)

    def _named_take_over(self, holder, etag: str, text: str) -> bool:
        """Whether :data:`TAKE_OVER_ENV` names this lock's holder, who may then be replaced; a
        holder still running on this host, or another holder than the one named, is refused."""
        wanted = take_over()
        if wanted is None:
            return False
        token = _holder_token(holder, etag)
        if wanted != token:
            raise SaveDirBusyError(
                f"{self.storage.url()}: {TAKE_OVER_ENV}={wanted} names another holder than the lock's ({text}; "
                f"lock {self.url}); not taking it over"
            )
        if _running_here(holder):
            raise SaveDirBusyError(
                f"{self.storage.url()}: {TAKE_OVER_ENV} names the lock of pid {holder['pid']}, which is still running "
                f"on this host ({text}); stop it first, or use another --save location"
            )
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._renew()
            except LockLostError as e:
                log.error("%s", e)
                return
            except ObjectStorageError as e:  # the next renewal tries again; check() decides
                log.warning("%s: lease renewal failed (%s)", self.url, e)

    def _renew(self) -> None:
        with self._lock:
            if self._lost is not None or self._etag is None:
                return
            try:
                self._etag = self.storage.replace_if(LOCK_NAME, self._body(), self._etag).etag
            except ObjectExistsError:
                self._lost = "was replaced by another job's"
            except ObjectMissingError:
                self._lost = "was removed"
        self._raise_if_lost()

    def check(self) -> None:
        """Raise :class:`LockLostError` unless the lock object is still the one this holder wrote
        last (one HEAD).  Once lost, always lost."""
        with self._lock:
            if self._etag is None and self._lost is None:
                return
            if self._lost is None:
                info = self.storage.head(LOCK_NAME)
                if info is None:
                    self._lost = "was removed"
                elif info.etag != self._etag:
                    self._lost = "was replaced by another job's"
        self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise LockLostError(
                f"{self.url}: the save location's lock object {self._lost} while this job (pid {os.getpid()}) "
                f"held it: another job may be writing to {self.storage.url()} now, so this job stops committing "
                "there (nor deletes anything); restart it, and give each job its own --save"
            )

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still ours (idempotent)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        with self._lock:
            etag, self._etag = self._etag, None
        if etag is not None and self._lost is None:
            try:
                self.storage.delete(LOCK_NAME, etag=etag)
            except (ObjectExistsError, ObjectMissingError):
                pass  # not ours any more: left to its holder
            except ObjectStorageError as e:  # the lease runs out by itself
                log.warning("%s: could not release the lock (%s); its lease runs out", self.url, e)

    def __enter__(self) -> ObjectLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def take_over() -> str | None:
    """The holder token :data:`TAKE_OVER_ENV` names (``None``: unset); a malformed one raises."""
    value = os.environ.get(TAKE_OVER_ENV, "").strip()
    if not value:
        return None
    if not _TOKEN.match(value):
        raise OptionsError(
            "lock takeover", [(TAKE_OVER_ENV, f"must be the 32 hex digits a refusal names, got {value!r}")]
        )
    return value


def _holder_token(holder, etag: str) -> str | None:
    """What names this holder for a takeover: its nonce (random per acquisition), else -- a lock
    body naming none -- the object's tag when it is an MD5; ``None``: nothing to name it by."""
    nonce = holder.get("nonce") if isinstance(holder, dict) else None
    if isinstance(nonce, str) and _TOKEN.match(nonce):
        return nonce
    tag = str(etag).strip('"').lower()
    return tag if _TOKEN.match(tag) else None


def _running_here(holder) -> bool | None:
    """Whether the holder's pid runs on this host (``None``: another host, or unknown)."""
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder_text(holder) -> str:
    if not isinstance(holder, dict):
        return "holder unknown (the lock object names none)"
    try:
        job = f", job {holder['job']}" if holder.get("job") else ""
        return f"host {holder['host']}, pid {holder['pid']}{job}, since {holder['started_iso']}"
    except (KeyError, TypeError):
        return "holder unknown (the lock object names none)"
