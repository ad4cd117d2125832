"""Reading part of a checkpoint on object storage: each rank object is fetched piecewise, by ranged
GETs, into a sparse local file of its size -- its header and metadata sections when the reader opens
it, then only the checksum chunks a load plan reads -- so a restore that needs a part of each object
(resharding, a model-only load) moves that part, not every object whole.

Why a sparse local file: the one load path (:mod:`..load.reader`: plan, validate, verify, copy)
reads mapped rank files and checks every chunk it uses against the file's own checksums before
anything is copied into a live tensor; the fetched ranges land at their own offsets, so that path
verifies them as it verifies a file on disk, and a damaged range is refused naming the rank and
tensor.  Bytes the plan does not read stay holes, never verified, never used.  The file lives in a
directory the caller made for this load and removes after it: never under a name another load
could mistake for a whole file -- or, without a directory (a save location on object storage and no
node-local one), in a memfd (memory-backed and nameless: nothing is left behind by a ``kill -9``),
closed by :meth:`RangeFetcher.close`.

Memory: ``threads`` ranges of at most ``range_bytes`` in flight, each written at its offset.

Thread-safety: :meth:`RangeFetcher.open` and :meth:`RangeFetcher.fetch` may be called from several
threads (one lock guards the bookkeeping; the transfers run outside it).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

from ..errors import CorruptCheckpointError
from ..format.file_format import HEADER_BYTES, Header
from ..format.manifest import Manifest
from ..fs.safe_io import create_temp
from .base import ObjectMissingError, Storage
from .survey import iter_prefix

__all__ = ["RangeFetcher", "coalesce"]

_RANGE = 16 << 20


def coalesce(spans, gap: int = 0) -> list[tuple[int, int]]:
    """``spans`` (``(lo, hi)`` byte ranges) sorted and merged where they overlap or lie at most
    ``gap`` bytes apart."""
    out: list[list[int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class RangeFetcher:
    """The rank objects of ``manifest``'s checkpoint on ``storage``, fetched piecewise into
    ``dest_dir`` (a directory of the caller's, holding nothing else of that name; ``None``: into
    memory files, :meth:`memory_fd`, closed by :meth:`close`).  ``fetched_bytes``: every byte moved so far."""

    def __init__(
        self, storage: Storage, manifest: Manifest, dest_dir: str, *, threads: int = 4, range_bytes: int = _RANGE
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.dest_dir = dest_dir
        self._memory: dict[int, int] | None = None if dest_dir is not None else {}  # rank -> its memfd
        self.threads = max(1, int(threads))
        self.range_bytes = max(1, int(range_bytes))
        self._lock = threading.Lock()
        self._opened: dict[int, threading.Event] = {}
        self._done: dict[int, set[tuple[int, int]]] = {}  # rank -> spans fetched
        self.fetched_bytes = 0
        self.requests = 0
        self.source = storage.url(iter_prefix(manifest.iteration))  # for messages

    def url(self, rank: int) -> str:
        return self.storage.url(self._key(rank))

    def _key(self, rank: int) -> str:
        rec = self.manifest.record(rank)
        if rec is None:
            raise CorruptCheckpointError(
                f"{self.storage.url(iter_prefix(self.manifest.iteration))}: the manifest has no object for rank {rank}"
            )
        return iter_prefix(self.manifest.iteration) + rec.file

    def path(self, rank: int) -> str:
        """Where ``rank``'s file is (without ``dest_dir``: its object's URL, for messages only)."""
        if self._memory is not None:
            return self.url(rank)
        return os.path.join(self.dest_dir, self.manifest.record(rank).file)

    def memory_fd(self, rank: int) -> int | None:
        """The memfd holding ``rank``'s file (after :meth:`open`), or ``None`` with a ``dest_dir``."""
        return None if self._memory is None else self._memory.get(rank)

    def close(self) -> None:
        """Close the memory files (idempotent); the reader's views keep their own mappings."""
        with self._lock:
            fds, self._memory = list((self._memory or {}).values()), None if self._memory is None else {}
        for fd in fds:
            os.close(fd)

    # ------------------------------------------------------------------ opening a rank object
    def open(self, rank: int) -> str:
        """Make ``rank``'s sparse local file (once): its committed size, its header and its index
        and objects sections fetched (what :class:`..format.file_format.RankFile` reads and checks
        on opening).  Its path."""
        with self._lock:
            ready = self._opened.get(rank)
            first = ready is None
            if first:
                ready = self._opened[rank] = threading.Event()
        if not first:
            ready.wait()
            if rank not in self._done:
                raise CorruptCheckpointError(f"{self.url(rank)}: rank {rank} object could not be fetched")
            return self.path(rank)
        try:
            key, rec = self._key(rank), self.manifest.record(rank)
            fd = (
                create_temp(self.path(rank))
                if self._memory is None
                else os.memfd_create(f"dsm-r{rank}", os.MFD_CLOEXEC)
            )
            try:
                os.ftruncate(fd, rec.file_bytes)
                head = self._get(rank, key, 0, min(HEADER_BYTES, rec.file_bytes))
                self._write(fd, head, 0)
                try:
                    h = Header.unpack(head, self.url(rank))
                except CorruptCheckpointError:
                    h = None  # the reader's own checks against the manifest say what is wrong
                tail = []
                if h is not None and h.file_bytes == rec.file_bytes:
                    tail = coalesce(
                        [
                            (h.index_offset, h.index_offset + h.index_bytes),
                            (h.objects_offset, h.objects_offset + h.objects_bytes),
                        ]
                    )
                    tail = [(max(lo, HEADER_BYTES), min(hi, rec.file_bytes)) for lo, hi in tail]
                self._fetch_spans(rank, key, fd, tail)
                if self._memory is None:
                    os.fsync(fd)
            finally:
                if self._memory is None:
                    os.close(fd)
                else:
                    with self._lock:
                        self._memory[rank] = fd
            with self._lock:
                self._done[rank] = {(0, HEADER_BYTES), *tail}
        finally:
            ready.set()
        return self.path(rank)

    # ------------------------------------------------------------------ the data a plan reads
    def fetch(self, rank: int, spans) -> int:
        """Fetch the byte ranges ``spans`` of ``rank``'s object not fetched yet (merged where they
        touch); the bytes moved."""
        self.open(rank)
        with self._lock:
            done = self._done[rank]
            todo = [s for s in coalesce(spans) if s not in done]
        if not todo:
            return 0
        key = self._key(rank)
        memory = self.memory_fd(rank)
        flags = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path(rank), flags) if memory is None else memory
        try:
            moved = self._fetch_spans(rank, key, fd, todo)
        finally:
            if memory is None:
                os.close(fd)
        with self._lock:
            self._done[rank].update(todo)
        return moved

    def _fetch_spans(self, rank: int, key: str, fd: int, spans) -> int:
        pieces = [
            (lo, min(hi, lo + self.range_bytes)) for s_lo, hi in spans for lo in range(s_lo, hi, self.range_bytes)
        ]

        def one(piece) -> int:
            lo, hi = piece
            self._write(fd, self._get(rank, key, lo, hi), lo)
            return hi - lo

        if len(pieces) <= 1:
            return sum(map(one, pieces))
        with cf.ThreadPoolExecutor(min(self.threads, len(pieces)), thread_name_prefix="dsm-ranges") as pool:
            return sum(pool.map(one, pieces))

    def _get(self, rank: int, key: str, lo: int, hi: int) -> bytes:
        try:
            data = self.storage.get(key, lo, hi)
        except ObjectMissingError as e:
            raise CorruptCheckpointError(f"{self.storage.url(key)}: rank {rank} object is missing") from e
        if len(data) != hi - lo:
            raise CorruptCheckpointError(
                f"{self.storage.url(key)}: rank {rank} object is shorter than the manifest says "
                f"({self.manifest.record(rank).file_bytes} bytes): bytes {lo}..{hi} read {len(data)}"
            )
        with self._lock:
            self.fetched_bytes += len(data)
            self.requests += 1
        return data

    @staticmethod
    def _write(fd: int, data: bytes, at: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
