"""Asynchronous cross-rank commit: agree that every rank's file is durable, then write the manifest.

One thread per rank (``dsm-commit-r{rank}``) takes tickets in save order.  For each it waits for the
local file to be durable, then sends one status record to rank 0 (:class:`.store_channel.StoreChannel`:
through the c10d store, on a connection of its own, never a process group, so it never interleaves
with training collectives).  Rank 0 decides; if every rank succeeded, the tier's writer (rank 0; on
the local tier each node's first rank, sent its node's rows by rank 0) writes ``manifest.json`` (the
commit point), and rank 0 broadcasts the outcome; the tracker follows.  Otherwise nothing is
written and every rank learns which ranks failed.  A rank whose commit thread fails before it has
its record (an unexpected error, not a failed file) still sends one, as failed: no rank waits for it,
and its error reaches its training thread as a commit's.  Rank 0 does O(N) work; every other rank sends
and receives O(1) bytes (a node leader: O(its node's ranks)).
A run of saves that every rank skipped (a stall: one per iteration) is abandoned in one round: each
rank sends how far its own run of queued skipped tickets goes, and every rank drops the tickets up
to the smallest of these without a round of their own and without a storage call (nobody wrote a
file).  One round per skipped save would leave, once storage recovers, a backlog of rounds as long
as the stall, during which each new save waits for its commit and is skipped in turn: at a round
cost near the iteration time, no checkpoint would commit again (issue 41).
Then the committer's ``after_commit`` runs: the tier hands its retention to its deleter thread
(:mod:`.deleter`) and offers the checkpoint to its subscribers -- the promotion, replication
(:meth:`.tier.Tier.on_commit`).

The committer never sees its tier: it is given a :class:`CommitSpec` (what it must know: the
tier's name, root, rank, token, the ranks it describes, whether its manifests are per node) and
:class:`CommitCalls` (what it may ask the tier to write) -- steps 6 to 8 of the tier contract
(:mod:`.tier`).

Thread-safety: ``submit``/``poll``/``drain``/``close`` are called from the training thread; the
commit thread owns the process group and the manifest writes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time

import numpy as np

from ..errors import CacheTimeoutError, CommitError, LockLostError, PromotionError
from ..runtime.faults import crash_point
from ..format.global_index import Summaries
from ..format.manifest import Manifest
from ..format.rank_table import COLUMNS, RankTable
from ..names import iter_dir, rank_file_name
from ..dist.store_channel import StoreChannel
from ..runtime.threads import QueueThread

__all__ = ["Committer", "CommitSpec", "CommitCalls", "Ticket", "CommitRecord"]

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
    "writes_lo",  # the ranks whose files this rank describes in a manifest: [lo, lo + n)
    "writes_n",
    "summary_sum",  # the checksum of this rank's global-index summary (:mod:`.global_index`); 0: none
    "skipped",  # 1: this rank skipped the save (its storage was behind): no file, nothing failed
    "skip_to",  # skipped: the last sequence number of this rank's run of skipped tickets from this one on
)
_RECORD = COLUMNS  # a manifest's record, in order
_SHOWN = 16  # ranks named in an outcome (and how many there are): the document stays small


def _to_i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


@dataclasses.dataclass
class Ticket:
    """One save (or a promotion's copy) of one rank, on its way to a commit.  ``token`` and ``seq``
    name its files: :meth:`file_name` is the one place a rank file's name is made (:meth:`records`
    hands the manifest the same names, as a table)."""

    iteration: int
    seq: int
    durable: object  # concurrent.futures.Future[FileReceipt]: a save's, or a promotion's copy
    metadata: dict
    t_save: float
    token: str  # run token in the file names (a re-promotion carries an earlier run's)
    skipped: bool = False  # this rank skipped the save (storage behind): the checkpoint is abandoned everywhere
    # this rank's global-index summary (:mod:`.global_index`) ``(bytes, checksum)`` when the save is
    # one whose commit writes a global index (the persistent tier's); ``None``: none to send
    summary: tuple[bytes, int] | None = None
    # whether this rank's failure of ``durable`` is reported by whoever made it (the engine stores a
    # save's error); a promotion's copy is not: its failure is the commit's to raise (PromotionError)
    reported: bool = True

    def file_name(self, rank: int) -> str:
        """Rank ``rank``'s file of this save."""
        return rank_file_name(rank, self.token, self.seq)

    def records(self, first: int, columns: np.ndarray) -> RankTable:
        """The manifest's records of this save's ranks ``first, first + 1, ...`` from their
        ``columns`` (:data:`.rank_table.COLUMNS`), their files named as :meth:`file_name` names them."""
        return RankTable(first, self.token, self.seq, columns)


