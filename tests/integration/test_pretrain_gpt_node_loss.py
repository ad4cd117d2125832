"""Megatron-LM's own ``pretrain_gpt.py --lazy-ckpt`` as a 4-node job on localhost (four torchruns,
``--nnodes 4``, one rank each, a node-local directory per node): a local checkpoint every
iteration, persisted every 10th, one partner replica.  The job stalls at iteration 18 once 17 is
committed and replicated, is killed with SIGKILL, node 1's local directory is deleted, and the whole
job restarts: it resumes from 17 (not 10), node 1's state fetched from its partner, and trains on
exactly as a run that was never interrupted.  (The default test set runs the same scenario with the
megatron-core trainer: tests/integration/test_node_loss.py.)"""

from __future__ import annotations

import glob
import shutil

import pytest

from datastates_megatron.engine.tiers.tier import committed_iterations
from tests.integration.megatron_lm_runs import CUDA, LAZY, MEGATRON_LM_DIR, assert_same_training, launch

pytestmark = [
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="MEGATRON_LM_DIR is not set"),
    pytest.mark.skipif(CUDA, reason="four ranks on one machine: CPU (gloo) only"),
    pytest.mark.slow,
]
NODES, ITERS, KILL_AT, PERSIST = 4, 20, 17, 10


def _replicated(tmp_path, iteration):
    def check() -> bool:
        pattern = str(tmp_path / "node*" / "run-*" / "replicas" / "r*" / f"iter_{iteration:07d}" / "manifest.json")
        return len(glob.glob(pattern)) == NODES

    return check


def test_a_lost_node_resumes_from_its_partner_through_pretrain_gpt(tmp_path):
    common = ["--train-iters", str(ITERS)]
    reference = launch(tmp_path, "reference", common, nproc=1, nodes=NODES, timeout=600)
    assert reference.returncode == 0, reference.describe()
    save = tmp_path / "ckpt"
    args = [
        *common,
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "1",
        *LAZY,
        "--lazy-ckpt-local-dir",
        str(tmp_path / "node{node}"),
        "--lazy-ckpt-persist-interval",
        str(PERSIST),
        "--lazy-ckpt-replicas",
        "1",
    ]
    import os

    os.environ["DSM_HOLD_AT"] = f"save:{KILL_AT + 1}"
    try:
        killed = launch(
            tmp_path, "killed", args, nproc=1, nodes=NODES, timeout=600, kill_when=_replicated(tmp_path, KILL_AT)
        )
    finally:
        del os.environ["DSM_HOLD_AT"]
    assert killed.returncode != 0, killed.describe()
    assert committed_iterations(str(save)) == [PERSIST], killed.describe()
    shutil.rmtree(tmp_path / "node1")

    resumed = launch(tmp_path, "resumed", args, nproc=1, nodes=NODES, timeout=600)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {KILL_AT}" in resumed.log, resumed.describe()
    assert "the replica held by rank 0" in resumed.log, resumed.describe()
    assert_same_training(resumed, reference, range(KILL_AT + 1, ITERS + 1), ranks=NODES)
