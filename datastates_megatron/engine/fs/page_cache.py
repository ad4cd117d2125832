"""Page-cache residency of checkpoint files, and reading a cold file in before it is restored.

A rank file is restored through ``mmap``: verify threads hash it and copy threads read it.  Cold,
its pages then arrive by page faults in readahead-window units, about half the speed of one plain
sequential read on the development machine (docs/BENCHMARKS.md).  Reading the file first in a few
contiguous stripes of large ``preadv`` calls, one per thread, fills the page cache at the device's
speed, after which hashing and copying run from memory.  A file that is already resident (a tmpfs
tier, a checkpoint just written) is left alone: the read would only cost a copy; so is one too big
for the memory available, whose first pages would be evicted again before they are verified.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading

import numpy as np

from ..errors import READ_ERRNOS, StorageReadError

__all__ = ["memory_backed", "resident_fraction", "resident_fraction_of", "read_range", "warm_file"]

log = logging.getLogger(__name__)
try:
    _libc = ctypes.CDLL(None, use_errno=True)  # the C library this process already has loaded
except OSError:  # pragma: no cover - no C library to load (Windows)
    _libc = None
_MEMORY_FS_MAGIC = {0x01021994, 0x858458F6}  # tmpfs, ramfs (linux/magic.h)

_BLOCK = 8 << 20  # bytes per preadv
_RESIDENT_ENOUGH = 0.9  # skip the read-ahead above this fraction of resident pages
_scratch = threading.local()


def memory_backed(fd: int) -> bool:
    """Whether ``fd`` lives on tmpfs/ramfs: every page is resident and every write is a memcpy into
    page-cache pages (O_DIRECT or not).  Linux ``fstatfs``; False elsewhere or when the call fails."""
    if _libc is None or not sys.platform.startswith("linux"):  # struct statfs below is Linux's
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _libc.fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FS_MAGIC


def resident_fraction(path: str) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore``), or None when it cannot be asked."""
    try:
        with open(path, "rb") as f:
            return resident_fraction_of(f.fileno(), path)
    except OSError:
        return None


def resident_fraction_of(fd: int, path: str) -> float | None:
    """:func:`resident_fraction` of the open file ``fd`` (named ``path`` for the permission check).

    None also for a file this process neither owns nor may write: Linux then reports every page as
    resident (``can_do_mincore``), which would hide a cold file."""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() and not os.access(path, os.W_OK):
            return None
        size = st.st_size
        if size == 0:
            return 0.0
        if _libc is None:
            return None
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private mapping: nothing is read in
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            finally:
                del anchor
        finally:
            mm.close()
    except (OSError, AttributeError, ValueError, TypeError, BufferError):
        return None
    if rc != 0:
        return None
    return float((np.frombuffer(vec, np.uint8) & 1).sum()) / pages


def read_range(fd: int, start: int, nbytes: int, tick=None) -> int:
    """Read ``[start, start + nbytes)`` of ``fd`` into a per-thread scratch buffer (and drop it): the
    point is the page cache it fills, in requests large enough for the device.  Returns the bytes
    read (fewer at the end of the file).  ``tick()``: called after each read returned (progress,
    for a caller's stall deadline)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(_BLOCK))
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [buf[: min(_BLOCK, nbytes - done)]], start + done)
        if n <= 0:
            break  # end of file
        done += n
        if tick is not None:
            tick()
    return done


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def warm_file(path: str, fd: int, pool: cf.Executor, stripes: int, tick=None) -> bool:
    """Read the open file ``fd`` (named ``path``) into the page cache in ``stripes`` contiguous parts
    on ``pool``, unless most of it is resident already or it would not fit in available memory.

    Returns whether it read; ``tick`` as :func:`read_range`'s.  Raises only
    :class:`.errors.StorageReadError` when the storage fails a read (``READ_ERRNOS``): the same page
    read through the file's mapping would be a SIGBUS.  Otherwise never raises: it only speeds up what the caller reads anyway, so any
    failure leaves the reads to page faults."""
    try:
        size = os.fstat(fd).st_size
        frac = resident_fraction_of(fd, path)
        if size == 0 or (frac is not None and frac >= _RESIDENT_ENOUGH):
            return False
        available = _memory_available()
        if available is not None and size > available // 2:
            return False
        part = -(-size // max(1, stripes))
        futures = [
            pool.submit(read_range, fd, s, min(part, size - s), *((tick,) if tick else ()))
            for s in range(0, size, part)
        ]
        cf.wait(futures)  # every stripe is over before the caller may close fd
        for fut in futures:
            fut.result()
    except OSError as e:
        if e.errno in READ_ERRNOS:  # the storage failed the read: through the mapping it is a SIGBUS
            name = errno.errorcode.get(e.errno, str(e.errno))
            raise StorageReadError(
                f"{path}: read failed: {name} ({e.strerror or os.strerror(e.errno)})", e.errno
            ) from e
        log.warning("%s: read-ahead failed (%s); reading through page faults", path, e)
        return False
    except Exception as e:  # noqa: BLE001 - an optimisation: report, never fail the restore
        log.warning("%s: read-ahead failed (%s); reading through page faults", path, e)
        return False
    return True
