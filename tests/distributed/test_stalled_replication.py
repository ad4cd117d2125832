"""A stalled partner never delays a local commit: 2 CPU ranks as 2 "nodes" (LOCAL_WORLD_SIZE=1),
each rank's node-local file replicated to the other; rank 1's receiving of a replica is held for a
few seconds (in-process, ``replica_transport.ReplicaReceiver.write``) while both ranks save and wait for their local
commits.  The replication runs on its own thread: the local commits go on at their pace, the
checkpoints committed meanwhile are dropped from replication (reported), and the newest one is
replicated once the partner answers."""

from __future__ import annotations

from datastates_megatron.engine.tiers.run_id import local_tier_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from .ranks import describe, run_ranks

HOLD_S = 8.0  # how long rank 1's receiving stalls
ITERS = 6


def _save_with_a_stalled_partner(args) -> dict:
    import threading
    import time

    import torch
    import torch.distributed as dist

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.engine.tiers import replica_transport

    persistent, local, hold = args[0], args[1], args[2] == "hold"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1 and hold:
        real, held = replica_transport.ReplicaReceiver.write, threading.Event()

        def write(self, data, offset):
            if not held.is_set():
                held.set()
                threading.Event().wait(HOLD_S)  # a partner whose storage stops answering for a while
            return real(self, data, offset)

        replica_transport.ReplicaReceiver.write = write
    mgr = CheckpointManager(persistent, EngineOptions(cache_bytes=4 << 20, timeout_s=60), keep_last=0, local_root=local)
    w = torch.zeros(1 << 16)
    mgr.register("w", w)
    latencies = []
    for it in range(1, ITERS + 1):
        w.fill_(float(it + rank))
        t0 = time.perf_counter()
        assert mgr.save(it)
        mgr.wait(persist=False)  # the local commit only
        latencies.append(time.perf_counter() - t0)
    mgr.wait()  # replication and promotion too, once the partner answers
    result = {"rank": rank, "latencies": latencies, "skipped": getattr(mgr.replication, "skipped", 0)}
    mgr.close()
    return result


def _run(tmp_path, mode: str) -> tuple[list[dict], str]:
    persistent = str(tmp_path / mode / "persistent")
    local = str(tmp_path / mode / "local{node}")
    res = run_ranks(_save_with_a_stalled_partner, 2, [persistent, local, mode], env={"LOCAL_WORLD_SIZE": "1"})
    assert all(r["returncode"] == 0 and r["result"] for r in res), describe(res)
    return [r["result"] for r in res], persistent


def test_a_stalled_partner_does_not_delay_local_commits(tmp_path):
    free, _ = _run(tmp_path, "free")
    held, persistent = _run(tmp_path, "hold")
    base = max(max(r["latencies"]) for r in free)
    worst = max(max(r["latencies"]) for r in held)
    # generous: the held exchange (HOLD_S) must not show in the local commits
    assert worst < base + HOLD_S / 2, (base, worst, held)
    assert all(r["skipped"] >= 1 for r in held), held  # commits made during the stall were not replicated
    for node, partner in ((0, 1), (1, 0)):
        replicas = f"{local_tier_dir(str(tmp_path / 'hold' / f'local{node}'), persistent)}/replicas/r{partner:05d}"
        assert ITERS in committed_iterations(replicas), (node, committed_iterations(replicas))
