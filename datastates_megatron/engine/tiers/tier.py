"""A tier: one checkpoint directory and its one owner -- its lock, the refusal of a newer checkpoint we
did not write, commit, retention, recycle pool, start-up cleanup.

``persistent`` is the save directory; ``local`` a node-local one (``node_local``: per-node
manifests), linked to the persistent tier by a :class:`.promotion.Promotion`, which subscribes to
the local tier's commits (:meth:`Tier.on_commit`).  A tier's name is for logs and manifests only:
what it does follows its flags (``node_local``, ``first``, ``writes``).  The object tier
(:class:`..storage.object_tier.ObjectTier`) is a :class:`Tier` over object storage: it overrides
the storage steps below (marked *storage*) and shares the rest.  What a tier directory holds is
decided in one place, :func:`survey`: an ``iter_*`` directory whose manifest reads back is
committed; one whose manifest exists but does not read is damaged (never loaded, never removed);
one without a manifest holding only names we write (:mod:`.names`) is our leftover; anything else
is not ours and is left alone (:mod:`.foreign` reports it).  Deleting and recycling follow
:mod:`.retention`'s rules.

The tier contract -- the order in which a tier is called (as PyTorch DCP's ``storage.py`` numbers
a writer's), each step on the thread named:

1. ``Tier(...)`` (training thread): plain data, nothing touched; ``run_id`` may be set until step 3.
2. Start-up, the writer only (training thread): ``survey()`` (*storage*, read only), then
   ``refuse_foreign(found)`` (*storage*, read only: before the lock), ``acquire()`` (*storage*:
   the one-writer lock, checked before each commit and deletion from now on), ``clean(found)``
   (*storage*: our leftovers only), and for the save location ``ensure_run_id()`` (*storage*).
3. ``open(channel, world_size, layout, timeout_s)`` (training thread): starts the commit thread.
   The committer is given a :class:`.commit.CommitSpec` (this tier's plain data) and
   :class:`.commit.CommitCalls` (the tier's storage steps 6 and 7) -- never the tier itself.
4. ``on_commit(callback, keep)`` (training thread, before the first save): the subscribers (the
   promotion, replication); ``keep()`` names iterations retention must not delete yet.
5. Each save, in save order (training thread): ``submit(ticket)``; the ticket names the save's
   files (:meth:`.commit.Ticket.file_name`, the one place a rank file's name is made) and carries
   this rank's global-index summary.  Just before a save opens its file (a flush thread),
   ``recycled(path)`` may move a retired file into place.  A promotion's copy is
   ``promote_file(src, iteration, name, pace)`` (*storage*, the promotion's thread), whose
   receipt the ticket waits on.
6. Commit thread, the writer, once every rank's file is durable: ``refuse_newer_format(iteration)``
   (*storage*), ``write_index(manifest, body, records)`` (*storage*, a tier that is not ``node_local``),
   ``write_manifest(manifest)`` (*storage*: the commit point), then ``write_tracker(iteration)``
   (*storage*, may lag).
7. Commit thread, the writer, when a save was not committed: ``discard(iteration, names, last)``
   (*storage*): its files go, nothing committed is touched.
8. Commit thread, every rank, after a commit: the writer's retention is handed to its deleter
   thread (the tier's :class:`.retention.KeepPolicy`; *storage*), then each subscriber is
   called, in subscription order.  A tier written outside a committer (a replica store) calls
   ``write_manifest`` itself and then ``retain(protected)``: the same policy, applied now.
9. Any time after step 3 (training thread): ``poll()`` (commits completed; one stored error
   raised once), ``drain(timeout)``, ``outstanding()`` (any thread), ``latest``,
   ``abandoned_skips``, ``latest_committed()`` (*storage*, a fresh survey).
10. End (training thread): ``drain_deletions(timeout)``, then ``close(timeout)`` (joins the
    threads; *storage*: empties the recycle pool) -- or ``abandon(timeout)`` for a start-up that
    failed -- and last ``release()`` (*storage*: the lock).

Thread-safety: :meth:`Tier.clean` runs at start-up, before the commit thread exists;
what follows a commit (:meth:`Tier.on_commit` callbacks) runs on the tier's commit thread; the
function :meth:`Tier.recycled` returns on a flush thread (the pool is shared by the node's ranks:
each take is one atomic rename); :meth:`Tier.outstanding` from any thread (retention asks it on the
deleter thread); every other method on the training thread, :meth:`Tier.on_commit` at start-up."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

from .commit import CommitCalls, Committer, CommitSpec
from .deleter import Deleter
from ..fs.dirlock import SaveDirLock
from ..errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    FormatVersionError,
    LockLostError,
    NoCheckpointError,
)
from ..runtime.faults import crash_point
from .foreign import refuse_newer_foreign
from ..format import verified_copy
from ..format.global_index import write_index
from ..format.manifest import Manifest, read_manifest, write_manifest, write_tracker
from ..names import (
    INDEX_NAME,
    MANIFEST_NAME,
    RUN_SUBDIR_PREFIX,
    is_ours_in_iteration,
    iter_dir,
    iteration_of,
    parse_rank_file_name,
    save_id,
)
from .retention import (
    KeepPolicy,
    delete_checkpoint,
    deletion_failed,
    remove_ours,
    remove_stale_tracker_temps,
    take_recycled,
    trim_recycled,
    unlink_ours,
)
from .run_id import ensure_run_id
from ..fs.safe_io import make_dir, make_root, real_dir

__all__ = [
    "Tier",
    "Survey",
    "survey",
    "list_iterations",
    "committed_iterations",
    "latest_committed",
    "latest_to_resume",
    "committed_saves",
    "report_other_runs",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Survey:
    """What a tier directory holds, read once (manifests validated, nothing followed through a link)."""

    root: str
    iterations: tuple[int, ...]  # every ``iter_*`` directory, committed or not, ascending
    committed: dict[int, Manifest]
    damaged: dict[int, CheckpointError]  # a manifest is there but does not read back (or may not be read)

    @property
    def order(self) -> list[int]:
        """Committed iterations in commit order (oldest commit first): a run that resumed from an
        older checkpoint and committed again supersedes higher iterations left by an earlier run."""
        return sorted(self.committed, key=lambda it: (self.committed[it].commit_seq, it))

    @property
    def newest(self) -> int | None:
        return max(self.committed, key=lambda it: (self.committed[it].commit_seq, it), default=None)

    def latest(self) -> int:
        """The latest committed iteration.  A damaged (or linked, or unreadable) ``iter_*``
        directory *newer* than every committed one raises (its own class: a ``FormatVersionError``
        says "upgrade"): manifests are written atomically, so damage means corruption, not a crash,
        and silently loading an older checkpoint would hide it.  One older than the newest
        committed checkpoint, and written before it, cannot hide anything: it is logged and
        skipped.  "Older" is by iteration number and by the manifest's mtime (a damaged manifest's
        ``commit_seq`` cannot be read; one rewritten after the newest commit may be a later commit
        of a run that resumed from an older checkpoint); a linked ``iter_*`` directory was never
        written by us at all."""
        newest = self.newest
        blocking = {it: e for it, e in self.damaged.items() if not self._older_than(it, newest)}
        for it, err in self.damaged.items():
            if it not in blocking:
                log.warning(
                    "%s: skipped (older than the newest committed checkpoint, iteration %d): %s",
                    iter_dir(self.root, it),
                    newest,
                    err,
                )
        if blocking:
            first = blocking[min(blocking)]
            raise type(first)(f"{first} (pass an explicit iteration to load another checkpoint)") from None
        if not self.committed:
            raise NoCheckpointError(f"{self.root}: no committed checkpoint (no iter_*/{MANIFEST_NAME})")
        return self.newest

    def _older_than(self, iteration: int, newest: int | None) -> bool:
        """Whether damaged ``iteration`` is older than committed ``newest`` (see :meth:`latest`)."""
        if newest is None or iteration >= newest:
            return False
        d = iter_dir(self.root, iteration)
        if os.path.islink(d):
            return True
        try:
            mine = os.lstat(os.path.join(d, MANIFEST_NAME)).st_mtime_ns
            theirs = os.lstat(os.path.join(iter_dir(self.root, newest), MANIFEST_NAME)).st_mtime_ns
        except OSError:
            return False
        return mine <= theirs

    def leftovers(self) -> list[int]:
        """Uncommitted directories of ours: no manifest, and every entry a name we write."""
        out = []
        for it in self.iterations:
            d = iter_dir(self.root, it)
            if it in self.committed or it in self.damaged or not real_dir(d):
                continue
            if all(is_ours_in_iteration(n) for n in _entries(d)):
                out.append(it)
        return out

    def strays(self, iteration: int) -> list[str]:
        """Entries of committed ``iteration``'s directory that we wrote and its manifest does not name."""
        return _strays(iter_dir(self.root, iteration), self.committed[iteration])


