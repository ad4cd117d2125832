"""A lost node on a 4-"node" job (4 ranks, LOCAL_WORLD_SIZE=1, a node-local directory per node) of
the megatron-core trainer (``datastates_megatron.demo.train``): local checkpoint every iteration,
persisted every 10th, 1 partner replica.  The job stalls at iteration 18 once 17 is committed and
replicated, is killed with SIGKILL, node 1's local directory is deleted, and the whole job restarts:
it resumes from 17 (not 10) -- node 1's state fetched from its partner's replica -- and ends with
every model and optimizer tensor equal, to the bit, to an uninterrupted run's."""

from __future__ import annotations

import glob
import json
import shutil

from datastates_megatron.engine.tiers.run_id import local_tier_dir
from datastates_megatron.engine.tiers.tier import committed_iterations
from tests.distributed.ranks import describe, run_ranks

NODES, ITERS, KILL_AT, PERSIST = 4, 20, 17, 10
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--vocab-size", "256"]


def _train(tmp_path, name, lazy, **kw):
    args = ["--train-iters", str(ITERS), *MODEL, "--log-json", str(tmp_path / name)]
    if lazy:
        args += [
            "--save",
            str(tmp_path / "save"),
            "--save-interval",
            "1",
            "--lazy-ckpt",
            "--lazy-ckpt-host-cache-gb",
            "0.01",
            "--lazy-ckpt-local-dir",
            str(tmp_path / "node{node}"),
            "--lazy-ckpt-persist-interval",
            str(PERSIST),
            "--lazy-ckpt-replicas",
            "1",
        ]
    env = {"LOCAL_WORLD_SIZE": "1", **kw.pop("env", {})}
    return run_ranks("datastates_megatron.demo.train", NODES, args, env=env, timeout=120, **kw)


def _records(tmp_path, name):
    return [json.load(open(f"{tmp_path / name}.rank{r}.json")) for r in range(NODES)]


def _replicated(tmp_path, iteration):
    """Every rank's file of ``iteration`` is committed on its partner (rank r's partner: r xor 1)."""

    def check() -> bool:
        found = glob.glob(
            str(tmp_path / "node*" / "run-*" / "replicas" / "r*" / f"iter_{iteration:07d}" / "manifest.json")
        )
        return len(found) == NODES

    return check


def test_a_lost_node_resumes_from_its_partners_replica_bit_exact(tmp_path):
    reference = _train(tmp_path, "reference", lazy=False)
    assert all(r["returncode"] == 0 for r in reference), describe(reference)

    killed = _train(
        tmp_path,
        "killed",
        lazy=True,
        env={"DSM_HOLD_AT": f"save:{KILL_AT + 1}"},
        kill_when=_replicated(tmp_path, KILL_AT),
    )
    assert all(r["returncode"] == -9 for r in killed), describe(killed)
    save = str(tmp_path / "save")
    assert committed_iterations(save) == [PERSIST]  # the persistent tier is 7 iterations behind
    shutil.rmtree(tmp_path / "node1")  # node 1 is lost with its /dev/shm; a fresh node takes its place

    resumed = _train(tmp_path, "resumed", lazy=True)
    assert all(r["returncode"] == 0 for r in resumed), describe(resumed)
    got, want = _records(tmp_path, "resumed"), _records(tmp_path, "reference")
    assert [g["resumed_from"] for g in got] == [KILL_AT] * NODES
    node1 = local_tier_dir(str(tmp_path / "node1"), save)
    assert got[1]["restored_from"] == f"{node1}/replicas/r00001", got[1]["restored_from"]
    assert got[0]["restored_from"] == local_tier_dir(str(tmp_path / "node0"), save)
    assert "the replica held by rank 0" in resumed[1]["stderr"], resumed[1]["stderr"][-3000:]
    for rank in range(NODES):
        assert got[rank]["digest"] == want[rank]["digest"], rank
        assert [i["loss"] for i in got[rank]["iterations"]] == [i["loss"] for i in want[rank]["iterations"][KILL_AT:]]
