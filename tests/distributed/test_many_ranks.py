"""64 forked gloo ranks (tiny tensors) commit through the store, restart, and read other ranks'
files: the protocol of docs/architecture.md ("The commit protocol at N ranks") with real processes."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.ranks import run_ranks

WORLD = 64


def _rank(args: list[str]) -> dict:
    import datetime

    import torch.distributed as dist

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.load.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.megatron.checkpointing.reshard import index_summary, plan_by_global_index

    root = args[0]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = EngineOptions(cache_bytes=1 << 16, timeout_s=120, flush_threads=1)
    w = torch.full((8,), float(rank))
    # its global identity: elements [8 rank, 8 rank + 8) of a parameter "w" (for the global index)
    meta = {
        "kind": "param_shard",
        "identity": 1,
        "chunk": 0,
        "params": [["w", [8 * world], "float32", 8 * rank, 8 * rank + 8, 0]],
    }
    with CheckpointManager(root, opts, keep_last=2, layout={"dp": world}, summarize=index_summary) as mgr:
        mgr.register("w", w, meta=meta)
        records = []
        for it in (1, 2):
            w.fill_(rank + 1000 * it)
            mgr.save(it, {"rank": rank})
            records += mgr.wait()
        latest = mgr.latest_committed
    w.zero_()
    with CheckpointManager(root, opts, keep_last=2, layout={"dp": world}, summarize=index_summary) as mgr:
        mgr.register("w", w, meta=meta)
        got = mgr.load()
        restored = w.tolist()

        class Neighbour(LoadPlanner):  # another rank's file: a load that reads a file not its own
            kind = "neighbour"
            reads_all_ranks = True

            def plan(self, reader):
                src = (reader.rank + 1) % world
                return LoadPlan(self.kind, (ReadItem(ElementRange(src, "w", 2, 4), w[:4]),), reader.objects(src))

        other = mgr.load(planner=Neighbour())
        half = torch.empty(16)

        class Half(LoadPlanner):  # a reshard to half the ranks (each twice): by identity, from the global index
            kind = "half"
            reads_all_ranks = True

            def plan(self, reader):
                q = reader.rank % (world // 2)

                def pairs(index):
                    return [
                        (r, half[at : at + r.count]) for r, at in index.ranges((0, "w", "param"), 16 * q, 16 * q + 16)
                    ]

                planned = plan_by_global_index(reader, pairs, 2 * q)
                return LoadPlan(self.kind, tuple(ReadItem(r, d) for r, d in planned[0]) if planned else ())

        resharded = mgr.load(planner=Half())
    return {
        "latest": latest,
        "committed": [r.iteration for r in records],
        "max_rank_bytes": records[-1].max_rank_bytes if records else None,
        "loaded": got.iteration,
        "restored": restored,
        "neighbour": w[:4].tolist(),
        "neighbour_objects": other.objects,
        "half": half.tolist(),
        "half_files": resharded.stats.files_opened,
    }


@pytest.mark.slow
def test_64_ranks_commit_restart_and_read_each_others_files(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    with capsys.disabled():  # the forked ranks report on the process's own stdout, not pytest's capture
        res = run_ranks(_rank, WORLD, [root], timeout=600)
    bad = [r for r in res if r["returncode"] != 0 or r["result"] is None]
    assert not bad, bad[0]["stderr"][-3000:]
    for r in res:
        got, rank = r["result"], r["rank"]
        assert got["latest"] == 2 and got["committed"] == [1, 2] and got["max_rank_bytes"] == 32
        assert got["loaded"] == 2 and got["restored"] == [rank + 2000.0] * 8
        assert got["neighbour"] == [(rank + 1) % WORLD + 2000.0] * 4
        assert got["neighbour_objects"] == {"rank": (rank + 1) % WORLD}
        q = rank % (WORLD // 2)  # its half: old ranks 2q and 2q+1, the only files it opened
        assert got["half"] == [2 * q + 2000.0] * 8 + [2 * q + 1 + 2000.0] * 8 and got["half_files"] == 2
    names = os.listdir(os.path.join(root, "iter_0000002"))
    assert "manifest.json" in names and sum(n.endswith(".dsck") for n in names) == WORLD
