"""The one verifying reader: executes any load plan (:mod:`.load_plan`) over one committed checkpoint.

A load runs in two phases around one cross-rank agreement.  First, on this rank: make the plan,
validate it whole (every source range inside its tensor and the file's data section, every
destination of the right size and dtype), read the files it mostly uses into the page cache, and
verify every checksum chunk the plan touches, once.  Then ``agree(error)`` -- joined exactly once on
every path, success or error -- so that no rank copies while another failed.  Only then are bytes
copied into the live tensors.  A bad checkpoint therefore leaves every rank's tensors untouched.

Rank files are opened on demand, each checked against the manifest (size, header and index
checksums, save identity), and mapped read-only; a symlink is never followed.  At most
``max_open`` are open at once (least recently used closed first, never one in use), so that a
load reading many files -- a reshard across thousands of old ranks -- holds a bounded number of
descriptors; work on the mapping is done in rank order so that each file is opened about once.

Thread-safety: one thread drives a load; the reader's own pool verifies and copies.  ``rank_file``,
``read`` and the other accessors may be called from several threads; ``close`` must not race them.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import errno
import logging
import os
import stat
import threading
import time

import torch

from ..errors import (
    READ_ERRNOS,
    CheckpointError,
    CorruptCheckpointError,
    LayoutMismatchError,
    NoCheckpointError,
    RankFileError,
    StorageReadError,
)
from ..runtime.faults import crash_point
from ..runtime.threads import DaemonPool
from ..format.file_format import RankFile, TensorEntry
from ..format.hashing import xxh64
from .load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
from ..format.manifest import Manifest, RankRecord, read_manifest
from ..names import iter_dir
from ..fs.page_cache import warm_file
from ..fs.safe_io import describe

log = logging.getLogger(__name__)

__all__ = ["RestoreStats", "CheckpointReader", "open_checkpoint", "open_rank", "MAX_OPEN_FILES"]

MAX_OPEN_FILES = 32  # rank files a reader keeps open at once (64 descriptors)


@dataclasses.dataclass
class RestoreStats:
    """What a load did: bytes copied, bytes hashed (whole chunks), and seconds per phase."""

    bytes: int = 0
    verified_bytes: int = 0
    verify_s: float = 0.0
    copy_s: float = 0.0
    read_ahead_s: float = 0.0  # 0 when the files were resident already
    read_bytes: int = 0  # bytes the read-ahead read from storage (0: resident already)
    plan_s: float = 0.0  # making and validating the plan (opens the files it names)
    agree_s: float = 0.0  # the cross-rank agreement (waits for the slowest rank)
    files_opened: int = 0  # rank files the reader opened (a reshard with a global index: only those it reads)
    fetched_bytes: int = 0  # bytes fetched from object storage for the plan's chunks (a ``fetcher``'s)


def open_checkpoint(root: str, iteration: int) -> tuple[str, Manifest]:
    """``(directory, manifest)`` of committed checkpoint ``iteration`` under ``root``; an ``iter_*``
    symlink is refused by :func:`.manifest.read_manifest`, never followed."""
    ckpt = iter_dir(root, iteration)
    if not os.path.lexists(ckpt):
        raise NoCheckpointError(f"{ckpt}: no such checkpoint directory")
    return ckpt, read_manifest(ckpt)


def open_rank(
    ckpt: str, manifest: Manifest, rank: int, record: RankRecord | None = None, memory_fd: int | None = None
) -> RankFile:
    """Open ``rank``'s file and check it is the one the manifest committed (a regular file of the
    committed size, whose header and index checksums, tag and iteration are the committed ones).
    The one check of a rank file against its manifest: a load and ``datastates-ckpt inspect``/``verify``
    use it.  A file that is not the committed one is a :class:`RankFileError` (its ``kind``: missing,
    size or file); one the format refuses (damaged, newer) raises the format's own error.
    ``memory_fd``: the file is this memfd (fetched into memory), which ``ckpt``/``rec.file`` only name."""
    rec = record or manifest.record(rank)  # ``record``: the manifest's, from the checkpoint's global index
    if rec is None:
        raise CorruptCheckpointError(f"{ckpt}: the {manifest.tier} manifest has no file for rank {rank}")
    path = os.path.join(ckpt, rec.file)
    missing = f"{ckpt}: rank {rank} file {rec.file} is missing"
    try:
        st = os.lstat(path) if memory_fd is None else os.fstat(memory_fd)
    except FileNotFoundError as e:
        raise RankFileError(missing, "missing", "file is missing") from e
    except OSError as e:
        if e.errno in READ_ERRNOS:
            raise _read_error(path, rank, "stat", e) from e
        raise RankFileError(
            f"{path}: rank {rank} file cannot be read: {e}", "file", f"cannot stat the file: {e}"
        ) from e
    if not stat.S_ISREG(st.st_mode):  # a link may point outside the checkpoint: never followed
        what = describe(st.st_mode)
        raise RankFileError(
            f"{missing}: {path} is {what}, not a regular file; refusing to follow or use it",
            "file",
            f"is {what} (not a regular file inside the checkpoint)",
        )
    if st.st_size != rec.file_bytes:
        what = "truncated" if st.st_size < rec.file_bytes else "longer than committed"
        raise RankFileError(
            f"{path}: rank {rank} file has {st.st_size} bytes, manifest says {rec.file_bytes}",
            "size",
            f"file is {what}: {st.st_size} bytes, manifest says {rec.file_bytes}",
        )
    try:
        rf = RankFile(path, memory_fd)  # O_NOFOLLOW + fstat again (:mod:`.safe_io`): a swap since lstat is refused too
    except FileNotFoundError as e:
        raise RankFileError(missing, "missing", "file is missing") from e
    except StorageReadError as e:
        raise StorageReadError(f"rank {rank}: {e}", e.errno) from e
    except OSError as e:
        if e.errno in READ_ERRNOS:
            raise _read_error(path, rank, "open", e) from e
        problem = f"rank {rank} file cannot be read: {e}"
        raise RankFileError(f"{path}: {problem}", "file", problem) from e
    if (
        xxh64(rf.header.pack()) != rec.header_xxh64
        or rf.header.index_xxh64 != rec.index_xxh64
        or rf.objects.get("tag") != rec.file
        or rf.objects.get("version") != manifest.iteration
    ):
        rf.close()
        problem = f"rank {rank} file is not the one committed by the manifest (from another iteration or run?)"
        raise RankFileError(f"{path}: {problem}", "file", problem)
    return rf


def _read_error(path: str, rank: int, what: str, e: OSError) -> StorageReadError:
    """The one line a failed read of a rank file gives: rank, file and errno."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    return StorageReadError(
        f"rank {rank}: {path}: {what} failed: {name} ({e.strerror or os.strerror(e.errno)})", e.errno
    )


