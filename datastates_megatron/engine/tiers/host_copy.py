"""This rank's newest committed rank file, kept in host memory for an in-process restart.

With ``host_copy`` on, each save writes its rank file twice, byte for byte: to its tier and into a
memfd (the writer's mirror, :class:`..format.writer.RankFileWriter`).  When the save commits, that
memory file becomes the rank's host copy and the one before it is closed; a save that fails or is
abandoned is closed once a newer one commits, or once ``limit`` newer saves started (a save's
commit is abandoned on every rank: no commit names it).  At most one committed copy is held, plus
``limit`` of saves not committed (the manager passes ``2 * max_inflight``: no more can still commit;
a copy closed early is only a copy lost: that restore reads a tier).

Megatron-LM's ``--inprocess-restart`` keeps the processes alive through a fault: the aborted
attempt's manager hands its copies to the next one (:func:`keep` / :func:`take`), whose restore
reads this rank's state from memory -- 0 bytes from storage -- when every rank holds the same
save (:meth:`CheckpointManager.choose`), each file checked against the checksums recorded at save.
A memfd has no name: nothing is left behind when the process dies, and a job restart reads its
tiers as before.  A forked child (a DataLoader worker) closes its inherited descriptors of the copies
at once (:mod:`..fs.fork_close`), and the descriptors a save or a restore holds of them too: a copy
the parent closes is freed, not kept alive by a worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref

from ..format.file_format import FileReceipt
from ..fs import fork_close
from ..format.rank_table import RankRecord

__all__ = ["HostCopies", "HostCopy", "MemoryFile", "keep", "take"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class HostCopy:
    """One save's rank file in a memfd; ``receipt`` once the file is durable."""

    iteration: int
    token: str
    seq: int
    name: str  # the rank file's name (:meth:`.commit.Ticket.file_name`)
    fd: int
    metadata: dict
    layout: dict
    receipt: FileReceipt | None = None
    committed_ms: int = 0

    def record(self, rank: int) -> RankRecord:
        """The manifest record of this file, as the commit wrote it."""
        r = self.receipt
        return RankRecord(rank, self.name, r.file_bytes, r.data_bytes, r.n_tensors, r.index_xxh64, r.header_xxh64)

    @property
    def nbytes(self) -> int:
        return self.receipt.file_bytes if self.receipt is not None else 0


