"""The lazy snapshot engine: ``save()`` returns at once; copies and flushes run on owned threads.

Pipeline of one version (one rank file)::

    save() [training thread]     encode objects, enqueue job                       (~tens of µs)
    copier thread                hand "open the rank file" to the flush pool, then for each
                                 region: acquire cache space (backpressure), device->host
                                 copy, hand the region to the flush pool (a CPU tensor under
                                 ``source_writes``: no cache, no copy; the region is handed
                                 over as a view of the tensor itself)
    flush threads (N)            one opens the rank file (recycled file moved into place,
                                 created; on tmpfs allocated and mapped), the
                                 others wait for it; wait for the copy, XXH64 each item,
                                 pwrite, release the region
                                 (a memory-backed file: hash and copy in one pass through its
                                 kept mapping, see ``mapped_files``); the last one writes
                                 index + objects + header and fsyncs
    wait_for_snapshot() [gate]   returns once the copies (and writes from sources) are complete:
                                 the caller may mutate.  It never waits for the rank file to be
                                 opened, except through writes from sources, which need it

Thread-safety: ``register`` and ``save`` are for one (training) thread; ``wait_for_snapshot``,
``wait``, ``poll`` and ``close`` may be called from any thread.  A background failure is stored and
re-raised exactly once on the caller's thread, by the next ``save``/``wait``/``poll``/``close``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import os
import queue
import threading
import time

import numpy as np
import torch

from ..format import data_layout, file_format, hashing, rank_table
from .device_copy import Completion, DeviceCopier, as_bytes
from ..runtime.faults import crash_point, stall_point
from ..errors import CacheTimeoutError, CheckpointError, CopyError, EngineClosedError, FlushError
from ..format.file_format import FORMAT_VERSION, HEADER_BYTES, FileReceipt, Header, build_index
from .host_cache import HostCache
from ..fs import fork_close
from ..fs.mapped_files import MappedFiles
from ..format.tagged_json import encode_objects
from ..options import EngineOptions
from ..fs.page_cache import memory_backed
from ..fs.safe_io import open_dir
from ..runtime.threads import ClosingContext, DaemonPool, close_at_exit, forget
from ..format.writer import ALIGN, RankFileWriter, tail_offset

__all__ = ["SnapshotEngine", "SaveHandle"]

log = logging.getLogger(__name__)
_SMALL_ALIGN = 64
_ZEROS = np.zeros(ALIGN, np.uint8)  # padding after a region written from its source


@dataclasses.dataclass
class _Entry:
    name: str
    tensor: torch.Tensor
    group: str
    meta: dict | None


class _Layout:
    """Placement of the registered tensors in the file; rebuilt only when registration changes."""

    def __init__(self, entries: list[_Entry], opts: EngineOptions, capacity: int) -> None:
        self.entries = entries
        self.names = [e.name for e in entries]
        self.bytes_views = [as_bytes(e.tensor) for e in entries]
        nbytes = np.array([v.numel() for v in self.bytes_views], np.int64)
        chunk = opts.effective_chunk_bytes
        if not opts.streaming and len(nbytes):
            biggest = int(nbytes.argmax())
            need = -(-int(nbytes[biggest]) // ALIGN) * ALIGN
            if need > capacity:
                raise ValueError(
                    f"rank {opts.rank}: tensor {self.names[biggest]!r} has {int(nbytes[biggest])} bytes, more than "
                    f"the host cache ({capacity} bytes), and streaming is off"
                )
            chunk = max(chunk, need)
        self.chunk_bytes = chunk
        offs, self.regions, self.items = data_layout.plan_layout(
            nbytes, chunk, opts.effective_small_bytes, opts.effective_pack_bytes, ALIGN, _SMALL_ALIGN
        )
        self.nbytes = nbytes
        self.offsets = offs + HEADER_BYTES
        self.data_bytes = int(self.regions[-1, 0] + self.regions[-1, 1]) if len(self.regions) else 0
        self.total_bytes = int(nbytes.sum())
        tensor_of_item = self.items[:, 0]
        self.items_per_tensor = np.bincount(tensor_of_item, minlength=len(entries)) if len(entries) else nbytes
        # last region holding each group's tensors: the gate for that group waits for it
        region_of_item = np.repeat(np.arange(len(self.regions)), self.regions[:, 3])
        self.group_last_region: dict[str, int] = {}
        for item, t in enumerate(tensor_of_item):
            g = entries[t].group
            self.group_last_region[g] = max(self.group_last_region.get(g, -1), int(region_of_item[item]))
        # the regions a CPU tensor may write from its own memory (``source_writes``): one whole item
        self.source_ok = [
            count == 1
            and int(self.items[first, 2]) == 0
            and self.bytes_views[int(self.items[first, 0])].device.type == "cpu"
            for _, _, first, count in self.regions.tolist()
        ]
        meta = {e.name: e.meta for e in entries if e.meta is not None}
        self.meta_json = encode_objects(meta)


class _Job:
    """One version in flight.  Its counters are guarded by ``lock``."""

    def __init__(
        self, version: int, path: str, layout: _Layout, objects_json: bytes, ready, t_save: float, before_open=None
    ):
        self.version = version
        self.path = path
        self.before_open = before_open
        self.memory_fd: int | None = None  # the file is written into this memfd (SnapshotEngine.save)
        self.mirror_fd: int | None = None  # and also, byte for byte, into this one (a host copy)
        self.layout = layout
        self.objects_json = objects_json
        self.ready = ready
        self.t_save = t_save
        self.t_call = 0.0
        self.t_copied = 0.0
        self.lock = threading.Lock()
        self.checksums = np.zeros(len(layout.items), np.uint64)
        self.completions: list[Completion] = []
        self.issued = 0  # regions handed to the flush pool
        self.flushed = 0  # regions finished (written or skipped)
        self.issuing_done = False
        self.error: BaseException | None = None
        self.finishing = False
        self.writer: RankFileWriter | None = None
        self.opened: cf.Future = cf.Future()  # settles (result None) once opening was tried; see job.error
        self.source_bytes = 0  # written straight from the registered tensors
        self.copied = threading.Event()
        self.durable: cf.Future = cf.Future()


class SaveHandle:
    """Returned by :meth:`SnapshotEngine.save`; read-only view of one version's progress."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.version = job.version
        self.path = job.path

    @property
    def snapshot_done(self) -> bool:
        """Every region copied or written from its source: the registered tensors may change."""
        job = self._job
        return job.copied.is_set() and all(c.query() for c in list(job.completions))

    @property
    def durable(self) -> cf.Future:
        """Resolves to a :class:`FileReceipt` when the file is fsynced, or to the error."""
        return self._job.durable


