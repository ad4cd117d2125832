"""User-facing options of the lazy checkpointer (one frozen dataclass, validated on construction).

The config is the only place its options are checked: its own fields (paths, cache size) here,
the rest by the engine's :class:`EngineOptions` / :class:`ManagerOptions` it builds, whose
problems are reported under the config's names.
"""

from __future__ import annotations

import dataclasses
import os

from ...engine.errors import OptionsError
from .flag_spec import option, options_of
from ...engine.options import (
    LOCAL_FALLBACK_CHOICES,
    ON_ERROR_CHOICES,
    RECYCLE_CHOICES,
    WHEN_BEHIND_CHOICES,
    EngineOptions,
    ManagerOptions,
)

__all__ = ["LazyCkptConfig", "OptionsError", "ON_ERROR_CHOICES", "LOCAL_FALLBACK_CHOICES", "RECYCLE_CHOICES"]


@dataclasses.dataclass(frozen=True)
class LazyCkptConfig:
    """Options for :class:`~datastates_megatron.LazyCheckpointer`.

    Each field is declared once, with its flag and its meaning (:func:`.flag_spec.option`): the
    ``--lazy-ckpt*`` flags (:mod:`..megatron_lm.args`) and the flag table of docs/megatron.md
    (:mod:`..megatron_lm.flag_table`) are generated from these declarations; ``python -m
    datastates_megatron.megatron.megatron_lm.flag_table`` prints that table.  ``save_dir`` is required.

    Invalid values raise :class:`OptionsError` (a ``ValueError``) listing every problem, each under
    its field name; :meth:`engine_options` and :meth:`manager_options` build what the engine takes.
    Immutable: thread-safe.
    """

    save_dir: str = option(
        None, megatron="--save", help="Persistent checkpoint root (required): `iter_XXXXXXX/` directories live here."
    )
    load_dir: str | None = option(None, megatron="--load", help="Where `load()` looks; default: `save_dir`.")
    host_cache_gb: float = option(
        4.0,
        "--lazy-ckpt-host-cache-gb",
        type=float,
        metavar="GB",
        help="Host cache (pinned when CUDA is present) shared by all in-flight checkpoints of one rank, in GiB. "
        "A save waits for space beyond this budget.",
    )
    flush_threads: int = option(
        2, "--lazy-ckpt-flush-threads", type=int, metavar="N", help="Writer threads per rank (host cache to storage)."
    )
    max_inflight: int = option(
        2,
        "--lazy-ckpt-max-inflight",
        type=int,
        metavar="N",
        help="Checkpoints of a rank that may be in flight (copying, flushing, or written and waiting for the "
        "other ranks') at once. A further save is skipped, or waits: --lazy-ckpt-when-behind.",
    )
    keep_last: int = option(
        0,
        "--lazy-ckpt-keep-last",
        type=int,
        metavar="N",
        default_doc="0 (keep all)",
        help="Keep the N newest committed checkpoints under --save and delete older ones; 0 keeps every "
        "checkpoint, as Megatron-LM does.",
    )
    keep_every: int = option(
        0,
        "--lazy-ckpt-keep-every",
        type=int,
        metavar="N",
        help="With --lazy-ckpt-keep-last: also keep every checkpoint whose iteration is a multiple of N; "
        "0: none this way.",
    )
    verify_on_load: bool = option(
        True, "--lazy-ckpt-verify-on-load", kind="both", help="Re-check every checksum when loading."
    )
    allow_vocab_change: bool = option(
        False,
        "--lazy-ckpt-allow-vocab-change",
        kind="switch",
        help="Load a checkpoint of another vocabulary (in any layout): rows of the word embedding and output "
        "layer past the checkpoint's start at zero (parameter, main "
        "parameter and Adam moments), rows past this run's are not read. Without it another vocabulary is "
        "refused, and so is another vocabulary padding unless both runs record the same vocabulary.",
    )
    on_error: str = option(
        "raise",
        "--lazy-ckpt-on-error",
        choices=ON_ERROR_CHOICES,
        help="raise: a failed background save raises in the training loop at the next poll. warn: the failure "
        "is logged, that iteration is not committed, and training continues.",
    )
    when_behind: str = option(
        "skip",
        "--lazy-ckpt-when-behind",
        choices=WHEN_BEHIND_CHOICES,
        help="skip: a save that a rank cannot stage without waiting for its storage (--lazy-ckpt-max-inflight "
        "checkpoints in flight, or no host cache room) is skipped; every rank abandons that checkpoint, one "
        "warning per stall names the rank, directory and skips, and training goes on at its pace; the next "
        "checkpoints are attempted as usual. wait: the save waits for the storage (bounded by "
        "--lazy-ckpt-timeout-s). The save at the end of a run, on a signal or at --exit-interval always waits.",
    )
    streaming: bool = option(
        True,
        "--lazy-ckpt-no-streaming",
        kind="negated",
        default_doc="streaming on",
        help="Never split a tensor. Without this flag, tensors larger than the host cache are streamed through "
        "it in chunks. With it, the cache must hold the largest shard: the model's largest tensor is checked "
        "when the checkpointer starts, the exact shard sizes by the engine.",
    )
    direct_io: bool | str = option(
        "auto",
        "--lazy-ckpt-direct-io",
        kind="auto",
        help="O_DIRECT writes. auto tries O_DIRECT and falls back to buffered writes, on requires O_DIRECT, "
        "off never uses it.",
    )
    source_writes: bool | str = option(
        "auto",
        "--lazy-ckpt-source-writes",
        kind="auto",
        help="Write host-resident (CPU) shards straight from their own memory, with no copy into the host "
        "cache; the pre-step gate then waits for those writes instead of for a copy. auto: on tmpfs/ramfs "
        "only (e.g. a --lazy-ckpt-local-dir in /dev/shm), where a write is a memcpy and cannot block on a "
        "device; on: always (those writes are buffered, and the gate may wait on the disk); off: never. "
        "CUDA shards are always copied.",
    )
    mapped_writes: bool = option(
        True,
        "--lazy-ckpt-mapped-writes",
        kind="both",
        help="Write rank files on tmpfs/ramfs (e.g. a --lazy-ckpt-local-dir in /dev/shm) through shared "
        "mappings kept from one save to the next, hashing and copying in one pass instead of hashing, then "
        "pwrite (less background CPU: docs/BENCHMARKS.md); off: plain writes.",
    )
    host_copy: bool | str = option(
        "auto",
        "--lazy-ckpt-host-copy",
        kind="auto",
        help="Also keep each rank's newest committed checkpoint file in host memory (a memfd: about one more "
        "copy of the rank's checkpoint, plus one per save not committed yet), so that an in-process restart "
        "(--inprocess-restart) restores from it and reads nothing from storage. auto: on under "
        "--inprocess-restart, else off (a job restart starts new processes: the copy dies with them).",
    )
    timeout_s: float = option(
        600.0,
        "--lazy-ckpt-timeout-s",
        type=float,
        metavar="S",
        help="The longest wait for cache space, an in-flight slot or a peer rank before an error is raised.",
    )
    local_dir: str | None = option(
        None,
        "--lazy-ckpt-local-dir",
        type=str,
        metavar="DIR",
        megatron="--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR",
        help="Optional fast node-local tier (NVMe, /dev/shm). Checkpoints land here first, under "
        "DIR/run-<id>/ (the run's id, created in --save): a directory several runs share, or one an earlier "
        "job left behind, is safe; another run's checkpoints are never loaded or promoted, and deleted only "
        "once that run ended cleanly with every one in its --save (logged). {node} "
        "in DIR is replaced by the node's index (rank // LOCAL_WORLD_SIZE): give each node its own "
        "directory when several nodes run on one machine. Must differ from --save. Without it, a --save on "
        "object storage is written from memory: each rank file is held in memory until its upload is done.",
    )
    persist_interval: int = option(
        1,
        "--lazy-ckpt-persist-interval",
        type=int,
        metavar="N",
        local_tier=True,
        megatron="--save-interval S, with --non-persistent-save-interval",
        help="With --lazy-ckpt-local-dir: promote to --save the local checkpoints whose iteration is a "
        "multiple of N, so a requeued run persists the same iterations and a --lazy-ckpt-keep-every multiple "
        "of N is always persisted; the last one of a run is promoted at exit whatever N.",
    )
    local_keep_last: int = option(
        2,
        "--lazy-ckpt-local-keep-last",
        type=int,
        metavar="N",
        local_tier=True,
        help="With --lazy-ckpt-local-dir: keep the N newest local checkpoints (node-local storage is small; "
        "0 keeps all).",
    )
    local_fallback: str = option(
        "all",
        "--lazy-ckpt-local-fallback",
        choices=LOCAL_FALLBACK_CHOICES,
        local_tier=True,
        help="With --lazy-ckpt-local-dir, when some node lost its local copy (node replaced): all ranks "
        "restore the newest persistent checkpoint from --save; rank: only the ranks without an intact local "
        "copy of it (same file, size and checksums as the persistent manifest lists) read --save, the "
        "others read locally.",
    )
    recycle_files: str = option(
        "local",
        "--lazy-ckpt-recycle-files",
        choices=RECYCLE_CHOICES,
        help="Where later saves overwrite retired rank files in place instead of freeing and re-allocating "
        "them: local the node-local tier only; all also --save (only when nothing outside the job -- an eval "
        "job, the CLI -- reads checkpoints while it trains: a reader of a retired checkpoint would see its "
        "file overwritten); off.",
    )
    replicas: int | None = option(
        None,
        "--lazy-ckpt-replicas",
        type=int,
        metavar="K",
        local_tier=True,
        default_doc="1 when the nodes pair up, else 0",
        megatron="--replication --replication-factor F (K = F-1)",
        help="With --lazy-ckpt-local-dir: K partner ranks on other nodes (the same local rank, "
        "LOCAL_WORLD_SIZE ranks apart, in cliques of K+1 nodes) also keep each rank's local checkpoint, "
        "copied over a gloo group of the clique after each local commit and committed once its checksums "
        "verify; a node lost alone resumes from the newest local checkpoint, its files fetched from the "
        "partners. 0: off.",
    )
    replication_jump: int | None = option(
        None,
        megatron="--replication-jump J",
        help="Ranks between replication partners; default: the ranks per node.",
    )
    promote_slots: int = option(
        2,
        "--lazy-ckpt-promote-slots",
        type=int,
        metavar="N",
        local_tier=True,
        help="With --lazy-ckpt-local-dir: at most N ranks of a node copy rank files to --save at once (a "
        "flock on slot files in the node-local run directory; a dead holder frees its slot), so a promotion "
        "never stampedes a parallel file system; 0: no cap.",
    )
    promote_mbps: float = option(
        0.0,
        "--lazy-ckpt-promote-mbps",
        type=float,
        metavar="MB_S",
        local_tier=True,
        help="With --lazy-ckpt-local-dir: each rank's copy to --save moves at most MB_S MB/s; 0: no cap.",
    )

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
        if not self.local_dir:  # an option of the node-local tier without one would be silently ignored
            problems += [
                (o.field, "only applies to a local tier: it requires local_dir")
                for o in _LOCAL_TIER_OPTIONS
                if getattr(self, o.field) != o.default
            ]
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
        fields = _fields_for(self, ManagerOptions)
        if fields["host_copy"] == "auto":  # only Megatron-LM's args know: see megatron_lm.checkpointing
            fields["host_copy"] = False
        return ManagerOptions(**fields)

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    @property
    def effective_load_dir(self) -> str:
        return self.load_dir or self.save_dir


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(LazyCkptConfig))
_LOCAL_TIER_OPTIONS = tuple(o for o in options_of(LazyCkptConfig) if o.local_tier)


def _fields_for(config: LazyCkptConfig, options_type) -> dict:
    """The config fields ``options_type`` has under the same name (the others keep its defaults)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(options_type) if f.name in _CONFIG_FIELDS}


def _config_name(field: str, text: str) -> tuple[str, str]:
    """An engine problem under the config's name for it (the cache is sized by ``host_cache_gb``)."""
    if field == "cache_bytes":
        return "host_cache_gb", f"is too small: the cache's bytes {text}"
    return field, text