@dataclasses.dataclass(frozen=True)
class CommitSpec:
    """What a committer knows of its tier: plain data, read at the tier's ``open``."""

    name: str  # in records, manifests and messages
    root: str  # in messages
    rank: int
    token: str  # this run's, in the manifest
    writes: tuple[int, ...]  # the ranks whose files this rank describes in a manifest (empty: none)
    run_id: str  # the run the manifests belong to (:mod:`.run_id`)
    node_local: bool  # each node's leader writes its node's manifest (two phases); no global index


@dataclasses.dataclass(frozen=True)
class CommitCalls:
    """What a committer asks its tier to write, on the commit thread, in this order for one
    checkpoint (the writer only): ``guard`` (the tier is still ours: raises ``LockLostError``),
    ``refuse_newer_format`` (raises :class:`CommitError`), ``write_index``, ``write_manifest`` (the
    commit point); then ``write_tracker``, or ``discard`` when nothing was committed; and on every
    rank ``after_commit`` once it is committed."""

    write_manifest: object  # (manifest) -> None
    write_tracker: object  # (iteration) -> None
    write_index: object  # (manifest, body, records) -> None
    discard: object  # (iteration, names, last) -> None; last: no other save of that iteration is pending
    refuse_newer_format: object  # (iteration) -> None
    after_commit: object = None  # (ticket) -> None
    guard: object = None  # () -> None


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """One committed checkpoint, with the figures telemetry reports (maxima over ranks)."""

    iteration: int
    total_bytes: int
    bytes_per_rank: tuple[int, ...]  # per rank on rank 0; empty on the others (O(1) per rank)
    save_call_s: float
    copy_s: float
    flush_s: float
    commit_s: float
    tier: str = "persistent"
    max_rank_bytes: int = 0  # the most bytes one rank saved (every rank knows it; ``bytes_per_rank``: rank 0)

    def __post_init__(self) -> None:
        if not self.max_rank_bytes and self.bytes_per_rank:
            object.__setattr__(self, "max_rank_bytes", max(self.bytes_per_rank))

    @property
    def d2h_gbps(self) -> float:
        return self.max_rank_bytes / self.copy_s / 1e9 if self.copy_s > 0 else float("inf")

    @property
    def flush_gbps(self) -> float:
        return self.max_rank_bytes / self.flush_s / 1e9 if self.flush_s > 0 else float("inf")