def _no_agreement(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _copy_one(src: torch.Tensor, dst: torch.Tensor, rank: int) -> int:
    crash_point("restore", rank)
    with torch.no_grad():
        dst.copy_(src.view(dst.shape))
    return src.numel() * src.element_size()


def _copy_batch(pairs: list, rank: int) -> int:
    return sum(_copy_one(src, item.dest, rank) for src, item in pairs)


def copy_batches(pairs: list, tasks: int) -> list[list]:
    """``pairs`` (source view, item) cut, in order, into about ``tasks`` batches of similar bytes: a
    plan of many small items (a row-parallel tensor resharded row by row) costs one task per batch,
    not a thread hand-off per item; a large item is a batch of its own."""
    total = sum(src.numel() * src.element_size() for src, _ in pairs)
    target = max(1, total // max(1, tasks))
    batches, batch, size = [], [], 0
    for src, item in pairs:
        nbytes = src.numel() * src.element_size()
        if batch and nbytes >= target:  # a large item goes alone: the batch before it is closed
            batches.append(batch)
            batch, size = [], 0
        batch.append((src, item))
        size += nbytes
        if size >= target:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    return batches


class CheckpointReader:
    """Reads checkpoint ``ckpt`` (its parsed ``manifest``) for rank ``rank``: executes load plans
    (:meth:`load`) and hands out verified element ranges (:meth:`read`).

    ``verify``: check chunk checksums before data is used (each chunk once per reader).
    ``max_open``: rank files open at once (each holds two descriptors: the file and its mapping).
    A context manager; ``close()`` is idempotent.  Thread-safety: see the module docstring."""

    def __init__(
        self,
        ckpt: str,
        manifest: Manifest,
        *,
        rank: int = 0,
        verify: bool = True,
        threads: int = 4,
        max_open: int = MAX_OPEN_FILES,
        partial: bool = False,
        fetcher=None,
    ) -> None:
        """``partial``: ``manifest`` holds this rank's record only (:func:`.source.resolve`); a plan
        that reads another rank's file makes the reader read the whole manifest then, once.
        ``fetcher``: the rank files are fetched piecewise from object storage into ``ckpt``
        (:class:`..storage.ranges.RangeFetcher`): each when first opened (its metadata), and the
        chunks a read or a plan uses before they are verified and copied."""
        self.fetcher = fetcher
        self.ckpt = ckpt
        self.manifest = manifest
        self._partial = partial
        self.rank = rank
        self.verify_chunks = verify
        self.threads = max(1, int(threads))
        self.max_open = max(1, int(max_open), self.threads)
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[int, RankFile] = collections.OrderedDict()  # least recently used first
        self._pins: collections.Counter[int] = collections.Counter()  # files whose mapping is in use
        self._verified: set[tuple[int, str, int]] = set()
        self._closed = False
        self.opened: set[int] = set()  # the ranks whose files this reader opened (for tests, benchmarks)
        self._records = None  # a partial manifest's other records: their source (:meth:`records_from`)
        self._found: dict[int, RankRecord] = {}
        self._progress = 0  # reads returned so far (files opened, read-ahead blocks, chunks verified)
        self._reading = ckpt  # the file read last: what a stalled read names
        self._preparing = False  # a deadline's worker thread is in the first phase
        self._abandoned = False  # ... and its caller gave up on it: it closes the reader when it returns
        self._deadline_lock = threading.Lock()  # for those two: a stalled open holds ``_lock``

    def records_from(self, source) -> None:
        """With a partial manifest, take the records of other ranks from ``source`` (``record(rank)
        -> RankRecord | None``, ``close()``: the checkpoint's global index, bound to the same commit;
        closed with this reader) before reading the whole manifest; ``None``: no such source."""
        with self._lock:
            old, self._records = self._records, source
        if old is not None and old is not source:
            old.close()

    # ------------------------------------------------------------------ files
    def rank_file(self, rank: int) -> RankFile:
        """The (validated) file of ``rank``, opened on first use.  Its header, entries and objects
        stay usable after the reader closes it; its mapping only under :meth:`_mapped`."""
        if not 0 <= rank < self.manifest.world_size:
            raise LayoutMismatchError(
                f"{self.ckpt}: no rank {rank} in a checkpoint of world size {self.manifest.world_size}"
            )
        with self._lock:
            if self._closed:
                raise CheckpointError(f"{self.ckpt}: reader is closed")
            rf = self._files.get(rank)
            if rf is not None:
                self._files.move_to_end(rank)
                return rf
            record = None
            if self._partial and self.manifest.record(rank) is None:
                record = self._record_of(rank)
                if record is None:
                    self._read_whole_manifest()
            self._evict(self.max_open - 1)
            rec = record or self.manifest.record(rank)
            self._reading = os.path.join(self.ckpt, rec.file) if rec is not None else self.ckpt
            if self.fetcher is not None:
                self.fetcher.open(rank)
            memory = None if self.fetcher is None else self.fetcher.memory_fd(rank)
            rf = self._files[rank] = open_rank(self.ckpt, self.manifest, rank, record, memory)
            self.opened.add(rank)
            self._tick()
            return rf

    def _record_of(self, rank: int) -> RankRecord | None:
        """(lock held) ``rank``'s record from :meth:`records_from`'s source (``None``: it has none,
        or failed: logged, and the whole manifest is read instead)."""
        if rank in self._found:
            return self._found[rank]
        if self._records is None:
            return None
        try:
            rec = self._records.record(rank)
        except CheckpointError as e:
            log.warning("rank %d: %s; reading the whole manifest instead", self.rank, e)
            self._records.close()
            self._records = None
            return None
        if rec is not None:
            self._found[rank] = rec
        return rec

    def _tick(self) -> None:
        """A read returned (a lost increment between threads is harmless: any change is progress)."""
        self._progress += 1

    def _read_whole_manifest(self) -> None:
        """(lock held) The whole manifest of the checkpoint whose header this reader was given: the
        same commit, or a :class:`CorruptCheckpointError` naming it."""
        whole = read_manifest(self.ckpt)
        if (whole.iteration, whole.commit_seq, whole.run_token) != (
            self.manifest.iteration,
            self.manifest.commit_seq,
            self.manifest.run_token,
        ):
            raise CorruptCheckpointError(f"{self.ckpt}: the manifest changed while it was read")
        self.manifest, self._partial = whole, False

    def _evict(self, keep: int) -> None:
        """Close least recently used files not in use until at most ``keep`` are open (lock held)."""
        for old in [r for r in self._files if not self._pins[r]][: max(0, len(self._files) - keep)]:
            self._files.pop(old).close()

    @contextlib.contextmanager
    def _mapped(self, rank: int):
        """``rank``'s file, kept open while the caller reads its mapping (views made under it stay
        valid after: an unmapped file's pages go with its last view)."""
        with self._lock:
            self._pins[rank] += 1
        try:
            rf = self.rank_file(rank)
            self._reading = rf.path
            yield rf
        finally:
            with self._lock:
                self._pins[rank] -= 1

    def objects(self, rank: int):
        """The non-tensor objects rank ``rank`` saved (``objects`` section, as passed to save)."""
        return self.rank_file(rank).objects["objects"]

    def tensor_meta(self, rank: int) -> dict:
        """``{tensor name: meta}`` as registered by rank ``rank``."""
        meta = self.rank_file(rank).objects.get("tensor_meta")
        return meta if isinstance(meta, dict) else {}

    def entry(self, rank: int, name: str) -> TensorEntry:
        rf = self.rank_file(rank)
        try:
            return rf.entries[name]
        except KeyError as e:
            raise CorruptCheckpointError(f"{rf.path}: rank {rank} file has no tensor {name!r}") from e

    # ------------------------------------------------------------------ ranges
    def _bytes_of(self, r: ElementRange) -> tuple[RankFile, TensorEntry, int, int]:
        """The file, entry and byte range ``[lo, hi)`` of ``r`` within its tensor, checked to lie
        inside the tensor and the file's data section."""
        rf = self.rank_file(r.rank)
        e = self.entry(r.rank, r.tensor)
        size = e.dtype.itemsize
        numel = e.nbytes // size if size else 0
        if r.start < 0 or r.count < 0 or r.start + r.count > numel:
            raise LayoutMismatchError(
                f"{rf.path}: rank {r.rank} tensor {r.tensor!r} has {numel} elements; asked for "
                f"[{r.start}, {r.start + r.count})"
            )
        lo, hi = r.start * size, (r.start + r.count) * size
        h = rf.header
        if not h.data_offset <= e.offset + lo <= e.offset + hi <= h.data_offset + h.data_bytes:
            raise CorruptCheckpointError(
                f"{rf.path}: rank {r.rank} tensor {r.tensor!r}: bytes {e.offset + lo}..{e.offset + hi} lie outside "
                f"the data section [{h.data_offset}, {h.data_offset + h.data_bytes})"
            )
        return rf, e, lo, hi

    def chunks_of(self, r: ElementRange) -> list[tuple[int, str, int]]:
        """The ``(rank, tensor, chunk)`` checksum chunks covering ``r``."""
        rf, _, lo, hi = self._bytes_of(r)
        if hi <= lo:
            return []
        cb = rf.header.chunk_bytes
        return [(r.rank, r.tensor, c) for c in range(lo // cb, (hi - 1) // cb + 1)]

    def _view(self, r: ElementRange) -> torch.Tensor:
        """1-D zero-copy view of ``r`` (copy-on-write mapping: writing it never touches the file)."""
        with self._mapped(r.rank):
            rf, e, lo, hi = self._bytes_of(r)
            if hi == lo:
                return torch.empty(0, dtype=e.dtype)
            return torch.from_numpy(rf.raw(e)[lo:hi]).view(e.dtype)

    def _views(self, rank: int, items: list[ReadItem]) -> list[tuple[torch.Tensor, ReadItem]]:
        """``(source view, item)`` for validated items of rank ``rank``'s file: one typed view of each
        tensor, sliced per item (a plan of many small items pays one slice each)."""
        whole: dict[str, torch.Tensor] = {}
        out = []
        with self._mapped(rank) as rf:
            for it in items:
                r = it.source
                t = whole.get(r.tensor)
                if t is None:
                    e = self.entry(rank, r.tensor)
                    size = e.dtype.itemsize
                    t = whole[r.tensor] = torch.from_numpy(rf.raw(e)[: e.nbytes // size * size]).view(e.dtype)
                out.append((t[r.start : r.start + r.count], it))
        return out

    def read(self, r: ElementRange) -> torch.Tensor:
        """A 1-D zero-copy view of ``r``, after verifying the chunks it touches."""
        self.fetch([r])
        self.verify([r])
        return self._view(r)

    def fetch(self, ranges) -> int:
        """With a ``fetcher``: fetch the chunks covering ``ranges`` not fetched yet (whole chunks:
        what verification hashes); the bytes moved.  Without one: 0."""
        if self.fetcher is None:
            return 0
        spans: dict[int, list[tuple[int, int]]] = {}
        for rank, name, c in sorted({k for r in ranges for k in self.chunks_of(r)}):
            e = self.entry(rank, name)
            cb = self.rank_file(rank).header.chunk_bytes
            lo = e.offset + c * cb
            spans.setdefault(rank, []).append((lo, min(e.offset + e.nbytes, lo + cb)))
        return sum(self.fetcher.fetch(rank, s) for rank, s in sorted(spans.items()))

    # ------------------------------------------------------------------ verification
    @property
    def _source(self) -> str:
        """Where the checkpoint's bytes come from: its directory, or the object storage prefix."""
        return self.ckpt if self.fetcher is None else f"{self.ckpt} (fetched from {self.fetcher.source})"

    def _verify_chunk(self, key: tuple[int, str, int]) -> tuple[str | None, int]:
        rank, name, c = key
        try:
            with self._mapped(rank) as rf:
                n = rf.verify_chunk(rf.entries[name], c)
        except CorruptCheckpointError as e:
            return f"rank {rank}: {e}", 0
        with self._lock:
            self._verified.add(key)
        self._tick()
        return None, n

    def verify(self, ranges, pool: cf.Executor | None = None) -> int:
        """Verify every chunk covering ``ranges`` not yet verified by this reader, in parallel;
        raises :class:`CorruptCheckpointError` naming every bad chunk.  Returns the bytes hashed."""
        if not self.verify_chunks:
            return 0
        keys = sorted({k for r in ranges for k in self.chunks_of(r)})
        with self._lock:
            keys = [k for k in keys if k not in self._verified]
        if not keys:
            return 0
        if pool is None:
            with cf.ThreadPoolExecutor(self.threads, thread_name_prefix=f"dsm-read-r{self.rank}") as own:
                results = list(own.map(self._verify_chunk, keys))
        else:
            results = list(pool.map(self._verify_chunk, keys))
        bad = [msg for msg, _ in results if msg]
        if bad:
            raise CorruptCheckpointError(
                f"rank {self.rank}: {len(bad)} corrupt chunk(s) in {self._source}: " + "; ".join(bad[:5])
            )
        return sum(n for _, n in results)

    # ------------------------------------------------------------------ plans
    def validate(self, plan: LoadPlan) -> None:
        """Raise (naming file, rank and tensor) unless every item of ``plan`` can be executed: its
        source inside its tensor and the data section, its destination a tensor of the source's
        dtype and element count."""
        for item in plan.items:
            r, dst = item.source, item.dest
            rf, e, _, _ = self._bytes_of(r)
            what = f"{rf.path}: rank {r.rank} tensor {r.tensor!r} elements [{r.start}, {r.start + r.count})"
            to = f"destination {item.label!r}" if item.label else "the destination"
            if not isinstance(dst, torch.Tensor):
                raise LayoutMismatchError(f"{what}: {to} is a {type(dst).__name__}, not a tensor")
            if dst.dtype != e.dtype:
                raise LayoutMismatchError(f"{what}: holds {e.dtype}, {to} is {dst.dtype}")
            if dst.numel() != r.count:
                raise LayoutMismatchError(f"{what}: {r.count} elements go to {to} of {dst.numel()}")

    def _warm(self, plan: LoadPlan, pool: cf.Executor) -> int:
        """Read into the page cache each file the plan reads at least half of (one sequential pass
        beats page faults); a file the plan reads a little of is left to the faults.  Returns the
        bytes read."""
        wanted: dict[int, int] = {}
        for item in plan.items:
            e = self.entry(item.source.rank, item.source.tensor)
            wanted[item.source.rank] = wanted.get(item.source.rank, 0) + item.source.count * e.dtype.itemsize
        warmed = 0
        for rank, nbytes in sorted(wanted.items()):
            with self._mapped(rank) as rf:
                try:
                    read = 2 * nbytes >= rf.header.data_bytes and warm_file(
                        rf.path, rf.fileno(), pool, self.threads, self._tick
                    )
                except StorageReadError as e:
                    raise StorageReadError(f"rank {rank}: {e}", e.errno) from e
                if read:
                    warmed += rf.header.file_bytes
        return warmed

    def load(self, planner: LoadPlanner, agree=None, *, stall_s: float | None = None) -> tuple[LoadPlan, RestoreStats]:
        """Plan with ``planner``, validate, warm and verify; join ``agree`` once; then copy.

        ``agree(error)`` is the cross-rank agreement (a collective): every rank passes its error, or
        None when its part validated, and it raises on every rank when any rank failed.  Without it
        this rank's error is raised as it is.  Nothing is written to a destination unless every
        rank validated.  Returns the plan and the statistics.

        ``stall_s``: the first phase runs on a thread of its own, and when no read returns for
        ``stall_s`` seconds (checked every ``stall_s``: given up after at most twice that since the
        last read) this rank gives up on it -- a :class:`StorageReadError` naming the file, joined
        to the agreement like any other error.  The abandoned thread keeps the reader's files and
        its daemon threads until the stalled call returns, then closes them."""
        agree = agree or _no_agreement
        stats = RestoreStats()
        pool = DaemonPool(self.threads, f"dsm-read-r{self.rank}")
        handed_off = False
        try:
            if stall_s is None:
                plan, error = self._prepare(planner, pool, stats)
            else:
                plan, error, handed_off = self._prepare_within(planner, pool, stats, stall_s)
            t0 = time.perf_counter()
            agree(error)
            stats.agree_s = time.perf_counter() - t0
            if error is not None:  # an agreement that does not raise on the failed rank: still never copy
                raise error
            t0 = time.perf_counter()
            by_rank: dict[int, list[ReadItem]] = {}
            for it in plan.items:
                by_rank.setdefault(it.source.rank, []).append(it)
            for r in sorted(by_rank):  # file by file: its views, then its copies
                batches = copy_batches(self._views(r, by_rank[r]), 4 * self.threads)
                stats.bytes += sum(pool.map(lambda batch: _copy_batch(batch, self.rank), batches))
                del batches
            stats.copy_s = time.perf_counter() - t0
        finally:
            if not handed_off:
                pool.shutdown(wait=True)
        stats.files_opened = len(self.opened)
        return plan, stats

    def _prepare(self, planner: LoadPlanner, pool: cf.Executor, stats: RestoreStats):
        """The first phase, on this rank only: ``(plan, None)``, or ``(plan or None, the error)``."""
        plan = None
        try:
            t0 = time.perf_counter()
            plan = planner.plan(self)
            self.validate(plan)
            stats.plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.fetcher is not None:  # the chunks the plan reads, by ranged GETs (no read-ahead)
                self.fetch([it.source for it in plan.items])
                stats.fetched_bytes = self.fetcher.fetched_bytes  # metadata and chunks
            else:
                stats.read_bytes = self._warm(plan, pool)
            if stats.read_bytes:
                stats.read_ahead_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            stats.verified_bytes = self.verify([it.source for it in plan.items], pool)
            stats.verify_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - every rank must hear it (an OSError too), not only this one
            return plan, e
        return plan, None

    def _prepare_within(self, planner: LoadPlanner, pool: DaemonPool, stats: RestoreStats, stall_s: float):
        """:meth:`_prepare` on a daemon thread, given up when no read returns for ``stall_s``:
        ``(plan, error, whether the thread was abandoned)``."""
        done = threading.Event()
        box: dict = {}

        def run() -> None:
            try:
                box["out"] = self._prepare(planner, pool, stats)
            finally:
                with self._deadline_lock:
                    self._preparing = False
                    abandoned = self._abandoned
                done.set()
                if abandoned:  # the caller is gone: what it would have released is ours
                    pool.shutdown(wait=False)
                    self._close_files()
                    log.info("rank %d: the abandoned read of %s returned; its files are closed", self.rank, self.ckpt)

        with self._deadline_lock:
            self._preparing = True
        worker = threading.Thread(target=run, name=f"dsm-restore-r{self.rank}", daemon=True)
        worker.start()
        seen = -1
        while not done.wait(stall_s):
            if self._progress != seen:
                seen = self._progress
                continue
            with self._deadline_lock:
                if self._preparing:
                    self._abandoned = True
            if not self._abandoned:  # it finished just now
                break
            err = StorageReadError(
                f"rank {self.rank}: {self._reading}: no read returned for {stall_s:.0f} s "
                f"(ETIMEDOUT: storage stalled); the restore gave up on it",
                errno.ETIMEDOUT,
            )
            return None, err, True
        return (*box["out"], False)

    def execute(self, plan: LoadPlan, agree=None) -> RestoreStats:
        """:meth:`load` of a plan made already."""
        return self.load(_Fixed(plan), agree)[1]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the files (idempotent); after an abandoned read, the thread stuck in it does once
        the read returns (unmapping a file under a read in progress is never safe)."""
        with self._deadline_lock:
            if self._abandoned and self._preparing:
                self._closed = True  # no new file is opened (not under ``_lock``: the stalled open holds it)
                return
        self._close_files()

    def _close_files(self) -> None:
        with self._lock:
            self._closed = True
            files, self._files = list(self._files.values()), collections.OrderedDict()
            records, self._records = self._records, None
        for rf in files:
            rf.close()
        if records is not None:
            records.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Fixed(LoadPlanner):
    """A plan made already, as a planner."""

    def __init__(self, plan: LoadPlan) -> None:
        self._plan = plan
        self.kind = plan.kind

    def plan(self, reader: CheckpointReader) -> LoadPlan:
        return self._plan
