"""Partial reads: element ranges of tensors in the rank files of one committed checkpoint, checksummed.

A reader opens rank files on demand (each checked against the manifest, as a full restore does), maps
them read-only, and hands out zero-copy views of element ranges.  Before a range is used, every
checksum chunk it touches is verified (a chunk is ``header.chunk_bytes`` of one tensor; a read is
therefore rounded out to whole chunks for verification, and nothing else of the file is touched).
:meth:`PartialReader.copy` verifies a whole plan first and only then copies, in parallel, so a
corrupt checkpoint leaves the destination tensors untouched.

Thread-safety: every method may be called from several threads; ``close`` must not race reads.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time

import torch

from .errors import CorruptCheckpointError, LayoutMismatchError
from .file_format import RankFile, TensorEntry
from .manifest import Manifest
from .restore import open_rank

__all__ = ["ElementRange", "ReadStats", "PartialReader"]


@dataclasses.dataclass(frozen=True)
class ElementRange:
    """Elements ``[start, start + count)`` of the flattened tensor ``tensor`` in rank ``rank``'s file."""

    rank: int
    tensor: str
    start: int
    count: int


@dataclasses.dataclass
class ReadStats:
    """What a :meth:`PartialReader.copy` did: bytes copied, bytes hashed (whole chunks), seconds."""

    bytes: int = 0
    verified_bytes: int = 0
    verify_s: float = 0.0
    copy_s: float = 0.0


