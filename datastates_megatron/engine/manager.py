"""CheckpointManager: one rank's snapshot engine, its tiers and their promotion; restores go to its
:class:`.load.restorer.Restorer`.

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
import logging
import os
import secrets
import time

import torch

from .dist.collective import Collective
from .dist.store_channel import StoreChannel, default_store
from .errors import (
    CheckpointError,
    FlushError,
    PromotionError,
    error_class_named,
    make_error,
)
from .format.global_index import encode_summary
from .fs.iteration_dir import prepare_iteration_dir
from .load.choice import DECIDE_FIELDS, HOST_MEMORY, RestoreChoice, newest_common, offer
from .load.load_plan import LoadPlanner, SameLayoutPlanner
from .load.restorer import LoadResult, Restorer, location
from .names import RUN_ID_NAME, iter_dir
from .options import EngineOptions, ManagerOptions
from .runtime.faults import hold_point
from .runtime.threads import ClosingContext, close_at_exit, forget
from .save.snapshot import SnapshotEngine
from .save.stall_report import StallReport
from .storage.stream import memory_file
from .storage.url import is_object_url
from .tiers import host_copy
from .tiers.commit import CommitRecord, Ticket
from .tiers.reclaim import mark_ended
from .tiers.replica_strategy import replication_plan
from .tiers.startup import release, start_replication, start_tiers
from .tiers.tier import Tier, committed_iterations, committed_saves

__all__ = ["HOST_MEMORY", "CheckpointManager", "LoadResult", "RestoreChoice"]

log = logging.getLogger(__name__)


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
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world_size = dist.get_world_size() if dist else 1
        # s3:// or msc://: the persistent tier is an ObjectTier, written by the promotion (or, without
        # local_root, by the uploads of memory files: _uploads)
        self.objects = is_object_url(root)
        self.root = location(root)
        self.load_root = location(load_root or root)
        self.layout = dict(layout or {})
        self.on_error = policy.on_error
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
        started = start_tiers(
            self.persistent,
            self._world,
            rank=self.rank,
            token=token,
            objects=self.objects,
            local_base=self.local_base,
            node_ranks=self.node_ranks,
            policy=policy,
        )
        self.run_id, self.local, self.local_root = started.run_id, started.local, started.local_root
        self._save_empty = started.save_empty  # rank 0: --save held no checkpoint (:meth:`_warn_wiped_save`)
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
                    self.replication = start_replication(
                        self.local,
                        self._world,
                        rank=self.rank,
                        per_node=per_node,
                        node_ranks=self.node_ranks,
                        jump=jump,
                        factor=factor,
                        keep_last=policy.local_keep_last,
                        timeout_s=opts.timeout_s,
                        tiers=(self.local, self.persistent),
                    )
        except BaseException:
            self._abandon_start(opts.timeout_s)
            raise
        self._restorer = Restorer(
            rank=self.rank,
            world_size=self.world_size,
            layout=self.layout,
            root=self.root,
            load_root=self.load_root,
            persistent=self.persistent,
            local=self.local,
            local_root=self.local_root,
            run_id=self.run_id,
            replication=self.replication,
            host=self.host,
            world=self._world,
            channel=self._resolve_chan,
            policy=policy,
            default_planner=lambda: SameLayoutPlanner(self.engine.registered, self.world_size, self.layout),
            timeout_s=opts.timeout_s,
        )
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

    def _release_lock(self, timeout: float | None = None) -> None:
        """``timeout``: at most this long on each tier (a bucket that does not answer)."""
        release((self.local, self.persistent), timeout)

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

    def choose(self, iteration: int | None = None, *, root: str | None = None, check=None) -> RestoreChoice:
        """Collective: the one restore decision -- which tier and iteration (default: the newest
        every rank can restore), where each rank's state comes from, and the checkpoint's manifest
        as this rank needs it -- made on rank 0 in one round of the resolve step
        (:meth:`.load.restorer.Restorer.choose`); any error is raised on every rank
        (``NoCheckpointError`` when there is nothing to restore)."""
        self._check_open()
        self._drain_deletions(None)  # the decision never races retention of what it names
        return self._restorer.choose(iteration, root=root, check=check)

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
        every registered tensor from this rank's own file, same layout): collective, raises on every
        rank or none, and writes nothing unless every rank validated its part
        (:meth:`.load.restorer.Restorer.load`, with its fallbacks)."""
        self._check_open()
        choice = iteration if isinstance(iteration, RestoreChoice) else self.choose(iteration, root=root)
        self._drain_deletions(None)  # a load never races retention of what it may read
        return self._restorer.load(choice, verify, planner)

    def _persistent_committed(self) -> list[int]:
        return sorted(self.persistent.survey().committed) if self.objects else committed_iterations(self.root)

    def committed(self) -> list[int]:
        return self._persistent_committed()

    # ------------------------------------------------------------------ tiers
    def _newest_local(self) -> int | None:
        """Start-up: the newest node-local checkpoint every rank holds from one save (one gather to
        rank 0 and one small answer back; a failure on rank 0 is raised on every rank)."""
        cols = self._restore_chan.gather(offer(committed_saves(self.local_root, self.run_id, self.rank)), DECIDE_FIELDS)
        answer = None
        if self._restore_chan.is_root:
            try:
                answer = newest_common(cols, None)
            except Exception as e:  # noqa: BLE001 - every rank must hear it
                answer = {"error": type(e).__name__, "message": str(e)[:1500]}
        answer = self._restore_chan.broadcast(answer)
        if "error" in answer:
            err = make_error(
                error_class_named(answer["error"]),
                f"rank {self.rank}: finding the newest node-local checkpoint failed on rank 0: {answer['message']}",
            )
            # every rank raises; rank 0, the store's host, only once all have heard
            self._world.raise_agreed(err, "load", report=4, own=False)
            raise err
        return answer["local"][0] if answer["local"] else None

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


def _durable(ticket: Ticket) -> bool:
    """Whether the ticket's file is written (its future settled without an error)."""
    return ticket.durable.done() and ticket.durable.exception() is None


def _span(iterations: list[int]) -> str:
    """``a..b`` (or ``a``): a range of iterations in a log line, however many."""
    return f"{iterations[0]}..{iterations[-1]}" if len(iterations) > 1 else f"{iterations[0]}"
