"""CheckpointManager: one rank's snapshot engine, its tiers and their promotion, and the load path.

The manager wires the parts together and drives them; each tier owns its directory (lock, foreign
checkpoint refusal, commit, retention, recycling: :class:`.tier.Tier`), and the manager uses it
through its methods only.

It turns "save these registered tensors as iteration N" into a Megatron-style checkpoint directory
that either exists whole (committed manifest) or not at all, and loads the latest one back in place.
Works without ``torch.distributed`` (one process) and with it (any backend: commits go through the
c10d store, :mod:`.store_channel`, never a process group of their own).  Thread-safety: one
training thread calls every method; the work runs on owned threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import os
import secrets
import time
import zlib

import numpy as np
import torch

from .dist.collective import Collective
from .tiers.commit import CommitRecord, Ticket
from .errors import (
    PromotionError,
    CheckpointError,
    FlushError,
    NoCheckpointError,
    OptionsError,
    SaveDirBusyError,
    StorageReadError,
    error_class_named,
    make_error,
)
from .runtime.faults import hold_point
from .format.global_index import encode_summary
from .format.manifest import Manifest, RankRecord, read_manifest
from .names import INDEX_NAME, LONGEST_RANK_FILE_NAME, REPLICAS_DIR, RUN_SUBDIR_PREFIX, iter_dir
from .options import EngineOptions, ManagerOptions
from .load.load_plan import LoadPlanner, SameLayoutPlanner
from .load.reader import CheckpointReader, RestoreStats, open_checkpoint
from .fs.iteration_dir import prepare_iteration_dir
from .tiers.replica_strategy import clique_of, replication_plan
from .tiers.replication import Replication
from .tiers import host_copy
from .fs import fork_close
from .names import RUN_ID_NAME
from .tiers.reclaim import mark_ended, reclaim_finished_runs, unmark_ended
from .tiers.run_id import run_subdir
from .fs.safe_io import check_path_fits, make_dir, make_root
from .storage.stream import memory_file
from .storage.url import is_object_url
from .save.snapshot import SnapshotEngine
from .save.stall_report import StallReport
from .load.resolve import Resolved, resolve
from .dist.store_channel import StoreChannel, default_store
from .runtime.threads import ClosingContext, close_at_exit, forget
from .tiers.tier import (
    Survey,
    Tier,
    committed_iterations,
    committed_saves,
    latest_to_resume,
    report_other_runs,
)

__all__ = ["CheckpointManager", "LoadResult", "RestoreChoice"]

log = logging.getLogger(__name__)
# the longest path we create under a tier's root: a temp name beside a rank file in an iter_* directory
_LONGEST_NAME = os.path.join("iter_0000000000", LONGEST_RANK_FILE_NAME + ".tmp-4194304")
# ... and under a node-local root: in this run's directory, a replica held for another rank
_LONGEST_LOCAL = os.path.join(RUN_SUBDIR_PREFIX + "f" * 16, REPLICAS_DIR, "r99999", _LONGEST_NAME)


def _fetch_global_index(storage, iteration: int, d: str) -> None:
    """Copy checkpoint ``iteration``'s global index object, if it has one within the index's size
    cap, into ``d`` (the planner checks it against the manifest, and against the rank files it opens)."""
    from .format.global_index import INDEX_MAX_BYTES
    from .fs.durable import atomic_write
    from .storage.survey import iter_prefix

    info = storage.head(iter_prefix(iteration) + INDEX_NAME)
    if info is None:
        return
    try:
        body = storage.read_capped(info.key, INDEX_MAX_BYTES, "global index", info.size)
    except CheckpointError as e:  # over its cap: never fetched
        log.warning("%s; planning without it", e)
        return
    atomic_write(os.path.join(d, INDEX_NAME), body)


def _no_check(manifest, ckpt) -> bool:
    """Resolve without a layout check: the load plan checks what it needs (``False``: no reshard)."""
    return False


HOST_MEMORY = "host memory"  # RestoreChoice.root and LoadResult.root of a restore from a host copy
RESTORE_CANDIDATES = 3  # checkpoints a restore tries when the storage fails its reads (the chosen, then older)
_SLOTS = 8  # restore candidates each rank sends (its newest local saves)
_DECIDE_FIELDS = ("n", *(f"{k}{i}" for i in range(_SLOTS) for k in ("it", "tok", "seq", "ms")))


def _offer(saves: dict) -> dict:
    """This rank's record for rank 0's restore decision: its ``_SLOTS`` newest local saves (by
    commit time), ``saves`` being ``{iteration: (token, seq, commit ms)}`` -- one fixed-size record."""
    newest = sorted(saves, key=lambda it: saves[it][2])[-_SLOTS:]
    record = {"n": len(newest)}
    for i in range(_SLOTS):
        it = newest[i] if i < len(newest) else 0
        token, seq, ms = saves[it] if i < len(newest) else (0, 0, 0)
        record.update({f"it{i}": it, f"tok{i}": token, f"seq{i}": seq, f"ms{i}": ms})
    return record


def _newest_common(cols: dict, iteration: int | None) -> dict:
    """Rank 0: ``{"local": [iteration, token, seq]}`` of the newest commit (by rank 0's commit time)
    every rank listed from the same save -- of ``iteration`` when one is asked for -- or ``None``.
    O(N * _SLOTS)."""
    n = cols["n"]
    common = None
    for r in range(len(n)):
        mine = {(int(cols[f"it{i}"][r]), int(cols[f"tok{i}"][r]), int(cols[f"seq{i}"][r])) for i in range(int(n[r]))}
        common = mine if common is None else common & mine
        if not common:
            return {"local": None}
    order = {(int(cols[f"it{i}"][0]), int(cols[f"tok{i}"][0]), int(cols[f"seq{i}"][0])): int(cols[f"ms{i}"][0])
             for i in range(int(n[0]))}  # fmt: skip
    if iteration is not None:
        common = {c for c in common if c[0] == iteration}
    best = max(common, key=lambda c: (order[c], c[0]), default=None)
    return {"local": list(best) if best is not None else None}


@dataclasses.dataclass(frozen=True)
class _Restorable:
    saves: dict  # iteration -> (run token as an int, save sequence, commit time in ms)
    how: dict  # iteration -> "local" (this node's copy) or "replica" (a clique member holds it)
    table: dict  # the clique's replica table (:meth:`.replication.Replication.holdings`)


@dataclasses.dataclass(frozen=True)
class RestoreChoice:
    """The one restore decision (:meth:`CheckpointManager.choose`), as this rank needs it; what
    :meth:`CheckpointManager.load` consumes.  Made on rank 0; ``tier``, ``iteration``, ``view``'s
    header and ``reshard`` are the same on every rank, ``source``/``root``/``save`` are this rank's.

    ``tier``: where the job restores from, ``"local"`` (each rank's host copy, node copy or a
    replica) or ``"persistent"`` (``shared``).  ``source``: where this rank's state comes
    from -- ``"host"`` (its host copy, in memory: :mod:`.tiers.host_copy`), ``"local"`` (its node's
    copy), ``"replica"`` (fetched from the clique member holding it at load) or ``"persistent"``.
    ``root``: the tier directory this rank reads (:data:`HOST_MEMORY` for a host copy).  ``view``: the
    checkpoint ``iteration`` of the shared tier (``shared``: the load directory), its manifest's
    header and this rank's record, read by rank 0 alone; ``None`` when that tier does not hold it.
    ``reshard``: the caller's layout check of that manifest found another layout its planner
    reshards from (every rank then reads the shared tier).  Immutable."""

    tier: str
    iteration: int
    source: str
    root: str
    why: str
    shared: str
    view: Resolved | None = None
    reshard: bool = False
    asked: int | None = None  # the iteration asked for (None: the newest)
    save: tuple[int, int] | None = None  # the local save restored: (run token as an int, sequence)
    replicas: dict = dataclasses.field(default_factory=dict)  # the clique's table, for the fetch

    @property
    def manifest(self) -> Manifest | None:
        """The shared tier's manifest of ``iteration`` (header and this rank's record), or ``None``."""
        return self.view.manifest if self.view is not None else None

    @property
    def layout(self) -> dict | None:
        """The layout the checkpoint was saved with (from ``view``), or ``None``."""
        return dict(self.view.manifest.layout) if self.view is not None else None


@dataclasses.dataclass(frozen=True)
class LoadResult:
    iteration: int
    objects: object
    metadata: dict
    stats: RestoreStats
    root: str  # the tier it was restored from
    plan_kind: str = SameLayoutPlanner.kind  # the planner that made the plan (``LoadPlanner.kind``)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class CheckpointManager(ClosingContext):
    """Save / commit / retain / load for one rank.  A context manager; ``close()`` is idempotent.

    ``on_error="warn"`` logs a failed save instead of raising; nothing is committed for it and the
    previous checkpoint stays the latest.  ``layout`` (e.g. ``{"tp": 1, "pp": 1, "dp": 2}``) is
    recorded in the manifest and must match on load.

    Start-up (collective; an error on any rank raises on every rank): rank 0 refuses a save
    directory holding a newer checkpoint we did not write (``ForeignCheckpointError``), takes the
    directory's one-writer lock (``SaveDirBusyError`` when another job holds it; held until
    ``close()``), then removes our own leftovers only.
    """

    def __init__(
        self,
        root: str,
        options: EngineOptions | None = None,
        policy: ManagerOptions | None = None,
        *,
        layout: dict | None = None,
        load_root: str | None = None,
        local_root: str | None = None,
        summarize=None,
        **policy_fields,
    ) -> None:
        """``summarize(tensors, metas) -> dict | None``: this rank's global-index summary of its
        registered tensors (:mod:`.global_index`; ``None``: no index).  ``policy_fields`` (``keep_last=0``, ``on_error="warn"``, ...) are a short form of
        ``policy=ManagerOptions(...)``: give one or the other."""
        if policy is not None and policy_fields:
            raise TypeError(f"CheckpointManager: give policy= or {sorted(policy_fields)}, not both")
        self.policy = policy = policy or ManagerOptions(**policy_fields)
        self.local_fallback = policy.local_fallback
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world_size = dist.get_world_size() if dist else 1
        # s3:// or msc://: the persistent tier is an ObjectTier, written by the promotion (or, without
        # local_root, by the uploads of memory files: _uploads)
        self.objects = is_object_url(root)
        self.root = _location(root)
        self.load_root = _location(load_root or root)
        self.layout = dict(layout or {})
        self.on_error = policy.on_error
        self.verify_on_load = policy.verify_on_load
        self.restore_threads = policy.restore_threads
        opts = dataclasses.replace(options or EngineOptions(), rank=self.rank)
        self._seq = 0
        self._closed = False
        self._summarize = summarize
        self._summary_stale = summarize is not None
        self._summary: tuple[bytes, int] | None = None  # this rank's, sent with each save's ticket
        self.last_commit: CommitRecord | None = None
        # promotions that failed since the last wait(persist=True), which raises those no newer
        # promotion superseded (poll and save do not: a bucket's outage must not stop training; the
        # promotion logged each at ERROR)
        self._failed_promotions: list[PromotionError] = []
        self._held_records: list[CommitRecord] = []  # polled by a wait that raised: the next poll's
        self._world = Collective()  # the default group: start-up, restore and tier agreements
        self.token = token = self._agree_token()
        # node of this rank (torchrun's LOCAL_WORLD_SIZE); "{node}" in local_root names a per-node dir
        self.per_node = per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)) or self.world_size
        self.node = self.rank // per_node
        self.node_ranks = range(self.node * per_node, min(self.world_size, (self.node + 1) * per_node))
        # the node-local root several runs may share; this run's tier is its run-<id> subdirectory
        self.local_base = os.path.abspath(local_root.format(node=self.node)) if local_root else None
        self.local_root: str | None = None  # set once the run id is agreed (_start_tiers)
        self.run_id = ""
        self._save_empty = False  # rank 0: --save held no checkpoint at start-up (:meth:`_warn_wiped_save`)
        self._uploads = None  # on object storage without local_root: each rank file streamed from memory
        if self.objects:
            from .storage import open_storage
            from .storage.object_tier import ObjectTier

            self.persistent = ObjectTier(
                open_storage(self.root),
                rank=self.rank,
                token=token,
                writes=list(range(self.world_size)) if self.rank == 0 else [],
                keep_last=policy.keep_last,
                keep_every=policy.keep_every,
            )
        else:
            self.persistent = Tier(
                "persistent",
                self.root,
                rank=self.rank,
                token=token,
                writes=list(range(self.world_size)) if self.rank == 0 else [],
                keep_last=policy.keep_last,
                keep_every=policy.keep_every,
                recycle_files=policy.recycle_files,
                first=not self.local_base,
            )
        self.local = self.promotion = self.replication = None
        # rank 0 resolves a restore and sends each rank its record (one store round each)
        self._resolve_chan = StoreChannel(
            default_store(), self.rank, self.world_size, f"dsm/{token}/resolve", opts.timeout_s
        )
        self._commit_chans: list[StoreChannel] = []  # each tier's (forget_ranks)
        self._start_tiers()
        self._first_tier = self.local or self.persistent  # where a save is committed first
        self._stalls = StallReport(self.rank, self._first_tier.root)  # saves skipped: storage behind
        self.host = None  # this rank's newest committed rank file in memory (policy.host_copy)
        try:
            if policy.host_copy is True:  # "auto" is resolved by the caller that knows (Megatron-LM's args)
                # saves not committed yet: up to max_inflight being written, max_inflight - 1 durable
                # and waiting for their commit (_behind), and this one
                self._start_host_copies(2 * opts.max_inflight)
            self.engine = SnapshotEngine(opts)
            if self.objects and not self.local_base:
                from .storage.stream import StreamUploads

                self._uploads = StreamUploads(self.persistent.storage, self.rank)
            for tier in (self.persistent, self.local):
                if tier:  # each tier's commits go through the c10d store on a connection of their own
                    channel = StoreChannel(
                        default_store(), self.rank, self.world_size, f"dsm/{token}/{tier.name}", opts.timeout_s
                    )
                    self._commit_chans.append(channel)
                    tier.open(channel, self.world_size, self.layout, opts.timeout_s)
            if self.local:
                from .tiers.promotion import Promotion

                self.promotion = Promotion(
                    self.local,
                    self.persistent,
                    interval=policy.persist_interval,
                    slots=policy.promote_slots,
                    mbps=policy.promote_mbps,
                )
                self._restore_chan = StoreChannel(
                    default_store(), self.rank, self.world_size, f"dsm/{token}/restore", opts.timeout_s
                )
                newest = self._newest_local()
                if newest is not None and self._save_empty:
                    self._warn_wiped_save(newest)
                self.promotion.resume(newest)
                jump, factor = replication_plan(self.world_size, per_node, policy.replicas, policy.replication_jump)
                if factor > 1:
                    self._start_replication(jump, factor, opts.timeout_s)
        except BaseException:
            self._abandon_start(opts.timeout_s)
            raise
        close_at_exit(self)

    def _warn_wiped_save(self, iteration: int) -> None:
        """Rank 0, at start-up: ``--save`` holds no checkpoint but the node-local tier of its run does
        -- a save directory wiped with ``rm -rf S/*`` keeps the dot-file naming the run.  Resuming
        from it is right for a run killed before its first promotion, a surprise for a new
        experiment: said once, with how to start fresh."""
        log.warning(
            "%s holds no checkpoint, but the node-local tier %s of its run %s (named by %s) holds iteration %d: "
            "resuming from it and promoting it to %s; to start fresh instead, remove %s (and %s) before starting",
            self.root,
            self.local_root,
            self.run_id,
            os.path.join(self.root, RUN_ID_NAME),
            iteration,
            self.root,
            os.path.join(self.root, RUN_ID_NAME),
            self.local_root,
        )

    def _start_host_copies(self, limit: int) -> None:
        """Keep each save's rank file in memory too (:mod:`.tiers.host_copy`); after an in-process
        restart, take over the copies the aborted attempt left."""
        kept = host_copy.take(self.rank, self.root)
        self.host = kept or host_copy.HostCopies(self.rank, self.root, limit)
        self.host.limit = max(1, limit)  # a kept one: this manager's
        held = self.host.newest()
        if held is not None:
            log.info(
                "rank %d: host copy of iteration %d (%d bytes) kept from the aborted attempt",
                self.rank,
                held.iteration,
                held.nbytes,
            )
        host = self.host
        self._first_tier.on_commit(lambda ticket: host.committed(ticket.token, ticket.seq, ticket.durable))

    def _abandon_start(self, timeout_s: float) -> None:
        """A start-up that failed after threads were started: stop them (nothing was saved yet;
        a process must not hang on them at exit; each join bounded) and release the locks."""
        if self.host is not None:  # a later attempt may still restore from it
            host_copy.keep(self.host)
        try:
            for part in (self.replication, self.promotion, self._uploads):
                if part is not None:
                    part.close(timeout_s)
            for tier in (self.local, self.persistent):
                if tier is not None:
                    tier.abandon(timeout_s)
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.close()
        finally:
            self._release_lock()

    def _start_replication(self, jump: int, factor: int, timeout_s: float) -> None:
        """The clique's group, then this rank's replica directories (agreed: a failure on any rank
        raises on every rank)."""
        clique = clique_of(self.rank, jump, factor)
        replication = Replication(self.local, clique, keep_last=self.policy.local_keep_last, timeout_s=timeout_s)
        try:
            nodes = {m // self.per_node for m in clique}
            if len(nodes) < len(clique):  # a node lost would lose every copy of its ranks' files
                raise OptionsError(
                    "replication",
                    [
                        (
                            "replication_jump",
                            f"{jump} puts rank {self.rank}'s partners {clique} on the same node "
                            f"({self.per_node} ranks per node): use a multiple of the ranks per node",
                        )
                    ],
                )
            writer = self.local.is_writer  # the node's replica directories: the union of its ranks' cliques
            replication.open_stores(
                {m for r in self.node_ranks for m in clique_of(r, jump, factor)} if writer else None
            )
        except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
            self._agree_start(e)
            raise
        self._agree_start(None)
        replication.follow()
        self.replication = replication

    def _start_tiers(self) -> None:
        """Start-up of the tiers' writers (agreed: a failure on any rank raises on every rank).  The
        save directory's writer first refuses a checkpoint we did not write that a resume would skip,
        then takes the directory's one-writer lock, cleans our own leftovers and reads (or, at the
        run's first start, creates) the run id.  With it every rank knows its node-local tier:
        ``<local root>/run-<id>``, whose writer takes that directory's lock before cleaning it."""
        run_id = 0
        try:
            for root, longest in ((self.root, _LONGEST_NAME), (self.local_base, _LONGEST_LOCAL)):
                if root and not is_object_url(root):  # ENAMETOOLONG now, not mid-save
                    check_path_fits(root, longest)
            if self.persistent.is_writer:
                if not self.objects:
                    make_root(self.root)
                found = self.persistent.survey()
                self._save_empty = not found.committed and not found.damaged
                self.persistent.refuse_foreign(found)  # read-only: before the lock
                self.persistent.acquire()
                self.persistent.clean(found)
                run_id = int(self.persistent.ensure_run_id(), 16)
        except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
            self._agree_start(e)
            raise
        self._agree_start(None)
        self.run_id = self.persistent.run_id = f"{self._world.broadcast(run_id, src=0):016x}"
        if not self.local_base:
            return
        self.local_root = run_subdir(self.local_base, self.run_id)
        self.local = Tier(
            "local",
            self.local_root,
            rank=self.rank,
            token=self.token,
            writes=list(self.node_ranks) if self.rank == self.node_ranks[0] else [],
            keep_last=self.policy.local_keep_last,
            recycle_files=self.policy.recycle_files,
            run_id=self.run_id,
            node_local=True,
        )
        try:
            if self.local.is_writer:
                make_root(self.local_base)  # the root given (a link there is the user's choice)
                make_dir(self.local_root)  # ours: never a link
                try:
                    self.local.acquire()
                except SaveDirBusyError as e:
                    raise SaveDirBusyError(
                        f"{self.local_root}: this run's node-local directory is in use by another writer ({e}). "
                        "On one machine running several nodes, give each its own directory with {node} in "
                        "--lazy-ckpt-local-dir"
                    ) from None
                unmark_ended(self.local_root)  # this run is live here again
                reclaim_finished_runs(self.local_base, self.run_id)
                report_other_runs(self.local_base, self.run_id)
                self.local.clean()
        except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
            self._agree_start(e)
            raise
        self._agree_start(None)

    def _agree_start(self, err: BaseException | None) -> None:
        """Make one rank's start-up error every rank's (a rank failing alone would leave the others
        waiting in the next collective); the save directory's lock is released before raising."""
        try:
            self._world.raise_agreed(err, f"rank {self.rank}: start-up")
        except BaseException:
            self._release_lock()
            raise

    def _agree_error(self, err: BaseException | None) -> None:
        """The load's one agreement (a collective on every path): when any rank failed, every rank
        raises the same error -- the failed ranks' messages (the first four), each naming its file,
        rank and tensor, under their common error class.  One process: ``err`` itself."""
        self._world.raise_agreed(err, "load", report=4, own=False)

    def _release_lock(self, timeout: float | None = None) -> None:
        """``timeout``: at most this long on each tier (a bucket that does not answer)."""
        for tier in (self.local, self.persistent):
            if tier is not None:
                tier.release(timeout)

    def _agree_token(self) -> str:
        """The run token: rank 0's random 62-bit number, on every rank."""
        return f"{self._world.broadcast(secrets.randbits(62), src=0):016x}"

    # ------------------------------------------------------------------ registration
    def register(self, name: str, tensor: torch.Tensor, *, group: str = "default", meta: dict | None = None) -> None:
        self.engine.register(name, tensor, group=group, meta=meta)
        self._summary_stale = self._summarize is not None

    def clear(self) -> None:
        self.engine.clear()
        self._summary_stale = self._summarize is not None

    def _current_summary(self) -> tuple[bytes, int] | None:
        """This rank's global-index summary (recomputed when its registrations changed): carried
        by each save's ticket to the commit that writes the global index."""
        if self._summary_stale:
            self._summary_stale = False
            doc = self._summarize(self.engine.registered, self.engine.registered_meta)
            self._summary = encode_summary(doc) if doc is not None else None
        return self._summary

    # ------------------------------------------------------------------ save path
    def save(self, iteration: int, objects=None, metadata: dict | None = None, *, final: bool = False) -> bool:
        """Start checkpoint ``iteration`` (collective: every rank calls it in the same order).

        Returns at once, with no storage call on this thread; ``False`` if it could not start
        and ``on_error="warn"``, or if it was skipped.  A storage error of this save (the iteration
        directory's mkdir, the file's open, write, fsync) happens after it returned: every rank
        abandons the checkpoint at its commit, and the error reaches the caller at its next
        ``save``/``poll``/``wait``/``close`` (raised, or one warning line).  Skipped: with ``when_behind="skip"`` a save this rank cannot stage without waiting for its
        storage (:meth:`_behind`) is not staged, and every rank abandons that checkpoint at its
        commit (:attr:`skipped` counts them here).  ``final`` (the save at the end of a run, on
        a signal or at an exit interval): never skipped; it waits for the storage, bounded by
        ``timeout_s``, and logs what it waited for."""
        self._check_open()
        hold_point("save")
        self._surface_errors()
        self._seq += 1
        ticket = Ticket(
            iteration, self._seq, None, dict(metadata or {}), 0.0, self.token, summary=self._current_summary()
        )
        tier = self._first_tier
        d = iter_dir(tier.root, iteration)
        behind = self._behind() if final or self.policy.when_behind == "skip" else None
        if behind and not final:
            return self._skip(ticket, behind)
        t_wait = time.perf_counter()
        error = memory = handle = mirror = None
        try:
            name = ticket.file_name(self.rank)
            path = os.path.join(d, name)
            if self.host is not None:  # the same bytes into memory, restored by an in-process restart
                mirror = self._start_host_copy(ticket, name)
            if self._uploads is not None:  # no node-local directory: into a memory file, uploaded once written
                memory = memory_file(name)
                handle = self.engine.save(iteration, path, objects, tag=name, memory_fd=memory, mirror_fd=mirror)
            else:
                # no storage call here on the training thread (issue 41): the writer's one mkdir, the other
                # ranks' check of it, and the move of a retired rank file into place (to be overwritten)
                # run on a flush thread just before the file is opened; an error there fails this rank's
                # file, every rank abandons the checkpoint at its commit, and the caller hears it at its
                # next save/poll/wait/close.  An iter_* symlink is refused on every rank: never written through
                prepare = prepare_iteration_dir(d, tier.is_writer, tier.recycled(path), rank=self.rank)
                handle = self.engine.save(iteration, path, objects, tag=name, before_open=prepare, mirror_fd=mirror)
        except CheckpointError as e:
            error, handle = e, None
        except OSError as e:  # the save path raises CheckpointError only: a raw one must not escape
            error, handle = FlushError(f"rank {self.rank}: iteration {iteration}: {d}: save failed: {e}"), None
            error.__cause__ = e
        finally:
            if memory is not None and handle is None:  # else the engine writes it and the upload closes it
                os.close(memory)
            if mirror is not None:
                if handle is None:
                    self.host.drop(ticket.token, ticket.seq)
                else:
                    self.host.attach(ticket.token, ticket.seq, handle.durable)
        ticket.t_save = t_save = time.perf_counter()
        if behind:  # a final save: it waited (bounded by timeout_s) rather than be skipped
            log.warning(
                "rank %d: final checkpoint of iteration %d waited %.1f s for storage of %s (%s)",
                self.rank,
                iteration,
                t_save - t_wait,
                tier.root,
                behind,
            )
        if handle is None:
            # the other ranks still expect this rank in the agreement for this sequence number: the
            # failed ticket goes in before the error is raised (on_error="raise") or logged
            ticket.durable = cf.Future()
            ticket.durable.set_exception(CheckpointError("save did not start"))
            tier.submit(ticket)
            self._handle(error)
            return False
        self._stalls.staged(iteration)
        ticket.durable = handle.durable
        if memory is not None:  # stored from memory once written (:mod:`.storage.stream`)
            ticket.durable = self._uploads.upload(handle.durable, memory, iteration, name)
            ticket.reported = False  # a failed upload is raised as a promotion's: by wait(persist=True)
        tier.submit(ticket)
        return True

    def _start_host_copy(self, ticket: Ticket, name: str) -> int | None:
        """The memory file this save's rank file is mirrored into, or ``None`` (logged) when the
        host cannot make one: the save goes on without it (a restart then reads a tier)."""
        try:
            return self.host.start(ticket.iteration, ticket.token, ticket.seq, name, ticket.metadata, self.layout)
        except OSError as e:
            log.warning("rank %d: iteration %d: no host copy of this save: %s", self.rank, ticket.iteration, e)
            return None

    def _behind(self) -> str | None:
        """Why this rank cannot stage a checkpoint now without waiting for its storage, or
        ``None``: the engine's reasons (every in-flight slot taken, no host cache room), or
        ``max_inflight`` of this rank's files durable but not committed -- waiting for another
        rank's (a stalled one): that bounds the files a healthy rank holds during another's stall."""
        waiting = [t.iteration for t in self._first_tier.outstanding() if not t.skipped and _durable(t)]
        if len(waiting) >= self.engine.options.max_inflight:
            return f"{len(waiting)} checkpoint(s) written, waiting for the other ranks' (iterations {_span(waiting)})"
        return self.engine.behind()

    def _skip(self, ticket: Ticket, why: str) -> bool:
        """Skip this save: ``ticket``, saying so, goes to the commit, where every rank abandons the
        checkpoint; the stall report tells it as an episode."""
        self._stalls.skipped_save(ticket.iteration, why, self._in_flight_s())
        ticket.durable = cf.Future()
        ticket.durable.set_exception(
            CheckpointError(f"rank {self.rank}: iteration {ticket.iteration}: skipped (storage behind)")
        )
        ticket.t_save, ticket.skipped = time.perf_counter(), True
        self._first_tier.submit(ticket)
        return False

    @property
    def skipped(self) -> int:
        """Saves this rank skipped (storage behind: ``when_behind="skip"``)."""
        return self._stalls.skipped

    def _in_flight_s(self) -> float:
        """Seconds since the oldest checkpoint not yet committed was saved."""
        outstanding = self._first_tier.outstanding()
        oldest = min((t.t_save for t in outstanding if not t.skipped), default=None)
        engine = self.engine.oldest_in_flight_s()
        return max(engine, time.perf_counter() - oldest if oldest is not None else 0.0)

    def wait_for_snapshot(self, group: str | None = None) -> None:
        """Gate: returns once pending copies are complete; the caller may then mutate the tensors."""
        self.engine.wait_for_snapshot(group)

    def poll(self) -> list[CommitRecord]:
        """Non-blocking: checkpoints committed since the last call (raises or logs failures; a
        failed promotion is kept for the next ``wait(persist=True)``)."""
        self._surface_errors()
        out, self._held_records = self._held_records, []
        for tier in (t for t in (self.local, self.persistent) if t):
            while True:
                try:
                    got = tier.poll()
                except PromotionError as e:
                    self._failed_promotions.append(e)
                    continue
                except CheckpointError as e:
                    self._handle(e)
                    continue
                out.extend(got)
                break
        if out:
            self.last_commit = out[-1]
        return out

    def wait(
        self, timeout: float | None = None, persist: bool = True, promote_newest: bool = False
    ) -> list[CommitRecord]:
        """Block until every pending checkpoint is committed (or has failed); with a local tier and
        ``persist=True``, also until every scheduled promotion is committed on the persistent tier.

        ``promote_newest`` (collective; for the end of a run, and what ``close`` does): first
        promote the newest local checkpoint if its ``persist_interval`` turn had not come -- what a
        job leaves behind must not depend on node-local storage outliving it."""
        try:
            self.engine.wait(timeout)
        except CheckpointError as e:
            self._handle(e)
        self._first_tier.drain(timeout)
        if persist and self.replication is not None:  # its exchanges run off the commit thread
            try:
                self.replication.drain(timeout)
            except CheckpointError as e:
                self._handle(e)
        if persist:
            if promote_newest and self.promotion is not None:
                self.promotion.promote_newest()
            self.persistent.drain(timeout)
        self._drain_deletions(timeout, (self.local, self.persistent) if persist else (self._first_tier,))
        out = self.poll()
        if persist and self._failed_promotions:
            newest = self.persistent.latest  # a promotion committed since supersedes a failed one
            failed = [e for e in self._failed_promotions if newest is None or (e.iteration or 0) > newest]
            self._failed_promotions = []
        else:
            failed = []
        if failed:
            err = (
                failed[0]
                if len(failed) == 1
                else PromotionError(f"{len(failed)} promotions failed; the last: {failed[-1]}", failed[-1].iteration)
            )
            self._held_records = out  # not lost: the next poll returns them
            self._handle(err)
            self._held_records = []
        return out

    def _drain_deletions(self, timeout: float | None, tiers=None) -> None:
        """Wait for the retention the commits so far handed to the tiers' deleter threads."""
        for tier in tiers or (self.local, self.persistent):
            if tier is not None:
                tier.drain_deletions(self.engine.options.timeout_s if timeout is None else timeout)

    @property
    def abandoned_skips(self) -> int:
        """Checkpoints every rank abandoned because some rank skipped its save (this rank's
        :attr:`skipped` included, once their commit rounds ran): what a stall cost."""
        return self._first_tier.abandoned_skips

    @property
    def latest_committed(self) -> int | None:
        return self._first_tier.latest

    def _surface_errors(self) -> None:
        while True:
            try:
                self.engine.poll()
                return
            except CheckpointError as e:
                self._handle(e)

    def _handle(self, err: CheckpointError) -> None:
        if self.on_error == "raise":
            raise err
        log.warning("rank %d: checkpoint failed, training goes on (on_error=warn): %s", self.rank, err)

    # ------------------------------------------------------------------ load path
    def latest(self, root: str | None = None) -> int:
        """The iteration :meth:`load` restores by default (collective: :meth:`choose`); raises
        ``NoCheckpointError``."""
        return self.choose(root=root).iteration

    def _latest_in(self, root: str, found: Survey | None = None) -> int:
        """The latest committed iteration under ``root`` -- refusing (``ForeignCheckpointError``)
        when a checkpoint we did not write there is newer: resuming would silently skip it."""
        if is_object_url(root):  # the persistent tier's objects: surveyed by rank 0 (resolve's ``survey``)
            return (found or self._survey_objects(root)).latest()
        return latest_to_resume(root, warn=self.rank == 0 and root != self.root, found=found)

    def choose(self, iteration: int | None = None, *, root: str | None = None, check=None) -> RestoreChoice:
        """Collective: the one restore decision -- which tier and iteration (default: the newest
        every rank can restore), where each rank's state comes from, and the checkpoint's manifest
        as this rank needs it -- made on rank 0 in one round of the resolve step
        (:func:`.load.resolve.resolve`): every rank sends one record (the directory it asks for, its
        newest local saves: O(1) bytes), rank 0 surveys ``root`` (default: the load directory),
        decides, reads that manifest once and runs ``check(manifest, ckpt) -> bool`` on it
        (``True``: another layout the caller's planner reshards; raise: none it can load), and every
        rank receives the answer and its own record.  No world-group collective unless it fails
        (with replication, one gather of the clique); any error is raised on every rank
        (``NoCheckpointError`` when there is nothing to restore)."""
        self._check_open()
        self._drain_deletions(None)  # the decision never races retention of what it names
        root = _location(root or self.load_root)
        tiered = (bool(self.local_root) or self.host is not None) and root == self.root
        found = self._restorable() if tiered else None  # the clique's collective, with replication
        # one record to rank 0: which directory this rank asks for, and its local candidates
        offer = {"root": zlib.crc32(root.encode("utf-8")), **(_offer(found.saves) if tiered else {})}
        try:
            view = resolve(
                root,
                iteration,
                self._resolve_chan,
                self.layout,
                check=check or _no_check,
                offer=offer,
                decide=functools.partial(self._decide, root=root, iteration=iteration, tiered=tiered),
                **self._readers(root),
            )
        except CheckpointError as e:  # alike on every rank: agreed, so that rank 0 (the store's
            self._world.raise_agreed(e, "restore")  # host) never exits before every rank has heard it
            raise
        decision, reshard = view.decision, bool(view.checked)
        it, why = decision["iteration"], decision["why"]
        shared = view if view.ckpt is not None else None
        common = dict(tier="persistent", iteration=it, shared=root, view=shared, reshard=reshard, asked=iteration)
        if tiered:
            common["replicas"] = found.table
        if decision["tier"] == "local" and not reshard:  # every rank holds it: in memory, its node's copy or a replica
            how = found.how[it]
            what = {"host": "this rank's host copy", "local": "this node's copy"}.get(
                how, "its node-local copy is missing"
            )
            common.update(tier="local", save=found.saves[it][:2])
            where = HOST_MEMORY if how == "host" else self.local_root
            return RestoreChoice(source=how, root=where, why=f"{why}; {what}", **common)
        if reshard:
            why = f"{why}; its layout is resharded, from every rank's file"
        elif (
            tiered
            and self.host is not None
            and not self.objects  # an object is fetched by every rank alike, never read beside a memory copy
            and self.host.holds(it, view.file_of(self.rank))
        ):
            return RestoreChoice(
                source="host", root=HOST_MEMORY, why="this rank's host copy of the persistent file", **common
            )
        elif (
            tiered
            and self.local_fallback == "rank"
            and not self.objects  # an object is fetched whole, never read beside a node's copy
            and self._local_copy_of(it, view.file_of(self.rank))
        ):
            return RestoreChoice(
                source="local", root=self.local_root, why="this node's copy of the persistent file", **common
            )
        return RestoreChoice(source="persistent", root=root, why=why, **common)

    def _decide(
        self, cols: dict, found: Survey, *, root: str, iteration: int | None, tiered: bool
    ) -> tuple[int | None, dict]:
        """Rank 0, inside the resolve step: the tier and iteration every rank restores, from every
        rank's record (``cols``: the directory it asks for, its local saves; O(N * _SLOTS)) and the
        survey of the shared tier ``found``.  The local tier wins when every rank holds the same save there (two nodes holding
        one iteration from different saves never restore together) and it is not older than the
        shared tier's newest.  Returns the shared tier's iteration to read (``None``: it does not
        hold the chosen one) and the decision."""
        elsewhere = np.flatnonzero(cols["root"] != cols["root"][0])
        if elsewhere.size:  # a restore is collective: one directory for every rank
            raise CheckpointError(
                f"rank(s) {elsewhere[:8].tolist()}{f' and {elsewhere.size - 8} more' if elsewhere.size > 8 else ''} "
                f"asked to load another directory than rank 0 ({root}); give every rank the same one"
            )
        common = _newest_common(cols, iteration)["local"] if tiered else None
        if iteration is not None:
            if common is not None:
                read = iteration if iteration in found.committed else None
                return read, {"tier": "local", "iteration": iteration, "why": f"iteration {iteration} is on every node"}
            why = f"iteration {iteration} is not on every node" if tiered else f"iteration {iteration} asked for"
            return iteration, {"tier": "persistent", "iteration": iteration, "why": why}
        try:
            newest = self._latest_in(root, found)
        except NoCheckpointError:
            if common is None:
                raise
            newest = None
        if common is not None and (newest is None or common[0] >= newest):
            read = common[0] if common[0] in found.committed else None
            return read, {"tier": "local", "iteration": common[0], "why": "the newest checkpoint every rank has"}
        why = "the newest checkpoint"
        if tiered:
            held = " or ".join(
                w for w, on in (("node-local", self.local_root), ("host-memory", self.host is not None)) if on
            )
            why = f"no {held} checkpoint every rank has"
            if common is not None:
                why = f"newer than the newest {held} checkpoint every rank has ({common[0]})"
        return newest, {"tier": "persistent", "iteration": newest, "why": why}

    def _persistent_committed(self) -> list[int]:
        return sorted(self.persistent.survey().committed) if self.objects else committed_iterations(self.root)

    def _fetch_own(self, view: Resolved) -> Resolved:
        """Collective: each rank fetches its own object of the checkpoint rank 0 resolved (``view``:
        the manifest's header and this rank's record, O(1) bytes per rank) into
        ``<local tier>/fetched/iter_N/``, verified whole (:mod:`.storage.fetch`); agreed.  Its
        directory and the one-record manifest, for the reader."""
        from .storage.fetch import fetch_rank

        it, err = view.manifest.iteration, None
        try:
            d = iter_dir(self._fetch_root(it), it)
            make_dir(d)
            fetch_rank(self.persistent.storage, view.manifest, self.rank, d)
        except Exception as e:  # noqa: BLE001 - every rank must hear it
            err = e
        self._agree_error(err)
        if err is not None:
            raise err
        return Resolved(d, view.manifest)

    def _fetch_root(self, iteration: int) -> str:
        """``<local tier>/fetched``, where this node keeps one checkpoint fetched from object
        storage: the node's writer removes the others (only what we wrote)."""
        root = os.path.join(self.local_root, "fetched")
        if self.local.is_writer:
            from .names import iteration_of
            from .tiers.retention import remove_ours

            for name in os.listdir(root) if os.path.isdir(root) else ():
                if iteration_of(name) not in (None, iteration):
                    remove_ours(os.path.join(root, name))
        make_dir(root)
        return root

    def _fetched(self, iteration: int, every_rank: bool) -> tuple[str, int]:
        """Collective: fetch checkpoint ``iteration`` of the persistent tier on object storage into
        ``<local tier>/fetched/`` -- this rank's object, or every rank's for a plan that reads them
        all -- each verified whole before it takes its name (:mod:`.storage.fetch`); agreed, so that
        a failure on any rank raises on every rank."""
        from .storage.fetch import fetch_checkpoint

        err, it = None, iteration
        try:
            root = self._fetch_root(it)
            fetch_checkpoint(self.persistent.storage, it, root, None if every_rank else [self.rank])
        except Exception as e:  # noqa: BLE001 - every rank must hear it
            err = e
        self._agree_error(err)
        if err is not None:
            raise err
        return root, it

    def load(
        self,
        iteration: int | RestoreChoice | None = None,
        *,
        root: str | None = None,
        verify: bool | None = None,
        planner: LoadPlanner | None = None,
    ) -> LoadResult:
        """Restore checkpoint ``iteration`` (default: the latest committed; a :class:`RestoreChoice`:
        what :meth:`choose` decided, not decided again) in place, as ``planner`` plans it (default:
        every registered tensor from this rank's own file, same layout), through the one verifying
        reader (:mod:`.reader`).  Collective: raises on every rank or none, and writes nothing
        unless every rank validated its part.  A planner that reads other ranks' files reads the
        shared tier (the load directory), never a node-local one.  A read the storage fails or
        stalls on any rank (:class:`StorageReadError`, agreed) makes every rank restore the next
        candidate: the persistent copy of a node-local checkpoint, else -- unless ``iteration``
        was given -- the checkpoint committed before (:meth:`_restore_older`)."""
        self._check_open()
        choice = iteration if isinstance(iteration, RestoreChoice) else self.choose(iteration, root=root)
        self._drain_deletions(None)  # a load never races retention of what it may read
        if planner is not None and planner.reads_all_ranks:  # other ranks' files, of the shared tier
            if choice.view is None:  # alike on every rank
                raise NoCheckpointError(
                    f"rank {self.rank}: {iter_dir(choice.shared, choice.iteration)}: not committed; a plan "
                    "reading every rank's file reads the checkpoint there, not a node-local copy"
                )
            # rank 0's view (the header and this rank's record): the reader takes the records of the
            # files the plan opens from the global index, or reads the whole manifest once if it must
            # (object storage: every rank's objects and the manifest are fetched first, as before)
            view = None if is_object_url(choice.shared) else choice.view
            return self._load_from(choice.shared, choice.iteration, verify, planner, view)
        chosen_root = choice.root
        why = choice.why
        if self.replication is not None and choice.shared == self.root:
            # collective of the clique: ranks whose node lost its copy fetch theirs
            need = choice.tier == "local" and choice.source == "replica"
            self.replication.drain()  # the clique group is the restore's (a save since choose() may have run)
            fetched, holder = self.replication.fetch(choice.iteration, choice.save, need, choice.replicas)
            if need:
                chosen_root = fetched or self.replication.own_root  # none: the load fails and falls back
                why = f"the replica held by rank {holder} ({why})"
        # a replica in use means a node lost its copy: worth a warning
        log.log(
            logging.WARNING if choice.source == "replica" else logging.INFO,
            "rank %d: restoring iteration %s from %s: %s",
            self.rank,
            choice.iteration,
            chosen_root,
            why,
        )
        try:
            # a rank reading the shared tier reads it through rank 0's view (local_fallback="rank":
            # some ranks may read their node's copy instead)
            view = choice.view if chosen_root == choice.shared else None
            if choice.source == "host":
                return self._load_host(choice, verify, planner)
            return self._load_from(chosen_root, choice.iteration, verify, planner, view)
        except CheckpointError as e:
            # every rank raised (the failure was agreed before any tensor was written): a bad local
            # copy on some rank must not hide an intact persistent checkpoint -- unless no rank read
            # a local copy (with local_fallback="rank" only some may have), so a retry would repeat it
            if choice.shared != self.root or not self._agree(chosen_root == self.root):
                if isinstance(e, StorageReadError) and choice.asked is None:
                    return self._restore_older(choice.shared, choice.iteration, e, verify, planner)
                raise
            try:  # collective: rank 0 finds and reads it, each rank gets its record
                fallback = self._resolve(self.root, choice.asked)
            except NoCheckpointError:
                # a checkpoint exists but could not be restored: never "no checkpoint" (a trainer
                # would start from scratch and overwrite --save), and never an older one than asked
                raise CheckpointError(
                    f"rank {self.rank}: restoring iteration {choice.iteration} from the node-local tier failed "
                    f"and {self.root} holds no {'copy of it' if choice.asked is not None else 'checkpoint'}: {e}"
                ) from e
            it = fallback.manifest.iteration
            log.warning(
                "rank %d: restoring local checkpoint %s failed (%s); restoring persistent checkpoint %d",
                self.rank,
                choice.iteration,
                e,
                it,
            )
            try:
                return self._load_from(self.root, it, verify, planner, view=fallback)
            except StorageReadError as again:  # the storage failed that read too (agreed on every rank)
                if choice.asked is not None:
                    raise
                return self._restore_older(self.root, it, again, verify, planner)

    def _restore_older(
        self, root: str, failed: int, err: StorageReadError, verify: bool | None, planner: LoadPlanner | None
    ) -> LoadResult:
        """Collective, after every rank agreed that reading checkpoint ``failed`` of ``root`` failed
        in the storage (``err``: an I/O error or a stalled read on some rank, not damage): restore
        the next older committed checkpoint there (by commit order), each chosen by rank 0 in one
        resolve round, at most :data:`RESTORE_CANDIDATES` checkpoints in all.  Every rank logs one
        line naming the failed rank(s), file and errno.  Never "no checkpoint": a trainer would
        start from scratch over ``root``."""
        for _ in range(RESTORE_CANDIDATES - 1):
            try:  # rank 0 surveys and picks; each rank gets its record
                view = resolve(
                    root,
                    None,
                    self._resolve_chan,
                    self.layout,
                    check=_no_check,
                    latest=functools.partial(_older_than, failed=failed),
                    **{k: v for k, v in self._readers(root).items() if k != "latest"},
                )
            except CheckpointError as e:
                try:  # alike on every rank: agreed, so that rank 0 (the store's host) never exits first
                    self._world.raise_agreed(e, "restore")
                except NoCheckpointError:
                    raise StorageReadError(
                        f"rank {self.rank}: restoring iteration {failed} from {root} failed and no older "
                        f"committed checkpoint is there: {err}"
                    ) from err
                raise
            it = view.manifest.iteration
            log.warning(
                "rank %d: restoring iteration %d from %s failed: %s; restoring iteration %d instead",
                self.rank,
                failed,
                root,
                err,
                it,
            )
            try:
                return self._load_from(root, it, verify, planner, view=view)
            except StorageReadError as e:
                failed, err = it, e
        raise StorageReadError(
            f"rank {self.rank}: the storage failed reading {RESTORE_CANDIDATES} checkpoints of {root} in a row "
            f"(the last, iteration {failed}): {err}"
        ) from err

    def _load_from(
        self, root: str, iteration: int, verify: bool | None, planner: LoadPlanner | None, view: Resolved | None = None
    ) -> LoadResult:
        """Restore ``iteration`` of the tier at ``root`` (collective: raises on every rank or none).
        ``view``: that checkpoint as rank 0 resolved it for this rank (the manifest's header and this
        rank's record: no rank but 0 reads the manifest); ``None``: this rank reads the manifest --
        a node-local one (it lists one node's ranks), or the whole one a plan reading every rank's
        file needs.  Nothing here is a collective before the reader's one agreement (a rank that
        fails to open its manifest joins that agreement, whichever way the others read) -- but on
        object storage, where every rank fetches what it reads into the node-local tier first
        (agreed: every rank reads object storage alike, never a node's copy beside it)."""
        if is_object_url(root) and self.local_root is None:  # no node-local directory: ranged GETs into memory
            return self._load_ranges(iteration, verify, planner)
        if view is not None and is_object_url(root):  # this rank's object, its record from rank 0
            view = self._fetch_own(view)
        elif is_object_url(root) and planner is not None:  # the byte ranges the plan reads, of any rank
            return self._load_ranges(iteration, verify, planner)
        elif is_object_url(root):  # every rank's objects (and the whole manifest) fetched, read locally
            root, iteration = self._fetched(iteration, every_rank=False)
        if view is not None:
            ckpt, manifest, partial = view.ckpt, view.manifest, True
        else:
            partial = False
            try:  # a rank failing here still joins the one agreement
                ckpt, manifest = open_checkpoint(root, iteration)
            except Exception as e:  # noqa: BLE001 - every rank must hear it
                self._agree_error(e)
                raise
        plan, stats, _ = self._read(ckpt, manifest, verify, planner, partial=partial)
        log.info(
            "rank %d: loaded iteration %d from %s (%s plan, %d bytes)",
            self.rank,
            iteration,
            ckpt,
            plan.kind,
            stats.bytes,
        )
        return LoadResult(iteration, plan.objects, manifest.metadata, stats, root, plan.kind)

    def _read(self, ckpt: str, manifest: Manifest, verify, planner, *, partial=False, fetcher=None, stall=True):
        """The one verifying reader over ``ckpt`` (a directory, or a label where ``fetcher`` serves
        the rank files: ranged GETs, a memory file), planned by ``planner`` (default: this rank's
        same-layout state) and joined to the one agreement: ``(plan, stats, whether it verified)``.
        ``stall``: give up on a read that stalls for the engine's timeout (ranged GETs have theirs)."""
        planner = planner or SameLayoutPlanner(self.engine.registered, self.world_size, self.layout)
        verify = self.verify_on_load if verify is None else verify
        stall_s = self.engine.options.timeout_s if stall else None
        with CheckpointReader(
            ckpt,
            manifest,
            rank=self.rank,
            verify=verify,
            threads=self.restore_threads,
            partial=partial,
            fetcher=fetcher,
        ) as reader:
            plan, stats = reader.load(planner, agree=self._agree_error, stall_s=stall_s)
        return plan, stats, verify

    def _load_host(self, choice: RestoreChoice, verify: bool | None, planner: LoadPlanner | None) -> LoadResult:
        """Restore this rank's state from its host copy (:mod:`.tiers.host_copy`): its memory file,
        checked against the checksums recorded at save -- 0 bytes read from storage.  Joins the
        reader's one agreement like :meth:`_load_from`, whichever way it fails."""
        borrowed = self.host.borrow(choice.iteration, choice.save)
        label = f"{HOST_MEMORY} of rank {self.rank}"
        if borrowed is None:  # a save committed since choose() replaced it
            err = CheckpointError(f"rank {self.rank}: {label}: no copy of iteration {choice.iteration} any more")
            self._agree_error(err)
            raise err
        copy, fd = borrowed
        try:
            return self._read_host_copy(choice, copy, fd, label, verify, planner)
        finally:
            fork_close.close(fd)

    def _read_host_copy(self, choice, copy, fd: int, label: str, verify, planner) -> LoadResult:
        shared = choice.view.manifest if choice.view is not None else None
        manifest = Manifest(
            iteration=copy.iteration,
            world_size=self.world_size,
            run_token=copy.token,
            ranks=(copy.record(self.rank),),
            layout=shared.layout if shared is not None else copy.layout,
            metadata=shared.metadata if shared is not None else copy.metadata,
            tier="host",
        )
        plan, stats, verify = self._read(
            label, manifest, verify, planner, partial=True, fetcher=host_copy.MemoryFile(fd, label)
        )
        log.info(
            "rank %d: restored iteration %d from host memory: 0 bytes read from storage (%d bytes%s)",
            self.rank,
            copy.iteration,
            stats.bytes,
            ", checksums verified" if verify else "",
        )
        return LoadResult(copy.iteration, plan.objects, manifest.metadata, stats, HOST_MEMORY, plan.kind)

    def _load_ranges(self, iteration: int, verify: bool | None, planner: LoadPlanner) -> LoadResult:
        """Collective: restore ``iteration`` of the persistent tier on object storage as ``planner``
        plans it (a reshard: parts of other ranks' objects), fetching by ranged GETs only the rank
        objects' metadata and the chunks the plan reads (:mod:`.storage.ranges`), into
        ``<local tier>/fetched/ranges-r<rank>/`` -- this rank's, emptied before and removed after --
        or, without a local tier, into memory files (no global index then: the plan reads each rank
        object's own metadata)."""
        from .storage.fetch import fetch_manifest
        from .storage.ranges import RangeFetcher
        from .storage.survey import iter_prefix
        from .tiers.retention import remove_ours

        from .names import iteration_of

        storage = self.persistent.storage
        err, manifest, work, d = None, None, "", ""
        try:
            if self.local_root is None:
                d = storage.url(iter_prefix(iteration)).rstrip("/")  # names the memory files in messages
            else:
                work = os.path.join(self._fetch_root(iteration), f"ranges-r{self.rank}")
                d = iter_dir(work, iteration)
                for name in os.listdir(work) if os.path.isdir(work) else ():  # a killed load's leftovers (ours)
                    if iteration_of(name) is not None:
                        remove_ours(os.path.join(work, name), self.rank)
                make_dir(d)
            manifest = fetch_manifest(storage, iteration)
            if work:
                _fetch_global_index(storage, iteration, d)  # the plan then opens only the objects it reads
        except Exception as e:  # noqa: BLE001 - every rank must hear it
            err = e
        if err is not None:
            self._agree_error(err)  # the reader's agreement is then never reached on any rank
            raise err
        fetcher = RangeFetcher(storage, manifest, d if work else None, threads=self.restore_threads)
        try:
            plan, stats, _ = self._read(d, manifest, verify, planner, fetcher=fetcher, stall=False)
        finally:
            fetcher.close()
            if work:
                remove_ours(d, self.rank)
                try:
                    os.rmdir(work)
                except OSError:
                    pass  # another entry there: not ours to remove
        log.info(
            "rank %d: loaded iteration %d from %s (%s plan, %d bytes; %d fetched by %d ranged GETs)",
            self.rank,
            iteration,
            storage.url(f"iter_{iteration:07d}"),
            plan.kind,
            stats.bytes,
            fetcher.fetched_bytes,
            fetcher.requests,
        )
        return LoadResult(iteration, plan.objects, manifest.metadata, stats, self.root, plan.kind)

    def _resolve(self, root: str, iteration: int | None) -> Resolved:
        """:func:`.load.resolve.resolve` of ``root`` for this world (collective): rank 0 reads, each rank
        gets its record; the layout is checked by the planner, not here."""
        return resolve(root, iteration, self._resolve_chan, self.layout, check=_no_check, **self._readers(root))

    def _readers(self, root: str) -> dict:
        """How rank 0 of the resolve step finds and reads checkpoints under ``root``: a directory's
        survey, or (object storage) a listing of the persistent tier's objects and its manifest
        objects; the newest is :meth:`_latest_in`'s."""
        hooks: dict = {"latest": lambda found: self._latest_in(root, found)}
        if is_object_url(root):
            hooks.update(survey=self._survey_objects, read=self._read_objects)
        return hooks

    def _survey_objects(self, root: str):
        """Rank 0: the persistent tier's objects (one listing; each manifest read once, then cached
        by its tag) -- the only object storage location this manager reads."""
        if root != self.root:
            raise NoCheckpointError(f"{root}: not this run's save location ({self.root}); no checkpoint read there")
        return self.persistent.survey()

    def _read_objects(self, found, iteration: int) -> tuple[str, Manifest]:
        """Rank 0 of :func:`.load.resolve.resolve` on object storage: the manifest object of
        committed ``iteration`` in the listing ``found``."""
        if iteration not in found.committed:
            if iteration in found.damaged:
                raise found.damaged[iteration]
            raise NoCheckpointError(f"{self.root}/iter_{iteration:07d}: no committed checkpoint")
        return f"{self.root}/iter_{iteration:07d}", found.committed[iteration]

    def _agree(self, ok: bool) -> list[int]:
        """Every rank says whether its file validated; returns the ranks that failed (default group)."""
        return self._world.agree(ok)

    def committed(self) -> list[int]:
        return self._persistent_committed()

    # ------------------------------------------------------------------ tiers
    def _restorable(self) -> _Restorable:
        """This rank's local-tier checkpoints: its host copy (:mod:`.tiers.host_copy`), else its
        node's, else (with replication) a replica its clique holds for it (a collective of the
        clique)."""
        saves = committed_saves(self.local_root, self.run_id, self.rank) if self.local_root else {}
        how, table = dict.fromkeys(saves, "local"), {}
        if self.replication is not None:
            self.replication.drain()  # the clique group is the restore's from here (its thread is idle)
            replica, table, replica_created = self.replication.holdings({it: s[:2] for it, s in saves.items()})
            for it, save in replica.items():
                if it not in saves:
                    saves[it], how[it] = (*save, replica_created[it]), "replica"
        for it, save in (self.host.saves() if self.host is not None else {}).items():
            saves[it], how[it] = save, "host"  # the same save as a node's copy, or a newer one
        return _Restorable(dict(sorted(saves.items())), how, table)

    def _newest_local(self) -> int | None:
        """Start-up: the newest node-local checkpoint every rank holds from one save (one gather to
        rank 0 and one small answer back; a failure on rank 0 is raised on every rank)."""
        cols = self._restore_chan.gather(
            _offer(committed_saves(self.local_root, self.run_id, self.rank)), _DECIDE_FIELDS
        )
        answer = None
        if self._restore_chan.is_root:
            try:
                answer = _newest_common(cols, None)
            except Exception as e:  # noqa: BLE001 - every rank must hear it
                answer = {"error": type(e).__name__, "message": str(e)[:1500]}
        answer = self._restore_chan.broadcast(answer)
        if "error" in answer:
            err = make_error(
                error_class_named(answer["error"]),
                f"rank {self.rank}: finding the newest node-local checkpoint failed on rank 0: {answer['message']}",
            )
            self._agree_error(err)  # every rank raises; rank 0, the store's host, only once all have heard
            raise err
        return answer["local"][0] if answer["local"] else None

    def _local_copy_of(self, iteration: int, persistent: RankRecord | None) -> bool:
        """This rank's local file of ``iteration`` is the very file the persistent manifest lists
        (``persistent``: same name -- run token and sequence -- size and checksums), so either may
        be read."""
        try:
            local = read_manifest(iter_dir(self.local_root, iteration)).record(self.rank)
        except (CheckpointError, OSError):
            return False
        return local is not None and local == persistent

    # ------------------------------------------------------------------ lifecycle
    def forget_ranks(self, ranks) -> None:
        """``ranks`` of this manager's world are gone for good (an in-process restart went on
        without them): the commits still pending stop waiting for them, and are abandoned on every
        rank (:meth:`.StoreChannel.forget`).  Call before :meth:`close`."""
        for channel in self._commit_chans:
            channel.forget(ranks)

    def close(self, timeout: float | None = None, *, keep_cache: bool = False) -> None:
        """Drain (commit what is pending and promote the newest local checkpoint), then stop every
        thread; idempotent.  ``keep_cache``: the host cache's arena and this rank's host copy go to
        the next manager of this process (an in-process restart: :meth:`.SnapshotEngine.close`,
        :func:`.tiers.host_copy.keep`)."""
        if self._closed:
            return
        forget(self)
        bound = self.engine.options.timeout_s if timeout is None else timeout  # every join is bounded
        ended = False
        try:
            self.wait(timeout, promote_newest=True)
            ended = True
        finally:
            self._closed = True
            try:
                self.engine.close(timeout, keep_cache=keep_cache)
            finally:
                try:
                    for part in (self.replication, self.local, self.promotion, self._uploads, self.persistent):
                        if part is not None:
                            part.close(bound)
                    if ended and self.local is not None and self.local.is_writer:
                        self._mark_ended()
                finally:
                    try:
                        self._release_lock(bound)
                    finally:
                        if self.host is not None:  # every thread that adds to it is joined
                            host_copy.keep(self.host) if keep_cache else self.host.close()

    def _mark_ended(self) -> None:
        """The run ended cleanly on this node: the next run here may reclaim its directory once
        nothing in it is newer than ``--save`` (:mod:`.tiers.reclaim`)."""
        try:
            mark_ended(self.local_root, self.run_id, self.root)
        except (CheckpointError, OSError) as e:  # the directory then stays, as before
            log.warning("rank %d: %s: could not mark the run as ended: %s", self.rank, self.local_root, e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"rank {self.rank}: checkpoint manager is closed")


def _older_than(found: Survey, *, failed: int) -> int:
    """Rank 0: the committed checkpoint in ``found`` committed last before ``failed`` was."""
    if failed not in found.committed:
        raise NoCheckpointError(f"{found.root}: iteration {failed} is no longer committed")
    seq = found.committed[failed].commit_seq
    older = [m for m in found.committed.values() if m.commit_seq < seq]
    if not older:
        raise NoCheckpointError(f"{found.root}: no committed checkpoint older than iteration {failed}")
    return max(older, key=lambda m: m.commit_seq).iteration


def _location(root: str) -> str:
    """A save location as the manager keeps it: an object storage URL as given, a path absolute."""
    return root.rstrip("/") if is_object_url(root) else os.path.abspath(root)


def _durable(ticket: Ticket) -> bool:
    """Whether the ticket's file is written (its future settled without an error)."""
    return ticket.durable.done() and ticket.durable.exception() is None


def _span(iterations: list[int]) -> str:
    """``a..b`` (or ``a``): a range of iterations in a log line, however many."""
    return f"{iterations[0]}..{iterations[-1]}" if len(iterations) > 1 else f"{iterations[0]}"
