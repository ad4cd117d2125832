"""Partner replication of the node-local tier: each rank's local file also lives on the ranks of its
clique on other nodes, so losing a node does not lose its node-local checkpoints.

Why: a dead node takes its ``/dev/shm`` with it; without a replica every rank falls back to the last
*promoted* checkpoint and the high local checkpoint frequency buys nothing for the most common
failure at scale.  As in nvidia-resiliency-ext's clique replication (and Megatron-LM's
``--replication-jump J --replication-factor F``): ranks ``r, r+J, ..., r+(F-1)J`` within blocks of
``J*F`` ranks form a clique (``J`` = ranks per node puts its members on ``F`` different nodes), and
every member keeps a copy of every other member's file.  Traffic stays inside cliques, over one
gloo group per clique (``F`` ranks, never the world).

Layout: the replica of rank ``s`` held by this rank is ``<run's local dir>/replicas/r<s>/iter_*``, a
tier directory of its own (one-rank manifest, the node manifest's record and metadata); a file
fetched back for this rank after its node was replaced lands in ``replicas/r<self>``.  A replica is
committed (its manifest written) only once the file is complete, every checksum verified and its
header matches the sender's manifest record.

Off the commit path, with skip semantics: a local commit only hands its checkpoint to this rank's
replication thread (``dsm-replicate-r{rank}``) and goes on, so a stalled partner never delays a
local commit or training.  Before each exchange the clique agrees (one all-reduce of the clique)
on the newest local commit any member has seen; every member waits until it has seen it too (the
local commits are the same on every rank) and exchanges that one; the older ones it had not
replicated are dropped (counted in :attr:`Replication.skipped`, reported).  What local retention
keeps for it (:meth:`Replication.kept`): the newest checkpoint seen, the one offered to or agreed
by the clique until its exchange is over, and the newest one whose exchange completed here.

Thread-safety: :meth:`Replication.replicate` runs on the replication thread; the restore steps run
on the training thread at load, after :meth:`Replication.drain` (the clique group is used by one
thread at a time).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time

import torch

from ..dist.collective import Collective
from ..errors import CacheTimeoutError, CheckpointError
from ..runtime.faults import crash_point
from ..format.file_format import RankFile
from ..format.manifest import read_manifest
from ..names import (
    REPLICAS_DIR,
    iter_dir,
    parse_rank_file_name,
    replica_store_name,
    replica_store_rank,
)
from .replica_strategy import replica_policy
from .replica_transport import HDR, PairTransport, ReplicaReceiver
from .retention import delete_checkpoint, remove_ours
from ..fs.safe_io import make_dir, real_dir
from .tier import Tier, committed_saves, list_iterations

__all__ = ["Replication", "ReplicaStats"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ReplicaStats:
    """Bytes and seconds of the replication of this rank's checkpoints (sent, received)."""

    checkpoints: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_fetched: int = 0  # this rank's own files fetched back at a restore
    seconds: float = 0.0
    failures: int = 0


