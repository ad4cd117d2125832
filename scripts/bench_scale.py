#!/usr/bin/env python
"""Scale harness: the project's own commit, restart, reshard, ``ls``, ``inspect`` and ``verify`` code
at N ranks, in one process, on an N-rank checkpoint of tiny real rank files.

    PYTHONPATH=. python scripts/bench_scale.py [--ranks 1024,4096,16384,65536] [--dir /dev/shm] [--nofile 256]
                                               [--repeats 3] [--json]

For each N it writes N tiny rank files (two fp32 tensors each, with the global-identity metadata a
Megatron DP shard carries) with the snapshot engine, then runs, each on the real code path:

* ``commit``: rank 0's commit of the N files (:class:`~datastates_megatron.engine.tiers.commit.Committer`),
  beside rank 1's, each over its own :class:`~datastates_megatron.engine.dist.store_channel.StoreChannel`
  on one in-process c10d store (``HashStore``, standing for the job's ``TCPStore``); the channels
  count the bytes each rank sends and receives.  Ranks 2..N-1 send their statuses (made from their
  files' receipts) through their own channels.  Also the calls that N ranks starting a save make
  to create the new iteration directory (mkdir and lstat, counted).  Rank 0's commit is timed up
  to the outcome and tracker; the hand-over of its retention (``Committer._after_commit``) and the
  retention itself (on the tier's deleter thread, waited for) apart.  The first commit carries every
  rank's global-index summary; then it runs ``--repeats`` times and the median run is reported.
* ``restart``: rank 0's resolve (find the newest committed checkpoint, read its manifest, check
  the layout, send each rank its record) and one non-leader rank's restart (receive its record,
  plan its same-layout load, open and check its own file).
* ``reshard``: one rank of a world of N/2 plans and executes its load by parameter identity (the
  index over every old rank file, then its element ranges through the verifying reader).
* ``ls``, ``inspect`` (every rank) and ``verify`` (every checksum) of the CLI.

Per operation it reports wall seconds, CPU seconds of the thread that ran it, the peak resident memory of the process during it (VmHWM, reset
before each operation), the most files open at once (``/proc/self/fd``, sampled every millisecond
on a thread) and bytes read from files (``/proc/self/io`` ``rchar``).  An operation that fails
(e.g. ``EMFILE``) is reported as failed with its error, and the run goes on.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

from datastates_megatron.engine import EngineOptions, SnapshotEngine
from datastates_megatron.engine.names import iter_dir, rank_file_name

ITERATION = 100
TOKEN = "0123456789abcdef"
K = 16  # elements per tensor
LAYOUT_KEYS = ("dp",)


# ---------------------------------------------------------------------------------------------- measuring
def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE while listing: every descriptor is taken
        return -1


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


@dataclasses.dataclass
class Measured:
    seconds: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the calling thread (what the operation costs on a loaded machine)
    peak_mb: float = 0.0
    max_open_files: int = 0
    read_bytes: int = 0
    error: str | None = None
    value: object = None


def measure(fn, *args, **kw) -> Measured:
    """Run ``fn`` once; its seconds, peak RSS, most descriptors open at once and bytes read."""
    base = _fds()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.001):
            n = _fds()
            peak[0] = max(peak[0], n) if n >= 0 else peak[0]

    t = threading.Thread(target=sample, name="bench-fd-sampler", daemon=True)
    t.start()
    _reset_hwm()
    r0 = _rchar()
    m = Measured()
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        m.value = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - reported as the operation's outcome
        m.error = f"{type(e).__name__}: {str(e)[:200]}"
    m.seconds, m.cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    m.read_bytes = _rchar() - r0
    stop.set()
    t.join()
    m.peak_mb = _hwm_mb()
    m.max_open_files = max(peak[0], _fds()) - base  # descriptors the operation itself held
    return m


# ---------------------------------------------------------------------------------------------- the checkpoint
def _meta(rank: int, world: int, layout: dict | None = None) -> dict:
    """The identity metadata of a DP shard: rank ``rank`` holds elements [rank*K, (rank+1)*K).
    With a ``layout`` (``{"tp", "pp", "dp"}``, world = their product, Megatron's rank order: TP
    fastest, PP slowest), each (TP, PP) position has a parameter ``w`` of its own (slice ``pp{pp}.tp{tp}``), of
    ``dp * K`` elements, of which DP rank ``d`` holds [d*K, (d+1)*K)."""
    if layout is not None:
        return _layout_meta(rank, layout)
    shard = {
        "kind": "param_shard",
        "identity": 2,
        "chunk": 0,
        "buffer": "buf0",
        "bucket": 0,
        "dp_rank": rank,
        "dp_size": world,
        "params": [["w", [world * K], "float32", rank * K, (rank + 1) * K, 0]],
    }
    state = {
        "kind": "optimizer_state",
        "identity": 2,
        "chunk": 0,
        "key": "exp_avg",
        "param": "w",
        "shape": [world * K],
        "dtype": "float32",
        "start": rank * K,
        "end": (rank + 1) * K,
    }
    return {"model0.buf0.bucket0.param_shard": shard, "opt0.g0.p0.exp_avg": state}


def _position(rank: int, layout: dict) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` rank of ``rank`` in ``layout`` (TP fastest, then DP, PP slowest)."""
    t, rest = rank % layout["tp"], rank // layout["tp"]
    return t, rest // layout["dp"], rest % layout["dp"]