def _strays(ckpt_dir: str, manifest: Manifest) -> list[str]:
    """Entries of ``ckpt_dir`` (committed by ``manifest``) that we wrote and ``manifest`` does not name."""
    named = {MANIFEST_NAME, INDEX_NAME, *manifest.file_names()}
    return [n for n in _entries(ckpt_dir) if n not in named and is_ours_in_iteration(n)]


def _entries(d: str) -> list[str]:
    """``os.listdir(d)``; ``[]`` when ``d`` vanished since it was surveyed (another job's retention,
    an operator): what is gone needs no cleaning."""
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


def list_iterations(root: str) -> list[int]:
    """Every ``iter_*`` directory under ``root``, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(it for n in names if (it := iteration_of(n)) is not None and os.path.isdir(os.path.join(root, n)))


def survey(root: str) -> Survey:
    """The one answer to "what is committed, ours, not ours" in the tier directory ``root``.
    Incremental: a manifest whose file is unchanged since it was last read here (same inode,
    size, mtime and ctime; :class:`_ManifestCache`) is not read again, nor one this process wrote
    itself (:meth:`Tier.write_manifest`) -- loads and ``ls`` survey a tier again; a tier's own
    retention does not: it knows what it committed."""
    iterations = list_iterations(root)
    committed, damaged = {}, {}
    for it in iterations:
        got = _MANIFESTS.read(iter_dir(root, it))
        if isinstance(got, Manifest):
            committed[it] = got
        elif got is not None:
            damaged[it] = got
    _MANIFESTS.keep_only(root, [iter_dir(root, it) for it in iterations])
    return Survey(root, tuple(iterations), committed, damaged)


def _detached(e: CheckpointError) -> CheckpointError:
    """``e``'s class and message without its traceback and causes: a stored error must not keep
    the frames (and so the bytes or parsed body of a hostile file) of the read that raised it."""
    try:
        return type(e)(str(e))
    except TypeError:
        return CorruptCheckpointError(str(e))


class _ManifestCache:
    """What :func:`read_manifest` said of each ``iter_*`` directory's manifest, keyed by its
    ``lstat`` (device, inode, size, mtime, ctime).  A manifest is replaced by a rename (a new
    inode), so an unchanged key is an unchanged file; one modified less than ``_RACY_NS`` ago is
    not cached (a write within the same timestamp tick would not change mtime: git's "racily
    clean" rule).  Bounded (oldest entries dropped); thread-safe (one lock around the dict)."""

    _RACY_NS = 2_000_000_000
    _MAX = 8192

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[tuple, object]] = {}

    def read(self, ckpt_dir: str) -> Manifest | CheckpointError | None:
        """The manifest of ``ckpt_dir``; its error (detached) when damaged or unreadable; ``None``
        when there is none (not committed)."""
        path = os.path.join(ckpt_dir, MANIFEST_NAME)
        key = None
        if real_dir(ckpt_dir):  # never through a linked directory: read_manifest refuses that itself
            key = _key(path)
        if key is not None:
            with self._lock:
                hit = self._entries.get(path)
            if hit is not None and hit[0] == key:
                return hit[1]
        try:
            got = read_manifest(ckpt_dir)
        except NoCheckpointError:
            return None
        except CheckpointError as e:  # damaged, or not ours to read (permission)
            got = _detached(e)
        if key is not None and time.time_ns() - max(key[3], key[4]) > self._RACY_NS:
            self._put(path, key, got)
        return got

    def remember(self, ckpt_dir: str, manifest: Manifest) -> None:
        """``manifest`` is what this process just wrote in ``ckpt_dir`` (a commit's writer): no
        survey need read it back (14 MB at 64k ranks), racy window or not -- it replaced the old one
        by a rename, so any later change of ours is a new inode (a new key)."""
        path = os.path.join(ckpt_dir, MANIFEST_NAME)
        key = _key(path)
        if key is not None:
            self._put(path, key, manifest)

    def _put(self, path: str, key: tuple, got) -> None:
        with self._lock:
            self._entries.pop(path, None)
            self._entries[path] = (key, got)
            while len(self._entries) > self._MAX:
                self._entries.pop(next(iter(self._entries)))

    def keep_only(self, root: str, ckpt_dirs: list[str]) -> None:
        """Forget the manifests under ``root`` outside ``ckpt_dirs`` (deleted by retention, say): the
        cache holds only what a survey of each root last found."""
        prefix = os.path.join(root, "")
        keep = {os.path.join(d, MANIFEST_NAME) for d in ckpt_dirs}
        with self._lock:
            for path in [p for p in self._entries if p.startswith(prefix) and p not in keep]:
                del self._entries[path]


