"""Promotion: the link from the node-local tier to the persistent one.

Fed by the local tier's commits (it subscribes: :meth:`.tier.Tier.on_commit`), every committed checkpoint whose
iteration is a multiple of ``interval`` is promoted (iterations, not this run's commits: a requeued
run promotes the same iterations as one that never stopped): each rank verifies its local file's checksums, copies the verified bytes to
the persistent tier and fsyncs, and the persistent tier's committer agrees across ranks and writes
the persistent manifest.  The local copy is never removed by a promotion -- only by the local tier's
retention, which keeps what the link reports :meth:`Promotion.pending` (its ``keep``).

Skip semantics: at most one promotion waits while a copy is in flight; a newer one replaces it, and
the one replaced is dropped -- its persistent commit is abandoned on every rank (the ticket says
"skipped": :mod:`.commit`), the local tier's retention may delete it, and it is counted
(:attr:`Promotion.skipped`) and reported.  A stalled ``--save`` thus costs neither the local
commits nor node-local space: what the link keeps is the copy in flight and the newest waiting.

Thread-safety: ``offer``/``schedule`` may be called from any thread (the local commit thread calls
``offer``); the copies run on the owned thread ``dsm-promote-r{rank}``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time

from .commit import Ticket
from ..errors import FlushError
from ..format.manifest import read_manifest
from ..names import iter_dir, parse_rank_file_name
from .promote_throttle import Pace, PromoteSlots, PromotionAbandoned
from ..runtime.threads import QueueThread
from .tier import Tier

__all__ = ["Promotion"]

log = logging.getLogger(__name__)
_GRACE_S = 10.0  # how long close() waits for a copy it gave up on to stop (a slot wait stops in 0.25 s)


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
        self._in_flight: set[int] = set()  # scheduled: being copied, or waiting (one at most)
        self._waiting: tuple | None = None  # (queued item, its ticket): the newest not yet being copied
        self._dropped: set = set()  # futures of queued items replaced before the copy thread got to them
        self._newest: Ticket | None = None  # this run's newest local commit when it is not promoted yet
        self.skipped = 0  # promotions dropped for a newer one while a copy was in flight
        self._warned = False  # a drop was warned about since the last copy that completed
        self._stop = threading.Event()  # set by close() past its timeout: the copies in progress give up
        self._doing = "idle"  # what the copy thread is doing, for close()'s report
        src.on_commit(self.offer, keep=self.pending)
        super().__init__(f"dsm-promote-r{self.rank}")

    def in_flight(self) -> set[int]:
        """Source iterations this rank is copying."""
        with self._lock:
            return set(self._in_flight)

    def pending(self) -> set[int]:
        """Source iterations the source tier's retention must keep: those this rank is copying and
        those whose commit on ``dst`` is still open -- the latter covers the other ranks of the node,
        still copying their own files of it, since that commit waits for every rank's copy.  A
        promotion this rank dropped is not kept: its commit is abandoned whatever the others copy."""
        return self.in_flight() | {t.iteration for t in self.dst.outstanding() if not t.skipped}

    def offer(self, ticket: Ticket) -> None:
        """``src`` committed ``ticket``'s checkpoint: promote it when its iteration is a multiple of
        ``interval`` (the same iterations after a requeue, so that they meet ``keep_every``)."""
        due = ticket.iteration % self._interval == 0
        with self._lock:
            self._newest = None if due else ticket
        if due:
            self.schedule(ticket.iteration, ticket.seq, ticket.metadata, summary=ticket.summary)

    def promote_newest(self) -> bool:
        """Schedule this run's newest local checkpoint unless it already was (collective, like every
        schedule: every rank saw the same local commits).  For the end of a run: node-local storage
        may not outlive the job, so its last checkpoint must reach the persistent tier whatever
        ``interval`` says.  Returns whether a promotion was scheduled."""
        with self._lock:
            ticket, self._newest = self._newest, None
        if ticket is None:
            return False
        self.schedule(ticket.iteration, ticket.seq, ticket.metadata, summary=ticket.summary)
        return True

    def resume(self, newest_common: int | None) -> None:
        """After a restart (collective): promote ``newest_common`` -- the newest source checkpoint
        every rank has -- if ``dst`` lacks it (a run killed before its end-of-run promotion)."""
        if newest_common is None:
            return
        latest = self.dst.latest_committed()  # a damaged manifest raises, as on a load
        if latest is None or newest_common > latest:
            m = read_manifest(iter_dir(self.src.root, newest_common))
            _, token, seq = parse_rank_file_name(m.record(self.rank).file)
            log.info(
                "rank %d: promoting local checkpoint %d left unpromoted by the previous run", self.rank, newest_common
            )
            self.schedule(newest_common, seq, dict(m.metadata), token=token)

    def schedule(
        self, iteration: int, seq: int, metadata: dict, token: str | None = None, summary: tuple | None = None
    ) -> None:
        """Promote ``src`` checkpoint ``iteration`` (collective: every rank schedules the same ones, in
        order).  ``token``: the run token in its file names, when an earlier run wrote it (else this
        run's); ``summary``: this rank's global-index summary of the save (its local ticket's)."""
        future: cf.Future = cf.Future()
        ticket = Ticket(
            iteration,
            seq,
            future,
            dict(metadata),
            time.perf_counter(),
            token or self.src.token,
            summary=summary,
            reported=False,  # a failed copy is raised by dst's commit (PromotionError), not only logged
        )
        item = (iteration, ticket, future)
        with self._lock:
            self._in_flight.add(iteration)
            dropped, self._waiting = self._waiting, (item, ticket)
            if dropped is not None:
                self._dropped.add(dropped[0][2])  # decided here, under the lock: never also copied
        self.dst.submit(ticket)
        self.put(item)
        if dropped is not None:
            self._drop(*dropped, newer=iteration)

    def _drop(self, item, ticket: Ticket, newer: int) -> None:
        """A waiting promotion replaced by ``newer``: its persistent commit is abandoned on every
        rank (a skip), and the local tier's retention may delete it; the copy thread passes it by."""
        iteration, _ticket, future = item
        self.skipped += 1
        ticket.skipped = True  # before the future settles: the committer reads it then
        future.set_exception(FlushError(f"rank {self.rank}: promotion of iteration {iteration} skipped for {newer}"))
        with self._lock:
            self._in_flight.discard(iteration)
            warn, self._warned = not self._warned, True
        log.log(
            logging.WARNING if warn else logging.INFO,
            "rank %d: promotion of local checkpoint %d to %s skipped: a copy is still in flight and %d is newer "
            "(%d promotion(s) skipped so far)",
            self.rank,
            iteration,
            self.dst.root,
            newer,
            self.skipped,
        )

    def _handle(self, item) -> None:
        iteration, ticket, future = item
        with self._lock:
            if future in self._dropped:  # replaced by a newer one (settled by _drop)
                self._dropped.discard(future)
                return
            if self._waiting is not None and self._waiting[0] is item:
                self._waiting = None  # being copied now: no longer replaceable
        name = ticket.file_name(self.rank)
        src = os.path.join(iter_dir(self.src.root, iteration), name)
        dst_dir = iter_dir(self.dst.root, iteration)
        try:
            if self._stop.is_set():
                raise PromotionAbandoned(f"rank {self.rank}: the promotion was closed before it started")
            self._doing = f"promoting iteration {iteration} (waiting for a promotion slot)"
            with self._slots.held(self._stop):  # at most ``slots`` of the node's ranks copy at once
                self._doing = f"promoting iteration {iteration} (copying {src})"
                pace = Pace(self._mbps, self._stop) if self._mbps > 0 else None  # no cap: no pacing at all
                receipt = self.dst.promote_file(src, iteration, name, pace)  # verified, then stored
            future.set_result(receipt)
            with self._lock:
                self._warned = False
        except BaseException as e:  # noqa: BLE001 - the persistent committer reports it on every rank
            err = (
                PromotionAbandoned(f"rank {self.rank}: promoting iteration {iteration} given up at close: {e}")
                if isinstance(e, PromotionAbandoned)
                else e
                if isinstance(e, FlushError)
                else FlushError(
                    f"rank {self.rank}: promoting iteration {iteration} from {src} to {dst_dir} failed: {e}"
                )
            )
            if isinstance(err, PromotionAbandoned):
                ticket.reported = True  # close() says what it gave up on
            log.error("%s", err)
            future.set_exception(err)
        finally:
            self._doing = "idle"
            with self._lock:
                self._in_flight.discard(iteration)

    def _busy_with(self) -> str:
        return f"{self._doing}, {self._queue.qsize()} more queued"

    def close(self, timeout: float | None = None) -> bool:
        """Join the copy thread after the promotions queued before, then release the slot files.
        ``timeout``: past it, what is left is given up -- a copy waiting for a slot that other
        processes hold, or paced by a tiny ``mbps``, stops (its persistent commit fails on every
        rank; the local copy stays and the next start promotes it) -- and the thread has
        ``_GRACE_S`` more to end; then this logs what it gave up on and returns.  Returns whether
        the thread ended."""
        ended = super().close() if timeout is None else self._close_bounded(timeout)
        if ended:
            self._slots.close()  # the thread is done with them (else they go with the process)
        return ended

    def _close_bounded(self, timeout: float) -> bool:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "rank %d: giving up the promotions left after %.0f s: %s", self.rank, timeout, self._busy_with()
            )
            self._stop.set()
        return super().close(_GRACE_S)