class SnapshotEngine(ClosingContext):
    """Per-rank lazy snapshot engine.  A context manager; ``close()`` is idempotent."""

    def __init__(self, options: EngineOptions | None = None) -> None:
        self.options = opts = options or EngineOptions()
        hashing.warmup()
        data_layout.warmup()
        file_format.warmup()
        rank_table.warmup()  # the manifest's records, formatted on rank 0's commit thread
        self.cache = HostCache(opts.cache_bytes, pin=opts.pin_memory)
        self._copier = DeviceCopier()
        # the files in flight, the ones retention keeps and the recycled ones waiting for their turn
        self._mapped = MappedFiles(max(8, 4 * opts.max_inflight)) if opts.mapped_writes else None
        self._entries: dict[str, _Entry] = {}
        self._layout: _Layout | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._pending: collections.OrderedDict[int, _Job] = collections.OrderedDict()
        self._pending_lock = threading.Lock()
        self._progress = threading.Condition()
        self._slots = threading.Semaphore(opts.max_inflight)
        self._errors: collections.deque[BaseException] = collections.deque()
        self._done: collections.deque[FileReceipt] = collections.deque()
        self._seq = 0
        self._last_opened: cf.Future | None = None  # copier thread only: files are opened in save order
        self._from_source_hint = False  # whether the last version wrote CPU tensors from their memory
        self._memory_backed_roots: dict[str, bool] = {}  # save root -> whether memory-backed (_writes_from_source)
        self._closed = False
        self.gate_wait_s = 0.0
        self.slot_wait_s = 0.0
        self.source_bytes = 0  # bytes written straight from registered tensors (no cache copy)
        # daemon threads: a write the storage never returns must not keep the process from exiting
        # (close() gives up on it, bounded; the interpreter joins ThreadPoolExecutor's workers)
        self._flush_pool = DaemonPool(opts.flush_threads, f"dsm-flush-r{opts.rank}")
        self._thread = threading.Thread(target=self._copy_loop, name=f"dsm-copier-r{opts.rank}", daemon=False)
        self._thread.start()
        close_at_exit(self)

    # ------------------------------------------------------------------ registration
    def register(self, name: str, tensor: torch.Tensor, *, group: str = "default", meta: dict | None = None) -> None:
        """Add (or replace) a tensor to snapshot under ``name``.  ``meta`` is stored in the file as JSON."""
        self._check_open()
        as_bytes(tensor)  # validates contiguity now rather than at save time
        self._entries[name] = _Entry(name, tensor, group, meta)
        self._layout = None

    def clear(self) -> None:
        """Forget every registered tensor (pending versions keep what they captured)."""
        self._entries.clear()
        self._layout = None

    @property
    def registered(self) -> dict[str, torch.Tensor]:
        return {n: e.tensor for n, e in self._entries.items()}

    @property
    def registered_meta(self) -> dict[str, dict | None]:
        """``{name: meta}`` of every registered tensor, as given to :meth:`register`."""
        return {n: e.meta for n, e in self._entries.items()}

    def _current_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(list(self._entries.values()), self.options, self.cache.capacity)
        return self._layout

    # ------------------------------------------------------------------ training-thread API
    def save(
        self,
        version: int,
        path: str,
        objects=None,
        tag: str = "",
        before_open=None,
        memory_fd: int | None = None,
        mirror_fd: int | None = None,
    ) -> SaveHandle:
        """Snapshot every registered tensor (and ``objects``) into ``path`` as ``version``; returns at once.

        ``tag`` is stored with the file (the commit layer uses run token, rank and sequence) so a file
        from another run or rank never passes for this one.  ``before_open()`` runs on a flush thread
        just before ``path`` is opened (the manager moves a recycled rank file into place there, off the
        training thread and off the gate's path; files are opened one at a time, in save order); an
        ``OSError`` from it is logged and the file is written anew.  Blocks only while ``max_inflight``
        versions are pending (bounded by ``timeout_s``); :meth:`behind` says beforehand whether it would.
        ``memory_fd``: write the file into this open memory file (a memfd; the caller keeps it) instead
        of creating ``path``, which then only names it in messages.  ``mirror_fd``: a memory file (the
        caller keeps it) that also receives every byte of the file, at the same offsets."""
        t0 = time.perf_counter()
        self._check_open()
        self._raise_pending()
        layout = self._current_layout()
        body = encode_objects(objects)
        objects_json = (
            b'{"objects":'
            + body
            + b',"tensor_meta":'
            + layout.meta_json
            + b',"version":'
            + str(int(version)).encode()
            + b',"tag":'
            + encode_objects(str(tag))
            + b"}"
        )
        # the job's own descriptor of the mirror (the caller may close its own at any time), closed
        # once the file's writer has duplicated it
        mirror = fork_close.opened(os.dup(mirror_fd)) if mirror_fd is not None else None
        if not self._slots.acquire(timeout=0):
            t_wait = time.perf_counter()
            ok = self._slots.acquire(timeout=self.options.timeout_s)
            self.slot_wait_s += time.perf_counter() - t_wait
            if not ok:
                if mirror is not None:
                    fork_close.close(mirror)
                raise CacheTimeoutError(
                    f"rank {self.options.rank}: version {version}: waited {self.options.timeout_s:.0f}s for one of "
                    f"{self.options.max_inflight} in-flight slots"
                )
        job = _Job(version, os.fspath(path), layout, objects_json, self._copier.mark_ready(), t0, before_open)
        job.memory_fd, job.mirror_fd = memory_fd, mirror
        with self._pending_lock:
            self._seq += 1
            self._pending[self._seq] = job
        self._jobs.put(job)
        job.t_call = time.perf_counter() - t0
        return SaveHandle(job)

    def behind(self) -> str | None:
        """Why a version of the registered tensors saved now would wait for storage -- every
        in-flight slot taken, or no host cache room for it -- or ``None`` when it would not.
        Training thread (the one that saves): what it finds stays true until its next ``save``,
        since only that thread takes slots and space."""
        self._check_open()
        if not self._slots.acquire(blocking=False):
            return f"{self.options.max_inflight} version(s) in flight"
        self._slots.release()
        earlier = self._cache_behind(self._current_layout())
        if earlier is not None:
            return (
                f"no host cache room ({earlier} bytes of its {self.cache.capacity} held or still needed by "
                f"versions in flight)"
            )
        return None

    def _cache_behind(self, layout: _Layout) -> int | None:
        """Whether ``layout``'s regions would wait for host cache space held by earlier versions
        (regions not yet flushed, or still to be copied).  A version larger than the cache streams
        through it and waits for its own flushes by design: it is behind only while an earlier
        version still holds or needs space.  The regions a CPU tensor writes from its own memory
        are not counted when the last version wrote from sources.  Returns the bytes earlier
        versions hold or still need when it would wait, else ``None``."""
        sizes = []
        with self._pending_lock:
            jobs = list(self._pending.values())
        for job in jobs:
            with self._progress:
                left = len(job.layout.regions) - job.issued if not job.issuing_done else 0
            sizes += job.layout.regions[len(job.layout.regions) - left :, 1].tolist()
        held = self.cache.used
        earlier = sum(sizes) + held
        sizes += [
            int(padded)
            for r, (_, padded, _, count) in enumerate(layout.regions)
            if not (self._from_source_hint and count == 1 and layout.source_ok[r])
        ]
        if sum(sizes) > self.cache.capacity:  # streams through the cache: behind while others are in it
            return earlier or None
        return None if self.cache.fits_now(sizes) else earlier

    def oldest_in_flight_s(self) -> float:
        """Seconds since the oldest pending version was saved (0: none pending)."""
        with self._pending_lock:
            starts = [j.t_save for j in self._pending.values()]
        return time.perf_counter() - min(starts) if starts else 0.0

    def wait_for_snapshot(self, group: str | None = None, timeout: float | None = None) -> None:
        """The gate: return once every pending copy (of ``group``, or of all) is complete.

        After it returns the caller may mutate the registered tensors.  On CUDA the training stream is
        made to wait on the copy events instead of blocking the host wherever the copies are issued."""
        timeout = self.options.timeout_s if timeout is None else timeout
        t0 = time.perf_counter()
        with self._pending_lock:
            jobs = list(self._pending.values())
        completions, writes = [], []
        for job in jobs:
            last = job.layout.group_last_region.get(group, -1) if group is not None else len(job.layout.regions) - 1
            if last < 0:
                continue
            with self._progress:
                ok = self._progress.wait_for(lambda: job.issued > last or job.issuing_done, timeout)
            if not ok:
                raise CacheTimeoutError(
                    f"rank {self.options.rank}: version {job.version}: snapshot copies not issued after {timeout:.0f}s"
                )
            with job.lock:
                upto = job.completions[: last + 1]
            # device copies run in order on one side stream: the last one with an event covers the rest
            last_copy = next((c for c in reversed(upto) if c.event is not None), None)
            if last_copy is not None:
                completions.append(last_copy)
            writes += [(job, c.written) for c in upto if c.written is not None]
        DeviceCopier.gate(completions)
        for job, written in writes:
            if not written.wait(max(0.0, t0 + timeout - time.perf_counter())):
                err = CacheTimeoutError(
                    f"rank {self.options.rank}: version {job.version}: writes of {job.path} straight from the "
                    f"registered tensors not done after {timeout:.0f}s; the version is abandoned (the tensors "
                    f"may change under those writes)"
                )
                with job.lock:
                    job.error = job.error or err
                raise err
        self.gate_wait_s += time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> list[FileReceipt]:
        """Block until every pending version is durable; returns receipts not yet returned by ``poll``."""
        timeout = self.options.timeout_s if timeout is None else timeout
        with self._pending_lock:
            futures = [j.durable for j in self._pending.values()]
        _, not_done = cf.wait(futures, timeout=timeout)
        if not_done:
            raise CacheTimeoutError(
                f"rank {self.options.rank}: {len(not_done)} version(s) not durable after {timeout:.0f}s"
            )
        return self.poll()

    def poll(self) -> list[FileReceipt]:
        """Non-blocking: receipts of versions that became durable since the last call."""
        self._raise_pending()
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    @property
    def pending_versions(self) -> list[int]:
        with self._pending_lock:
            return [j.version for j in self._pending.values()]

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None, *, keep_cache: bool = False) -> None:
        """Drain pending versions, stop and join every thread; idempotent.  Re-raises a stored error.
        ``keep_cache`` (an in-process restart): once every thread is joined, the host cache's arena
        is left to the next engine of this process (:meth:`.HostCache.keep`); never while a write
        the storage has not returned may still touch it."""
        if self._closed:
            return
        forget(self)
        drained = False
        try:
            self.wait(timeout)
            drained = True
        finally:
            self._closed = True
            self._jobs.put(None)
            if drained:
                self._thread.join()
                self._flush_pool.shutdown(wait=True)
                self.cache.close()
                if keep_cache:
                    self.cache.keep()
                if self._mapped is not None:
                    self._mapped.close()
            else:  # storage is stuck: report instead of hanging on the blocked writes
                given_up = self._abandon_pending()
                self.cache.close()
                self._thread.join(self.options.timeout_s)
                # queued regions still run, as no-ops (their version failed): the last one to
                # return closes and removes its file
                self._flush_pool.shutdown(wait=False)
                log.error(
                    "rank %d: close() gave up on %d version(s) whose writes the storage has not returned: %s; "
                    "not durable, never committed (the last committed checkpoint stays the latest); each file "
                    "is closed and removed once its writes return",
                    self.options.rank,
                    len(given_up),
                    "; ".join(given_up),
                )
        self._raise_pending()

    def _abandon_pending(self) -> list[str]:
        """Fail every version still pending (close() gives up on them): what is still queued for it
        does nothing, and the flush thread finishing its last region closes and removes the file.
        Returns ``"<file> (N s in flight)"`` for each."""
        now = time.perf_counter()
        with self._pending_lock:
            jobs = list(self._pending.values())
        out = []
        for job in jobs:
            s = now - job.t_save
            err = CacheTimeoutError(
                f"rank {self.options.rank}: version {job.version}: {job.path}: given up at close() after "
                f"{s:.0f} s in flight: the storage has not returned its write"
            )
            with job.lock:
                job.error = job.error or err
            out.append(f"{job.path} ({s:.0f} s in flight)")
        return out

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            log.warning("SnapshotEngine for rank %d was not closed", self.options.rank)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"rank {self.options.rank}: the snapshot engine is closed")

    def _raise_pending(self) -> None:
        if self._errors:
            raise self._errors.popleft()

    # ------------------------------------------------------------------ copier thread
    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._copy_job(job)
            except BaseException as e:  # noqa: BLE001 - stored and re-raised on the caller's thread
                self._fail(job, e, "copy")
            finally:
                with self._progress:
                    job.t_copied = time.perf_counter()
                    job.issuing_done = True
                    job.copied.set()
                    self._progress.notify_all()
                self._maybe_finish(job)

    def _copy_job(self, job: _Job) -> None:
        layout = job.layout
        # opening the file (on tmpfs: allocating and mapping all of it) runs on the flush side, queued
        # ahead of this job's regions, so the copies the gate waits for never wait for it
        previous, self._last_opened = self._last_opened, job.opened
        try:
            self._flush_pool.submit(self._open_file, job, previous)
        except BaseException:
            if job.mirror_fd is not None:
                fork_close.close(job.mirror_fd)
                job.mirror_fd = None
            job.opened.set_result(None)
            raise
        items = layout.items
        from_source = self._from_source_hint = self._writes_from_source(job.path, job.memory_fd is not None)
        for r, (_, padded, first, count) in enumerate(layout.regions):
            if job.error is not None:
                return
            t, chunk, off, length = (int(x) for x in items[first])
            if from_source and count == 1 and off == 0 and layout.bytes_views[t].device.type == "cpu":
                start = chunk * layout.chunk_bytes
                self._issue(
                    job, r, None, Completion(written=threading.Event()), layout.bytes_views[t][start : start + length]
                )
                continue
            try:
                region = self.cache.acquire(int(padded), self.options.timeout_s)
            except CacheTimeoutError as e:
                raise CacheTimeoutError(f"rank {self.options.rank}: version {job.version}: {e}") from e
            try:
                used = 0
                completion = Completion()
                for k in range(first, first + count):
                    t, chunk, off, length = (int(x) for x in items[k])
                    if off > used:
                        region.tensor[used:off].zero_()
                    start = chunk * layout.chunk_bytes
                    completion = self._copier.copy(
                        layout.bytes_views[t][start : start + length], region.tensor[off : off + length], job.ready
                    )
                    used = off + length
                if used < padded:
                    region.tensor[used:padded].zero_()
            except BaseException as e:
                self.cache.release(region)
                raise CopyError(
                    f"rank {self.options.rank}: version {job.version}: copying {layout.names[int(items[first, 0])]!r} "
                    f"to host failed: {e}"
                ) from e
            self._issue(job, r, region, completion, None)

    def _writes_from_source(self, path: str, in_memory: bool = False) -> bool:
        """Whether CPU tensors skip the cache: see ``EngineOptions.source_writes``.  "auto" asks the
        file system of the directory above ``path``'s (the save root: the iteration directory may
        not exist yet, and is on the same file system), once per root: this runs on the copier
        thread, which the gate waits for, and a lookup in a directory where a stalled ``mkdir`` or
        ``unlink`` holds the kernel's directory lock would wait as long (issue 41)."""
        mode = self.options.source_writes
        if mode != "auto":
            return bool(mode)
        if in_memory:  # a memory file (``memory_fd``): memory-backed, and ``path`` is only its name
            return True
        root = os.path.dirname(os.path.dirname(path)) or "."
        known = self._memory_backed_roots.get(root)
        if known is not None:
            return known
        try:
            fd = open_dir(root)
        except OSError:
            return False  # opening the file will fail too, and report it
        try:
            known = self._memory_backed_roots[root] = memory_backed(fd)
        finally:
            os.close(fd)
        return known

    def _open_file(self, job: _Job, previous: cf.Future | None) -> None:
        """Flush thread: move a recycled file into place (``before_open``) and open ``job.path``;
        after the previous version's file (``previous``, queued before this one: never waits on a
        task still in the queue).  Failures go to ``job.error``; ``job.opened`` settles either way."""
        try:
            if previous is not None:
                previous.result()
            if job.error is None:  # else the copy failed already: no file to make
                if job.before_open is not None:
                    try:
                        job.before_open()
                    except OSError as e:
                        log.warning(
                            "rank %d: version %d: preparing %s failed (%s); writing a new file",
                            self.options.rank,
                            job.version,
                            job.path,
                            e,
                        )
                try:
                    job.writer = RankFileWriter(
                        job.path,
                        self.options.direct_io,
                        self._mapped,
                        HEADER_BYTES + job.layout.data_bytes,
                        memory_fd=job.memory_fd,
                        mirror_fd=job.mirror_fd,
                    )
                except OSError as e:
                    raise FlushError(
                        f"rank {self.options.rank}: version {job.version}: cannot create {job.path}: {e}"
                    ) from e
        except BaseException as e:  # noqa: BLE001 - stored and re-raised on the caller's thread
            self._fail(job, e, "open")
        finally:
            if job.mirror_fd is not None:
                fork_close.close(job.mirror_fd)
                job.mirror_fd = None
            job.opened.set_result(None)
        self._maybe_finish(job)

    def _issue(self, job: _Job, r: int, region, completion: Completion, source) -> None:
        with self._progress:
            job.completions.append(completion)
            job.issued += 1
            self._progress.notify_all()
        self._flush_pool.submit(self._flush_region, job, r, region, completion, source)

    # ------------------------------------------------------------------ flush threads
    def _flush_region(self, job: _Job, r: int, region, completion: Completion, source: torch.Tensor | None) -> None:
        """Hash and write region ``r`` from the cache (``region``) or straight from a CPU tensor
        (``source``, a uint8 view; ``completion.written`` is set when it is no longer read)."""
        layout = job.layout
        offset, padded, first, count = (int(x) for x in layout.regions[r])
        try:
            job.opened.result()  # settles: opening never waits on a region
            if job.error is None:
                completion.synchronize()
                data = (region.tensor if source is None else source).numpy()
                spans = [(int(layout.items[k, 2]), int(layout.items[k, 3])) for k in range(first, first + count)]
                stall_point("write", self.options.rank, job.version)
                try:
                    if job.writer.mapping is not None:  # memory-backed: hash and copy in one pass
                        job.checksums[first : first + count] = job.writer.copy_hashed(
                            data, HEADER_BYTES + offset, padded, spans
                        )
                    else:
                        for k, (off, length) in enumerate(spans, first):
                            job.checksums[k] = hashing.xxh64_kernel(data[off : off + length], np.uint64(0))
                        job.writer.write(data[:padded] if source is None else data, HEADER_BYTES + offset)
                        if source is not None and padded > data.nbytes:
                            job.writer.write(_ZEROS[: padded - data.nbytes], HEADER_BYTES + offset + data.nbytes)
                    if source is not None:
                        with job.lock:
                            job.source_bytes += data.nbytes
                    crash_point("flush", self.options.rank)
                except OSError as e:
                    name = layout.names[int(layout.items[first, 0])]
                    raise FlushError(
                        f"rank {self.options.rank}: version {job.version}: writing {job.path} (tensor {name!r}, "
                        f"offset {HEADER_BYTES + offset}) failed: {e}"
                    ) from e
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "flush")
        finally:
            if region is not None:
                self.cache.release(region)
            if completion.written is not None:
                completion.written.set()
            with job.lock:
                job.flushed += 1
        self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        with job.lock:
            if not job.issuing_done or not job.opened.done() or job.flushed < job.issued or job.finishing:
                return
            job.finishing = True
        try:
            receipt = None if job.error is not None else self._finish_file(job)
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "finalize")
            receipt = None
        if job.writer is not None:
            job.writer.close()
        if receipt is None:
            try:
                if job.writer is not None and job.memory_fd is None:  # a memory file has no name to remove
                    os.unlink(job.path)
            except OSError:
                pass
            job.durable.set_exception(job.error)
        else:
            self._done.append(receipt)
            job.durable.set_result(receipt)
        with self._pending_lock:
            self.source_bytes += job.source_bytes
            for seq, j in list(self._pending.items()):
                if j is job:
                    del self._pending[seq]
        self._slots.release()

    def _finish_file(self, job: _Job) -> FileReceipt:
        layout = job.layout
        per_tensor = np.split(job.checksums, np.cumsum(layout.items_per_tensor)[:-1]) if len(layout.entries) else []
        index = build_index(
            layout.names,
            [e.tensor.dtype for e in layout.entries],
            [tuple(e.tensor.shape) for e in layout.entries],
            layout.offsets,
            layout.nbytes,
            per_tensor,
        )
        index_offset = -(-(HEADER_BYTES + layout.data_bytes) // ALIGN) * ALIGN
        index_offset = tail_offset(index_offset, len(index) + len(job.objects_json), job.writer.reused_bytes)
        objects_offset = index_offset + len(index)
        header = Header(
            version=FORMAT_VERSION,
            data_offset=HEADER_BYTES,
            data_bytes=layout.data_bytes,
            index_offset=index_offset,
            index_bytes=len(index),
            index_xxh64=hashing.xxh64(index),
            objects_offset=objects_offset,
            objects_bytes=len(job.objects_json),
            objects_xxh64=hashing.xxh64(job.objects_json),
            chunk_bytes=layout.chunk_bytes,
            n_tensors=len(layout.entries),
            file_bytes=objects_offset + len(job.objects_json),
        )
        crash_point("before_finish", self.options.rank)
        try:
            job.writer.finish(index + job.objects_json, index_offset, header)
        except OSError as e:
            raise FlushError(
                f"rank {self.options.rank}: version {job.version}: finishing {job.path} failed: {e}"
            ) from e
        return FileReceipt.of(
            header,
            layout.total_bytes,
            job.version,
            job.path,
            save_call_s=job.t_call,
            copy_s=job.t_copied - job.t_save,
            flush_s=time.perf_counter() - job.t_save,
        )

    def _fail(self, job: _Job, exc: BaseException, stage: str) -> None:
        with job.lock:
            first = job.error is None
            if first:
                job.error = exc
        if first:
            if not isinstance(exc, CheckpointError):
                wrapped = FlushError if stage != "copy" else CopyError
                err = wrapped(f"rank {self.options.rank}: version {job.version}: {stage} of {job.path} failed: {exc!r}")
                err.__cause__ = exc
                with job.lock:
                    job.error = err
                exc = err
            # reported once, where it is surfaced (the next poll, save or wait: raised, or the one
            # on_error=warn line); the message already names the rank, the version and the file
            log.info("%s", exc)
            self._errors.append(exc)
