"""Engine and manager options (frozen, every rule checked once, on construction)."""

from __future__ import annotations

import dataclasses

from .errors import OptionsError

__all__ = [
    "EngineOptions",
    "ManagerOptions",
    "ON_ERROR_CHOICES",
    "LOCAL_FALLBACK_CHOICES",
    "RECYCLE_CHOICES",
    "WHEN_BEHIND_CHOICES",
]

ON_ERROR_CHOICES = ("raise", "warn")  # a failed save raises on the training thread, or is logged
LOCAL_FALLBACK_CHOICES = ("all", "rank")  # who reads the persistent tier when a node lost its local copy
# where retired rank files are overwritten in place by later saves: the node-local tier only (private
# to the job), every tier (also the persistent one, when nothing outside the job reads it), or nowhere
RECYCLE_CHOICES = ("local", "all", "off")
# a save while this rank's storage is behind (earlier checkpoints still in flight, no cache room):
# skipped and reported (training goes on), or waited for (bounded by ``timeout_s``)
WHEN_BEHIND_CHOICES = ("skip", "wait")

_ALIGN = 4096


def _fails(value, test) -> bool:
    try:
        return not test(value)
    except TypeError:  # None or a string where a number belongs
        return True


def _at_least(opts, names, low: int) -> list[tuple[str, str]]:
    return [
        (n, f"must be >= {low}, got {getattr(opts, n)}") for n in names if _fails(getattr(opts, n), lambda v: v >= low)
    ]


def _positive(opts, names) -> list[tuple[str, str]]:
    return [(n, f"must be > 0, got {getattr(opts, n)}") for n in names if _fails(getattr(opts, n), lambda v: v > 0)]


def _auto_flags(opts, names) -> list[tuple[str, str]]:
    return [
        (n, f"must be True, False or 'auto', got {getattr(opts, n)!r}")
        for n in names
        if getattr(opts, n) not in (True, False, "auto")
    ]


def _one_of(opts, name: str, choices: tuple) -> list[tuple[str, str]]:
    value = getattr(opts, name)
    ok = isinstance(value, str) and value in choices
    return [] if ok else [(name, f"must be one of {', '.join(choices)}, got {value!r}")]


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
                   ``pwrite``; see :mod:`~datastates_megatron.engine.fs.mapped_files`.  Off: ``pwrite``.
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
        problems = []
        if self.cache_bytes < 4 * _ALIGN:
            problems.append(("cache_bytes", f"must be at least {4 * _ALIGN}, got {self.cache_bytes}"))
        problems += _at_least(self, ("flush_threads", "max_inflight", "chunk_bytes", "pack_bytes"), 1)
        problems += _at_least(self, ("small_bytes",), 0)
        problems += _auto_flags(self, ("direct_io", "source_writes"))
        problems += _positive(self, ("timeout_s",))
        if problems:
            raise OptionsError("EngineOptions", problems)

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


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """Policy of :class:`~datastates_megatron.engine.manager.CheckpointManager` (retention, errors, restore,
    tiers); the engine's own knobs are :class:`EngineOptions`.

    keep_last / keep_every: keep the N newest committed checkpoints (0, the default: all, as
                   Megatron-LM keeps them), and with ``keep_last`` also every iteration divisible by
                   ``keep_every`` (0: none).
    on_error:      ``raise``: a failed save raises on the training thread; ``warn``: it is logged,
                   nothing is committed for it and the previous checkpoint stays the latest.
    when_behind:   a save while this rank cannot stage it without waiting (``max_inflight`` of its
                   checkpoints not yet committed, or no host cache room for it now): ``skip`` -- it
                   is not staged, every rank abandons that checkpoint through the commit protocol,
                   and training goes on; ``wait`` -- the save waits (back-pressure, bounded by the
                   engine's ``timeout_s``).  A ``final`` save (the end of a run) always waits.
    verify_on_load: re-check every checksum on load.
    restore_threads: reader threads of a restore.
    persist_interval / local_keep_last / local_fallback: the node-local tier's promotion interval
                   (the local checkpoints whose iteration is a multiple of it are promoted), its
                   retention (small by default: node-local storage is), and who reads the
                   persistent tier when a node lost its local copy.
    recycle_files: where retired rank files are overwritten in place by later saves (see
                   ``RECYCLE_CHOICES``).
    promote_slots / promote_mbps: at most ``promote_slots`` ranks of a node copy a rank file to the
                   persistent tier at once (0: no cap), each at most ``promote_mbps`` MB/s (0: no
                   cap) (:mod:`.promote_throttle`): a promotion never stampedes a parallel file system.
    replicas / replication_jump: each rank's node-local file is also kept by ``replicas`` partner
                   ranks, ``replication_jump`` ranks apart (:mod:`.replication`; None: 1 partner when
                   the nodes pair up, ranks per node apart; 0 partners: off).
    host_copy:     also keep each rank's newest committed file in host memory (a memfd: one more copy
                   of the rank's state, plus one per save in flight), so that an in-process restart
                   restores from it, reading nothing from storage (:mod:`.tiers.host_copy`).
                   ``"auto"`` (the Megatron-LM default, on under ``--inprocess-restart``) is off here.
    """

    keep_last: int = 0
    keep_every: int = 0
    on_error: str = "raise"
    when_behind: str = "skip"
    verify_on_load: bool = True
    restore_threads: int = 4
    persist_interval: int = 1
    local_keep_last: int = 2
    local_fallback: str = "all"
    recycle_files: str = "local"
    replicas: int | None = None
    replication_jump: int | None = None
    promote_slots: int = 2
    promote_mbps: float = 0.0
    host_copy: bool | str = False

    def __post_init__(self) -> None:
        problems = _at_least(self, ("keep_last", "keep_every", "local_keep_last", "promote_slots", "promote_mbps"), 0)
        if not problems and self.keep_every and not self.keep_last:
            problems.append(("keep_every", "needs keep_last >= 1: with keep_last=0 every checkpoint is kept anyway"))
        for name, low in (("replicas", 0), ("replication_jump", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                problems.append((name, f"must be None or an int >= {low}, got {value!r}"))
        problems += _at_least(self, ("restore_threads", "persist_interval"), 1)
        problems += _one_of(self, "on_error", ON_ERROR_CHOICES)
        problems += _one_of(self, "when_behind", WHEN_BEHIND_CHOICES)
        problems += _one_of(self, "local_fallback", LOCAL_FALLBACK_CHOICES)
        problems += _one_of(self, "recycle_files", RECYCLE_CHOICES)
        if not isinstance(self.host_copy, bool) and self.host_copy != "auto":
            problems.append(("host_copy", f"must be True, False or 'auto', got {self.host_copy!r}"))
        if problems:
            raise OptionsError("ManagerOptions", problems)