class Committer(QueueThread):
    """Owns the commit thread of one rank; a context manager, ``close()`` idempotent."""

    def __init__(
        self,
        spec: CommitSpec,
        calls: CommitCalls,
        channel: StoreChannel,
        world_size: int,
        layout: dict,
        next_commit_seq: int,
        timeout_s: float,
    ) -> None:
        """``spec``/``calls``: the tier's (it owns this committer); ``channel``: this tier's own,
        used by the commit thread only."""
        self.spec = spec
        self.calls = calls
        self.root = spec.root
        self.rank = rank = spec.rank
        self.world_size = world_size
        self._chan = channel
        self._token = spec.token
        self._layout = layout
        self._commit_seq = next_commit_seq
        self._timeout = timeout_s
        self._writes = list(spec.writes)  # the ranks whose files this rank describes in a manifest
        if self._writes and list(self._writes) != list(range(self._writes[0], self._writes[0] + len(self._writes))):
            raise ValueError(f"rank {rank}: a writer describes a contiguous range of ranks, not {self._writes}")
        self._two_phase = spec.node_local  # node leaders write the manifests, not rank 0 alone
        # a shared tier's writer also writes the checkpoint's global index (a reshard's map)
        self._indexed = not spec.node_local
        self._published = 0  # the summary checksum this rank last sent
        self._summaries = Summaries(world_size) if self._indexed and channel.is_root else None
        self._records: collections.deque[CommitRecord] = collections.deque()
        self._errors: collections.deque[BaseException] = collections.deque()
        self.latest: int | None = None
        self.skipped = 0  # checkpoints abandoned because some rank skipped its save (commit thread writes)
        self.rounds = 0  # commit rounds run (one gather and broadcast each): what a stall costs after it
        self._absorb_to = 0  # the tickets up to this sequence number were abandoned with an earlier one
        # a daemon: a storage call that never returns (an unlink behind a held write) must not keep
        # the process from exiting; close() joins it, bounded, and says what it gave up on.  A
        # commit cut short at exit is a crash at that point, which the commit protocol survives
        super().__init__(f"dsm-commit-r{rank}" + (f"-{spec.name}" if spec.node_local else ""), daemon=True)

    def _busy_with(self) -> str:
        """The checkpoint being committed (or abandoned) and this rank's file of it: a storage call
        on it has not returned (a rank file's unlink behind a held write, the manifest's write)."""
        busy = self._busy_for()
        queued = f"{self._queue.qsize()} item(s) still queued"
        if busy is None or not isinstance(busy[0], Ticket):
            return queued
        ticket, seconds = busy
        path = os.path.join(iter_dir(self.root, ticket.iteration), ticket.file_name(self.rank))
        return f"iteration {ticket.iteration} ({path}), in a storage call not returned for {seconds:.0f} s; {queued}"

    def submit(self, ticket: Ticket) -> None:
        self.put(ticket, key=ticket.seq)  # outstanding by sequence number (:meth:`_skipped_run`)

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
        if not super().drain(timeout):
            raise CacheTimeoutError(
                f"rank {self.rank}: {len(self.outstanding())} checkpoint(s) not committed after {timeout:.0f}s"
            )

    # ------------------------------------------------------------------ commit thread
    def _handle(self, ticket: Ticket) -> None:
        committed = False
        if ticket.seq <= self._absorb_to:  # every rank skipped it: abandoned in an earlier round
            return
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
            # reported once, where it is surfaced (the next poll or wait: raised, or the one
            # on_error=warn line)
            log.info("%s", err)
            self._errors.append(err)
        if committed:
            self._after_commit(ticket)

    def _after_commit(self, ticket: Ticket) -> None:
        """Retention and promotion of a committed checkpoint (``after_commit``): outside the
        commit's ``try``, so that nothing they raise can turn a commit into "nothing committed" (the
        tier logs its own failures; this is the last guard)."""
        if self.calls.after_commit is None:
            return
        try:
            self.calls.after_commit(ticket)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed whatever happens here
            log.error(
                "rank %d: iteration %d is committed (%s tier), but what follows its commit failed: %r",
                self.rank,
                ticket.iteration,
                self.spec.name,
                e,
            )

    def _status(self, ticket: Ticket) -> dict[str, int]:
        """This rank's status record of ``ticket`` (zeros after its ``ok`` when its file failed)."""
        status = dict.fromkeys(_STATUS, 0)
        status.update(iteration=ticket.iteration, seq=ticket.seq)
        if self._writes:
            status.update(writes_lo=self._writes[0], writes_n=len(self._writes))
        summary = ticket.summary if self._indexed else None
        if summary is not None:
            raw, h = summary
            if h != self._published:  # sent once per change, kept in the store
                self._chan.publish("summary", raw)
                self._published = h
            status.update(summary_sum=h)
        if ticket.skipped:
            status.update(skipped=1, skip_to=self._skipped_run(ticket.seq))
            return status
        try:
            r = ticket.durable.result(timeout=self._timeout)
        except BaseException:  # noqa: BLE001 - the engine already stored and logged this rank's error
            if ticket.skipped:  # dropped while waiting (a promotion replaced by a newer one)
                status.update(skipped=1)
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

    def _skipped_run(self, seq: int) -> int:
        """The last sequence number of the run of this rank's submitted tickets, from ``seq`` on,
        that are all skipped."""
        with self._idle:
            while (nxt := self._outstanding.get(seq + 1)) is not None and nxt.skipped:
                seq += 1
        return seq

    def _commit(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s checkpoint was committed (False or an error: it was not).  Rank 0 gathers every rank's status (O(N) there, one record sent by each other rank),
        writes the manifest -- on the local tier each node leader writes its node's, with its
        node's rows from rank 0, and rank 0 gathers whether they could -- and broadcasts the
        outcome (one small document)."""
        chan = self._chan
        self.rounds += 1
        fault = None
        try:
            mine = self._status(ticket)
        except Exception as e:  # noqa: BLE001 - this rank still joins the round, as a failed one:
            fault = e  # no rank waits for its record, and the checkpoint is abandoned on every rank
            mine = dict.fromkeys(_STATUS, 0)
            mine.update(iteration=ticket.iteration, seq=ticket.seq)
            if self._writes:
                mine.update(writes_lo=self._writes[0], writes_n=len(self._writes))
        cols = chan.gather(mine, _STATUS)  # rank 0: every rank's status, a column per field
        verdict = self._verdict(ticket, cols) if chan.is_root else None
        if self._two_phase:
            got = chan.scatter(self._leader_docs(verdict, cols) if chan.is_root else None, expect=bool(self._writes))
            ok = True
            if self._writes and got["go"]:
                ok = self._write_manifest(ticket, got["cols"], got["lo"])
            oks = chan.gather({"ok": int(ok)}, ("ok",))
            if chan.is_root and verdict["go"]:
                bad = np.flatnonzero(oks["ok"] == 0).tolist()
                verdict.update(go=not bad, unwritten=bad[:_SHOWN], n_unwritten=len(bad))
        elif chan.is_root and verdict["go"]:
            ok = self._write_manifest(ticket, cols, 0)
            verdict.update(go=ok, unwritten=[] if ok else [0], n_unwritten=int(not ok))
        outcome = chan.broadcast(verdict)
        if not outcome["go"]:
            if fault is None:
                self._refuse(ticket, outcome, own_failed=mine["ok"] != 1)
                return False
            try:  # the writers' clean-up; its own error (out of step, a promotion's) gives way to the fault
                self._refuse(ticket, outcome, own_failed=True)
            except Exception as e:  # noqa: BLE001 - the fault is this rank's error
                log.info("rank %d: iteration %d: %s", self.rank, ticket.iteration, e)
            raise CommitError(
                f"rank {self.rank}: iteration {ticket.iteration}: commit failed: {fault!r}; nothing committed"
            ) from fault
        self._commit_seq += 1
        self.latest = ticket.iteration
        if self._writes:
            # the manifest is the commit point; the tracker is Megatron's hint and may lag it
            crash_point("before_tracker", self.rank)
            try:
                self.calls.write_tracker(ticket.iteration)
            except OSError as e:
                log.warning(
                    "rank %d: iteration %d is committed but %s could not update the tracker: %s",
                    self.rank,
                    ticket.iteration,
                    self.root,
                    e,
                )
        record = CommitRecord(
            iteration=ticket.iteration,
            total_bytes=outcome["total_bytes"],
            bytes_per_rank=tuple(cols["data_bytes"].tolist()) if cols is not None else (),
            save_call_s=outcome["call_us"] / 1e6,
            copy_s=outcome["copy_us"] / 1e6,
            flush_s=outcome["flush_us"] / 1e6,
            commit_s=time.perf_counter() - ticket.t_save,
            tier=self.spec.name,
            max_rank_bytes=outcome["max_rank_bytes"],
        )
        self._records.append(record)
        return True

    def _leader_docs(self, verdict: dict, cols: dict[str, np.ndarray]) -> dict[int, dict]:
        """Rank 0, local tier: to each node leader the verdict and (when it may write) the status
        columns of its node's ranks."""
        docs = {}
        for r in np.flatnonzero(cols["writes_n"]).tolist():
            lo, n = int(cols["writes_lo"][r]), int(cols["writes_n"][r])
            node = {f: cols[f][lo : lo + n].tolist() for f in _RECORD} if verdict["go"] else {}
            docs[r] = {"go": verdict["go"], "lo": lo, "cols": node}
        return docs

    def _verdict(self, ticket: Ticket, cols: dict[str, np.ndarray]) -> dict:
        """Rank 0: whether every rank saved ``ticket`` (the same iteration and sequence) and
        succeeded; with the figures every rank's commit record reports.  O(N) in numpy, small to send."""
        it, sq = cols["iteration"], cols["seq"]
        filled = np.zeros(sq.size, dtype=bool)  # gone ranks whose rows of zeros the channel made: failed
        filled[sorted(self._chan.filled)] = True
        stray = np.flatnonzero(((it != ticket.iteration) | (sq != ticket.seq)) & ~filled)
        failed = np.flatnonzero(cols["ok"] != 1)
        skipped = np.flatnonzero(cols["skipped"] != 0)
        everyone = not stray.size and skipped.size == sq.size  # every rank skipped it: a run may go at once
        return {
            "all_skipped": bool(everyone),
            "skip_to": int(cols["skip_to"].min()) if everyone else ticket.seq,
            "go": not stray.size and not failed.size,
            "stray": [(i, int(it[i]), int(sq[i])) for i in stray[:_SHOWN].tolist()],
            "n_stray": int(stray.size),
            "failed": failed[:_SHOWN].tolist(),
            "n_failed": int(failed.size),
            "skipped": skipped[:_SHOWN].tolist(),
            "n_skipped": int(skipped.size),
            "unwritten": [],
            "n_unwritten": 0,
            "total_bytes": int(cols["data_bytes"].sum()),
            "max_rank_bytes": int(cols["data_bytes"].max()),
            "call_us": int(cols["call_us"].max()),
            "copy_us": int(cols["copy_us"].max()),
            "flush_us": int(cols["flush_us"].max()),
        }

    def _write_manifest(self, ticket: Ticket, cols: dict, lo: int) -> bool:
        """The writer: this tier's manifest of ``ticket`` (the commit point) from the status
        columns (arrays, or lists sent by rank 0) of ranks ``lo``, ``lo + 1``, ... (every rank on
        rank 0; a node leader's node); ``False`` (the error stored) when it could not be written."""
        try:
            first, n = self._writes[0], len(self._writes)
            # the records as columns (signed int64 as sent: the unsigned checksums back by the cast)
            table = np.stack(
                [np.asarray(cols[f], dtype=np.int64)[first - lo : first - lo + n] for f in _RECORD], axis=1
            )
            manifest = Manifest(
                iteration=ticket.iteration,
                world_size=self.world_size,
                run_token=self._token,
                ranks=ticket.records(first, table.view(np.uint64)),  # columns: no object per rank
                layout=self._layout,
                metadata=ticket.metadata,
                commit_seq=self._commit_seq,
                tier=self.spec.name,
                run_id=self.spec.run_id,
            )
            if self.calls.guard is not None:  # the directory is still ours (its lock file is the one we locked)
                self.calls.guard()
            self.calls.refuse_newer_format(ticket.iteration)
            self._write_index(manifest, cols)
            crash_point("before_manifest", self.rank)
            self.calls.write_manifest(manifest)
        except CommitError as e:  # a newer format's checkpoint is there
            self._errors.append(e)
            return False
        except LockLostError as e:
            err = CommitError(f"rank {self.rank}: iteration {ticket.iteration}: not committed: {e}")
            err.__cause__ = e
            self._errors.append(err)
            return False
        except Exception as e:  # noqa: BLE001 - an OSError, or metadata that is not JSON: every rank must hear it
            # (a writer that raised here would leave every other rank waiting for the outcome)
            err = CommitError(
                f"rank {self.rank}: iteration {ticket.iteration}: writing the {self.spec.name} manifest in {self.root} failed: {e}"
            )
            err.__cause__ = e
            self._errors.append(err)
            return False
        return True

    def _write_index(self, manifest: Manifest, cols: dict) -> None:
        """Rank 0 (persistent tier): the checkpoint's global index, before its manifest, when every
        rank sent a summary, with the manifest's records (its table's columns, in the index's
        order).  Optional: a failure is logged and the checkpoint has no index."""
        if self._summaries is None:
            return
        try:
            body = self._summaries.update(cols["summary_sum"], lambda ranks: self._chan.fetch("summary", ranks))
            t = manifest.ranks
            records = (t.token, t.seq, t.columns) if t.first == 0 and len(t) == manifest.world_size else None
            if body is not None:
                self.calls.write_index(manifest, body, records)
        except Exception as e:  # noqa: BLE001 - a reshard then reads every rank file's metadata
            log.warning(
                "rank %d: iteration %d: no global index written (%r); a reshard of it reads every rank file",
                self.rank,
                manifest.iteration,
                e,
            )

    def _refuse(self, ticket: Ticket, outcome: dict, own_failed: bool) -> None:
        """Nothing was committed: the writers remove the save's files; every rank but one whose own
        error is stored already raises, naming the ranks that failed."""
        if self._writes and not outcome["all_skipped"]:  # when every rank skipped, nobody wrote a file
            self._discard(ticket)
        if outcome["n_stray"]:
            raise CommitError(
                f"rank {self.rank}: ranks are out of step: rank(s) saving {_shown(outcome['stray'], outcome['n_stray'])} "
                f"(rank, iteration, sequence), not iteration {ticket.iteration} sequence {ticket.seq}; nothing committed"
            )
        if outcome["n_failed"] and outcome["n_failed"] == outcome["n_skipped"]:
            # only skips (storage behind somewhere): reported by the skipping ranks, not an error here
            self.skipped += 1
            if outcome["skip_to"] > ticket.seq:  # every rank skipped these too: abandoned with this one
                self.skipped += outcome["skip_to"] - ticket.seq
                self._absorb_to = outcome["skip_to"]
            log.debug(
                "rank %d: iteration %d abandoned (%s tier): rank(s) %s skipped it",
                self.rank,
                ticket.iteration,
                self.spec.name,
                _shown(outcome["skipped"], outcome["n_skipped"]),
            )
            return
        if outcome["n_failed"]:
            failed = _shown(outcome["failed"], outcome["n_failed"])
            if own_failed and ticket.reported:
                return  # this rank's own error is already stored by the engine
            if not ticket.reported:  # a promotion: every rank raises it, the failing ones with their own error
                own = ticket.durable.exception(timeout=0) if own_failed else None
                raise PromotionError(
                    f"{own if own is not None else f'rank {self.rank}: iteration {ticket.iteration}'}; "
                    f"not promoted: rank(s) {failed} failed to copy their files, nothing committed in "
                    f"{self.root}, latest there stays {self.latest}",
                    ticket.iteration,
                )
            raise CommitError(
                f"rank {self.rank}: iteration {ticket.iteration}: rank(s) {failed} "
                f"failed to write their files; nothing committed, latest stays {self.latest}"
            )
        if self.rank in outcome["unwritten"]:
            return  # this writer's error is stored
        raise CommitError(
            f"rank {self.rank}: iteration {ticket.iteration}: a {self.spec.name} manifest could not be written "
            f"(by rank(s) {_shown(outcome['unwritten'], outcome['n_unwritten'])}); nothing committed"
        )

    def _discard(self, ticket: Ticket) -> None:
        """Remove the files of a save that was not committed (and its directory if nothing else is there)."""
        others = [t for t in self.outstanding() if t.iteration == ticket.iteration and t.seq != ticket.seq]
        self.calls.discard(ticket.iteration, [ticket.file_name(r) for r in self._writes], not others)

    def outstanding(self) -> list[Ticket]:
        """The tickets submitted and not processed yet (any thread)."""
        return self._outstanding_items()


def _shown(ranks: list, n: int) -> str:
    return f"{ranks}" + (f" and {n - len(ranks)} more" if n > len(ranks) else "")
