"""Multi-level tiers on 4 CPU ranks as 2 "nodes" (LOCAL_WORLD_SIZE=2, a local dir per node)."""

import os
import shutil

from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.run_id import local_tier_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from .ranks import describe, run_ranks

WORKER = "tests.workers.manager_worker"
NODES = {"LOCAL_WORLD_SIZE": "2"}


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    return [r["result"] for r in results]


def _local(tmp_path, node):
    """Node ``node``'s local tier of the run whose --save is ``persistent``."""
    return local_tier_dir(str(tmp_path / f"local{node}"), str(tmp_path / "persistent"))


def _args(tmp_path, *extra):
    """Without replicas: these tests are about a node-local tier alone (test_replication has them)."""
    return [
        "--root",
        str(tmp_path / "persistent"),
        "--local-root",
        str(tmp_path / "local{node}"),
        "--replicas",
        "0",
        *extra,
    ]


def test_promotion_interval_retention_per_tier_and_restore_preference(tmp_path):
    persistent = str(tmp_path / "persistent")
    _ok(
        run_ranks(
            WORKER,
            4,
            [
                "save",
                *_args(
                    tmp_path, "--iters", "6", "--persist-interval", "2", "--keep-last", "2", "--local-keep-last", "2"
                ),
            ],
            env=NODES,
        )
    )
    assert committed_iterations(persistent) == [4, 6]  # every 2nd local checkpoint, keep_last=2
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        local = _local(tmp_path, node)
        assert committed_iterations(local) == [5, 6]  # local_keep_last=2
        m = read_manifest(iter_dir(local, 6))
        assert m.tier == "local" and [r.rank for r in m.ranks] == ranks and m.world_size == 4
    assert read_manifest(iter_dir(persistent, 6)).tier == "persistent"
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] and "local" in r["root"] for r in loaded), loaded

    # node 1 is replaced: its local dir is gone -> every rank falls back to the persistent tier
    shutil.rmtree(tmp_path / "local1")
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] and r["root"] == persistent for r in loaded), loaded


def test_local_fallback_rank_reads_only_the_missing_node_from_persistent(tmp_path):
    persistent = str(tmp_path / "persistent")
    _ok(run_ranks(WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "2")], env=NODES))
    shutil.rmtree(tmp_path / "local1")  # node 1 replaced; node 0 still has 5 and 6 locally
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path, "--local-fallback", "rank")], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] for r in loaded), loaded
    roots = {r["rank"]: r["root"] for r in loaded}
    assert roots[0] == roots[1] == _local(tmp_path, 0), roots
    assert roots[2] == roots[3] == persistent, roots

    # a local copy that is not the persistent file is never read: a new run re-saves 6 locally and
    # is killed in its end-of-run promotion, node 1 is replaced again -> node 0's local 6 differs
    # from the persistent 6
    killed = run_ranks(
        WORKER,
        4,
        ["save", *_args(tmp_path, "--start", "6", "--iters", "1", "--persist-interval", "5")],
        env={**NODES, "DSM_CRASH_AT": "promote"},
    )
    assert all(r["returncode"] == -9 for r in killed), describe(killed)
    shutil.rmtree(tmp_path / "local1")
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path, "--local-fallback", "rank")], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] and r["root"] == persistent for r in loaded), loaded


def test_a_clean_end_promotes_the_newest_local_checkpoint_whatever_the_interval(tmp_path):
    persistent = str(tmp_path / "persistent")
    done = _ok(run_ranks(WORKER, 4, ["save", *_args(tmp_path, "--iters", "3", "--persist-interval", "2")], env=NODES))
    assert all(not r["errors"] for r in done), done
    assert committed_iterations(persistent) == [2, 3]  # 2 by the interval, 3 by close()
    assert read_manifest(iter_dir(persistent, 3)).tier == "persistent"


def test_newer_local_checkpoint_wins_and_unpromoted_one_is_promoted_on_restart(tmp_path):
    persistent = str(tmp_path / "persistent")
    # killed in its end-of-run promotion (the 2nd promotion: 2 by the interval, then 3)
    killed = run_ranks(
        WORKER,
        4,
        ["save", *_args(tmp_path, "--iters", "3", "--persist-interval", "2")],
        env={**NODES, "DSM_CRASH_AT": "promote:2"},
    )
    assert all(r["returncode"] == -9 for r in killed), describe(killed)
    assert committed_iterations(persistent) == [2]
    resumed = _ok(
        run_ranks(WORKER, 4, ["resume", *_args(tmp_path, "--iters", "1", "--persist-interval", "5")], env=NODES)
    )
    assert all(r["iteration"] == 3 and r["exact"] and "local" in r["root"] for r in resumed), resumed
    assert 3 in committed_iterations(persistent)  # the restart promoted what the last run left local-only


def test_crash_during_promotion_keeps_local_copy_and_is_redone(tmp_path):
    persistent = str(tmp_path / "persistent")
    crashed = run_ranks(
        WORKER,
        4,
        ["save", *_args(tmp_path, "--iters", "2", "--persist-interval", "2")],
        env={**NODES, "DSM_CRASH_AT": "promote", "DSM_CRASH_RANK": "3"},
    )
    assert any(r["returncode"] == -9 for r in crashed), describe(crashed)
    assert committed_iterations(persistent) == []  # promotion of 2 never committed
    assert committed_iterations(_local(tmp_path, 1)) == [1, 2]  # the local copies are intact
    resumed = _ok(
        run_ranks(WORKER, 4, ["resume", *_args(tmp_path, "--iters", "1", "--persist-interval", "9")], env=NODES)
    )
    assert all(r["iteration"] == 2 and r["exact"] for r in resumed), resumed
    assert committed_iterations(persistent) == [2, 3]  # 2 redone after the restart, 3 at its end


def test_nodes_holding_the_same_iteration_from_different_saves_are_never_restored_together(tmp_path):
    """Node 0's local 6 comes from a second run's re-save, node 1's from the first run (its manifest
    of the re-save lost): both are committed and intact, but restoring them together would mix two
    runs.  The second run's start-up promoted the first run's 6 to the persistent tier, so that is
    the newest checkpoint every rank can read from one save."""
    _ok(run_ranks(WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "5")], env=NODES))
    first_run_node1 = tmp_path / "first-run-local1"
    shutil.copytree(tmp_path / "local1", first_run_node1)
    _ok(
        run_ranks(
            WORKER, 4, ["save", *_args(tmp_path, "--start", "6", "--iters", "1", "--persist-interval", "5")], env=NODES
        )
    )
    shutil.rmtree(tmp_path / "local1")
    shutil.copytree(first_run_node1, tmp_path / "local1")
    node0 = read_manifest(iter_dir(_local(tmp_path, 0), 6)).run_token
    node1 = read_manifest(iter_dir(_local(tmp_path, 1), 6)).run_token
    assert node0 != node1  # the setup: same iteration, two runs
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    persistent = str(tmp_path / "persistent")
    assert all(r["iteration"] == 6 and r["exact"] and r["root"] == persistent for r in loaded), loaded


def test_a_corrupt_local_file_on_one_rank_falls_back_to_the_intact_persistent_checkpoint(tmp_path):
    persistent = str(tmp_path / "persistent")
    _ok(run_ranks(WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "2")], env=NODES))
    local1 = iter_dir(_local(tmp_path, 1), 6)
    record = read_manifest(local1).record(3)
    with open(os.path.join(local1, record.file), "r+b") as f:  # one bit flipped in rank 3's tensor data
        f.seek(record.file_bytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] and r["root"] == persistent for r in loaded), loaded