def _layout_meta(rank: int, layout: dict) -> dict:
    t, p, d = _position(rank, layout)
    dp, name, sl = layout["dp"], "w", f"pp{p}.tp{t}"
    shard = {
        "kind": "param_shard",
        "identity": 2,
        "slice": sl,
        "chunk": 0,
        "buffer": "buf0",
        "bucket": 0,
        "dp_rank": d,
        "dp_size": dp,
        "params": [[name, [dp * K], "float32", d * K, (d + 1) * K, 0]],
    }
    state = {
        "kind": "optimizer_state",
        "identity": 2,
        "slice": sl,
        "chunk": 0,
        "key": "exp_avg",
        "param": name,
        "shape": [dp * K],
        "dtype": "float32",
        "start": d * K,
        "end": (d + 1) * K,
    }
    return {"model0.buf0.bucket0.param_shard": shard, "opt0.g0.p0.exp_avg": state}


def build(root: str, world: int, layout: dict | None = None) -> list:
    """Write the N rank files of iteration ``ITERATION`` under ``root``; their receipts, by rank."""
    d = iter_dir(root, ITERATION)
    os.makedirs(d, exist_ok=True)
    receipts = []
    opts = EngineOptions(cache_bytes=1 << 20, timeout_s=60, direct_io=False)
    with SnapshotEngine(opts) as eng:
        for rank in range(world):
            eng.clear()
            for name, meta in _meta(rank, world, layout).items():
                eng.register(name, torch.full((K,), float(rank)), meta=meta)
            name = rank_file_name(rank, TOKEN, 1)
            h = eng.save(ITERATION, os.path.join(d, name), {"rank": rank}, tag=name)
            receipts.append(h.durable.result(timeout=60))
        eng.wait()
    return receipts


# ---------------------------------------------------------------------------------------------- commit
def _summary(rank: int, world: int, layout: dict | None = None) -> tuple[bytes, int]:
    """Rank ``rank``'s global-index summary, as its manager makes it from its registrations."""
    from datastates_megatron.engine.format.global_index import encode_summary
    from datastates_megatron.megatron.checkpointing.reshard import index_summary

    metas = _meta(rank, world, layout)
    return encode_summary(index_summary({n: torch.empty(K) for n in metas}, metas))


