"""The persistent tier on object storage: a :class:`..tiers.tier.Tier` over a save prefix and its one
owner.  The tier's contract (its numbered call order, :mod:`..tiers.tier`) is the same; what differs
is its storage steps, which this class overrides: the survey, the lock, start-up cleaning, the
promotion's copy, the committer's writes, retention.  Its commit thread, subscribers and deleter
are the base class's.

Its checkpoints are written by the promotion (the node-local tier absorbs the save; a rank
object is :func:`.upload.upload_verified` from the local file) or, without a node-local tier, by
:mod:`.stream` (the same upload, from a memory file).  The commit is the committer's
(:class:`..tiers.commit.Committer`: the same cross-rank agreement as on POSIX), which asks this
tier for the writes (:class:`..tiers.commit.CommitCalls`): every rank object is stored before rank 0
hears that rank's status, then the manifest is one PUT -- conditional: ``If-None-Match: *`` for a
new iteration, ``If-Match`` the surveyed tag for a re-save -- then the tracker (informative, may
lag).  S3's strong read-after-write consistency makes a manifest visible to every reader once its
PUT returns.  The one-writer lock is a lease object (:mod:`.lock`), checked before each manifest
and each deletion.  Retention (the writer's deleter thread, as on POSIX) deletes a checkpoint
manifest first, then the objects we wrote under it; nothing we did not write is deleted, and
nothing outside the prefix is touched.  As the POSIX tier, the writer knows what it committed: the
checkpoints kept come from the start-up survey (:meth:`ObjectTier.clean`) and the manifests it wrote
since, so a commit and its retention send the same requests whatever the number of checkpoints
kept (a listing of the iteration deleted and of the one committed, never one of every prefix nor a
HEAD of every kept manifest).

Thread-safety: as :class:`..tiers.tier.Tier`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time

from ..errors import CorruptCheckpointError, ForeignCheckpointError, LockLostError
from ..runtime.faults import crash_point
from ..format.manifest import Manifest
from ..names import (
    INDEX_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    RUN_ID_NAME,
    TRACKER_NAME,
    is_ours_in_iteration,
    iteration_of,
)
from ..tiers.run_id import RUN_ID_MAX_BYTES, is_run_id
from ..tiers.tier import Tier
from .base import ObjectExistsError, ObjectMissingError, ObjectStorageError, Storage
from .lock import DEFAULT_LEASE_S, ObjectLock
from .survey import ManifestCache, ObjectSurvey, iter_prefix, manifest_key, survey_committed, survey_objects
from .upload import upload_verified

__all__ = ["ObjectTier"]

log = logging.getLogger(__name__)


class ObjectTier(Tier):
    """The persistent tier of one rank on ``storage`` (see the module docstring).  ``writes``: the
    ranks this rank describes in manifests (every rank on rank 0, else empty); only the writer
    deletes.  ``lease_s``: the lock's lease (:mod:`.lock`)."""

    def __init__(
        self,
        storage: Storage,
        *,
        rank: int,
        token: str,
        writes: list[int],
        keep_last: int = 0,
        keep_every: int = 0,
        run_id: str = "",
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        super().__init__(
            "persistent",
            storage.url(),
            rank=rank,
            token=token,
            writes=writes,
            keep_last=keep_last,
            keep_every=keep_every,
            recycle_files="off",  # objects are never overwritten in place
            run_id=run_id,
        )
        self.storage = storage
        self._lease_s = lease_s
        self._manifests = ManifestCache()
        self._released = False  # the lock was released: a commit thread close() gave up on commits nothing

    @staticmethod
    def _location(root: str) -> str:
        """The storage's URL, as it is."""
        return root

    # ------------------------------------------------------------------ start-up (the writer)
    def survey(self) -> ObjectSurvey:
        return survey_objects(self.storage, self._manifests)

    def refuse_foreign(self, found: ObjectSurvey, option: str = "--save") -> None:
        """Refuse (``ForeignCheckpointError``) when an ``iter_*`` prefix without our manifest holds
        objects we did not write at a higher iteration than our newest commit."""
        newest = found.newest
        newer = {it: names for it, names in found.foreign().items() if newest is None or it > newest}
        if newer:
            it = min(newer)
            raise ForeignCheckpointError(
                f"{self.storage.url(iter_prefix(it))}: holds objects we did not write ({', '.join(newer[it][:3])}) "
                f"newer than our latest checkpoint ({newest}); a run from {option} would silently skip it: "
                "use another location"
            )

    def acquire(self) -> ObjectTier:
        """Take the prefix's lease lock (:class:`.lock.ObjectLock`)."""
        if self._dirlock is None:
            self._dirlock = ObjectLock(self.storage, lease_s=self._lease_s).acquire()
        return self

    def release(self, timeout: float | None = None) -> None:
        """Release the lock (idempotent), then the storage's connections and threads: the last call
        on a tier, after :meth:`close`.  ``timeout``: a store that does not answer would hold the
        caller for every retry of the lock's deletion and every part in flight; past ``timeout``
        seconds this gives up, logs it and returns (the lease runs out by itself, the requests left
        end with their own timeouts on a daemon thread)."""
        lock, self._dirlock = self._dirlock, None
        self._released = self._released or lock is not None
        if timeout is None:
            self._release(lock)
            return
        done = threading.Thread(target=self._release, args=(lock,), name=f"dsm-release-r{self.rank}", daemon=True)
        done.start()
        done.join(timeout)
        if done.is_alive():
            log.warning(
                "rank %d: %s: gave up after %.0f s releasing the lock and closing the storage (the store does not "
                "answer); the lock's lease runs out by itself in at most %.0f s",
                self.rank,
                self.root,
                timeout,
                self._lease_s,
            )

    def _release(self, lock: ObjectLock | None) -> None:
        try:
            if lock is not None:
                lock.release()
        finally:
            self.storage.close()

    def clean(self, found: ObjectSurvey | None = None) -> None:
        """Start-up (the writer): delete our leftovers (objects of uncommitted iterations, objects
        a committed manifest does not name, unfinished uploads of ours); a damaged manifest's
        objects are kept and logged."""
        if not self.is_writer:
            return
        found = found or self.survey()
        for it, err in found.damaged.items():
            log.warning("%s: manifest is unreadable (%s); leaving it alone", self.storage.url(iter_prefix(it)), err)
        removed = 0
        for it in found.leftovers():
            for name in found.objects[it]:
                self.storage.delete(iter_prefix(it) + name)
                removed += 1
        for it in found.committed:
            for name in found.strays(it):
                self.storage.delete(iter_prefix(it) + name)
                removed += 1
        abort = getattr(self.storage, "abort_unfinished", None)  # S3: uploads of a job killed mid-upload
        if abort is not None:
            removed += len(abort("iter_", _is_our_key))
        if removed:
            log.info("rank %d: removed %d leftover object(s) of ours under %s", self.rank, removed, self.root)
        self._next_seq = max((m.commit_seq for m in found.committed.values()), default=-1) + 1
        with self._deleter_lock:
            kept = {it: m.commit_seq for it, m in found.committed.items()}
            self._kept = {**kept, **(self._kept or {})}

    def ensure_run_id(self) -> str:
        """The id of this save location's run (``.datastates.run``, :mod:`..tiers.run_id`), created
        at its first start with a conditional create (the writer holds the lock; a lost race reads
        the winner's)."""
        for _ in range(2):
            try:
                raw = self.storage.read_capped(RUN_ID_NAME, RUN_ID_MAX_BYTES, "run id")
            except ObjectMissingError:
                run_id = f"{secrets.randbits(63):016x}"
                doc = {"run_id": run_id, "created": time.time(), "save_dir": self.root}
                try:
                    self.storage.create(RUN_ID_NAME, (json.dumps(doc) + "\n").encode("utf-8"))
                    return run_id
                except ObjectExistsError:
                    continue
            try:
                run_id = json.loads(raw.decode("utf-8"))["run_id"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                run_id = None
            if not isinstance(run_id, str) or not is_run_id(run_id):
                raise CorruptCheckpointError(
                    f"{self.storage.url(RUN_ID_NAME)}: not a run id object of datastates-megatron"
                )
            return run_id
        raise ObjectStorageError(f"{self.storage.url(RUN_ID_NAME)}: created and removed while it was read")

    # ------------------------------------------------------------------ the promotion's copy
    def promote_file(self, src: str, iteration: int, name: str, pace=None):
        """Store the local rank file ``src`` as ``iter_N/name`` (verified first): its receipt."""
        return upload_verified(src, self.storage, iter_prefix(iteration) + name, iteration, pace)

    # ------------------------------------------------------------------ the committer's writes
    def refuse_newer_format(self, iteration: int) -> None:
        """Nothing to refuse: a manifest is replaced only ``If-Match`` the tag surveyed."""

    def write_manifest(self, manifest: Manifest) -> None:
        """The commit point: one conditional PUT of the manifest."""
        if self._released:  # a thread close() gave up on, answered late: the lock is no longer ours
            raise LockLostError(
                f"{self.storage.url(LOCK_NAME)}: released when the job closed, before iteration "
                f"{manifest.iteration}'s manifest; not committed"
            )
        key = manifest_key(manifest.iteration)
        body = manifest.to_json()
        old = self.storage.head(key)
        receipt = self.storage.create(key, body) if old is None else self.storage.replace_if(key, body, old.etag)
        self._manifests.remember(key, receipt.etag, manifest)
        self._count_written(manifest)  # retention counts it, never reads it back

    def write_tracker(self, iteration: int) -> None:
        self.storage.put_bytes(TRACKER_NAME, f"{iteration}".encode())

    def write_index(self, manifest: Manifest, body: bytes, records: tuple | None = None) -> None:
        from ..format.global_index import index_blob

        self.storage.put_bytes(iter_prefix(manifest.iteration) + INDEX_NAME, index_blob(manifest, body, records))

    def discard(self, iteration: int, names: list[str], last: bool) -> None:
        """A save that was not committed: delete its rank objects (there are no directories)."""
        for name in names:
            try:
                self.storage.delete(iter_prefix(iteration) + name)
            except ObjectStorageError as e:  # uncommitted: the next start-up removes it
                log.warning("rank %d: %s", self.rank, e)

    # ------------------------------------------------------------------ after a commit (the deleter thread)
    def _retain_after(self, just) -> None:
        try:
            self._retain(just, self.outstanding())
        except (OSError, LockLostError) as e:
            log.warning(
                "rank %d: retention of %s after iteration %d failed (%s); nothing committed is lost, it is "
                "tried again at the next commit",
                self.rank,
                self.root,
                just.iteration,
                e,
            )

    def _retain(self, just, outstanding: list) -> None:
        if self._dirlock is not None:
            self._dirlock.check()  # lost: delete nothing (LockLostError, logged above)
        protected = {t.iteration for t in outstanding} | {just.iteration}
        for _, keep in self._followers:
            if keep is not None:
                protected |= keep()
        self._delete_by_policy(protected)
        with self._deleter_lock:
            manifest = self._written.get(just.iteration)
        if manifest is not None:  # superseded objects of this iteration's earlier saves
            found = self._with_objects(
                dataclasses.replace(_EMPTY, committed={just.iteration: manifest}), just.iteration
            )
            keep = {t.file_name(r) for t in (just, *outstanding) for r in self.writes}
            for name in found.strays(just.iteration):
                if name not in keep:
                    self.storage.delete(iter_prefix(just.iteration) + name)

    def _delete_by_policy(self, protected: set[int]) -> None:
        """Delete what the tier's :class:`..tiers.retention.KeepPolicy` does not keep, deciding on
        what the tier knows (:meth:`_commit_order`: no survey per commit); each iteration deleted
        is listed once (manifest first, then its objects)."""
        for it in self.retention.deletions(self._commit_order(), protected):
            crash_point("retention", self.rank)
            self._delete_checkpoint(self._with_objects(_EMPTY, it), it)  # one listing of that prefix
            with self._deleter_lock:
                self._kept.pop(it, None)
                self._written.pop(it, None)
            log.info("rank %d: retention deleted %s", self.rank, self.storage.url(iter_prefix(it)))

    def _surveyed_commits(self) -> dict[int, int]:
        """The fallback of :meth:`_commit_order` for a tier never cleaned: the ``iter_*`` prefixes
        and their manifests (O(checkpoints kept) requests, once)."""
        return {it: m.commit_seq for it, m in survey_committed(self.storage, self._manifests).committed.items()}

    def _with_objects(self, found: ObjectSurvey, iteration: int) -> ObjectSurvey:
        """``found`` with every object of ``iteration`` listed (one listing of that prefix)."""
        names = {o.key[len(iter_prefix(iteration)) :]: o for o in self.storage.list(iter_prefix(iteration))}
        names = {n: o for n, o in names.items() if "/" not in n}
        return dataclasses.replace(found, objects={**found.objects, iteration: names})

    def _delete_checkpoint(self, found: ObjectSurvey, iteration: int) -> None:
        """Manifest first (only the one listed: a manifest rewritten since is not ours to delete),
        then every object we wrote under the iteration; others stay.  A manifest already gone (an
        operator's deletion) leaves the objects to delete."""
        names = found.objects.get(iteration, {})
        manifest = names.get(MANIFEST_NAME)
        if manifest is not None:
            try:
                self.storage.delete(manifest.key, etag=manifest.etag)
            except ObjectExistsError:
                log.warning("%s: rewritten since it was surveyed; not deleted", self.storage.url(manifest.key))
                return
            except ObjectMissingError:
                log.info("%s: already deleted", self.storage.url(manifest.key))
        crash_point("retention_files")
        for name, info in names.items():
            if name != MANIFEST_NAME and is_ours_in_iteration(name):
                self.storage.delete(info.key)

    def close(self, timeout: float | None = None) -> None:
        """:meth:`abandon`: there is no recycle pool to empty."""
        self.abandon(timeout)

    def __repr__(self) -> str:  # pragma: no cover - for logs
        return f"ObjectTier({self.root!r}, rank={self.rank}, pid={os.getpid()})"


_EMPTY = ObjectSurvey("", {}, {}, {}, ())


def _is_our_key(key: str) -> bool:
    """``iter_NNNNNNN/<a name we write>``."""
    head, sep, name = key.partition("/")
    return bool(sep) and iteration_of(head) is not None and "/" not in name and is_ours_in_iteration(name)
