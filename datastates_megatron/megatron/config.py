"""User-facing options of the lazy checkpointer (one frozen dataclass, validated on construction).

The config is the only place its options are checked: its own fields (paths, cache size) here,
the rest by the engine's :class:`EngineOptions` / :class:`ManagerOptions` it builds, whose
problems are reported under the config's names.
"""

from __future__ import annotations

import dataclasses
import os

from ..engine.errors import OptionsError
from ..engine.options import (
    LOCAL_FALLBACK_CHOICES,
    ON_ERROR_CHOICES,
    RECYCLE_CHOICES,
    EngineOptions,
    ManagerOptions,
)

__all__ = ["LazyCkptConfig", "OptionsError", "ON_ERROR_CHOICES", "LOCAL_FALLBACK_CHOICES", "RECYCLE_CHOICES"]


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
                     (less background CPU: docs/BENCHMARKS.md); ``False``: ``pwrite``.
    timeout_s:       longest wait on cache space, an in-flight slot or a peer rank before erroring.
    local_dir:       optional fast node-local tier (multi-level); ``None`` disables it.
    persist_interval: with ``local_dir``, promote every N-th local checkpoint to ``save_dir`` (and the
                     newest at ``close``, whatever N).
    local_keep_last: retention of the local tier.
    promote_slots / promote_mbps: with ``local_dir``, at most N ranks of a node copy to ``save_dir``
                     at once (0: no cap), each at most M MB/s (0: no cap).
    recycle_files:   where retention moves retired rank files to a pool that later saves overwrite in
                     place (saves freeing and re-allocating a checkpoint's pages/blocks each time):
                     ``"local"`` the node-local tier only (private to the job); ``"all"`` also the
                     persistent tier -- only when nothing outside the job (an eval job, the CLI)
                     reads checkpoints while training runs, since a reader of a retired checkpoint
                     would then see it overwritten; ``"off"``.
    local_fallback:  when some node lost its local copy: ``"all"`` ranks restore the persistent
                     checkpoint from the persistent tier; ``"rank"``: only the ranks without an
                     intact local copy of it read the persistent tier, the others read locally.
    replicas:        with ``local_dir``, how many partner ranks (on other nodes) keep a copy of each
                     rank's local file, so that a lost node restores from them (None: 1 when the
                     nodes pair up; 0: off).  ``replication_jump``: ranks between partners (None:
                     ranks per node).  Megatron-LM's ``--replication-factor F --replication-jump J``
                     mean ``replicas = F - 1`` and the same jump.

    Invalid values raise :class:`OptionsError` (a ``ValueError``) listing every problem, each under
    its field name; :meth:`engine_options` and :meth:`manager_options` build what the engine takes.
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
    replicas: int | None = None
    replication_jump: int | None = None
    promote_slots: int = 2
    promote_mbps: float = 0.0

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        if not self.save_dir:
            problems.append(("save_dir", "is required (Megatron's --save)"))
        for name in ("save_dir", "load_dir", "local_dir"):
            if getattr(self, name):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if not isinstance(self.host_cache_gb, (int, float)) or not self.host_cache_gb > 0:
            problems.append(("host_cache_gb", f"must be > 0, got {self.host_cache_gb}"))
        if self.local_dir and self.save_dir and os.path.realpath(self.local_dir) == os.path.realpath(self.save_dir):
            problems.append(("local_dir", f"and save_dir must differ, both are {self.save_dir!r}"))
        for build in (self.engine_options, self.manager_options):
            try:
                build()
            except OptionsError as e:
                problems += [_config_name(field, text) for field, text in e.problems]
            except TypeError:  # host_cache_gb is not a number: reported above
                pass
        firsts = {}
        for field, text in problems:  # one problem per field (host_cache_gb = 0 fails twice)
            firsts.setdefault(field, text)
        if firsts:
            raise OptionsError("LazyCkptConfig", list(firsts.items()))

    def engine_options(self) -> EngineOptions:
        """The :class:`EngineOptions` of the snapshot engine (cache size and writer knobs)."""
        return EngineOptions(cache_bytes=self.host_cache_bytes, **_fields_for(self, EngineOptions))

    def manager_options(self) -> ManagerOptions:
        """The :class:`ManagerOptions` of the checkpoint manager (retention, errors, tiers)."""
        return ManagerOptions(**_fields_for(self, ManagerOptions))

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    @property
    def effective_load_dir(self) -> str:
        return self.load_dir or self.save_dir


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(LazyCkptConfig))


def _fields_for(config: LazyCkptConfig, options_type) -> dict:
    """The config fields ``options_type`` has under the same name (the others keep its defaults)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(options_type) if f.name in _CONFIG_FIELDS}


def _config_name(field: str, text: str) -> tuple[str, str]:
    """An engine problem under the config's name for it (the cache is sized by ``host_cache_gb``)."""
    if field == "cache_bytes":
        return "host_cache_gb", f"is too small: the cache's bytes {text}"
    return field, text
