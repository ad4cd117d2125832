"""Two gloo ranks, an in-process restart in miniature: each rank saves with host copies, closes its
manager with ``keep_cache=True`` (the aborted attempt's) and builds a new one in the same process.

Every rank holding the newest save in memory restores it from there, reading nothing from storage;
a rank that lost its copy (a replacement rank, a recycled cache) reads ``--save`` while the other
still reads memory -- a mix that is bit-exact, agreed through the one restore decision."""

from __future__ import annotations

from .ranks import describe, run_ranks

N = 40_000


def _restart_in_process(args) -> dict:
    import torch
    import torch.distributed as dist

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.engine.tiers import host_copy

    root, lose = args[0], int(args[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    opts = EngineOptions(cache_bytes=1 << 20, timeout_s=60)
    w = torch.zeros(N)

    def manager():
        mgr = CheckpointManager(root, opts, keep_last=0, host_copy=True)
        mgr.register("w", w)
        return mgr

    mgr = manager()
    for it in (2, 4):
        w.copy_(torch.arange(N, dtype=w.dtype) * (rank + 1) + it)
        mgr.save(it, {"rank": rank, "it": it})
        mgr.wait()
    expected = w.clone()
    mgr.close(keep_cache=True)
    if rank == lose:  # this rank's copy is gone: a replacement rank's start
        host_copy.take(rank, mgr.root).close()
    w.zero_()
    with manager() as again:
        choice = again.choose()
        got = again.load(choice)
    return {
        "source": choice.source,
        "tier": choice.tier,
        "iteration": got.iteration,
        "root": got.root,
        "exact": bool(torch.equal(w, expected)),
        "objects": got.objects,
        "read": got.stats.bytes,
    }


def _restored(tmp_path, lose: int) -> list[dict]:
    results = run_ranks(_restart_in_process, 2, [str(tmp_path / "save"), str(lose)], timeout=120)
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    got = [r["result"] for r in results]
    assert all(g["iteration"] == 4 and g["exact"] and g["objects"] == {"rank": i, "it": 4} for i, g in enumerate(got))
    return got


def test_every_rank_restores_from_its_host_copy(tmp_path):
    got = _restored(tmp_path, lose=-1)
    assert [(g["tier"], g["source"], g["root"]) for g in got] == [("local", "host", "host memory")] * 2, got


def test_a_rank_without_its_copy_reads_storage_and_the_other_reads_memory(tmp_path):
    got = _restored(tmp_path, lose=1)
    assert [g["source"] for g in got] == ["host", "persistent"], got
    assert got[0]["root"] == "host memory" and got[1]["root"] == str(tmp_path / "save"), got
