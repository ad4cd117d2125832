#!/usr/bin/env python
"""Scale harness: the project's own commit, restart, reshard, ``ls``, ``inspect`` and ``verify`` code
at N ranks, in one process, on an N-rank checkpoint of tiny real rank files.

    python scripts/bench_scale.py [--ranks 1024,4096,16384,65536] [--dir /dev/shm] [--json]

For each N it writes N tiny rank files (two fp32 tensors each, with the global-identity metadata a
Megatron DP shard carries) with the snapshot engine, then runs, each on the real code path:

* ``commit``: rank 0's commit of the N files (:class:`~datastates_megatron.engine.commit.Committer`),
  and one other rank's, over a counting stand-in for the collective that forwards to an in-process
  store and counts the bytes each rank sends and receives; fabricated rows only for ranks whose
  side of the protocol is not measured.  Also the iteration directory's creation as N ranks run it.
* ``restart``: rank 0's resolve (find the newest committed checkpoint, read its manifest, check
  the layout, send each rank its record) and one non-leader rank's restart (receive its record,
  plan its same-layout load, open and check its own file).
* ``reshard``: one rank of a world of N/2 plans and executes its load by parameter identity (the
  index over every old rank file, then its element ranges through the verifying reader).
* ``ls``, ``inspect`` (every rank) and ``verify`` (every checksum) of the CLI.

Per operation it reports seconds, the peak resident memory of the process during it (VmHWM, reset
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
from datastates_megatron.engine.manifest import iter_dir, rank_file_name

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
    t0 = time.perf_counter()
    try:
        m.value = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - reported as the operation's outcome
        m.error = f"{type(e).__name__}: {str(e)[:200]}"
    m.seconds = time.perf_counter() - t0
    m.read_bytes = _rchar() - r0
    stop.set()
    t.join()
    m.peak_mb = _hwm_mb()
    m.max_open_files = max(peak[0], _fds()) - base  # descriptors the operation itself held
    return m


# ---------------------------------------------------------------------------------------------- the checkpoint
def _meta(rank: int, world: int) -> dict:
    """The identity metadata of a DP shard: rank ``rank`` holds elements [rank*K, (rank+1)*K)."""
    shard = {
        "kind": "param_shard",
        "identity": 1,
        "chunk": 0,
        "buffer": "buf0",
        "bucket": 0,
        "dp_rank": rank,
        "dp_size": world,
        "params": [["w", [world * K], "float32", rank * K, (rank + 1) * K, 0]],
    }
    state = {
        "kind": "optimizer_state",
        "identity": 1,
        "chunk": 0,
        "key": "exp_avg",
        "param": "w",
        "shape": [world * K],
        "dtype": "float32",
        "start": rank * K,
        "end": (rank + 1) * K,
    }
    return {"model0.buf0.bucket0.param_shard": shard, "opt0.g0.p0.exp_avg": state}


def build(root: str, world: int) -> list:
    """Write the N rank files of iteration ``ITERATION`` under ``root``; their receipts, by rank."""
    d = iter_dir(root, ITERATION)
    os.makedirs(d, exist_ok=True)
    receipts = []
    opts = EngineOptions(cache_bytes=1 << 20, timeout_s=60, direct_io=False)
    with SnapshotEngine(opts) as eng:
        for rank in range(world):
            eng.clear()
            for name, meta in _meta(rank, world).items():
                eng.register(name, torch.full((K,), float(rank)), meta=meta)
            name = rank_file_name(rank, TOKEN, 1)
            h = eng.save(ITERATION, os.path.join(d, name), {"rank": rank}, tag=name)
            receipts.append(h.durable.result(timeout=60))
        eng.wait()
    return receipts


# ---------------------------------------------------------------------------------------------- commit
class CountingGather:
    """Stand-in for :class:`~datastates_megatron.engine.collective.Collective` (the all-gather
    protocol): returns every rank's row (this rank's own, the others' fabricated from their
    receipts) and counts what a ring all-gather moves per rank: N-1 rows sent, N-1 received."""

    def __init__(self, rank: int, rows: list[dict]) -> None:
        self.rank, self.rows, self.world_size = rank, rows, len(rows)
        self.active = True
        self.sent = self.received = 0

    def _ring(self, width: int) -> None:
        row = 8 * (2 + width)
        self.sent += (self.world_size - 1) * row
        self.received += (self.world_size - 1) * row

    def gather(self, record):
        self._ring(len(record))
        rows = list(self.rows)
        rows[self.rank] = dict(record)
        return rows

    def agree(self, ok):
        self._ring(1)
        return [] if ok else [self.rank]


def _status_rows(receipts) -> list[dict]:
    from datastates_megatron.engine.commit import _STATUS, _to_i64

    rows = []
    for r in receipts:
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
        )
        rows.append(row)
    return rows


def _committer(root: str, rank: int, world: int, coll):
    from datastates_megatron.engine.tier import Tier

    tier = Tier("persistent", root, rank=rank, token=TOKEN, writes=list(range(world)) if rank == 0 else [])
    tier.open(coll, world, {"dp": world}, 60.0)
    return tier


def _ticket(receipt):
    from datastates_megatron.engine.commit import Ticket

    done: cf.Future = cf.Future()
    done.set_result(receipt)
    return Ticket(ITERATION, 1, done, {}, time.perf_counter(), token=TOKEN)


def commit(root: str, world: int, receipts) -> dict:
    """Rank 0's commit and rank 1's, each on its own committer, over the counting stand-in."""
    rows = _status_rows(receipts)
    out = {}
    for rank in (0, 1):
        coll = CountingGather(rank, rows)
        tier = _committer(root, rank, world, coll)
        try:
            m = measure(tier.committer._commit, _ticket(receipts[rank]))
        finally:
            tier.committer.close()
        out[rank] = (m, coll.sent + coll.received)
    return out


# ---------------------------------------------------------------------------------------------- restart
def restart(root: str, world: int, rank: int):
    """One rank's restart as the manager runs it: find the latest, read its manifest, plan its
    same-layout load (opening and checking its own file)."""
    from datastates_megatron.engine.load_plan import SameLayoutPlanner
    from datastates_megatron.engine.reader import CheckpointReader, open_checkpoint
    from datastates_megatron.engine.tier import latest_committed

    it = latest_committed(root)
    ckpt, manifest = open_checkpoint(root, it)
    targets = {n: torch.empty(K) for n in _meta(rank, world)}
    with CheckpointReader(ckpt, manifest, rank=rank, verify=True, threads=1) as reader:
        plan = SameLayoutPlanner(targets, world, {"dp": world}).plan(reader)
    return len(plan.items)


# ---------------------------------------------------------------------------------------------- reshard
def reshard(root: str, world: int, new_rank: int) -> int:
    """Rank ``new_rank`` of a world of N/2: its shard [2K*new_rank, 2K*(new_rank+1)) of ``w`` and
    of its ``exp_avg``, planned by parameter identity and loaded through the verifying reader."""
    from datastates_megatron.engine.load_plan import LoadPlan, ReadItem
    from datastates_megatron.engine.reader import CheckpointReader, open_checkpoint
    from datastates_megatron.megatron.reshard import CheckpointIndex

    ckpt, manifest = open_checkpoint(root, ITERATION)
    with CheckpointReader(ckpt, manifest, rank=new_rank, verify=True, threads=1) as reader:
        index = CheckpointIndex.from_reader(reader)
        start, end = 2 * K * new_rank, 2 * K * (new_rank + 1)
        items = []
        for what in ("param", "exp_avg"):
            dst = torch.empty(end - start)
            items += [ReadItem(r, dst[at : at + r.count]) for r, at in index.ranges((0, "w", what), start, end)]
            if what == "param":
                param = dst
        reader.execute(LoadPlan("reshard", tuple(items)))
    if not torch.equal(param, torch.arange(start, end).div(K, rounding_mode="floor").float()):
        raise RuntimeError("resharded values differ from what was saved")
    return len(items)


# ---------------------------------------------------------------------------------------------- one N
def run(world: int, base: str) -> dict:
    from datastates_megatron import cli

    root = tempfile.mkdtemp(prefix=f"bench-scale-{world}-", dir=base)
    try:
        t0 = time.perf_counter()
        receipts = build(root, world)
        build_s = time.perf_counter() - t0
        c = commit(root, world, receipts)
        ckpt = iter_dir(root, ITERATION)
        mb = os.path.getsize(os.path.join(ckpt, "manifest.json"))
        r0 = measure(restart, root, world, 0)
        rk = measure(restart, root, world, world // 2 + 1)
        rs = measure(reshard, root, world, world // 4)
        ls = measure(cli.list_checkpoints, root)
        ins = measure(cli.inspect_checkpoint, ckpt)
        ver = measure(cli.verify_checkpoint, ckpt, threads=2)
        if ver.error is None and not ver.value["ok"]:
            ver.error = f"verify found problems: {ver.value['errors'][:2]}"
        ops = {"rank0_commit": c[0][0], "rank1_commit": c[1][0], "rank0_restart": r0, "restart": rk}
        ops.update(reshard=rs, ls=ls, inspect=ins, verify=ver)
        doc = {
            "ranks": world,
            "build_s": build_s,
            "manifest_bytes": mb,
            "rank0_commit_s": c[0][0].seconds,
            "commit_bytes_per_rank": c[1][1],
            "restart_s": rk.seconds,
            "restart_manifest_bytes": rk.read_bytes,
            "rank0_restart_s": r0.seconds,
            "reshard_s": rs.seconds,
            "reshard_max_open_files": rs.max_open_files,
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
        f"commit bytes sent+received by rank 1: {doc['commit_bytes_per_rank']}",
        f"  {'operation':<14} {'seconds':>9} {'peak MB':>8} {'max fds':>8} {'read bytes':>12}  error",
    ]
    for name, m in doc["ops"].items():
        lines.append(
            f"  {name:<14} {m['seconds']:>9.4f} {m['peak_mb']:>8.0f} {m['max_open_files']:>8} "
            f"{m['read_bytes']:>12}  {m['error'] or ''}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024,4096,16384,65536", help="comma-separated N (default: %(default)s)")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where to build")
    p.add_argument("--json", action="store_true", help="one JSON object per N, one per line")
    a = p.parse_args(argv)
    import datastates_megatron

    if not a.json:
        print(f"datastates_megatron from {os.path.dirname(datastates_megatron.__file__)}; building in {a.dir}")
    for n in (int(x) for x in a.ranks.split(",")):
        doc = run(n, a.dir)
        print(json.dumps(doc, sort_keys=True) if a.json else _table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