class Replication:
    """The replicas of one rank: what it sends its clique, what it keeps for the others, and the
    restore steps that use them.  ``close()`` is idempotent (the group is the process group's)."""

    def __init__(self, local: Tier, clique: list[int], *, keep_last: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.local = local
        self.rank = local.rank
        self.clique = clique
        self.me = clique.index(self.rank)
        # at least 2 (0: all): a node lost while the newest is replicated -- some cliques done, some
        # not -- still finds the one before it on every partner
        self.keep = replica_policy(keep_last)  # each replica store's retention (:mod:`.replica_strategy`)
        self.stats = ReplicaStats()
        self.timeout_s = timeout_s
        # the newest local checkpoint whose exchange completed here: local retention keeps it
        self.last_replicated: int | None = None
        self.skipped = 0  # local checkpoints dropped for a newer one while an exchange was in flight
        self._cond = threading.Condition()
        self._seen: list = []  # local commits (tickets) not yet exchanged nor dropped, oldest first
        self._offered: int | None = None  # the iteration offered to / agreed by the clique, until exchanged
        self._busy = False  # an agreement or exchange is in progress
        self._closing = False
        self._warned = False  # a drop was warned about since the last exchange that completed
        self._thread: threading.Thread | None = None
        self.group = dist.new_group(
            clique, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True
        )
        self._coll = Collective(self.group)
        self._stores = {src: self._store(src) for src in clique}  # its own too: a fetched copy
        self._io = PairTransport(self.group)  # how the bytes move (:mod:`.replica_transport`)

    def open_stores(self, node_sources: set[int] | None) -> None:
        """Start-up: make this rank's replica directories (never through a link: each level is
        checked) and clean our leftovers there.  ``node_sources`` (the node's writer only): every
        rank whose replicas this node's ranks keep; the directories of any other rank (another
        layout or replication setting) are removed, ours only."""
        top = os.path.join(self.local.root, REPLICAS_DIR)
        make_dir(top)
        for name in os.listdir(top) if node_sources is not None else ():
            src = replica_store_rank(name)
            if src is not None and src not in node_sources and real_dir(os.path.join(top, name)):
                for it in list_iterations(os.path.join(top, name)):
                    delete_checkpoint(os.path.join(top, name), it)
                remove_ours(os.path.join(top, name))
        for store in self._stores.values():
            make_dir(store.root)
            store.clean()

    @property
    def own_root(self) -> str:
        """Where a file fetched back for this rank lands (``replicas/r<self>``)."""
        return self._stores[self.rank].root

    def _store(self, src: int) -> Tier:
        root = os.path.join(self.local.root, REPLICAS_DIR, replica_store_name(src))
        return Tier(
            "replica",
            root,
            rank=self.rank,
            token=self.local.token,
            writes=[src],
            run_id=self.local.run_id,
            retention=self.keep,
        )

    # ------------------------------------------------------------------ after each local commit
    def follow(self) -> None:
        """Subscribe to the local tier's commits (:meth:`.tier.Tier.on_commit`; each is handed to the
        replication thread, started here) and make the local retention keep :meth:`kept`."""
        # a daemon: a partner that never answers must not hold the interpreter's exit (close() is
        # bounded); cut short, an exchange leaves only our temp files, which the next start removes
        self._thread = threading.Thread(target=self._run, name=f"dsm-replicate-r{self.rank}", daemon=True)
        self._thread.start()
        self.local.on_commit(self._offer, keep=self.kept)

    def kept(self) -> set[int]:
        """What the local tier's retention must keep: the newest checkpoint seen (the next to
        exchange), the one offered to or agreed by the clique until its exchange is over, and the
        newest one replicated -- until the newest has its replicas, a lost node needs it."""
        with self._cond:
            out = {self.last_replicated, self._offered, self._seen[-1].iteration if self._seen else None}
        return out - {None}

    def _offer(self, ticket) -> None:
        """The local commit thread, after each local commit: hand it over and go on (never waits)."""
        with self._cond:
            self._seen.append(ticket)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> None:
        """Block until every local commit handed over so far is exchanged or dropped (``wait`` and
        ``load``: a load then uses the clique group on the training thread, alone)."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: not self._seen and not self._busy, timeout):
                raise CacheTimeoutError(
                    f"rank {self.rank}: replication of iteration(s) {[t.iteration for t in self._seen]} "
                    f"to clique {self.clique} not done after {timeout:.0f}s"
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._seen or self._closing)
                if not self._seen:
                    return
                newest = self._seen[-1]
                self._offered, self._busy = newest.iteration, True
            try:
                self._exchange_newest(newest)
            except Exception as e:  # noqa: BLE001 - a lost replica never uncommits the local checkpoint
                log.error("rank %d: replication after iteration %d failed: %r", self.rank, newest.iteration, e)
            finally:
                with self._cond:
                    self._offered, self._busy = None, False
                    self._cond.notify_all()

    def _exchange_newest(self, newest) -> None:
        """Agree with the clique on the newest local commit any member has seen, wait until this rank
        has seen it (every rank commits the same checkpoints), drop the older ones, exchange it."""
        import torch.distributed as dist

        agreed = torch.tensor([newest.seq], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        seq = int(agreed.item())
        with self._cond:
            if not self._cond.wait_for(lambda: any(t.seq >= seq for t in self._seen), self.timeout_s):
                raise CacheTimeoutError(
                    f"rank {self.rank}: local commit of save {seq} not seen after {self.timeout_s:.0f}s"
                )
            target = next(t for t in self._seen if t.seq >= seq)
            dropped = [t for t in self._seen if t.seq < target.seq]
            self._seen = [t for t in self._seen if t.seq > target.seq]
            self._offered = target.iteration
            warn = bool(dropped) and not self._warned
            self._warned |= bool(dropped)
        if dropped:
            self.skipped += len(dropped)
            log.log(
                logging.WARNING if warn else logging.INFO,
                "rank %d: replication of local checkpoint(s) %s to clique %s skipped: an exchange was in flight and "
                "%d is newer (%d skipped so far)",
                self.rank,
                [t.iteration for t in dropped],
                self.clique,
                target.iteration,
                self.skipped,
            )
        self.replicate(target)
        if self.last_replicated == target.iteration:
            with self._cond:
                self._warned = False

    def replicate(self, ticket) -> None:
        """Replication thread, for the local commit of ``ticket`` the clique agreed on: send this
        rank's file to every other member and keep theirs (a collective of the clique: each member
        calls it for the same commits, in order).  A failure is logged; the local checkpoint stays committed."""
        t0 = time.perf_counter()
        crash_point("replicate", self.rank)
        name = ticket.file_name(self.rank)
        src_path = os.path.join(iter_dir(self.local.root, ticket.iteration), name)
        try:
            manifest = read_manifest(iter_dir(self.local.root, ticket.iteration))
            record = manifest.record(self.rank)
            ok = record is not None and record.file == name
        except (CheckpointError, OSError) as e:
            log.error("rank %d: cannot replicate iteration %d: %s", self.rank, ticket.iteration, e)
            manifest, ok = None, False
        failed = False
        for k in range(1, len(self.clique)):
            dst, src = self.clique[(self.me + k) % len(self.clique)], self.clique[(self.me - k) % len(self.clique)]
            sent, got = self._exchange(dst, src, src_path if ok else None, manifest, ticket.iteration, ticket.seq)
            failed |= not got
            self.stats.bytes_sent += sent
        self.stats.checkpoints += 1
        self.stats.failures += int(failed)
        if not failed:
            self.last_replicated = ticket.iteration
        self.stats.seconds += time.perf_counter() - t0

    def _exchange(self, dst: int, src: int, path: str | None, manifest, iteration: int, seq: int) -> tuple[int, bool]:
        """Send ``path`` (None: nothing to send) to ``dst`` while receiving ``src``'s file of the same
        checkpoint; returns (bytes sent, whether ``src``'s replica was committed)."""
        out_file = None
        if path is not None:
            try:
                out_file = RankFile(path)
            except (CheckpointError, OSError) as e:  # the partner still hears from us: "nothing"
                log.error("rank %d: cannot replicate %s: %s", self.rank, path, e)
        try:
            body = manifest.to_json() if out_file is not None else b""
            token = parse_rank_file_name(os.path.basename(path))[1] if out_file is not None else ""
            hdr = {
                "ok": int(out_file is not None),
                "iteration": iteration,
                "seq": seq,
                "token": int(token, 16) if token else 0,
                "file_bytes": out_file.header.file_bytes if out_file is not None else 0,
                "manifest_bytes": len(body),
            }
            theirs = self._io.swap_ints(hdr, dst, src)
            their_body = self._io.swap_bytes(body, theirs["manifest_bytes"], dst, src)
            receiver = ReplicaReceiver(self._stores[src], src, theirs, their_body, self.rank)
            try:
                self._io.swap_file(out_file, hdr["file_bytes"], receiver, theirs["file_bytes"], dst, src)
            except BaseException:
                receiver.abort()  # no descriptor nor temp file left behind
                raise
        finally:
            if out_file is not None:
                out_file.close()
        committed = receiver.commit()
        if committed:
            self.stats.bytes_received += theirs["file_bytes"]
        return hdr["file_bytes"], committed

    # ------------------------------------------------------------------ point to point, in step
    # ------------------------------------------------------------------ restore
    def holdings(self, local: dict[int, tuple[int, int]]) -> tuple[dict[int, tuple[int, int]], dict, dict[int, int]]:
        """Collective of the clique (at restore): the checkpoints this rank can restore from a
        replica -- its own fetched copies and those its clique members hold for it -- as
        ``{iteration: (token, seq)}``, the clique's table ``{(src, iteration, token, seq): holder}``
        that :meth:`fetch` reads, and each one's commit time (ms, from the source's manifest).
        ``local``: this rank's node-local checkpoints (they need no replica)."""
        mine = []
        for src, store in self._stores.items():
            for it, (token, seq, ms) in committed_saves(store.root, store.run_id, src).items():
                mine.append({"src": src, "iteration": it, "token": token, "seq": seq, "ms": ms})
        rows = self._coll.gather_many(mine[-64:], fields=("src", "iteration", "token", "seq", "ms"), capacity=64)
        table: dict = {}
        created: dict = {}
        for holder, recs in zip(self.clique, rows):
            for r in recs:
                key = (r["src"], r["iteration"], r["token"], r["seq"])
                if key not in table or holder == r["src"]:  # a copy the rank holds itself needs no transfer
                    table[key] = holder
                created[key] = r["ms"]
        avail, avail_created = {}, {}
        for (src, it, token, seq), _holder in table.items():
            if src == self.rank and local.get(it) != (token, seq):
                avail[it], avail_created[it] = (token, seq), created[(src, it, token, seq)]
        return avail, table, avail_created

    def fetch(
        self, iteration: int | None, save: tuple[int, int] | None, need: bool, table: dict
    ) -> tuple[str | None, int | None]:
        """Collective of the clique: every member that needs checkpoint ``iteration`` (its node-local
        copy is missing) gets its file from the member holding its replica.  Returns the directory
        this rank then restores from (its ``replicas/r<self>``; None when it did not need one or the
        transfer failed) and the rank that held it."""
        rows = self._coll.gather(
            {
                "need": int(need),
                "iteration": iteration or 0,
                "token": save[0] if save else 0,
                "seq": save[1] if save else 0,
            }
        )
        mine, mine_from = None, None
        for member, row in zip(self.clique, rows):
            if not row["need"]:
                continue
            key = (member, row["iteration"], row["token"], row["seq"])
            holder = table.get(key)
            if member == self.rank:
                mine_from = holder
            if holder is None or holder == member:
                if member == self.rank and holder == member:
                    mine = self._stores[member].root  # fetched by an earlier restart: already here
                continue
            if self.rank == holder:
                self._send_replica(member, *key[1:])
            elif self.rank == member:
                mine = self._receive_own(holder, row["iteration"])
        return mine, mine_from

    def _send_replica(self, member: int, iteration: int, token: int, seq: int) -> None:
        """Send ``member`` its file of ``iteration`` from the replica held here -- verified first: a
        damaged replica is announced as "nothing" (``ok=0``), so the member's restore fails cleanly
        and every rank falls back together instead of waiting for bytes that never come."""
        d = iter_dir(self._stores[member].root, iteration)
        rf = None
        try:
            m = read_manifest(d)
            rf = RankFile(os.path.join(d, m.ranks[0].file))
            rf.verify_all()
        except (CheckpointError, OSError) as e:
            log.error("rank %d: cannot send rank %d its replica of iteration %d: %s", self.rank, member, iteration, e)
            if rf is not None:
                rf.close()
            self._io.send_ints(dict.fromkeys(HDR, 0), member)
            return
        with rf:
            body = m.to_json()
            hdr = {
                "ok": 1,
                "iteration": iteration,
                "seq": seq,
                "token": token,
                "file_bytes": rf.header.file_bytes,
                "manifest_bytes": len(body),
            }
            self._io.send_ints(hdr, member)
            self._io.p2p(torch.frombuffer(bytearray(body), dtype=torch.uint8), member, None, member)
            self._io.swap_file(rf, hdr["file_bytes"], None, 0, member, member)
        log.info(
            "rank %d: sent rank %d its file of iteration %d from the replica held here", self.rank, member, iteration
        )

    def _receive_own(self, holder: int, iteration: int) -> str | None:
        into = torch.empty(len(HDR), dtype=torch.int64)
        self._io.p2p(None, holder, into, holder)
        theirs = dict(zip(HDR, into.tolist()))
        if not theirs["ok"]:
            log.error("rank %d: rank %d could not send the replica of iteration %d", self.rank, holder, iteration)
            return None
        body = self._io.swap_bytes(b"", theirs["manifest_bytes"], holder, holder)
        receiver = ReplicaReceiver(self._stores[self.rank], self.rank, theirs, body, self.rank)
        try:
            self._io.swap_file(None, 0, receiver, theirs["file_bytes"], holder, holder)
        except BaseException:
            receiver.abort()
            raise
        if not receiver.commit():
            return None
        self.stats.bytes_fetched += theirs["file_bytes"]
        return self._stores[self.rank].root

    def close(self, timeout: float | None = None) -> None:
        """Exchange what was handed over (the newest), then stop the replication thread; idempotent.
        Bounded: after ``timeout`` (default ``timeout_s``) it logs what it gave up on and returns
        (the thread is left to end with its exchange).  The clique group goes with the process group."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread.join(self.timeout_s if timeout is None else timeout)
        if thread.is_alive():
            log.error(
                "rank %d: closed with the replication of iteration %s to clique %s still in flight; not waited for",
                self.rank,
                self._offered,
                self.clique,
            )
