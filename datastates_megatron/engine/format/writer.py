"""Positional writes of one rank file: ``pwrite`` at precomputed offsets, O_DIRECT when possible, fsync.

A memory-backed (tmpfs) file can instead be written through a kept shared mapping
(:mod:`.mapped_files`), hashing and copying each region in one pass (:meth:`RankFileWriter.copy_hashed`).

Thread-safe: several flush threads may ``write`` / ``copy_hashed`` disjoint ranges of the same file
concurrently.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np

from . import hashing
from ..errors import FlushError
from .file_format import HEADER_BYTES, Header
from ..fs import fork_close
from ..fs.mapped_files import MappedFiles
from ..fs.page_cache import memory_backed
from ..fs.safe_io import open_for_write, reopen_same

__all__ = ["ALIGN", "RankFileWriter", "pwrite_direct", "reuse_limit", "tail_offset"]

log = logging.getLogger(__name__)
ALIGN = 4096  # O_DIRECT: offsets, lengths and the source address in multiples of this


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view = view[n:]
        offset += n


def pwrite_direct(fd: int, data, offset: int, path: str) -> int:
    """``pwrite`` ``data`` at ``offset`` through ``fd`` (opened with O_DIRECT; the address, offset
    and length 4 KiB-aligned).  Returns the bytes written: fewer than ``len(data)`` when the file
    system refused O_DIRECT (EINVAL), at once or midway -- the caller writes the rest buffered.
    Partial writes (a single ``pwrite`` moves at most 2 GiB - 4 KiB on Linux) are continued."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("%s: O_DIRECT write refused (%s); writing the rest buffered", path, e)
            break
        if n <= 0:
            break
        done += n
    return done


def reuse_limit(data_end: int) -> int:
    """The largest existing file a save whose data ends at ``data_end`` overwrites in place: since a
    reused file is never made smaller (a process that has it mapped would die of SIGBUS on the
    pages cut off), at most 1/8 + 4 MiB of its size is padding."""
    return data_end + data_end // 8 + (4 << 20)


def tail_offset(data_end_aligned: int, tail_bytes: int, reused_bytes: int) -> int:
    """Where the index and objects of a file go: right after its data, or later, so that the file
    ends no earlier than the ``reused_bytes`` of the recycled file it overwrites (the gap is the old
    bytes, covered by no checksum and read by nobody: the header gives every section's offset)."""
    return max(data_end_aligned, reused_bytes - tail_bytes)


