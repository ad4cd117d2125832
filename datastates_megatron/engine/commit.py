"""Asynchronous cross-rank commit: agree that every rank's file is durable, then write the manifest.

One thread per rank (``dsm-commit-r{rank}``) takes tickets in save order.  For each it waits for the
local file to be durable, then all ranks gather one status record (:class:`.collective.Collective`
on a dedicated gloo group that no other code uses, so it never interleaves with training collectives).
If every rank succeeded, the tier's writer (rank 0; on the local tier each node's first rank)
writes ``manifest.json`` (the commit point) and the ranks agree on the outcome;
the tracker follows; otherwise nothing is written and every rank learns which ranks failed.
Then the tier's retention runs, on this thread, so deletions never block training, and the tier's
promotion, if any, is offered the checkpoint (:meth:`.tier.Tier.after_commit`).

Thread-safety: ``submit``/``poll``/``drain``/``close`` are called from the training thread; the
commit thread owns the process group and the manifest writes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time

from .collective import Collective
from .errors import CacheTimeoutError, CommitError, LockLostError
from .faults import crash_point
from .manifest import Manifest, RankRecord, iter_dir, rank_file_name, write_manifest, write_tracker
from .retention import unlink_ours
from .threads import QueueThread

__all__ = ["Committer", "Ticket", "CommitRecord"]

log = logging.getLogger(__name__)
# one rank's status of one save, gathered by every rank (checksums as signed int64)
_STATUS = (
    "ok",
    "iteration",
    "seq",
    "file_bytes",
    "data_bytes",
    "n_tensors",
    "index_xxh64",
    "header_xxh64",
    "copy_us",
    "flush_us",
    "call_us",
)


def _to_i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _to_u64(i: int) -> int:
    return i + (1 << 64) if i < 0 else i


@dataclasses.dataclass
class Ticket:
    iteration: int
    seq: int
    durable: object  # concurrent.futures.Future[FileReceipt]: a save's, or a promotion's copy
    metadata: dict
    t_save: float
    token: str | None = None  # run token in the file names (a re-promotion carries an earlier run's)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """One committed checkpoint, with the figures telemetry reports (maxima over ranks)."""

    iteration: int
    total_bytes: int
    bytes_per_rank: tuple[int, ...]
    save_call_s: float
    copy_s: float
    flush_s: float
    commit_s: float
    tier: str = "persistent"

    @property
    def d2h_gbps(self) -> float:
        return max(self.bytes_per_rank) / self.copy_s / 1e9 if self.copy_s > 0 else float("inf")

    @property
    def flush_gbps(self) -> float:
        return max(self.bytes_per_rank) / self.flush_s / 1e9 if self.flush_s > 0 else float("inf")


class Committer(QueueThread):
    """Owns the commit thread of one rank; a context manager, ``close()`` idempotent."""

    def __init__(
        self, tier, collective: Collective, world_size: int, layout: dict, next_commit_seq: int, timeout_s: float
    ) -> None:
        """``tier``: the :class:`.tier.Tier` whose manifests this thread writes."""
        self.tier = tier
        self.root = tier.root
        self.rank = rank = tier.rank
        self.world_size = world_size
        self._coll = collective  # this tier's own group: used by the commit thread only
        self._token = tier.token
        self._layout = layout
        self._commit_seq = next_commit_seq
        self._timeout = timeout_s
        self._writes = tier.writes  # the ranks whose files this rank describes in a manifest
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding: dict[int, Ticket] = {}  # seq -> ticket not yet processed
        self._records: collections.deque[CommitRecord] = collections.deque()
        self._errors: collections.deque[BaseException] = collections.deque()
        self.latest: int | None = None
        # the writer's check that it still owns the directory (:meth:`.dirlock.SaveDirLock.check`),
        # run before each manifest is written; raises LockLostError (nothing is committed then)
        self.guard = None
        super().__init__(f"dsm-commit-r{rank}" + ("-local" if tier.name == "local" else ""))

    def submit(self, ticket: Ticket) -> None:
        with self._lock:
            self._outstanding[ticket.seq] = ticket
        self.put(ticket)

    def poll(self) -> list[CommitRecord]:
        """Commits completed since the last call; re-raises one stored error (once)."""
        if self._errors:
            raise self._errors.popleft()
        out = []
        while self._records:
            out.append(self._records.popleft())
        return out

    def drain(self, timeout: float | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        with self._idle:
            if not self._idle.wait_for(lambda: not self._outstanding, timeout):
                raise CacheTimeoutError(
                    f"rank {self.rank}: {len(self._outstanding)} checkpoint(s) not committed after {timeout:.0f}s"
                )

    # ------------------------------------------------------------------ commit thread
    def _handle(self, ticket: Ticket) -> None:
        committed = False
        try:
            committed = self._commit(ticket)
        except BaseException as e:  # noqa: BLE001 - stored, re-raised on the training thread
            err = (
                e
                if isinstance(e, CommitError)
                else CommitError(
                    f"rank {self.rank}: iteration {ticket.iteration}: commit failed: {e!r}; nothing committed"
                )
            )
            if err is not e:
                err.__cause__ = e
            log.error("%s", err)
            self._errors.append(err)
        try:
            if committed:
                self._after_commit(ticket)
        finally:
            with self._idle:
                self._outstanding.pop(ticket.seq, None)
                self._idle.notify_all()

    def _after_commit(self, ticket: Ticket) -> None:
        """Retention and promotion of a committed checkpoint: outside the commit's ``try``, so that
        nothing they raise can turn a commit into "nothing committed" (the tier logs its own
        failures; this is the last guard)."""
        try:
            self.tier.after_commit(ticket)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed whatever happens here
            log.error(
                "rank %d: iteration %d is committed (%s tier), but what follows its commit failed: %r",
                self.rank,
                ticket.iteration,
                self.tier.name,
                e,
            )

    def _status(self, ticket: Ticket) -> dict[str, int]:
        """This rank's status record of ``ticket`` (zeros after its ``ok`` when its file failed)."""
        status = dict.fromkeys(_STATUS, 0)
        status.update(iteration=ticket.iteration, seq=ticket.seq)
        try:
            r = ticket.durable.result(timeout=self._timeout)
        except BaseException:  # noqa: BLE001 - the engine already stored and logged this rank's error
            return status
        status.update(
            ok=1,
            file_bytes=r.file_bytes,
            data_bytes=r.data_bytes,
            n_tensors=r.n_tensors,
            index_xxh64=_to_i64(r.index_xxh64),
            header_xxh64=_to_i64(r.header_xxh64),
            copy_us=int(r.copy_s * 1e6),
            flush_us=int(r.flush_s * 1e6),
            call_us=int(r.save_call_s * 1e6),
        )
        return status

    def _commit(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s checkpoint was committed (False or an error: it was not)."""
        rows = self._coll.gather(self._status(ticket))
        if any(r["iteration"] != ticket.iteration or r["seq"] != ticket.seq for r in rows):
            raise CommitError(
                f"rank {self.rank}: ranks are out of step: saving "
                f"{[(r['iteration'], r['seq']) for r in rows]} (iteration, sequence) per rank; nothing committed"
            )
        failed = [i for i, r in enumerate(rows) if r["ok"] != 1]
        if failed:
            if self._writes:
                self._discard(ticket)
            if self.rank in failed:
                return False  # this rank's own error is already stored by the engine
            raise CommitError(
                f"rank {self.rank}: iteration {ticket.iteration}: rank(s) {failed} failed to write their files; "
                f"nothing committed, latest stays {self.latest}"
            )
        ok = True
        if self._writes:
            try:
                manifest = Manifest(
                    iteration=ticket.iteration,
                    world_size=self.world_size,
                    run_token=self._token,
                    ranks=tuple(
                        RankRecord(
                            i,
                            rank_file_name(i, ticket.token or self._token, ticket.seq),
                            r["file_bytes"],
                            r["data_bytes"],
                            r["n_tensors"],
                            _to_u64(r["index_xxh64"]),
                            _to_u64(r["header_xxh64"]),
                        )
                        for i, r in enumerate(rows)
                        if i in self._writes
                    ),
                    layout=self._layout,
                    metadata=ticket.metadata,
                    commit_seq=self._commit_seq,
                    tier=self.tier.name,
                    run_id=self.tier.run_id,
                )
                if self.guard is not None:
                    self.guard()
                crash_point("before_manifest", self.rank)
                write_manifest(self.root, manifest)
            except LockLostError as e:
                ok = False
                err = CommitError(f"rank {self.rank}: iteration {ticket.iteration}: not committed: {e}")
                err.__cause__ = e
                self._errors.append(err)
            except OSError as e:
                ok = False
                err = CommitError(
                    f"rank {self.rank}: iteration {ticket.iteration}: writing the {self.tier.name} manifest in {self.root} failed: {e}"
                )
                err.__cause__ = e
                self._errors.append(err)
        if self._coll.agree(ok):
            if self._writes:
                self._discard(ticket)
            if not self._writes:
                raise CommitError(
                    f"rank {self.rank}: iteration {ticket.iteration}: a {self.tier.name} manifest could not be written; "
                    "nothing committed"
                )
            return False
        self._commit_seq += 1
        self.latest = ticket.iteration
        if self._writes:
            # the manifest is the commit point; the tracker is Megatron's hint and may lag it
            crash_point("before_tracker", self.rank)
            try:
                write_tracker(self.root, ticket.iteration)
            except OSError as e:
                log.warning(
                    "rank %d: iteration %d is committed but %s could not update the tracker: %s",
                    self.rank,
                    ticket.iteration,
                    self.root,
                    e,
                )
        bytes_per_rank = tuple(r["data_bytes"] for r in rows)
        record = CommitRecord(
            iteration=ticket.iteration,
            total_bytes=sum(bytes_per_rank),
            bytes_per_rank=bytes_per_rank,
            save_call_s=max(r["call_us"] for r in rows) / 1e6,
            copy_s=max(r["copy_us"] for r in rows) / 1e6,
            flush_s=max(r["flush_us"] for r in rows) / 1e6,
            commit_s=time.perf_counter() - ticket.t_save,
            tier=self.tier.name,
        )
        self._records.append(record)
        return True

    def _discard(self, ticket: Ticket) -> None:
        """Remove the files of a save that was not committed (and its directory if nothing else is there)."""
        d = iter_dir(self.root, ticket.iteration)
        for r in self._writes:
            unlink_ours(os.path.join(d, rank_file_name(r, ticket.token or self._token, ticket.seq)))
        others = [t for t in self.outstanding() if t.iteration == ticket.iteration and t.seq != ticket.seq]
        if not others:
            try:
                os.rmdir(d)  # only succeeds when empty: a committed manifest keeps it
            except OSError:
                pass

    def outstanding(self) -> list[Ticket]:
        """The tickets submitted and not processed yet (any thread)."""
        with self._lock:
            return list(self._outstanding.values())
