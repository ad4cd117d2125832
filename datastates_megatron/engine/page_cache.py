"""Page-cache residency of checkpoint files, and reading a cold file in before it is restored.

A rank file is restored through ``mmap``: verify threads hash it and copy threads read it.  Cold,
its pages then arrive by page faults in readahead-window units, about half the speed of one plain
sequential read on the development machine (docs/BENCHMARKS.md).  Reading the file first in a few
contiguous stripes of large ``preadv`` calls, one per thread, fills the page cache at the device's
speed, after which hashing and copying run from memory.  A file that is already resident (a tmpfs
tier, a checkpoint just written) is left alone: the read would only cost a copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import mmap
import os
import threading

import numpy as np

__all__ = ["resident_fraction", "read_range", "warm_file"]

_BLOCK = 8 << 20  # bytes per preadv
_RESIDENT_ENOUGH = 0.9  # skip the read-ahead above this fraction of resident pages
_scratch = threading.local()


def resident_fraction(path: str) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore``), or None when it cannot be asked."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private mapping: nothing is read in
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            finally:
                del anchor
                mm.close()
    except (OSError, AttributeError, ValueError, TypeError):
        return None
    if rc != 0:
        return None
    return float((np.frombuffer(vec, np.uint8) & 1).sum()) / pages


def read_range(fd: int, start: int, nbytes: int) -> None:
    """Read ``[start, start + nbytes)`` of ``fd`` into a per-thread scratch buffer (and drop it): the
    point is the page cache it fills, in requests large enough for the device."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(_BLOCK))
    end = start + nbytes
    while start < end:
        n = os.preadv(fd, [buf[: min(_BLOCK, end - start)]], start)
        if n <= 0:
            return  # end of file
        start += n


def warm_file(path: str, pool: cf.Executor, stripes: int) -> bool:
    """Read ``path`` into the page cache in ``stripes`` contiguous parts on ``pool`` unless most of it
    is resident already; returns whether it read.  Best effort: an error leaves reads to page faults."""
    frac = resident_fraction(path)
    if frac is not None and frac >= _RESIDENT_ENOUGH:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        part = -(-size // max(1, stripes))
        starts = range(0, size, max(part, 1))
        list(pool.map(lambda s: read_range(fd, s, min(part, size - s)), starts))
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