def _status_rows(receipts, summaries) -> list[dict]:
    """Every rank's status of the save, as its commit thread sends it (from its file's receipt)."""
    from datastates_megatron.engine.tiers.commit import _STATUS, _to_i64

    rows = []
    for r, (_, h) in zip(receipts, summaries):
        row = dict.fromkeys(_STATUS, 0)
        row.update(
            ok=1,
            iteration=ITERATION,
            seq=1,
            file_bytes=r.file_bytes,
            data_bytes=r.data_bytes,
            n_tensors=r.n_tensors,
            index_xxh64=_to_i64(r.index_xxh64),
            header_xxh64=_to_i64(r.header_xxh64),
            summary_sum=h,
        )
        rows.append(row)
    rows[0].update(writes_lo=0, writes_n=len(rows))
    return rows


def _tier(root: str, rank: int, world: int, channel, layout: dict | None = None):
    from datastates_megatron.engine.tiers.tier import Tier

    tier = Tier("persistent", root, rank=rank, token=TOKEN, writes=list(range(world)) if rank == 0 else [])
    tier.open(channel, world, dict(layout or {"dp": world}), 60.0)
    return tier


def _ticket(receipt, summary):
    """A save's ticket, carrying its rank's global-index summary as the manager puts it there."""
    from datastates_megatron.engine.tiers.commit import Ticket

    done: cf.Future = cf.Future()
    done.set_result(receipt)
    return Ticket(ITERATION, 1, done, {}, time.perf_counter(), token=TOKEN, summary=summary)


