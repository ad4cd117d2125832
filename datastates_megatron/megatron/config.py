"""User-facing options of the lazy checkpointer (one frozen dataclass, validated on construction)."""

from __future__ import annotations

import dataclasses
import os

from ..engine.options import LOCAL_FALLBACK_CHOICES, RECYCLE_CHOICES

__all__ = ["LazyCkptConfig", "ON_ERROR_CHOICES", "LOCAL_FALLBACK_CHOICES", "RECYCLE_CHOICES"]

ON_ERROR_CHOICES = ("raise", "warn")


@dataclasses.dataclass(frozen=True)
class LazyCkptConfig:
    """Options for :class:`~datastates_megatron.LazyCheckpointer`.

    save_dir:        persistent checkpoint root (Megatron's ``--save``); ``iter_XXXXXXX/`` dirs live here.
    load_dir:        where ``load()`` looks (Megatron's ``--load``); defaults to ``save_dir``.
    host_cache_gb:   byte budget of the (pinned) host cache shared by all in-flight checkpoints.
    flush_threads:   writer threads per rank (host -> storage).
    max_inflight:    checkpoints that may be pending (copying or flushing) at once; ``save`` waits beyond.
    keep_last:       keep this many newest committed checkpoints (0 = keep all).
    keep_every:      additionally keep every iteration divisible by this (0 = none).
    verify_on_load:  re-check every checksum on ``load``.
    on_error:        ``raise``: a failed save raises on the caller's thread; ``warn``: it is logged,
                     nothing is committed for that iteration and training goes on.
    streaming:       allow tensors larger than the host cache to be streamed through it in chunks.
    direct_io:       ``"auto"`` tries O_DIRECT and falls back; ``True`` requires it; ``False`` never.
    source_writes:   write host-resident (CPU) shards straight from their memory, without a copy into
                     the host cache (the pre-step gate then waits for those writes): ``"auto"`` on
                     tmpfs/ramfs (a node-local tier in ``/dev/shm``); ``True`` always; ``False`` never.
    mapped_writes:   write rank files on tmpfs/ramfs through shared mappings kept from one save to
                     the next, hashing and copying in one pass instead of hashing, then ``pwrite``
                     (docs/BENCHMARKS.md: 34-43 ms of background CPU per 112 MiB checkpoint instead
                     of 58-67 ms); ``False``: ``pwrite``.
    timeout_s:       longest wait on cache space, an in-flight slot or a peer rank before erroring.
    local_dir:       optional fast node-local tier (multi-level); ``None`` disables it.
    persist_interval: with ``local_dir``, promote every N-th local checkpoint to ``save_dir`` (and the
                     newest at ``close``, whatever N).
    local_keep_last: retention of the local tier.
    recycle_files:   where retention moves retired rank files to a pool that later saves overwrite in
                     place (saves freeing and re-allocating a checkpoint's pages/blocks each time):
                     ``"local"`` the node-local tier only (private to the job); ``"all"`` also the
                     persistent tier -- only when nothing outside the job (an eval job, the CLI)
                     reads checkpoints while training runs, since a reader of a retired checkpoint
                     would then see it overwritten; ``"off"``.
    local_fallback:  when some node lost its local copy: ``"all"`` ranks restore the persistent
                     checkpoint from the persistent tier; ``"rank"``: only the ranks without an
                     intact local copy of it read the persistent tier, the others read locally.
    """

    save_dir: str
    load_dir: str | None = None
    host_cache_gb: float = 4.0
    flush_threads: int = 2
    max_inflight: int = 2
    keep_last: int = 2
    keep_every: int = 0
    verify_on_load: bool = True
    on_error: str = "raise"
    streaming: bool = True
    direct_io: bool | str = "auto"
    source_writes: bool | str = "auto"
    mapped_writes: bool = True
    timeout_s: float = 600.0
    local_dir: str | None = None
    persist_interval: int = 1
    local_keep_last: int = 2
    local_fallback: str = "all"
    recycle_files: str = "local"

    def __post_init__(self) -> None:
        if not self.save_dir:
            raise ValueError("LazyCkptConfig.save_dir is required (Megatron's --save)")
        object.__setattr__(self, "save_dir", os.fspath(self.save_dir))
        if self.load_dir is not None:
            object.__setattr__(self, "load_dir", os.fspath(self.load_dir))
        if self.local_dir is not None:
            object.__setattr__(self, "local_dir", os.fspath(self.local_dir))
        if not self.host_cache_gb > 0:
            raise ValueError(f"host_cache_gb must be > 0, got {self.host_cache_gb}")
        for name in ("flush_threads", "max_inflight", "persist_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("keep_last", "keep_every", "local_keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {self.on_error!r}")
        if self.recycle_files not in RECYCLE_CHOICES:
            raise ValueError(f"recycle_files must be one of {RECYCLE_CHOICES}, got {self.recycle_files!r}")
        if self.local_fallback not in LOCAL_FALLBACK_CHOICES:
            raise ValueError(f"local_fallback must be one of {LOCAL_FALLBACK_CHOICES}, got {self.local_fallback!r}")
        for name in ("direct_io", "source_writes"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    @property
    def effective_load_dir(self) -> str:
        return self.load_dir or self.save_dir
