"""Shared mappings of memory-backed (tmpfs) rank files, kept from one save to the next.

On tmpfs a ``pwrite`` is a memcpy plus per-page work in the kernel (page lookup, locking,
dirtying), and a separate hash pass reads the data again; hashing and copying in one pass into a
mapping whose pages are already there does neither (figures: docs/BENCHMARKS.md).
Mapping a file anew on every save gives the gain back (populating and tearing down the page
tables costs about as much), so a file's mapping is kept while the file lives.  The node-local tier
recycles its rank files (``recycle_files``): the next save overwrites the same inode through the
same mapping.

Safety:
* A mapping pins its file's pages even after the file is deleted, so every :meth:`acquire` first
  drops the mappings of files that no longer have a name (``st_nlink == 0``), and at most
  ``max_files`` are kept (least recently used first out).  ``close()`` drops them all.
* A store past the end of a mapped file is a SIGBUS, not an error: before a mapping is handed
  out, the file's first ``size`` bytes are allocated with ``posix_fallocate`` (which reports a full
  tmpfs as ``ENOSPC``) unless ``fstat`` already shows them allocated.  The writer only ever grows
  a file beyond what it writes through the mapping, and nothing else truncates a tier's files.
* A file is keyed by ``(st_dev, st_ino)``; the pool keeps a descriptor of each mapped file open,
  so an inode number cannot be reused while its mapping is kept.

Thread-safe: ``acquire``, ``release`` and ``close`` take one lock.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading

import numpy as np

__all__ = ["MappedFiles"]

log = logging.getLogger(__name__)


class _Mapped:
    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(
            fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.in_use = False

    def drop(self) -> None:
        """Unmap (once no view of it is left) and close the descriptor."""
        self.view = None
        try:
            self.map.close()
        except BufferError:  # a writer still holds a view: unmapped when that view goes
            pass
        os.close(self.fd)


def _allocated(st: os.stat_result, size: int) -> bool:
    return st.st_size >= size and st.st_blocks * 512 >= st.st_size  # no holes in the first size bytes


class MappedFiles:
    """Pool of shared, writable mappings of memory-backed files, one per inode (see the module doc)."""

    def __init__(self, max_files: int = 8) -> None:
        if max_files < 1:
            raise ValueError(f"max_files must be >= 1, got {max_files}")
        self.max_files = max_files
        self._files: collections.OrderedDict[tuple[int, int], _Mapped] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.reused = 0  # acquisitions served by a kept mapping
        self.mapped = 0  # mappings made

    def acquire(self, fd: int, size: int) -> np.ndarray:
        """A writable uint8 view of the first ``size`` bytes of the file open as ``fd`` (read-write),
        allocated.  Raises ``OSError`` (``ENOSPC`` on a full tmpfs) when it cannot be had; the
        caller then writes with ``pwrite``.  Hand it back with :meth:`release`."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            if self._closed:
                raise OSError("the mapped-file pool is closed")
            self._drop_unlinked()
            kept = self._files.get(key)
            if kept is not None and kept.in_use:
                raise OSError(f"inode {key} is already being written through its mapping")
            if kept is not None and kept.size < size:  # grown: map it again at the new size
                self._files.pop(key).drop()
                kept = None
            if not _allocated(st, size):  # a new file, or shrunk or punched since it was mapped
                os.posix_fallocate(fd, 0, size)
            if kept is None:
                kept = self._map(fd, key, size)
            else:
                self._files.move_to_end(key)
                self.reused += 1
            kept.in_use = True
            return kept.view[:size]

    def _map(self, fd: int, key: tuple[int, int], size: int) -> _Mapped:
        own = os.dup(fd)
        try:
            kept = _Mapped(own, size)
        except BaseException:
            os.close(own)
            raise
        self._files[key] = kept
        self.mapped += 1
        while len(self._files) > self.max_files:
            oldest = next((k for k, m in self._files.items() if not m.in_use), None)
            if oldest is None:
                break
            self._files.pop(oldest).drop()
        return kept

    def release(self, fd: int, keep: bool = True) -> None:
        """The writer of the file open as ``fd`` is done with its view.  ``keep=False``: the file is
        never written again (a memfd): its mapping is dropped now, not pinned until the next acquire."""
        st = os.fstat(fd)
        with self._lock:
            key = (st.st_dev, st.st_ino)
            kept = self._files.get(key)
            if kept is not None:
                kept.in_use = False
                if not keep:
                    self._files.pop(key).drop()

    def _drop_unlinked(self) -> None:
        for key, kept in list(self._files.items()):
            if not kept.in_use and os.fstat(kept.fd).st_nlink == 0:
                self._files.pop(key).drop()

    def close(self) -> None:
        """Drop every mapping; idempotent.  Later :meth:`acquire` calls raise ``OSError``."""
        with self._lock:
            self._closed = True
            while self._files:
                self._files.popitem()[1].drop()

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)