class RankFileWriter:
    """Writes one rank file.  ``direct``: True (required), False (never) or "auto" (try, fall back).

    ``mapped_files`` / ``data_end``: when the file is memory-backed, its first ``data_end`` bytes
    are taken from that pool as ``mapping`` (None otherwise, or when the pool cannot map it)."""

    def __init__(
        self,
        path: str,
        direct: bool | str = "auto",
        mapped_files: MappedFiles | None = None,
        data_end: int = 0,
        memory_fd: int | None = None,
        mirror_fd: int | None = None,
    ) -> None:
        self.path = path
        self._mirror = None
        self._mirror_failed = False
        self._mirror_lock = threading.Lock()
        self._keep_mapping = memory_fd is None  # a memory file is never written again
        if memory_fd is not None:  # a nameless memory file of the caller's (memfd): nothing to open or reuse
            self._fd, self.reused_bytes, direct = os.dup(memory_fd), 0, False
        else:
            self._open_named(path, data_end)
        self._direct_fd = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = reopen_same(path, self._fd, os.O_WRONLY | os.O_DIRECT)
            except OSError as e:
                if direct is True:
                    os.close(self._fd)
                    raise FlushError(f"{path}: O_DIRECT is not supported here: {e}") from e
        elif direct is True:
            os.close(self._fd)
            raise FlushError(f"{path}: O_DIRECT is not available on this platform")
        self.memory_backed = memory_backed(self._fd)  # tmpfs/ramfs: see EngineOptions.source_writes
        self.mapping: np.ndarray | None = None
        self._pool = None
        if mapped_files is not None and self.memory_backed and data_end > HEADER_BYTES:
            try:
                self.mapping = mapped_files.acquire(self._fd, data_end)
                self._pool = mapped_files
            except OSError as e:
                log.warning("%s: not mapped (%s); writing it with pwrite", path, e)
        # ``mirror_fd``: a memory file (memfd) that receives every byte written here, at the same
        # offsets: the rank's host copy (:mod:`..tiers.host_copy`)
        if mirror_fd is not None:
            try:
                self._mirror = fork_close.opened(os.dup(mirror_fd))
            except OSError as e:  # the file is written without its copy (an empty copy is never kept)
                log.warning("%s: no host copy (%s)", path, e)

    def _open_named(self, path: str, data_end: int) -> None:
        # no O_TRUNC: ``path`` may be a recycled rank file, overwritten in place (its blocks/pages
        # reused); its old header is zeroed at once.  Read-write: a shared writable mapping needs it.
        # Never through a symlink, only a regular file (:mod:`.safe_io`): a link planted at this
        # name must not redirect the write.  A file found here is reused only when it has no other
        # hard link (a ``cp -al`` backup would get our bytes) and is not much larger than this save
        # (it is never truncated smaller: ``reused_bytes``); else its name is unlinked -- whoever
        # holds it keeps its bytes -- and a new file is made.
        self._fd = open_for_write(path)
        self.reused_bytes = 0
        try:
            st = os.fstat(self._fd)
            if st.st_nlink != 1 or st.st_size > reuse_limit(data_end):  # an empty linked file too
                os.close(self._fd)
                self._fd = None
                os.unlink(path)
                self._fd = open_for_write(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            elif st.st_size:
                self.reused_bytes = st.st_size
                _pwrite_all(self._fd, bytes(HEADER_BYTES), 0)
        except OSError:
            if self._fd is not None:
                os.close(self._fd)
            raise

    def write(self, data: np.ndarray, offset: int) -> None:
        """Write ``data`` (uint8) at ``offset``; O_DIRECT when address, offset and length are 4 KiB-aligned."""
        fd = self._direct_fd
        aligned = fd is not None and offset % ALIGN == 0 and data.nbytes % ALIGN == 0 and data.ctypes.data % ALIGN == 0
        done = pwrite_direct(fd, data, offset, self.path) if aligned else 0
        if aligned and done < data.nbytes:  # refused: this file system takes buffered writes only
            self._close_direct()
        if done < data.nbytes:
            _pwrite_all(self._fd, data[done:], offset + done)
        self._mirror_write(data, offset)

    def _mirror_write(self, data, offset: int) -> None:
        mirror = self._mirror  # closed only by close(), after every flush thread's write returned
        if mirror is None or self._mirror_failed:
            return
        try:
            _pwrite_all(mirror, data, offset)
        except OSError as e:  # the copy is dropped (emptied: its size is then not the file's), never the file
            self._drop_mirror(e)

    def _drop_mirror(self, e: OSError) -> None:
        with self._mirror_lock:  # several flush threads write one file's regions at once
            if self._mirror_failed:
                return
            self._mirror_failed = True
        log.warning("%s: its host copy failed (%s); the file is written without it", self.path, e)
        try:
            os.ftruncate(self._mirror, 0)
        except OSError:
            pass

    def copy_hashed(self, data: np.ndarray, offset: int, padded: int, spans) -> list[int]:
        """Through ``mapping``: copy each ``(off, length)`` span of ``data`` (uint8) to ``offset + off``
        while hashing it, and zero the rest of ``[offset, offset + padded)``.  Returns the spans' XXH64s."""
        out = self.mapping[offset : offset + padded]
        sums, used = [], 0
        for off, length in spans:
            if off > used:
                out[used:off] = 0
            sums.append(hashing.xxh64_copy(data[off : off + length], out[off : off + length]))
            used = off + length
        if used < padded:
            out[used:padded] = 0
        self._mirror_write(out, offset)
        return sums

    def finish(self, tail: bytes, tail_offset: int, header: Header) -> None:
        """Write index+objects (``tail``), then the header, then fsync: the file is complete and durable.
        A reused file only grows (see :func:`tail_offset`): nobody's mapping loses a page."""
        _pwrite_all(self._fd, tail, tail_offset)
        if header.file_bytes < self.reused_bytes:
            raise FlushError(
                f"{self.path}: would shrink a reused file ({self.reused_bytes} -> {header.file_bytes} bytes)"
            )
        os.ftruncate(self._fd, header.file_bytes)
        _pwrite_all(self._fd, header.pack(), 0)
        os.fsync(self._fd)
        # the same bytes (a memory file needs no fsync): the header first, so that a copy whose
        # tail write failed is never one of the file's size with the file's header
        self._mirror_write(header.pack(), 0)
        self._mirror_write(tail, tail_offset)
        if self._mirror is not None and not self._mirror_failed:
            try:
                os.ftruncate(self._mirror, header.file_bytes)
            except OSError as e:
                self._drop_mirror(e)

    def _close_direct(self) -> None:
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    def close(self) -> None:
        """Hand the mapping back and close the file descriptors; idempotent."""
        self._close_direct()
        self.mapping = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.release(self._fd, keep=self._keep_mapping)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._mirror is not None:
            fork_close.close(self._mirror)
            self._mirror = None
