"""Engine options (frozen, validated on construction)."""

from __future__ import annotations

import dataclasses

__all__ = ["EngineOptions", "LOCAL_FALLBACK_CHOICES", "RECYCLE_CHOICES"]

LOCAL_FALLBACK_CHOICES = ("all", "rank")  # who reads the persistent tier when a node lost its local copy
# where retired rank files are overwritten in place by later saves: the node-local tier only (private
# to the job), every tier (also the persistent one, when nothing outside the job reads it), or nowhere
RECYCLE_CHOICES = ("local", "all", "off")

_ALIGN = 4096


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Knobs of :class:`~datastates_megatron.engine.SnapshotEngine`.

    cache_bytes:   host staging budget shared by all in-flight versions (never exceeded).
    flush_threads: writer threads; they hash and ``pwrite`` regions in parallel.
    max_inflight:  versions pending at once; ``save`` waits (bounded by ``timeout_s``) beyond that.
    chunk_bytes:   largest region of one tensor; bigger tensors are streamed through the cache in
                   chunks (and get one checksum per chunk).  Capped at a quarter of the cache so copy
                   and flush overlap.
    small_bytes / pack_bytes: tensors of at most ``small_bytes`` are coalesced into regions of at
                   most ``pack_bytes`` (one write, one region for many tiny tensors).
    streaming:     if False, a tensor is never split; one larger than the cache is an error.
    direct_io:     True / False / "auto" (try O_DIRECT, fall back to buffered writes).
    source_writes: hash and write host-resident (CPU) tensors straight from their own memory, with no
                   copy into the cache; the gate then waits for those writes instead of for a copy.
                   "auto": only on tmpfs/ramfs, where a write is itself a memcpy (the cache copy
                   would be a second copy of the same bytes) and cannot block on a device; True:
                   always (those writes become buffered, and the gate may wait on the disk);
                   False: never.
    mapped_writes: write memory-backed (tmpfs/ramfs) rank files through shared mappings kept from one
                   save to the next (a recycled file is overwritten through the same mapping),
                   hashing and copying each region in one pass instead of hashing, then
                   ``pwrite``; see :mod:`~datastates_megatron.engine.mapped_files`.  Off: ``pwrite``.
    timeout_s:     longest wait for cache space or an in-flight slot before raising.
    pin_memory:    pin the cache (default: when CUDA is available).
    rank:          used in thread names, log lines and error messages only.
    """

    cache_bytes: int = 1 << 30
    flush_threads: int = 2
    max_inflight: int = 2
    chunk_bytes: int = 64 << 20
    small_bytes: int = 256 << 10
    pack_bytes: int = 4 << 20
    streaming: bool = True
    direct_io: bool | str = "auto"
    source_writes: bool | str = "auto"
    mapped_writes: bool = True
    timeout_s: float = 600.0
    pin_memory: bool | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        if self.cache_bytes < 4 * _ALIGN:
            raise ValueError(f"cache_bytes must be at least {4 * _ALIGN}, got {self.cache_bytes}")
        for name in ("flush_threads", "max_inflight", "chunk_bytes", "pack_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.small_bytes < 0:
            raise ValueError(f"small_bytes must be >= 0, got {self.small_bytes}")
        if self.direct_io not in (True, False, "auto"):
            raise ValueError(f"direct_io must be True, False or 'auto', got {self.direct_io!r}")
        if self.source_writes not in (True, False, "auto"):
            raise ValueError(f"source_writes must be True, False or 'auto', got {self.source_writes!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def effective_chunk_bytes(self) -> int:
        cap = max(_ALIGN, (self.cache_bytes // 4) // _ALIGN * _ALIGN)
        return max(_ALIGN, min(self.chunk_bytes, cap) // _ALIGN * _ALIGN)

    @property
    def effective_pack_bytes(self) -> int:
        return min(self.pack_bytes, self.effective_chunk_bytes)

    @property
    def effective_small_bytes(self) -> int:
        return min(self.small_bytes, self.effective_pack_bytes)
