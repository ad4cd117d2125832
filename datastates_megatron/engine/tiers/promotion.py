"""Promotion: the link from the node-local tier to the persistent one.

Fed by the local tier's commits (it subscribes: :meth:`.tier.Tier.on_commit`), every committed checkpoint whose
iteration is a multiple of ``interval`` is promoted (iterations, not this run's commits: a requeued
run promotes the same iterations as one that never stopped): each rank verifies its local file's checksums, copies the verified bytes to
the persistent tier and fsyncs, and the persistent tier's committer agrees across ranks and writes
the persistent manifest.  The local copy is never removed by a promotion -- only by the local tier's
retention, which keeps what the link reports :meth:`Promotion.pending` (its ``keep``).

Thread-safety: ``offer``/``schedule`` may be called from any thread (the local commit thread calls
``offer``); the copies run on the owned thread ``dsm-promote-r{rank}``.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import threading
import time

import numpy as np

from .commit import Ticket
from ..errors import FlushError, NoCheckpointError
from ..runtime.faults import crash_point
from ..format.file_format import HEADER_BYTES, FileReceipt, RankFile
from ..format.manifest import read_manifest
from ..names import iter_dir, parse_rank_file_name, rank_file_name
from ..names import PROMOTING_SUFFIX
from .promote_throttle import Pace, PromoteSlots
from ..fs.safe_io import create_temp, make_dir, reopen_same
from ..runtime.threads import QueueThread
from .tier import Tier, survey
from ..format.writer import ALIGN, pwrite_direct
from ..fs.durable import fsync_dir

__all__ = ["Promotion", "copy_verified"]

log = logging.getLogger(__name__)
_COPY_BLOCK = 16 << 20


def _copy_bytes(fd_in: int, fd_out: int, size: int, start: int = 0, pace=None) -> None:
    """Copy bytes ``[start, size)`` in the kernel (``sendfile``: one page-cache-to-page-cache copy,
    no user buffer); where the platform or file system refuses, through one reused buffer.
    ``pace(n)`` is called after each block (:class:`.promote_throttle.Pace`)."""
    done = start
    try:
        os.lseek(fd_out, start, os.SEEK_SET)  # sendfile writes at the output's file position
        while done < size:
            n = os.sendfile(fd_out, fd_in, done, min(_COPY_BLOCK, size - done))
            if n == 0:
                break
            done += n
            if pace is not None:
                pace(n)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK) or done > start:
            raise
    except AttributeError:  # pragma: no cover - no os.sendfile on this platform
        pass
    buf = memoryview(bytearray(_COPY_BLOCK)) if done < size else None
    while done < size:
        n = os.preadv(fd_in, [buf[: min(_COPY_BLOCK, size - done)]], done)
        if n == 0:
            break
        written = 0
        while written < n:
            written += os.pwrite(fd_out, buf[written:n], done + written)
        done += n
        if pace is not None:
            pace(n)
    if done != size:
        raise FlushError(f"copied {done} of {size} bytes: the source file is shorter than its header says")


def _copy_direct(source: np.ndarray, path: str, fd_out: int, pace=None) -> int:
    """Write the 4 KiB-aligned prefix of ``source`` (a page-aligned mapping of the local file) to
    ``path`` (the inode ``fd_out`` has open) with O_DIRECT; returns the bytes written, 0 where
    O_DIRECT is refused.

    Why: a buffered copy (``sendfile``) fills the page cache with a checkpoint nobody reads back,
    and the kernel's per-page work and dirty-page throttling cost more CPU than the O_DIRECT
    write (docs/BENCHMARKS.md) -- CPU the training threads share on a busy node.  A write the file system refuses (EINVAL) stops here;
    the caller copies the rest buffered."""
    aligned = source.nbytes // ALIGN * ALIGN
    if not aligned or not hasattr(os, "O_DIRECT"):
        return 0
    try:
        fd = reopen_same(path, fd_out, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return 0
    done = 0
    try:
        while done < aligned:  # in blocks of _COPY_BLOCK, like the buffered copy
            block = min(_COPY_BLOCK, aligned - done)
            n = pwrite_direct(fd, source[done : done + block], done, path)
            done += n
            if pace is not None:
                pace(n)
            if n < block:  # refused
                break
    finally:
        os.close(fd)
    return done


def _copy_file(rf: RankFile, fd_out: int, path_out: str, size: int, pace=None) -> None:
    """Copy the first ``size`` bytes of ``rf`` to ``fd_out`` (open on ``path_out``): O_DIRECT from
    its mapping as far as the destination allows, the rest through ``_copy_bytes``."""
    done = _copy_direct(rf.span(0, size), path_out, fd_out, pace)
    if done < size:
        _copy_bytes(rf.fileno(), fd_out, size, start=done, pace=pace)


def copy_verified(src: str, dst: str, version: int, pace=None) -> FileReceipt:
    """Verify every checksum of ``src`` then copy it to ``dst`` (temp name, fsync, rename), paced
    by ``pace`` (:class:`.promote_throttle.Pace`) when given."""
    t0 = time.perf_counter()
    tmp = dst + PROMOTING_SUFFIX
    with RankFile(src) as rf:
        data_bytes = rf.verify_all()
        header = rf.header
        fd_tmp = create_temp(tmp)  # O_EXCL | O_NOFOLLOW: a link planted at the temp name is refused
        try:
            with os.fdopen(fd_tmp, "wb") as fout:  # copied from the file just verified, not the path again
                _copy_file(rf, fout.fileno(), tmp, header.file_bytes, pace)
                os.fsync(fout.fileno())
            # a rewrite of the source in place (a recycled file) zeroes its header first: if the
            # header is still the verified one, the bytes copied are the ones verified
            if os.pread(rf.fileno(), HEADER_BYTES, 0) != header.pack():
                raise FlushError(f"{src}: the local file was rewritten while it was promoted")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    crash_point("promote")
    os.replace(tmp, dst)
    fsync_dir(os.path.dirname(dst))
    dt = time.perf_counter() - t0
    return FileReceipt.of(header, data_bytes, version, dst, copy_s=dt, flush_s=dt)


class Promotion(QueueThread):
    """The link ``src`` -> ``dst`` of one rank, owning its copy thread; ``close()`` is idempotent
    and joins it.  ``interval``: ``src``'s checkpoints whose iteration is a multiple of it are promoted.
    ``slots``: at most this many ranks sharing ``src``'s directory (a node) copy at once (0: no cap);
    ``mbps``: each copy moves at most this many MB/s (0: no cap) (:mod:`.promote_throttle`)."""

    def __init__(self, src: Tier, dst: Tier, *, interval: int, slots: int = 0, mbps: float = 0.0) -> None:
        self.src, self.dst = src, dst
        self.rank = src.rank
        self._slots = PromoteSlots(src.root, slots, src.rank)
        self._mbps = mbps
        self._interval = interval
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._newest: Ticket | None = None  # this run's newest local commit when it is not promoted yet
        src.on_commit(self.offer, keep=self.pending)
        super().__init__(f"dsm-promote-r{self.rank}")

    def in_flight(self) -> set[int]:
        """Source iterations this rank is copying."""
        with self._lock:
            return set(self._in_flight)

    def pending(self) -> set[int]:
        """Source iterations the source tier's retention must keep: those this rank is copying and
        those whose commit on ``dst`` is still open -- the latter covers the other ranks of the node,
        still copying their own files of it, since that commit waits for every rank's copy."""
        return self.in_flight() | {t.iteration for t in self.dst.outstanding()}

    def offer(self, ticket: Ticket) -> None:
        """``src`` committed ``ticket``'s checkpoint: promote it when its iteration is a multiple of
        ``interval`` (the same iterations after a requeue, so that they meet ``keep_every``)."""
        due = ticket.iteration % self._interval == 0
        with self._lock:
            self._newest = None if due else ticket
        if due:
            self.schedule(ticket.iteration, ticket.seq, ticket.metadata)

    def promote_newest(self) -> bool:
        """Schedule this run's newest local checkpoint unless it already was (collective, like every
        schedule: every rank saw the same local commits).  For the end of a run: node-local storage
        may not outlive the job, so its last checkpoint must reach the persistent tier whatever
        ``interval`` says.  Returns whether a promotion was scheduled."""
        with self._lock:
            ticket, self._newest = self._newest, None
        if ticket is None:
            return False
        self.schedule(ticket.iteration, ticket.seq, ticket.metadata)
        return True

    def resume(self, newest_common: int | None) -> None:
        """After a restart (collective): promote ``newest_common`` -- the newest source checkpoint
        every rank has -- if ``dst`` lacks it (a run killed before its end-of-run promotion)."""
        if newest_common is None:
            return
        try:
            latest = survey(self.dst.root).latest()  # a damaged manifest raises, as on a load
        except NoCheckpointError:
            latest = None
        if latest is None or newest_common > latest:
            m = read_manifest(iter_dir(self.src.root, newest_common))
            _, token, seq = parse_rank_file_name(m.record(self.rank).file)
            log.info(
                "rank %d: promoting local checkpoint %d left unpromoted by the previous run", self.rank, newest_common
            )
            self.schedule(newest_common, seq, dict(m.metadata), token=token)

    def schedule(self, iteration: int, seq: int, metadata: dict, token: str | None = None) -> None:
        """Promote ``src`` checkpoint ``iteration`` (collective: every rank schedules the same ones, in
        order).  ``token``: the run token in its file names, when an earlier run wrote it."""
        future: cf.Future = cf.Future()
        with self._lock:
            self._in_flight.add(iteration)
        self.dst.submit(Ticket(iteration, seq, future, dict(metadata), time.perf_counter(), token))
        self.put((iteration, seq, token or self.src.token, future))

    def _handle(self, item) -> None:
        iteration, seq, token, future = item
        name = rank_file_name(self.rank, token, seq)
        src = os.path.join(iter_dir(self.src.root, iteration), name)
        dst_dir = iter_dir(self.dst.root, iteration)
        try:
            make_dir(dst_dir)  # never into a directory reached through a symlink
            with self._slots.held():  # at most ``slots`` of the node's ranks copy at once
                pace = Pace(self._mbps) if self._mbps > 0 else None  # no cap: no pacing at all
                receipt = copy_verified(src, os.path.join(dst_dir, name), iteration, pace)
            future.set_result(receipt)
        except BaseException as e:  # noqa: BLE001 - the persistent committer reports it on every rank
            err = (
                e
                if isinstance(e, FlushError)
                else FlushError(
                    f"rank {self.rank}: promoting iteration {iteration} from {src} to {dst_dir} failed: {e}"
                )
            )
            log.error("%s", err)
            future.set_exception(err)
        finally:
            with self._lock:
                self._in_flight.discard(iteration)

    def close(self) -> None:
        """Join the copy thread (after the promotions queued before), then release the slot files."""
        super().close()
        self._slots.close()