def commit(root: str, world: int, receipts, repeats: int, layout: dict | None = None) -> dict:
    """Rank 0's commits of the N files (measured) beside rank 1's (their bytes), each on its own
    committer and store channel over one in-process c10d store; ranks 2..N-1 send their statuses
    through their own channels first (the same call their commit threads make).  The first commit
    also carries every rank's global-index summary (sent once per run); then ``repeats`` commits
    of the same save (a rank's summary is not sent again), timed alike."""
    import torch.distributed as dist

    from datastates_megatron.engine.tiers.commit import _STATUS
    from datastates_megatron.engine.dist.store_channel import StoreChannel

    store = dist.HashStore()
    prefix = f"dsm/{TOKEN}/persistent"
    summaries = [_summary(r, world, layout) for r in range(world)]
    rows = _status_rows(receipts, summaries)
    others = [StoreChannel(store, r, world, prefix, 60.0) for r in range(2, world)]
    for ch in others:
        ch.publish("summary", summaries[ch.rank][0])
    chans = {r: StoreChannel(store, r, world, prefix, 60.0) for r in (0, 1)}
    tiers = {r: _tier(root, r, world, chans[r], layout) for r in (0, 1)}
    runs = []
    try:
        for _ in range(1 + repeats):
            for ch in others:
                ch._round = chans[1]._round  # past the outcome they would have read, as rank 1 is
                ch.gather(rows[ch.rank], _STATUS)
            bytes0 = {r: c.sent + c.received for r, c in chans.items()}
            ticket = _ticket(receipts[0], summaries[0])
            with cf.ThreadPoolExecutor(1) as pool:
                other = pool.submit(tiers[1]._committer._commit, _ticket(receipts[1], summaries[1]))
                m = measure(tiers[0]._committer._commit, ticket)
                other.result(timeout=120)
            if tiers[0].latest != ITERATION or tiers[1].latest != ITERATION:
                m.error = m.error or "the commit did not commit on rank 0 and rank 1"
            # then, as the commit thread does (``Committer._after_commit``): hand retention over ...
            t0 = time.perf_counter()
            tiers[0]._committer._after_commit(ticket)
            after_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            tiers[0].drain_deletions(120)  # ... and the deleter thread's retention, waited for
            retention_s = time.perf_counter() - t0
            runs.append(
                {
                    "rank0": m,
                    "rank0_s": m.seconds,
                    "rank0_cpu_s": m.cpu_s,
                    "after_commit_s": after_s,
                    "retention_s": retention_s,
                    "rank0_bytes": chans[0].sent + chans[0].received - bytes0[0],
                    "bytes": chans[1].sent + chans[1].received - bytes0[1],
                }
            )
    finally:
        for t in tiers.values():
            t.close()
    first, rest = runs[0], sorted(runs[1:], key=lambda r: r["rank0_s"])
    c = dict(rest[len(rest) // 2])  # the median run of a run's steady state
    c.update(
        first_s=first["rank0_s"],
        first_bytes=first["bytes"],
        runs_s=[r["rank0_s"] for r in rest],
    )
    return c


def mkdirs(root: str, world: int) -> tuple[int, int]:
    """``(mkdir, lstat)`` calls made when N ranks start a save into a new iteration directory: the
    writer's preparation, then every other rank's (on its flush thread)."""
    from datastates_megatron.engine.fs.iteration_dir import prepare_iteration_dir

    d = iter_dir(root, ITERATION + 1)
    calls = {"mkdir": 0, "lstat": 0}
    real = {name: getattr(os, name) for name in calls}

    def counting(name):
        def call(*a, **kw):
            calls[name] += 1
            return real[name](*a, **kw)

        return call

    try:
        for name in calls:
            setattr(os, name, counting(name))
        for rank in range(world):
            then = prepare_iteration_dir(d, rank == 0)
            if then is not None:
                then()
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    return calls["mkdir"], calls["lstat"]


# ---------------------------------------------------------------------------------------------- restart
def restart(root: str, world: int, rank: int, store) -> tuple[int, int]:
    """One rank's restart: the resolve step (:func:`~datastates_megatron.engine.load.resolve.resolve`:
    on rank 0 the survey, manifest, layout check and one scatter; on another rank the receipt of
    its record), then its same-layout plan, opening and checking its own file.  Returns the plan's
    items and the bytes received through the store."""
    from datastates_megatron.engine.load.load_plan import SameLayoutPlanner
    from datastates_megatron.engine.load.reader import CheckpointReader
    from datastates_megatron.engine.load.resolve import resolve
    from datastates_megatron.engine.dist.store_channel import StoreChannel

    chan = StoreChannel(store, rank, world, f"dsm/{TOKEN}/resolve", 60.0)
    got = resolve(root, None, chan, {"dp": world})
    targets = {n: torch.empty(K) for n in _meta(rank, world)}
    with CheckpointReader(got.ckpt, got.manifest, rank=rank, verify=True, threads=1) as reader:
        plan = SameLayoutPlanner(targets, world, {"dp": world}).plan(reader)
    return len(plan.items), chan.received


# ---------------------------------------------------------------------------------------------- reshard
def reshard(root: str, world: int, new_rank: int) -> tuple[int, int]:
    """Rank ``new_rank`` of a world of N/2: its shard [2K*new_rank, 2K*(new_rank+1)) of ``w`` and
    of its ``exp_avg``, planned by parameter identity from the checkpoint's global index (as
    :class:`~datastates_megatron.megatron.checkpointing.reshard.ReshardPlanner` does; non-tensor state from old
    rank ``new_rank``) and loaded through the verifying reader.  Returns the read items and the
    rank files opened."""
    from datastates_megatron.engine.load.load_plan import LoadPlan, ReadItem
    from datastates_megatron.engine.load.reader import CheckpointReader, open_checkpoint
    from datastates_megatron.megatron.checkpointing.reshard import CheckpointIndex, plan_by_global_index

    start, end = 2 * K * new_rank, 2 * K * (new_rank + 1)
    dst = {what: torch.empty(end - start) for what in ("param", "exp_avg")}

    def plan(index):
        return [
            (r, dst[what][at : at + r.count]) for what in dst for r, at in index.ranges(("", 0, "w", what), start, end)
        ]

    ckpt, manifest = open_checkpoint(root, ITERATION)
    with CheckpointReader(ckpt, manifest, rank=new_rank, verify=True, threads=1) as reader:
        planned = plan_by_global_index(reader, plan, new_rank)
        pairs = planned[0] if planned is not None else plan(CheckpointIndex.from_reader(reader))
        reader.objects(new_rank)
        stats = reader.execute(LoadPlan("reshard", tuple(ReadItem(r, d) for r, d in pairs)))
    if not torch.equal(dst["param"], torch.arange(start, end).div(K, rounding_mode="floor").float()):
        raise RuntimeError("resharded values differ from what was saved")
    return len(pairs), stats.files_opened


# ---------------------------------------------------------------------------------------------- --reshard FROM TO
def parse_layout(text: str) -> dict:
    """``tp4pp8dp512`` -> ``{"tp": 4, "pp": 8, "dp": 512}`` (a part left out is 1)."""
    import re

    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:dp(\d+))?", text.strip().lower())
    if not m or not any(m.groups()):
        raise ValueError(f"layout {text!r}: expected e.g. tp4pp8dp512")
    return {k: int(v or 1) for k, v in zip(("tp", "pp", "dp"), m.groups())}


def _name(layout: dict) -> str:
    return f"tp{layout['tp']}pp{layout['pp']}dp{layout['dp']}"


def resolve_rank0(root: str, new: dict, store) -> dict:
    """Rank 0 of layout ``new``: the restore choice's resolve step (survey, the manifest read once,
    each rank's record sent through the store), as every resharding restart does once."""
    from datastates_megatron.engine.dist.store_channel import StoreChannel
    from datastates_megatron.engine.load.resolve import resolve

    from datastates_megatron.engine.tiers import tier

    tier._MANIFESTS._entries = {}  # a restart is another process: the writer's cached manifests are not there
    world = new["tp"] * new["pp"] * new["dp"]
    chan = StoreChannel(store, 0, world, f"dsm/{TOKEN}/resolve", 60.0)
    r0 = _rchar()
    resolve(root, None, chan, new, check=lambda manifest, ckpt: True)
    return {"rank0_read_bytes": _rchar() - r0, "rank0_sent_bytes": chan.sent}


def reshard_layout(root: str, old: dict, new: dict, new_rank: int, store) -> dict:
    """Rank ``new_rank`` of layout ``new`` restores its DP shard of its (TP, PP) position's parameter
    and Adam state from the checkpoint written at ``old`` (the same TP and PP), as a resharding rank
    does: its view of the checkpoint from rank 0's resolve (the manifest's header and its own record,
    from the store), the global index (its slice's pieces near its ranges, and the records of the
    files they name), those rank files (checked against their own metadata), then its ranges
    through the verifying reader.  Returns what it read and opened, and the plan's seconds."""
    from datastates_megatron.engine.dist.store_channel import StoreChannel
    from datastates_megatron.engine.load.load_plan import LoadPlan, ReadItem
    from datastates_megatron.engine.load.reader import CheckpointReader
    from datastates_megatron.engine.load.resolve import resolve
    from datastates_megatron.megatron.checkpointing.reshard import CheckpointIndex, plan_by_global_index

    t, p, d = _position(new_rank, new)
    total = old["dp"] * K
    start, end = d * total // new["dp"], (d + 1) * total // new["dp"]
    sl = f"pp{p}.tp{t}"  # the (TP, PP) position's model-parallel slice (identity 2)
    dst = {what: torch.empty(end - start) for what in ("param", "exp_avg")}
    seen = {}

    def plan(index):
        seen.setdefault("gi", getattr(index, "gi", None))  # the global index it reads, when it does
        return [
            (r, dst[what][at : at + r.count]) for what in dst for r, at in index.ranges((sl, 0, "w", what), start, end)
        ]

    world = new["tp"] * new["pp"] * new["dp"]
    chan = StoreChannel(store, new_rank, world, f"dsm/{TOKEN}/resolve", 60.0)
    fds0 = _fds()
    r0 = _rchar()
    t0 = time.perf_counter()
    got = resolve(root, None, chan, new, check=lambda manifest, ckpt: True)
    manifest_bytes = _rchar() - r0 + chan.received  # read from files (none) and received from rank 0
    with CheckpointReader(got.ckpt, got.manifest, rank=new_rank, verify=True, threads=1, partial=True) as reader:
        planned = plan_by_global_index(reader, plan, new_rank)
        pairs = planned[0] if planned is not None else plan(CheckpointIndex.from_reader(reader))
        reader.objects(min(new_rank, got.manifest.world_size - 1))
        plan_s = time.perf_counter() - t0
        index_read = seen["gi"].bytes_read if seen.get("gi") is not None else None  # ranged reads, records too
        meta_read = _rchar() - r0  # index, the opened files' headers (read calls)
        mapped = sum(  # their index and objects sections come through the mapping: not in rchar
            reader.rank_file(r).header.index_bytes + reader.rank_file(r).header.objects_bytes for r in reader.opened
        )
        whole_manifest = len(reader.manifest.ranks) > 1  # a manifest of one record: rank 0's resolve's
        open_after_plan = _fds() - fds0  # the index and the planned files, all open now (the sampler may miss them)
        stats = reader.execute(LoadPlan("reshard", tuple(ReadItem(r, dst_) for r, dst_ in pairs)))
    old_rank = [t + old["tp"] * (e // K + old["dp"] * p) for e in range(start, end)]
    if not torch.equal(dst["param"], torch.tensor(old_rank, dtype=torch.float32)):
        raise RuntimeError("resharded values differ from what was saved")
    return {
        "manifest_bytes": manifest_bytes,
        "index_bytes": index_read,
        "metadata_bytes": meta_read + chan.received + mapped,
        "whole_manifest_read": whole_manifest,
        "files_opened": stats.files_opened,
        "open_after_plan": open_after_plan,
        "plan_s": plan_s,
        "index_used": planned is not None,
    }


def run_reshard(old: dict, new: dict, base: str) -> dict:
    """Build a checkpoint at layout ``old`` (files, manifest, global index: one commit), then one
    rank of ``new`` reshards from it; figures of that rank."""
    if (old["tp"], old["pp"]) != (new["tp"], new["pp"]):
        raise SystemExit(f"--reshard {_name(old)} {_name(new)}: this harness's model changes DP only (same TP and PP)")
    world = old["tp"] * old["pp"] * old["dp"]
    root = tempfile.mkdtemp(prefix=f"bench-scale-reshard-{world}-", dir=base)
    try:
        t0 = time.perf_counter()
        receipts = build(root, world, old)
        c = commit(root, world, receipts, 1, old)  # the first commit writes the index; one more, as at a restart
        build_s = time.perf_counter() - t0
        new_world = new["tp"] * new["pp"] * new["dp"]
        new_rank = new_world // 2 + 1 if new_world > 2 else 0  # in the middle: neither end is special
        import torch.distributed as dist

        store = dist.HashStore()
        r0 = measure(resolve_rank0, root, new, store)
        m = measure(reshard_layout, root, old, new, new_rank, store)
        ckpt = iter_dir(root, ITERATION)
        doc = {
            "from": _name(old),
            "to": _name(new),
            "ranks_from": world,
            "ranks_to": new_world,
            "rank": new_rank,
            "build_s": build_s,
            "manifest_file_bytes": os.path.getsize(os.path.join(ckpt, "manifest.json")),
            "index_file_bytes": sum(
                os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.startswith("global_index")
            ),
            "seconds": m.seconds,
            "max_open_files": max(m.max_open_files, (m.value or {}).get("open_after_plan", 0)),
            "peak_mb": m.peak_mb,
            "error": m.error or r0.error,
            "rank0_resolve_s": r0.seconds,
            "commit_first_s": c["first_s"],  # rank 0's commit that builds the index body from the summaries
            "commit_s": c["rank0_s"],  # the next one (body kept): the index with the records, and the manifest
            **(r0.value or {}),
            **(m.value or {}),
        }
        return doc
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _reshard_table(doc: dict) -> str:
    if doc["error"]:
        return f"reshard {doc['from']} -> {doc['to']}: FAILED: {doc['error']}"
    return (
        f"reshard {doc['from']} ({doc['ranks_from']:,} ranks) -> {doc['to']} ({doc['ranks_to']:,}), rank "
        f"{doc['rank']}: metadata read {doc['metadata_bytes']:,} bytes (manifest {doc['manifest_bytes']:,} "
        f"from rank 0's resolve, whole manifest read: {doc['whole_manifest_read']}; global index "
        f"{doc['index_bytes']:,} of {doc['index_file_bytes']:,}; the rest: the opened files' headers, index "
        f"and objects); files open at once {doc['max_open_files']} (rank files opened {doc['files_opened']}); "
        f"plan {doc['plan_s']:.3f} s, whole load {doc['seconds']:.3f} s; global index used: {doc['index_used']}; "
        f"peak {doc['peak_mb']:.0f} MB\n"
        f"  rank 0's resolve (once per restart): read {doc['rank0_read_bytes']:,} bytes (manifest file "
        f"{doc['manifest_file_bytes']:,}), sent {doc['rank0_sent_bytes']:,} bytes, {doc['rank0_resolve_s']:.3f} s; "
        f"its commits (the index written before the manifest): first {doc['commit_first_s']:.3f} s, next "
        f"{doc['commit_s']:.3f} s"
    )


# ---------------------------------------------------------------------------------------------- one N
def run(world: int, base: str, repeats: int = 3) -> dict:
    from datastates_megatron import cli

    root = tempfile.mkdtemp(prefix=f"bench-scale-{world}-", dir=base)
    try:
        t0 = time.perf_counter()
        receipts = build(root, world)
        build_s = time.perf_counter() - t0
        c = commit(root, world, receipts, repeats)
        mkdir_calls, lstat_calls = mkdirs(root, world)
        ckpt = iter_dir(root, ITERATION)
        mb = os.path.getsize(os.path.join(ckpt, "manifest.json"))
        import torch.distributed as dist

        store = dist.HashStore()
        r0 = measure(restart, root, world, 0, store)
        rk = measure(restart, root, world, world // 2 + 1, store)
        rs = measure(reshard, root, world, world // 4)
        ls = measure(cli.list_checkpoints, root)
        ins = measure(cli.inspect_checkpoint, ckpt)
        ver = measure(cli.verify_checkpoint, ckpt, threads=2)
        if ver.error is None and not ver.value["ok"]:
            ver.error = f"verify found problems: {ver.value['errors'][:2]}"
        ops = {"rank0_commit": c["rank0"], "rank0_restart": r0, "restart": rk}
        ops.update(reshard=rs, ls=ls, inspect=ins, verify=ver)
        doc = {
            "ranks": world,
            "build_s": build_s,
            "manifest_bytes": mb,
            "rank0_commit_s": c["rank0_s"],
            "rank0_commit_runs_s": c["runs_s"],
            "rank0_first_commit_s": c["first_s"],
            "first_commit_bytes_per_rank": c["first_bytes"],
            "rank0_commit_cpu_s": c["rank0_cpu_s"],
            "rank0_after_commit_s": c["after_commit_s"],
            "rank0_retention_s": c["retention_s"],
            "rank0_commit_bytes": c["rank0_bytes"],
            "commit_bytes_per_rank": c["bytes"],
            "mkdir_calls": mkdir_calls,
            "lstat_calls": lstat_calls,
            "restart_s": rk.seconds,
            "restart_cpu_s": rk.cpu_s,
            "restart_manifest_bytes": rk.read_bytes + (rk.value[1] if rk.value else 0),
            "rank0_restart_s": r0.seconds,
            "rank0_restart_cpu_s": r0.cpu_s,
            "reshard_s": rs.seconds,
            "reshard_max_open_files": rs.max_open_files,
            "reshard_files_opened": rs.value[1] if rs.value else None,
            "verify_s": ver.seconds,
            "verify_max_open_files": ver.max_open_files,
            "peak_mb": max(m.peak_mb for m in ops.values()),
            "ops": {k: {f: v for f, v in dataclasses.asdict(m).items() if f != "value"} for k, m in ops.items()},
        }
        return doc
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(doc: dict) -> str:
    lines = [
        f"N = {doc['ranks']}: manifest {doc['manifest_bytes'] / 1e6:.2f} MB, built in {doc['build_s']:.1f} s; "
        f"commit bytes sent+received: rank 1 {doc['commit_bytes_per_rank']}, rank 0 {doc['rank0_commit_bytes']}; "
        f"new iteration directory: {doc['mkdir_calls']} mkdir, {doc['lstat_calls']} lstat; "
        f"restart manifest bytes of rank {doc['ranks'] // 2 + 1}: {doc['restart_manifest_bytes']}; "
        f"rank 0's commit: {doc['rank0_commit_s']:.4f} s ({doc['rank0_commit_cpu_s']:.4f} CPU s) to the outcome, its retention "
        f"handed to its deleter (Committer._after_commit) {doc['rank0_after_commit_s']:.4f} s, done there "
        f"{doc['rank0_retention_s']:.4f} s later; the run's first commit (every rank's index summary) "
        f"{doc['rank0_first_commit_s']:.4f} s, {doc['first_commit_bytes_per_rank']} bytes for rank 1; "
        f"rank files opened by a resharding rank: {doc['reshard_files_opened']}",
        f"  {'operation':<14} {'seconds':>9} {'cpu s':>9} {'peak MB':>8} {'max fds':>8} {'read bytes':>12}  error",
    ]
    for name, m in doc["ops"].items():
        lines.append(
            f"  {name:<14} {m['seconds']:>9.4f} {m['cpu_s']:>9.4f} {m['peak_mb']:>8.0f} {m['max_open_files']:>8} "
            f"{m['read_bytes']:>12}  {m['error'] or ''}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024,4096,16384,65536", help="comma-separated N (default: %(default)s)")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where to build")
    p.add_argument("--repeats", type=int, default=3, help="commits per N; the median is reported")
    p.add_argument("--nofile", type=int, help="run under this limit of open files (RLIMIT_NOFILE)")
    p.add_argument("--json", action="store_true", help="one JSON object per N, one per line")
    p.add_argument(
        "--reshard",
        nargs=2,
        metavar=("FROM", "TO"),
        help="instead: a checkpoint at layout FROM (e.g. tp4pp8dp512), one rank of layout TO (e.g. "
        "tp4pp8dp504) resharding from it: metadata bytes it reads, files open at once, its plan's seconds",
    )
    a = p.parse_args(argv)
    if a.nofile:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import datastates_megatron

    if not a.json:
        print(f"datastates_megatron from {os.path.dirname(datastates_megatron.__file__)}; building in {a.dir}")
    if a.reshard:
        try:
            old, new = (parse_layout(x) for x in a.reshard)
        except ValueError as e:
            p.error(str(e))
        doc = run_reshard(old, new, a.dir)
        print(json.dumps(doc, sort_keys=True) if a.json else _reshard_table(doc), flush=True)
        return 1 if doc["error"] else 0
    for n in (int(x) for x in a.ranks.split(",")):
        doc = run(n, a.dir, a.repeats)
        print(json.dumps(doc, sort_keys=True) if a.json else _table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