class PartialReader:
    """Reads element ranges from the rank files of checkpoint ``ckpt`` (its parsed ``manifest``).

    ``verify``: check chunk checksums before data is used (each chunk once per reader).  A context
    manager; ``close()`` is idempotent.  Thread-safe (see the module docstring)."""

    def __init__(self, ckpt: str, manifest: Manifest, *, verify: bool = True, threads: int = 4, rank: int = 0) -> None:
        self.ckpt = ckpt
        self.manifest = manifest
        self.verify_chunks = verify
        self.threads = max(1, int(threads))
        self.rank = rank  # the reading rank, for messages and thread names
        self._lock = threading.Lock()
        self._files: dict[int, RankFile] = {}
        self._verified: set[tuple[int, str, int]] = set()
        self._closed = False

    # ------------------------------------------------------------------ files
    def rank_file(self, rank: int) -> RankFile:
        """The (validated) file of ``rank``, opened on first use."""
        if not 0 <= rank < self.manifest.world_size:
            raise LayoutMismatchError(
                f"{self.ckpt}: no rank {rank} in a checkpoint of world size {self.manifest.world_size}"
            )
        with self._lock:
            if self._closed:
                raise CorruptCheckpointError(f"{self.ckpt}: reader is closed")
            rf = self._files.get(rank)
            if rf is None:
                rf = self._files[rank] = open_rank(self.ckpt, self.manifest, rank)
            return rf

    def objects(self, rank: int):
        """The non-tensor objects rank ``rank`` saved (``objects`` section, as passed to save)."""
        return self.rank_file(rank).objects["objects"]

    def tensor_meta(self, rank: int) -> dict:
        """``{tensor name: meta}`` as registered by rank ``rank``."""
        meta = self.rank_file(rank).objects.get("tensor_meta")
        return meta if isinstance(meta, dict) else {}

    def entry(self, rank: int, name: str) -> TensorEntry:
        rf = self.rank_file(rank)
        try:
            return rf.entries[name]
        except KeyError as e:
            raise CorruptCheckpointError(f"{rf.path}: rank {rank} file has no tensor {name!r}") from e

    # ------------------------------------------------------------------ ranges
    def _bytes_of(self, r: ElementRange) -> tuple[RankFile, TensorEntry, int, int]:
        rf = self.rank_file(r.rank)
        e = self.entry(r.rank, r.tensor)
        size = e.dtype.itemsize
        numel = e.nbytes // size if size else 0
        if r.start < 0 or r.count < 0 or r.start + r.count > numel:
            raise LayoutMismatchError(
                f"{rf.path}: rank {r.rank} tensor {r.tensor!r} has {numel} elements; asked for [{r.start}, {r.start + r.count})"
            )
        return rf, e, r.start * size, (r.start + r.count) * size

    def chunks_of(self, r: ElementRange) -> list[tuple[int, str, int]]:
        """The ``(rank, tensor, chunk)`` checksum chunks covering ``r``."""
        rf, e, lo, hi = self._bytes_of(r)
        if hi <= lo:
            return []
        cb = rf.header.chunk_bytes
        return [(r.rank, r.tensor, c) for c in range(lo // cb, (hi - 1) // cb + 1)]

    def _verify_chunk(self, key: tuple[int, str, int]) -> tuple[str | None, int]:
        rank, name, c = key
        rf = self.rank_file(rank)
        e = rf.entries[name]
        try:
            n = rf.verify_chunk(e, c)
        except CorruptCheckpointError as err:
            return f"rank {rank}: {err}", 0
        with self._lock:
            self._verified.add(key)
        return None, n

    def verify(self, ranges, pool: cf.Executor | None = None) -> int:
        """Verify every chunk covering ``ranges`` (not yet verified by this reader), in parallel;
        raises :class:`CorruptCheckpointError` naming every bad chunk.  Returns the bytes hashed."""
        if not self.verify_chunks:
            return 0
        keys = sorted({k for r in ranges for k in self.chunks_of(r)})
        with self._lock:
            keys = [k for k in keys if k not in self._verified]
        if not keys:
            return 0
        if pool is None:
            with cf.ThreadPoolExecutor(self.threads, thread_name_prefix=f"dsm-pread-r{self.rank}") as own:
                results = list(own.map(self._verify_chunk, keys))
        else:
            results = list(pool.map(self._verify_chunk, keys))
        bad = [msg for msg, _ in results if msg]
        if bad:
            raise CorruptCheckpointError(
                f"rank {self.rank}: {len(bad)} corrupt chunk(s) in {self.ckpt}: " + "; ".join(bad[:5])
            )
        return sum(n for _, n in results)

    def read(self, r: ElementRange) -> torch.Tensor:
        """A 1-D zero-copy view of ``r`` (copy-on-write mapping: writing it never touches the file),
        after verifying the chunks it touches."""
        self.verify([r])
        return self._view(r)

    def _view(self, r: ElementRange) -> torch.Tensor:
        rf, e, lo, hi = self._bytes_of(r)
        if hi == lo:
            return torch.empty(0, dtype=e.dtype)
        raw = rf.raw(e)[lo:hi]
        return torch.from_numpy(raw).view(e.dtype)

    def copy(self, plan: list[tuple[ElementRange, torch.Tensor]]) -> ReadStats:
        """Copy each source range into its destination (a tensor of ``count`` elements, any shape,
        written in place).  Every chunk is verified before the first destination is written."""
        stats = ReadStats()
        for r, dst in plan:
            if dst.numel() != r.count:
                raise LayoutMismatchError(f"rank {self.rank}: {r} goes to a destination of {dst.numel()} elements")
            if self.entry(r.rank, r.tensor).dtype != dst.dtype:
                raise LayoutMismatchError(
                    f"rank {self.rank}: {r} holds {self.entry(r.rank, r.tensor).dtype}, destination is {dst.dtype}"
                )
        with cf.ThreadPoolExecutor(self.threads, thread_name_prefix=f"dsm-pread-r{self.rank}") as pool:
            t0 = time.perf_counter()
            stats.verified_bytes = self.verify([r for r, _ in plan], pool)
            stats.verify_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            stats.bytes = sum(pool.map(self._copy_one, plan))
            stats.copy_s = time.perf_counter() - t0
        return stats

    def _copy_one(self, item: tuple[ElementRange, torch.Tensor]) -> int:
        r, dst = item
        src = self._view(r)
        with torch.no_grad():
            dst.copy_(src.view(dst.shape))
        return src.numel() * src.element_size()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            self._closed = True
            files, self._files = list(self._files.values()), {}
        for rf in files:
            rf.close()

    def __enter__(self) -> "PartialReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
