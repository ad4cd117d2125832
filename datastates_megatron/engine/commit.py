"""Asynchronous cross-rank commit: agree that every rank's file is durable, then write the manifest.

One thread per rank (``dsm-commit-r{rank}``) takes tickets in save order.  For each it waits for the
local file to be durable, then all ranks gather one status record (:class:`.collective.Collective`
on a dedicated gloo group that no other code uses, so it never interleaves with training collectives).
If every rank succeeded, the tier's writer (rank 0; on the local tier each node's first rank)
writes ``manifest.json`` (the commit point) and the ranks agree on the outcome;
the tracker follows; otherwise nothing is written and every rank learns which ranks failed.
Retention runs afterwards on rank 0, on this thread, so deletions never block training.

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
from .errors import CacheTimeoutError, CommitError
from .faults import crash_point
from .manifest import (
    Manifest,
    RankRecord,
    iter_dir,
    parse_rank_file_name,
    rank_file_name,
    write_manifest,
    write_tracker,
)
from .retention import delete_checkpoint, select_deletions, trim_recycled, unlink_ours
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
    durable: object  # concurrent.futures.Future[FileReceipt]
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
        self,
        root: str,  # the tier's root directory (node-local for the local tier)
        *,
        rank: int,
        world_size: int,
        collective: Collective,
        token: str,
        layout: dict,
        next_commit_seq: int,
        keep_last: int,
        keep_every: int,
        timeout_s: float,
        tier: str = "persistent",
        node_ranks: list[int] | None = None,
        on_commit=None,
        protect=None,
        recycle: bool = False,
    ) -> None:
        self.root = root
        self._recycle = recycle  # retention moves rank files to the pool the next saves reuse
        self.rank = rank
        self.world_size = world_size
        self._coll = collective  # this tier's own group: used by the commit thread only
        self._token = token
        self._layout = layout
        self._commit_seq = next_commit_seq
        self._keep_last = keep_last
        self._keep_every = keep_every
        self._timeout = timeout_s
        self.tier = tier
        # which ranks' files this rank describes in a manifest: all of them on rank 0 for the
        # persistent tier; its node's ranks on each node's first rank for the local tier
        if tier == "persistent":
            self._writes = list(range(world_size)) if rank == 0 else []
        else:
            nodes = node_ranks or list(range(world_size))
            self._writes = nodes if rank == min(nodes) else []
        self._on_commit = on_commit  # called on the commit thread with (ticket, record)
        self._protect = protect  # () -> iterations retention must keep (e.g. being promoted)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding: dict[int, Ticket] = {}  # seq -> ticket not yet processed
        self._records: collections.deque[CommitRecord] = collections.deque()
        self._errors: collections.deque[BaseException] = collections.deque()
        self.latest: int | None = None
        super().__init__(f"dsm-commit-r{rank}" + ("-local" if tier == "local" else ""))

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes this tier's manifests (and so runs its retention)."""
        return bool(self._writes)

    def submit(self, ticket: Ticket) -> None:
        with self._lock:
            self._outstanding[ticket.seq] = ticket
        self.put(ticket)

    @property
    def recycles(self) -> bool:
        """Whether this tier's retention recycles rank files (so saves should take from the pool)."""
        return self._recycle

    def pending_iterations(self) -> set[int]:
        with self._lock:
            return {t.iteration for t in self._outstanding.values()}

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
        try:
            self._commit(ticket)
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
        finally:
            with self._idle:
                self._outstanding.pop(ticket.seq, None)
                self._idle.notify_all()

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

    def _commit(self, ticket: Ticket) -> None:
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
                return  # this rank's own error is already stored by the engine
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
                    tier=self.tier,
                )
                crash_point("before_manifest", self.rank)
                write_manifest(self.root, manifest)
            except OSError as e:
                ok = False
                err = CommitError(
                    f"rank {self.rank}: iteration {ticket.iteration}: writing the {self.tier} manifest in {self.root} failed: {e}"
                )
                err.__cause__ = e
                self._errors.append(err)
        if self._coll.agree(ok):
            if self._writes:
                self._discard(ticket)
            if not self._writes:
                raise CommitError(
                    f"rank {self.rank}: iteration {ticket.iteration}: a {self.tier} manifest could not be written; "
                    "nothing committed"
                )
            return
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
            tier=self.tier,
        )
        self._records.append(record)
        if self._writes:
            self._retain(ticket)
        if self._on_commit is not None:
            self._on_commit(ticket, record)

    def _retain(self, just_committed: Ticket) -> None:
        from .manifest import committed_iterations

        protected = self.pending_iterations() | {just_committed.iteration}
        if self._protect is not None:
            protected |= self._protect()
        for it in select_deletions(committed_iterations(self.root), self._keep_last, self._keep_every, protected):
            crash_point("retention", self.rank)
            delete_checkpoint(self.root, it, recycle=self._recycle)
            log.info("rank %d: retention deleted %s (%s tier)", self.rank, iter_dir(self.root, it), self.tier)
        if self._recycle:
            trim_recycled(self.root, keep=2 * len(self._writes))  # two checkpoints' worth
        # files of an older save of the same iteration, now superseded by this manifest
        d = iter_dir(self.root, just_committed.iteration)
        pending_names = {
            rank_file_name(r, t.token or self._token, t.seq) for t in self._snapshot_outstanding() for r in self._writes
        }
        current = {rank_file_name(r, just_committed.token or self._token, just_committed.seq) for r in self._writes}
        for name in os.listdir(d):
            if (
                parse_rank_file_name(name) is not None
                and name not in current
                and name not in pending_names
                and not self._newer_save_of_this_run(name, just_committed.seq)
            ):
                unlink_ours(os.path.join(d, name))

    def _newer_save_of_this_run(self, name: str, seq: int) -> bool:
        """A file of a later save of the same iteration that another rank may have started before
        this (writer) rank submitted it: it is not superseded, it supersedes."""
        parsed = parse_rank_file_name(name)
        return parsed is not None and parsed[1] == self._token and parsed[2] > seq

    def _discard(self, ticket: Ticket) -> None:
        """Remove the files of a save that was not committed (and its directory if nothing else is there)."""
        d = iter_dir(self.root, ticket.iteration)
        for r in self._writes:
            unlink_ours(os.path.join(d, rank_file_name(r, ticket.token or self._token, ticket.seq)))
        others = [t for t in self._snapshot_outstanding() if t.iteration == ticket.iteration and t.seq != ticket.seq]
        if not others:
            try:
                os.rmdir(d)  # only succeeds when empty: a committed manifest keeps it
            except OSError:
                pass

    def _snapshot_outstanding(self) -> list[Ticket]:
        with self._lock:
            return list(self._outstanding.values())