def _key(path: str) -> tuple | None:
    """The cache key of the file at ``path`` (its ``lstat``), ``None`` when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


_MANIFESTS = _ManifestCache()  # the process's one manifest cache


def committed_iterations(root: str) -> list[int]:
    return survey(root).order


def latest_committed(root: str) -> int:
    return survey(root).latest()


def latest_to_resume(root: str, *, warn: bool = False, found: Survey | None = None) -> int:
    """The latest committed iteration under ``root`` -- refusing (``ForeignCheckpointError``) when a
    checkpoint we did not write there is newer: resuming would silently skip it.  ``warn``: log the
    older ones (left alone).  ``found``: the survey of ``root`` already made."""
    try:
        latest = (found or survey(root)).latest()
    except NoCheckpointError:
        refuse_newer_foreign(root, None, option="--load", warn=False)
        raise
    refuse_newer_foreign(root, latest, option="--load", warn=warn)
    return latest


def committed_saves(root: str, run_id: str, rank: int) -> dict[int, tuple[int, int, int]]:
    """``{iteration: (run token as an int, save sequence, commit time in ms)}`` of the checkpoints
    committed under ``root`` by run ``run_id`` that list ``rank``'s file: what a restart can restore
    from this directory (a node-local tier, or a replica store).  The commit time orders commits
    across runs and rollbacks.  A checkpoint of another run (copied in) is named and skipped."""
    out = {}
    for it, m in sorted(survey(root).committed.items()):
        if m.run_id != run_id:
            log.warning("rank %d: %s belongs to run %r, not this run; not loaded", rank, iter_dir(root, it), m.run_id)
            continue
        rec = m.record(rank)
        save = save_id(rec.file) if rec is not None else None
        if save is not None:
            out[it] = (*save, int(m.created * 1000))
    return out


def report_other_runs(local_base: str, run_id: str) -> list[str]:
    """Name, in one warning, what a shared node-local root holds of other runs: their ``run-<id>``
    directories and checkpoints written directly under the root (before local tiers were bound to
    their run).  Read only: they are never loaded or promoted by this run (one that ended cleanly was
    reclaimed before: :mod:`.reclaim`)."""
    try:
        names = os.listdir(local_base)
    except FileNotFoundError:
        return []
    ours = RUN_SUBDIR_PREFIX + run_id
    others = sorted(n for n in names if n != ours and (n.startswith(RUN_SUBDIR_PREFIX) or iteration_of(n) is not None))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        log.warning(
            "%s: holds node-local checkpoints of other runs (%s); this run (%s) never loads, promotes or "
            "deletes them (those of a run that ended cleanly with all in its --save are) -- remove them when "
            "those runs are over",
            local_base,
            shown,
            run_id,
        )
    return others


class Tier:
    """One tier of one rank: its directory and everything that changes it -- the directory's
    one-writer lock (:meth:`acquire`), the refusal of a newer checkpoint we did not write
    (:meth:`refuse_foreign`), its committer (:meth:`open`; then :meth:`submit`, :meth:`poll`,
    :meth:`drain`), its retention (``keep_last``/``keep_every``; 0 keeps everything), its recycle
    pool (:meth:`recycled`) and its start-up cleanup.  ``writes``: the ranks whose files this rank
    describes in the tier's manifests (empty on the ranks that are not the tier's writer); only the
    writer deletes.  ``recycle_files`` (:data:`.options.RECYCLE_CHOICES`) and ``first`` (saves are
    written here first; a promotion's copies are new files) decide whether retired rank files are
    overwritten in place.  What follows a commit -- the promotion to the next tier, replication --
    subscribes with :meth:`on_commit`."""

    def __init__(
        self,
        name: str,
        root: str,
        *,
        rank: int,
        token: str,
        writes: list[int],
        keep_last: int = 0,
        keep_every: int = 0,
        recycle_files: str = "off",
        first: bool = True,
        run_id: str = "",
        node_local: bool = False,
        retention: KeepPolicy | None = None,
    ) -> None:
        self.name = name  # in logs, records and manifests only: behaviour follows the flags
        # node-local (``node_local``): each node's leader writes a manifest of its node's ranks, no
        # global index is written, and ``recycle_files="local"`` applies
        self.node_local = node_local
        self.run_id = run_id  # the run this tier's manifests belong to (:mod:`.run_id`)
        self.root = self._location(root)
        self.rank = rank
        self.token = token  # this run's token, in the names of the files it writes
        self.writes = writes
        # which committed checkpoints the writer's retention keeps (``keep_last``/``keep_every``: its short form)
        self.retention = retention or KeepPolicy(keep_last, keep_every)
        # retention moves rank files to the pool that the next saves overwrite: where saves write
        # first, on the node-local tier unless "off", on a persistent tier alone only with "all"
        self._recycle = first and recycle_files in (("local", "all") if node_local else ("all",))
        self._committer: Committer | None = None
        self._dirlock: SaveDirLock | None = None
        self._followers: list[tuple] = []  # (callback, keep) of :meth:`on_commit`, in subscription order
        self._deleter: Deleter | None = None  # the writer's retention thread (:meth:`_deletions`)
        self._deleter_lock = threading.Lock()  # also guards _written and _kept
        self._written: dict[int, Manifest] = {}  # iteration -> the manifests this writer wrote last
        # iteration -> commit sequence of every checkpoint committed here, as the writer knows it: from
        # the start-up survey, then its own commits and deletions (retention never surveys again)
        self._kept: dict[int, int] | None = None
        self._next_seq = 0

    @staticmethod
    def _location(root: str) -> str:
        """``root`` as this tier names it: an absolute directory."""
        return os.path.abspath(root)

    @property
    def is_writer(self) -> bool:
        return bool(self.writes)

    # ------------------------------------------------------------------ start-up (the writer)
    def survey(self) -> Survey:
        """What the tier holds now (:func:`survey`)."""
        return survey(self.root)

    def latest_committed(self) -> int | None:
        """The newest committed iteration here (``None``: none); a damaged newer manifest raises."""
        try:
            return self.survey().latest()
        except NoCheckpointError:
            return None

    def ensure_run_id(self) -> str:
        """The id of the run this save location belongs to (:func:`.run_id.ensure_run_id`)."""
        return ensure_run_id(self.root)

    def refuse_foreign(self, found: Survey, option: str = "--save") -> None:
        """Raise ``ForeignCheckpointError`` when the directory holds a checkpoint we did not write
        that is newer than our newest in ``found``: a resume would silently skip it.  Read-only:
        called before :meth:`acquire`, so a refused start changes nothing."""
        refuse_newer_foreign(self.root, found.newest, option=option)

    def acquire(self) -> Tier:
        """Take the directory's one-writer lock (:class:`.dirlock.SaveDirLock`; ``SaveDirBusyError``
        when another job holds it).  Once held, every commit and every deletion first checks that
        the lock file is still the one locked (nothing is committed or deleted once it is not)."""
        if self._dirlock is None:
            self._dirlock = SaveDirLock(self.root).acquire()
        return self

    def release(self, timeout: float | None = None) -> None:
        """Release the lock (idempotent); after :meth:`close`.  ``timeout`` is for the object-storage
        tier (:mod:`..storage.object_tier`): releasing a ``flock`` never waits on storage."""
        lock, self._dirlock = self._dirlock, None
        if lock is not None:
            lock.release()

    def clean(self, found: Survey | None = None) -> None:
        """Start-up (the writer): remove our leftovers -- uncommitted directories, files a committed
        manifest does not name (a crashed re-save), stale tracker temps, the recycle pool.  A damaged
        manifest's directory is kept (it may be repairable) and logged; what is not ours stays."""
        if not self.is_writer:
            return
        make_root(self.root)  # the caller made its own directories with make_dir (never a link)
        found = found or survey(self.root)
        for it, err in found.damaged.items():
            log.warning("%s: manifest is unreadable (%s); leaving the directory alone", iter_dir(self.root, it), err)
        removed = [iter_dir(self.root, it) for it in found.leftovers() if remove_ours(iter_dir(self.root, it))]
        for it in found.committed:
            d = iter_dir(self.root, it)
            for name in found.strays(it):
                try:
                    if unlink_ours(os.path.join(d, name)):
                        removed.append(os.path.join(d, name))
                except OSError as e:  # a refused deletion never stops a start-up
                    deletion_failed(os.path.join(d, name), e, self.rank)
        removed += remove_stale_tracker_temps(self.root)
        trim_recycled(self.root, keep=0)
        if removed:
            log.info("rank %d: removed %d leftover(s) of ours under %s", self.rank, len(removed), self.root)
        self._next_seq = max((m.commit_seq for m in found.committed.values()), default=-1) + 1
        with self._deleter_lock:
            self._kept = {it: m.commit_seq for it, m in found.committed.items()}

    # ------------------------------------------------------------------ commits
    def open(self, collective, world_size: int, layout: dict, timeout_s: float) -> None:
        """Start the tier's commit thread (:class:`.commit.Committer`, on its own ``collective``),
        guarded by the lock when this rank holds it."""
        spec = CommitSpec(
            name=self.name,
            root=self.root,
            rank=self.rank,
            token=self.token,
            writes=tuple(self.writes),
            run_id=self.run_id,
            node_local=self.node_local,
        )
        calls = CommitCalls(
            write_manifest=self.write_manifest,
            write_tracker=self.write_tracker,
            write_index=self.write_index,
            discard=self.discard,
            refuse_newer_format=self.refuse_newer_format,
            after_commit=self._committed,
            guard=self._dirlock.check if self._dirlock is not None else None,
        )
        self._committer = Committer(spec, calls, collective, world_size, layout, self._next_seq, timeout_s)

    def submit(self, ticket) -> None:
        """Queue ``ticket`` (a save's, or a promotion's copy) for commit, in save order."""
        self._committer.submit(ticket)

    def poll(self) -> list:
        """Commits completed since the last call; re-raises one stored commit error (once)."""
        return self._committer.poll()

    def drain(self, timeout: float | None = None) -> None:
        """Block until every ticket submitted so far is committed or has failed."""
        self._committer.drain(timeout)

    def outstanding(self) -> list:
        """The tickets submitted and not yet committed (nor failed)."""
        return self._committer.outstanding() if self._committer is not None else []

    @property
    def latest(self) -> int | None:
        """The newest iteration this run committed here (``None``: none yet)."""
        return self._committer.latest

    @property
    def abandoned_skips(self) -> int:
        """Checkpoints abandoned here because some rank skipped its save (its storage was behind)."""
        return self._committer.skipped

    def on_commit(self, callback, keep=None) -> None:
        """Subscribe ``callback(ticket)``: called on the commit thread after each commit of this
        tier (after its retention is handed to the deleter; subscribers in order, each before the
        next commit).  ``keep()``: iterations this tier's retention must not delete yet (a copy of
        them is still being made elsewhere)."""
        self._followers.append((callback, keep))

    def recycled(self, path: str):
        """What to run just before a save opens ``path`` (on a flush thread): move a retired rank
        file of the pool into place to be overwritten -- ``None`` when this tier does not recycle."""
        return functools.partial(take_recycled, self.root, path) if self._recycle else None

    def _committed(self, ticket) -> None:
        """Commit thread, once ``ticket``'s save is committed: the writer hands it to its deleter
        (:mod:`.deleter`: retention and the superseded files of that iteration, off this thread);
        then the subscribers (:meth:`on_commit`) are called.  A deletion that fails is logged with
        its path and retried at the next commit: it never uncommits anything nor holds back a
        subscriber."""
        if self.is_writer:
            self._deletions().submit(ticket)
        for callback, _ in self._followers:
            callback(ticket)

    # ------------------------------------------------------------------ the storage (commit thread, promotion)
    def promote_file(self, src: str, iteration: int, name: str, pace=None):
        """Store the rank file ``src`` (another tier's) as ``name`` of ``iteration`` here, verified
        first (:func:`.verified_copy.copy_verified`): its receipt, for this tier's commit."""
        d = iter_dir(self.root, iteration)
        make_dir(d)  # never into a directory reached through a symlink
        return verified_copy.copy_verified(src, os.path.join(d, name), iteration, pace)

    def refuse_newer_format(self, iteration: int) -> None:
        """Raise :class:`CommitError` when ``iteration`` already holds a checkpoint in a newer format
        than this version writes: a re-save must never replace its manifest (nor, then, let retention
        take its files for strays).  A damaged manifest there is replaced, as before; none costs one
        ``lstat``, and one this process wrote or read unchanged is not read again (the manifest cache)."""
        d = iter_dir(self.root, iteration)
        if not os.path.lexists(os.path.join(d, MANIFEST_NAME)):
            return
        got = _MANIFESTS.read(d)  # a damaged one (or a linked directory's) is replaced, as before
        if isinstance(got, FormatVersionError):
            raise CommitError(
                f"{d}: holds a checkpoint in a newer format ({got}); it is left as it is and this save of iteration "
                f"{iteration} is not committed (save another iteration, or load it with a newer datastates-megatron)"
            )

    def write_index(self, manifest: Manifest, body: bytes, records: tuple | None = None) -> None:
        """The checkpoint's global index (:mod:`.global_index`), before its manifest."""
        write_index(self.root, manifest, body, records)

    def write_manifest(self, manifest: Manifest) -> None:
        """The commit point: ``manifest`` replaces the iteration's atomically; then remembered
        (:meth:`_manifest_written`)."""
        write_manifest(self.root, manifest)
        self._manifest_written(manifest)

    def write_tracker(self, iteration: int) -> None:
        """Megatron's tracker: informative, may lag the manifest."""
        write_tracker(self.root, iteration)

    def discard(self, iteration: int, names: list[str], last: bool) -> None:
        """A save that was not committed: remove its files ``names`` of ``iteration``; ``last`` (no
        other save of that iteration is pending): its directory too when nothing else is there."""
        d = iter_dir(self.root, iteration)
        for name in names:
            unlink_ours(os.path.join(d, name))
        if last:
            try:
                os.rmdir(d)  # only succeeds when empty: a committed manifest keeps it
            except OSError:
                pass

    def _manifest_written(self, manifest: Manifest) -> None:
        """The commit thread wrote ``manifest`` (the writer): this tier's retention counts it among the
        checkpoints kept and never reads it back (14 MB at 64k ranks) -- the tier knows what it
        wrote, so a commit's metadata work does not grow with the checkpoints kept.  The newest few
        manifests are kept for their rank-file names (the superseded files of a re-save)."""
        self._count_written(manifest)
        # the process's one manifest cache: no survey (a load, ``ls``) reads it back either
        _MANIFESTS.remember(iter_dir(self.root, manifest.iteration), manifest)

    def _count_written(self, manifest: Manifest) -> None:
        """``manifest`` (just written) among the checkpoints kept, and among the last few written."""
        with self._deleter_lock:
            if self._kept is not None:
                self._kept[manifest.iteration] = manifest.commit_seq
            self._written.pop(manifest.iteration, None)
            self._written[manifest.iteration] = manifest
            while len(self._written) > 4:
                self._written.pop(next(iter(self._written)))

    def _deletions(self) -> Deleter:
        """The writer's deleter, started on first use (a tier that never commits starts no thread)."""
        with self._deleter_lock:
            if self._deleter is None:
                self._deleter = Deleter(self.rank, self._retain_after, node_local=self.node_local)
            return self._deleter

    def drain_deletions(self, timeout: float) -> None:
        """Block until the retention of every commit so far is done (what ``wait()`` promises)."""
        if self._deleter is not None:
            self._deleter.drain(timeout)

    def _retain_after(self, just) -> None:
        """Deleter thread: retention after ``just``'s commit, protecting what is outstanding now."""
        try:
            self._retain(just, self.outstanding())
        except OSError as e:
            log.warning(
                "rank %d: retention of the %s tier after iteration %d failed (%s); nothing committed "
                "is lost, it is tried again at the next commit",
                self.rank,
                self.name,
                just.iteration,
                e,
            )

    def _retain(self, just, outstanding: list) -> None:
        if not self._still_owned():  # the lock was lost since the manifest was written: delete nothing
            return
        protected = {t.iteration for t in outstanding} | {just.iteration}
        for _, keep in self._followers:  # still being copied elsewhere (the next tier, partners)
            if keep is not None:
                protected |= keep()
        self._delete_by_policy(protected)
        with self._deleter_lock:
            manifest = self._written.get(just.iteration)
        if self._recycle:
            trim_recycled(self.root, keep=2 * len(self.writes))  # two checkpoints' worth
        # files of older saves of this iteration, superseded by its manifest -- not those of a save
        # still pending, nor of a later save of this run another rank may have started before this
        # (writer) rank submitted it: it supersedes
        keep = {t.file_name(r) for t in (just, *outstanding) for r in self.writes}
        d = iter_dir(self.root, just.iteration)
        for name in _strays(d, manifest) if manifest is not None else ():
            parsed = parse_rank_file_name(name)
            if parsed and name not in keep and not (parsed[1] == self.token and parsed[2] > just.seq):
                unlink_ours(os.path.join(d, name))

    def retain(self, protected: set[int]) -> None:
        """Apply this tier's :class:`.retention.KeepPolicy` now, on the calling thread, keeping
        ``protected``: for a tier written outside a committer (a replica store, whose receiver
        commits with :meth:`write_manifest`)."""
        self._delete_by_policy(protected)

    def _delete_by_policy(self, protected: set[int]) -> None:
        """Delete what the policy does not keep (a refused deletion is logged, tried again next time)."""
        for it in self.retention.deletions(self._commit_order(), protected):
            crash_point("retention", self.rank)
            try:
                delete_checkpoint(self.root, it, recycle=self._recycle, rank=self.rank)
            except OSError as e:  # the next ones may still go; this one is tried again next time
                deletion_failed(iter_dir(self.root, it), e, self.rank)
                continue
            with self._deleter_lock:
                self._kept.pop(it, None)
                self._written.pop(it, None)
            log.info("rank %d: retention deleted %s (%s tier)", self.rank, iter_dir(self.root, it), self.name)

    def _commit_order(self) -> list[int]:
        """The checkpoints committed here, oldest commit first.  From what the tier knows; only a
        tier whose start-up survey was never taken (:meth:`clean`) surveys, once."""
        with self._deleter_lock:
            kept = self._kept
        if kept is None:
            surveyed = self._surveyed_commits()
            with self._deleter_lock:
                if self._kept is None:
                    self._kept = surveyed
                    for it, m in self._written.items():  # written while the survey ran
                        self._kept.setdefault(it, m.commit_seq)
        with self._deleter_lock:
            return sorted(self._kept, key=lambda it: (self._kept[it], it))

    def _surveyed_commits(self) -> dict[int, int]:
        """``{iteration: commit_seq}`` of what is committed here, surveyed (the one fallback of
        :meth:`_commit_order`)."""
        return {it: m.commit_seq for it, m in survey(self.root).committed.items()}

    def _still_owned(self) -> bool:
        """Whether this job still owns the directory (its lock file is the one it locked): once not,
        another job may be using the recycle pool, and this one deletes nothing more there."""
        try:
            if self._dirlock is not None:
                self._dirlock.check()
        except LockLostError as e:
            log.warning("rank %d: leaving the recycle pool of %s as it is: %s", self.rank, self.root, e)
            return False
        return True

    def abandon(self, timeout: float | None = None) -> None:
        """Join the commit thread and the deleter (each within ``timeout`` s when given; past it, the
        thread is logged and left), and nothing else: a start-up that failed, or a run cut short
        (the directory stays as it is; :meth:`release` the lock after)."""
        if self._committer is not None:
            self._committer.close(timeout)
        if self._deleter is not None:
            self._deleter.close(timeout)  # after the committer: the last commit's retention is queued

    def close(self, timeout: float | None = None) -> None:
        """:meth:`abandon`; then (the writer) empty the pool: training is over, its retired files
        only hold space.  The lock is kept until :meth:`release`."""
        self.abandon(timeout)
        if self.is_writer and self._still_owned():
            try:
                trim_recycled(self.root, keep=0)
            except OSError as e:
                log.warning("rank %d: could not empty the recycle pool of %s: %s", self.rank, self.root, e)
