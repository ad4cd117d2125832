"""A restore's two passes over a rank file: read and verify every chunk, then copy verified bytes.

The reader must verify every chunk before the agreement and copy only after it, so a restore
passes over the bytes twice.  It used to pass three times, the last two through a page-faulting
mapping: a read-ahead into the page cache, a hash of every chunk through the mapping, then a copy
through the mapping.  Here:

* :func:`read_and_verify` (before the agreement) reads the chunks the plan uses, in file order, in
  ``threads`` contiguous stripes of ``BLOCK``-byte ``preadv`` calls into a small per-thread buffer,
  and hashes each block while it is still in the CPU cache (:class:`.hashing.Xxh64Stream`): one pass
  over storage at its sequential speed, the hash hidden under the other stripes' reads, no faults.
  The bytes stay in the page cache.
* :func:`copy_into` (after the agreement) ``preadv``s a destination's bytes straight from the page
  cache into the live tensor: one memcpy per byte, no mapping.  A destination it cannot take (not
  a contiguous CPU tensor) is left to the caller's mapped copy.

The copy reads the file again, as the mapped copy did: the bytes verified are the file's, and the
file is committed and never written again by us (a file rewritten underneath by someone else is
outside what the checksums can catch in either design).

Thread-safety: the functions are re-entrant; each thread uses its own buffer.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import threading

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..format.hashing import Xxh64Stream

__all__ = ["BLOCK", "ChunkSpan", "read_and_verify", "copy_into"]

BLOCK = 4 << 20  # bytes per read: large for the device, small enough to hash from the CPU cache
_scratch = threading.local()


@dataclasses.dataclass(frozen=True)
class ChunkSpan:
    """Checksum chunk ``key`` = ``(rank, tensor, chunk)``: ``nbytes`` at file ``offset``."""

    key: tuple[int, str, int]
    offset: int
    nbytes: int


def _buffer() -> memoryview:
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < BLOCK:
        buf = _scratch.buf = memoryview(np.empty(BLOCK, np.uint8))
    return buf


def _read_full(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; a file shorter than its index says is corrupt."""
    done, want = 0, len(view)
    while done < want:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: ends at byte {offset + done}, expected {offset + want}")
        done += n


def _stripe(fd: int, path: str, spans: list[ChunkSpan]) -> list[int]:
    """Read and hash ``spans`` in order on this thread; their XXH64 digests."""
    buf = _buffer()
    arr = np.frombuffer(buf, np.uint8)
    digests = []
    for span in spans:
        stream = Xxh64Stream()
        done = 0
        while done < span.nbytes:
            n = min(BLOCK, span.nbytes - done)
            _read_full(fd, buf[:n], span.offset + done, path)
            stream.update(arr[:n])
            done += n
        digests.append(stream.digest())
    return digests


def _stripes(spans: list[ChunkSpan], k: int) -> list[list[ChunkSpan]]:
    """``spans`` (in file order) cut into at most ``k`` contiguous runs of about equal bytes."""
    total = sum(s.nbytes for s in spans)
    share = -(-total // max(1, k)) if total else 1
    out: list[list[ChunkSpan]] = [[]]
    filled = 0
    for s in spans:
        if filled >= share and len(out) < k:
            out.append([])
            filled = 0
        out[-1].append(s)
        filled += s.nbytes
    return [run for run in out if run]


def read_and_verify(fd: int, path: str, spans: list[ChunkSpan], pool: cf.Executor, threads: int) -> list[int]:
    """The XXH64 digest of every span of the open file ``fd`` (named ``path``), read in file order
    on ``threads`` stripes of ``pool``; in the order of ``spans``.  Raises
    :class:`CorruptCheckpointError` for a file shorter than a span, ``OSError`` for a failed read."""
    order = sorted(range(len(spans)), key=lambda i: spans[i].offset)
    runs = _stripes([spans[i] for i in order], threads)
    futures = [pool.submit(_stripe, fd, path, run) for run in runs]
    cf.wait(futures)  # every stripe is over before the caller may close fd
    digests = [d for fut in futures for d in fut.result()]
    out = [0] * len(spans)
    for i, d in zip(order, digests):
        out[i] = d
    return out


def copy_into(fd: int, offset: int, dst: torch.Tensor, path: str) -> bool:
    """Read ``dst``'s bytes from ``offset`` of ``fd`` straight into ``dst`` (one memcpy from the page
    cache).  False, untouched, when ``dst`` is not a contiguous CPU tensor."""
    if dst.device.type != "cpu" or not dst.is_contiguous():
        return False
    if dst.numel():
        flat = dst.detach().reshape(-1).view(torch.uint8).numpy()
        _read_full(fd, memoryview(flat), offset, path)
    return True