class HostCopies:
    """The memory copies of one rank's saves to ``root``.  Thread-safe: :meth:`start` runs on the
    training thread, :meth:`committed` on the commit thread, the receipts on a flush thread."""

    def __init__(self, rank: int, root: str, limit: int = 2) -> None:
        self.rank = rank
        self.root = root
        self.limit = max(1, limit)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], HostCopy] = {}  # saves not committed yet
        self._newest: HostCopy | None = None  # the newest committed save's copy
        self._closed = False
        _live.add(self)

    def start(self, iteration: int, token: str, seq: int, name: str, metadata: dict, layout: dict) -> int:
        """A new memory file for save ``(token, seq)`` of ``iteration``; the caller's engine mirrors
        the rank file into it (and dups it)."""
        fd = fork_close.opened(os.memfd_create(f"dsm-host-{name}", os.MFD_CLOEXEC))
        copy = HostCopy(iteration, token, seq, name, fd, dict(metadata), dict(layout))
        with self._lock:
            self._pending[(token, seq)] = copy
            stale = []
            while len(self._pending) > self.limit:  # the oldest: abandoned, never to commit
                stale.append(self._pending.pop(next(iter(self._pending))))
        for c in stale:
            fork_close.close(c.fd)
        return fd

    def attach(self, token: str, seq: int, durable) -> None:
        """Take save ``(token, seq)``'s receipt when its file is durable; a failed save's copy is closed."""

        def done(f) -> None:
            with self._lock:
                copy = self._pending.get((token, seq))
                if copy is None:
                    return
                if f.cancelled() or f.exception() is not None:
                    del self._pending[(token, seq)]
                else:
                    copy.receipt = f.result()
                    return
            fork_close.close(copy.fd)

        durable.add_done_callback(done)

    def drop(self, token: str, seq: int) -> None:
        """Save ``(token, seq)`` did not start: close its memory file."""
        with self._lock:
            copy = self._pending.pop((token, seq), None)
        if copy is not None:
            fork_close.close(copy.fd)

    def committed(self, token: str, seq: int, durable=None) -> None:
        """Save ``(token, seq)`` committed (its tier's commit thread): its copy becomes the newest; the
        one before it, and every earlier save of this run still pending (abandoned), are closed.
        ``durable``: the save's future, whose receipt is taken here when :meth:`attach`'s callback
        has not run yet (a future wakes its waiters, the commit thread, before its callbacks).  A
        copy whose size is not the file's (its mirror failed: :class:`.RankFileWriter`) is closed."""
        receipt = None
        if durable is not None and durable.done() and not durable.cancelled() and durable.exception() is None:
            receipt = durable.result()
        closing = []
        with self._lock:
            copy = self._pending.pop((token, seq), None)
            if copy is not None and copy.receipt is None:
                copy.receipt = receipt
            if copy is not None and copy.receipt is not None and _size(copy.fd) != copy.receipt.file_bytes:
                log.warning("rank %d: the host copy of iteration %d is incomplete; not kept", self.rank, copy.iteration)
                copy.receipt = None
            if copy is None or copy.receipt is None or self._closed:
                if copy is not None:
                    closing.append(copy)
            else:
                copy.committed_ms = int(time.time() * 1000)
                if self._newest is not None:
                    closing.append(self._newest)
                self._newest = copy
                for key in [k for k in self._pending if k[0] == token and k[1] < seq]:
                    closing.append(self._pending.pop(key))
        for c in closing:
            fork_close.close(c.fd)

    def newest(self) -> HostCopy | None:
        """The newest committed save's copy, or ``None``."""
        with self._lock:
            return self._newest

    def saves(self) -> dict:
        """``{iteration: (run token as an int, seq, commit ms)}`` of the copy held (the restore's offer)."""
        c = self.newest()
        return {} if c is None else {c.iteration: (int(c.token, 16), c.seq, c.committed_ms)}

    def borrow(self, iteration: int, save: tuple[int, int] | None = None) -> tuple[HostCopy, int] | None:
        """The committed copy of ``iteration`` (and of save ``(token as an int, seq)`` when given)
        with a duplicate of its descriptor, the caller's to close (:func:`.fork_close.close`), or ``None``: a commit that
        closes the copy meanwhile leaves the caller's descriptor open."""
        with self._lock:
            c = self._newest
            if c is None or c.iteration != iteration or (save is not None and (int(c.token, 16), c.seq) != tuple(save)):
                return None
            return c, fork_close.opened(os.dup(c.fd))

    def holds(self, iteration: int, record: RankRecord | None) -> bool:
        """Whether the copy held is ``iteration``'s very file the manifest lists as ``record``."""
        c = self.newest()
        return c is not None and record is not None and c.iteration == iteration and c.record(self.rank) == record

    def close(self) -> None:
        """Close every memory file; idempotent."""
        with self._lock:
            self._closed = True
            copies = list(self._pending.values()) + ([self._newest] if self._newest is not None else [])
            self._pending, self._newest = {}, None
        for c in copies:
            fork_close.close(c.fd)

    def retire_pending(self) -> None:
        """Close the copies of saves that did not commit (a manager closing): only the committed one is kept."""
        with self._lock:
            copies, self._pending = list(self._pending.values()), {}
        for c in copies:
            fork_close.close(c.fd)


def _size(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return -1


class MemoryFile:
    """A reader's ``fetcher`` (:class:`..load.reader.CheckpointReader`) over a host copy: the rank
    file is this memfd, and nothing is fetched."""

    fetched_bytes = 0
    source = "host memory"

    def __init__(self, fd: int, label: str) -> None:
        self._fd, self._label = fd, label

    def open(self, rank: int) -> str:
        return self._label

    def memory_fd(self, rank: int) -> int:
        return self._fd

    def fetch(self, rank: int, spans) -> int:
        return 0

    def close(self) -> None:
        """The copy stays open: it is :class:`HostCopies`'."""


_live: weakref.WeakSet = weakref.WeakSet()  # every HostCopies of this process


def _forget_in_child() -> None:
    """In a forked child: close the inherited descriptors of every copy, without a lock (another
    thread of the parent may have held one at the fork) and without touching the memory."""
    for copies in list(_live):
        held = list(copies._pending.values()) + ([copies._newest] if copies._newest is not None else [])
        copies._pending, copies._newest, copies._closed = {}, None, True
        copies._lock = threading.Lock()
        for c in held:
            try:
                fork_close.close(c.fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_forget_in_child)

_kept: dict[tuple[int, str], HostCopies] = {}
_kept_lock = threading.Lock()


def keep(copies: HostCopies) -> None:
    """An in-process restart: leave ``copies`` (its committed one only) to the next manager of this
    process saving to the same root (:func:`take`); any copies left before are closed."""
    copies.retire_pending()
    with _kept_lock:
        old = _kept.pop((copies.rank, copies.root), None)
        _kept[(copies.rank, copies.root)] = copies
    if old is not None and old is not copies:
        old.close()


def take(rank: int, root: str) -> HostCopies | None:
    """The copies an aborted attempt of this process left for ``rank`` saving to ``root``, or ``None``;
    copies left for another rank or root are closed (they would never be read)."""
    with _kept_lock:
        mine = _kept.pop((rank, root), None)
        others = list(_kept.values())
        _kept.clear()
    for o in others:
        o.close()
    return mine
