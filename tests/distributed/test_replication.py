"""Partner replication on 4 CPU ranks as 2 "nodes" (LOCAL_WORLD_SIZE=2, a local dir per node): each
rank's local file is kept by its clique partner on the other node, so a lost node restores from its
partner's replica -- bit-exact, newer than the persistent tier -- and only a node lost together with
its partner falls back to the persistent tier."""

import glob
import os
import shutil

from datastates_megatron.engine.names import MANIFEST_NAME, RANK_FILE_SUFFIX, RECYCLE_DIR, iteration_of
from datastates_megatron.engine.tiers.run_id import local_tier_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from .ranks import describe, run_ranks

WORKER = "tests.workers.manager_worker"
NODES = {"LOCAL_WORLD_SIZE": "2"}


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    return [r["result"] for r in results]


def _args(tmp_path, *extra):
    return ["--root", str(tmp_path / "persistent"), "--local-root", str(tmp_path / "local{node}"), *extra]


def _local(tmp_path, node):
    return local_tier_dir(str(tmp_path / f"local{node}"), str(tmp_path / "persistent"))


def _kept_for_others(tmp_path, node) -> list[str]:
    """Every committed checkpoint (a manifest) and rank file anywhere under node ``node``'s local root,
    hidden directories included, that is not the node's own: not in an ``iter_*`` directory of its
    local tier, nor a retired file of that tier's recycle pool.  A replica is found whatever it is named."""
    local, found = _local(tmp_path, node), []
    own = {os.path.join(local, RECYCLE_DIR)}
    for top, _, files in os.walk(tmp_path / f"local{node}"):
        for name in files:
            if name != MANIFEST_NAME and not name.endswith(RANK_FILE_SUFFIX):
                continue
            if top in own or (os.path.dirname(top) == local and iteration_of(top) is not None):
                continue
            found.append(os.path.join(top, name))
    return sorted(found)


def test_a_lost_node_restores_from_its_partners_replica(tmp_path):
    persistent = str(tmp_path / "persistent")
    # local checkpoint every iteration, persisted every 4th; killed after 6 (no end-of-run promotion)
    _ok(
        run_ranks(
            WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "4", "--abandon")], env=NODES
        )
    )
    assert committed_iterations(persistent) == [4]
    for node, partners in ((0, [2, 3]), (1, [0, 1])):  # rank r's partner is r+2 (mod 4): the other node
        for src in partners:
            assert committed_iterations(f"{_local(tmp_path, node)}/replicas/r{src:05d}") == [5, 6]
        assert len(_kept_for_others(tmp_path, node)) == 2 * len(partners) * 2  # 2 iterations: manifest + file
    shutil.rmtree(tmp_path / "local1")  # node 1 is replaced: an empty node-local directory
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 6 and r["exact"] for r in loaded), loaded
    roots = {r["rank"]: r["root"] for r in loaded}
    assert roots[0] == roots[1] == _local(tmp_path, 0), roots
    for rank in (2, 3):  # fetched back from rank 0 / 1, into this node's own replicas/r<self>
        assert roots[rank] == f"{_local(tmp_path, 1)}/replicas/r{rank:05d}", roots

    # the run goes on from there; its later checkpoints are replicated again
    resumed = _ok(
        run_ranks(WORKER, 4, ["resume", *_args(tmp_path, "--iters", "2", "--persist-interval", "4")], env=NODES)
    )
    assert all(r["iteration"] == 6 and r["exact"] and not r["errors"] for r in resumed), resumed
    assert committed_iterations(f"{_local(tmp_path, 0)}/replicas/r00002") == [7, 8]


def test_a_node_lost_with_its_partner_falls_back_to_persistent(tmp_path):
    persistent = str(tmp_path / "persistent")
    _ok(
        run_ranks(
            WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "4", "--abandon")], env=NODES
        )
    )
    shutil.rmtree(tmp_path / "local0")
    shutil.rmtree(tmp_path / "local1")
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 4 and r["exact"] and r["root"] == persistent for r in loaded), loaded


def test_replication_off_keeps_no_replica(tmp_path):
    """No checkpoint of another rank under any name (the check finds the replicas of the test above)."""
    _ok(run_ranks(WORKER, 4, ["save", *_args(tmp_path, "--iters", "2", "--replicas", "0")], env=NODES))
    for node in (0, 1):
        assert committed_iterations(_local(tmp_path, node)), node  # the node's own checkpoints are there
        assert _kept_for_others(tmp_path, node) == [], node


def _flip_a_byte(path, offset_from_end=100):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_replica_falls_back_to_persistent_on_every_rank(tmp_path):
    """The partner holding a lost node's file finds it damaged: it says so instead of sending it,
    and every rank restores the persistent checkpoint -- never a hang, never "no checkpoint"."""
    persistent = str(tmp_path / "persistent")
    _ok(
        run_ranks(
            WORKER, 4, ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "4", "--abandon")], env=NODES
        )
    )
    replica = glob.glob(f"{_local(tmp_path, 0)}/replicas/r00002/iter_0000006/*.dsck")[0]
    _flip_a_byte(replica)
    shutil.rmtree(tmp_path / "local1")
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 4 and r["exact"] and r["root"] == persistent for r in loaded), loaded
    # asked for explicitly, iteration 6 cannot be restored: an error that is not "no checkpoint"
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path), "--iteration", "6"], env=NODES))
    assert all(r["error"].startswith("CheckpointError") and r["untouched"] for r in loaded), loaded


def test_partners_on_one_node_are_refused(tmp_path):
    got = run_ranks(
        WORKER, 4, ["save", *_args(tmp_path, "--iters", "1", "--replicas", "1", "--replication-jump", "1")], env=NODES
    )
    assert all(r["returncode"] != 0 for r in got), describe(got)
    assert all("on the same node" in r["stderr"] for r in got), describe(got)


def test_a_node_lost_while_the_newest_checkpoint_is_replicated_restores_the_one_before(tmp_path):
    """local_keep_last=1: when node 1 dies while 6 is being replicated, its partners hold 5 only --
    so the survivors' local tier must still hold 5, not only 6 (else: back to persistent 4)."""
    killed = run_ranks(
        WORKER,
        4,
        ["save", *_args(tmp_path, "--iters", "6", "--persist-interval", "4", "--local-keep-last", "1")],
        env={**NODES, "DSM_CRASH_AT": "replicate:6", "DSM_CRASH_RANK": "2"},
    )
    assert any(r["returncode"] == -9 for r in killed), describe(killed)
    shutil.rmtree(tmp_path / "local1")
    loaded = _ok(run_ranks(WORKER, 4, ["load", *_args(tmp_path)], env=NODES))
    assert all(r["iteration"] == 5 and r["exact"] for r in loaded), loaded
