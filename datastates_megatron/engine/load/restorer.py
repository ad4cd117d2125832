"""Restorer: one rank's restore -- the decision (:meth:`Restorer.choose`, made on rank 0 in one
resolve round) and the load of what it names, from a host copy, a node's copy, a clique's replica or
the persistent tier (a directory or object storage), falling back together when any rank fails.

The :class:`..manager.CheckpointManager` starts the tiers and hands them here; nothing in this module
starts, saves or commits.  Every method is collective unless its docstring says "rank 0".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import zlib
from collections.abc import Callable

from ..dist.collective import Collective
from ..dist.store_channel import StoreChannel
from ..errors import CheckpointError, NoCheckpointError, StorageReadError
from ..format.manifest import Manifest, RankRecord, read_manifest
from ..fs import fork_close
from ..fs.safe_io import make_dir
from ..names import INDEX_NAME, iter_dir
from ..options import ManagerOptions
from ..storage.url import is_object_url
from ..tiers import host_copy
from ..tiers.tier import Survey, committed_saves, latest_to_resume
from .choice import HOST_MEMORY, Restorable, RestoreChoice, decide, offer
from .load_plan import LoadPlanner, SameLayoutPlanner
from .reader import CheckpointReader, RestoreStats, open_checkpoint
from .resolve import Resolved, resolve

__all__ = ["RESTORE_CANDIDATES", "LoadResult", "Restorer", "location"]

log = logging.getLogger(__name__)

RESTORE_CANDIDATES = 3  # checkpoints a restore tries when the storage fails its reads (the chosen, then older)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    iteration: int
    objects: object
    metadata: dict
    stats: RestoreStats
    root: str  # the tier it was restored from
    plan_kind: str = SameLayoutPlanner.kind  # the planner that made the plan (``LoadPlanner.kind``)


def location(root: str) -> str:
    """A save location as the manager keeps it: an object storage URL as given, a path absolute."""
    return root.rstrip("/") if is_object_url(root) else os.path.abspath(root)


def _no_check(manifest, ckpt) -> bool:
    """Resolve without a layout check: the load plan checks what it needs (``False``: no reshard)."""
    return False


def _fetch_global_index(storage, iteration: int, d: str) -> None:
    """Copy checkpoint ``iteration``'s global index object, if it has one within the index's size
    cap, into ``d`` (the planner checks it against the manifest, and against the rank files it opens)."""
    from ..format.global_index import INDEX_MAX_BYTES
    from ..fs.durable import atomic_write
    from ..storage.survey import iter_prefix

    info = storage.head(iter_prefix(iteration) + INDEX_NAME)
    if info is None:
        return
    try:
        body = storage.read_capped(info.key, INDEX_MAX_BYTES, "global index", info.size)
    except CheckpointError as e:  # over its cap: never fetched
        log.warning("%s; planning without it", e)
        return
    atomic_write(os.path.join(d, INDEX_NAME), body)


def _older_than(found: Survey, *, failed: int) -> int:
    """Rank 0: the committed checkpoint in ``found`` committed last before ``failed`` was."""
    if failed not in found.committed:
        raise NoCheckpointError(f"{found.root}: iteration {failed} is no longer committed")
    seq = found.committed[failed].commit_seq
    older = [m for m in found.committed.values() if m.commit_seq < seq]
    if not older:
        raise NoCheckpointError(f"{found.root}: no committed checkpoint older than iteration {failed}")
    return max(older, key=lambda m: m.commit_seq).iteration


class Restorer:
    """Choose and load for one rank over the tiers its manager started.

    ``root``: the persistent tier's location (``persistent``: its :class:`.tiers.tier.Tier` or
    ``ObjectTier``), ``load_root``: the directory a restore reads by default; ``local``: the
    node-local tier of this run (at ``local_root``) or ``None``; ``replication``, ``host``: the
    clique's replicas and this rank's host copies, or ``None``.  ``world``: the default group's
    agreements; ``channel``: the store channel of the resolve round.  ``default_planner()``: the plan
    of a load given none (this rank's registered tensors, same layout).  ``timeout_s``: a read that
    stalls this long fails (agreed)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        layout: dict,
        root: str,
        load_root: str,
        persistent,
        local=None,
        local_root: str | None = None,
        run_id: str = "",
        replication=None,
        host: host_copy.HostCopies | None = None,
        world: Collective,
        channel: StoreChannel,
        policy: ManagerOptions,
        default_planner: Callable[[], LoadPlanner],
        timeout_s: float,
    ) -> None:
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.root, self.load_root = root, load_root
        self.objects = is_object_url(root)
        self.persistent, self.local, self.replication, self.host = persistent, local, replication, host
        self.local_root = local_root
        self.run_id = run_id
        self._world, self._resolve_chan = world, channel
        self.local_fallback = policy.local_fallback
        self.verify_on_load = policy.verify_on_load
        self.restore_threads = policy.restore_threads
        self.default_planner = default_planner
        self.timeout_s = timeout_s

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
        root = location(root or self.load_root)
        tiered = (bool(self.local_root) or self.host is not None) and root == self.root
        found = self._restorable() if tiered else None  # the clique's collective, with replication
        # one record to rank 0: which directory this rank asks for, and its local candidates
        record = {"root": zlib.crc32(root.encode("utf-8")), **(offer(found.saves) if tiered else {})}
        try:
            view = resolve(
                root,
                iteration,
                self._resolve_chan,
                self.layout,
                check=check or _no_check,
                offer=record,
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

    def _decide(self, cols: dict, found: Survey, *, root: str, iteration: int | None, tiered: bool) -> tuple:
        """Rank 0, inside the resolve step: :func:`.choice.decide` over this rank's tiers."""
        held = " or ".join(
            w for w, on in (("node-local", self.local_root), ("host-memory", self.host is not None)) if on
        )
        latest = functools.partial(self._latest_in, root)
        return decide(cols, found, root=root, iteration=iteration, tiered=tiered, latest=latest, held=held)

    def _fetch_own(self, view: Resolved) -> Resolved:
        """Collective: each rank fetches its own object of the checkpoint rank 0 resolved (``view``:
        the manifest's header and this rank's record, O(1) bytes per rank) into
        ``<local tier>/fetched/iter_N/``, verified whole (:mod:`..storage.fetch`); agreed.  Its
        directory and the one-record manifest, for the reader."""
        from ..storage.fetch import fetch_rank

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
            from ..names import iteration_of
            from ..tiers.retention import remove_ours

            for name in os.listdir(root) if os.path.isdir(root) else ():
                if iteration_of(name) not in (None, iteration):
                    remove_ours(os.path.join(root, name))
        make_dir(root)
        return root

    def _fetched(self, iteration: int, every_rank: bool) -> tuple[str, int]:
        """Collective: fetch checkpoint ``iteration`` of the persistent tier on object storage into
        ``<local tier>/fetched/`` -- this rank's object, or every rank's for a plan that reads them
        all -- each verified whole before it takes its name (:mod:`..storage.fetch`); agreed, so that
        a failure on any rank raises on every rank."""
        from ..storage.fetch import fetch_checkpoint

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

    def load(self, choice: RestoreChoice, verify: bool | None = None, planner: LoadPlanner | None = None) -> LoadResult:
        """Restore what ``choice`` names (:meth:`choose`; nothing is decided again) in place, as
        ``planner`` plans it (default: every registered tensor from this rank's own file, same
        layout), through the one verifying reader (:mod:`.reader`).  Collective: raises on every rank
        or none, and writes nothing unless every rank validated its part.  A planner that reads other
        ranks' files reads the shared tier (the load directory), never a node-local one.  A read the
        storage fails or stalls on any rank (:class:`StorageReadError`, agreed) makes every rank
        restore the next candidate: the persistent copy of a node-local checkpoint, else -- unless an
        iteration was asked for -- the checkpoint committed before (:meth:`_restore_older`)."""
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
        ``stall``: give up on a read that stalls for ``timeout_s`` (ranged GETs have theirs)."""
        planner = planner or self.default_planner()
        verify = self.verify_on_load if verify is None else verify
        stall_s = self.timeout_s if stall else None
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
        """Restore this rank's state from its host copy (:mod:`..tiers.host_copy`): its memory file,
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
        objects' metadata and the chunks the plan reads (:mod:`..storage.ranges`), into
        ``<local tier>/fetched/ranges-r<rank>/`` -- this rank's, emptied before and removed after --
        or, without a local tier, into memory files (no global index then: the plan reads each rank
        object's own metadata)."""
        from ..storage.fetch import fetch_manifest
        from ..storage.ranges import RangeFetcher
        from ..storage.survey import iter_prefix
        from ..tiers.retention import remove_ours

        from ..names import iteration_of

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
        by its tag) -- the only object storage location this restorer reads."""
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

    def _restorable(self) -> Restorable:
        """This rank's local-tier checkpoints: its host copy (:mod:`..tiers.host_copy`), else its
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
        return Restorable(dict(sorted(saves.items())), how, table)

    def _local_copy_of(self, iteration: int, persistent: RankRecord | None) -> bool:
        """This rank's local file of ``iteration`` is the very file the persistent manifest lists
        (``persistent``: same name -- run token and sequence -- size and checksums), so either may
        be read."""
        try:
            local = read_manifest(iter_dir(self.local_root, iteration)).record(self.rank)
        except (CheckpointError, OSError):
            return False
        return local is not None and local == persistent

    def _agree_error(self, err: BaseException | None) -> None:
        """The load's one agreement (a collective on every path): when any rank failed, every rank
        raises the same error -- the failed ranks' messages (the first four), each naming its file,
        rank and tensor, under their common error class.  One process: ``err`` itself."""
        self._world.raise_agreed(err, "load", report=4, own=False)
