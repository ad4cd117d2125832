"""Integration: lazy checkpoints of the demo trainer under a real Slurm, through datastates_megatron/launch/cpu_demo.sbatch.

Each test submits ``datastates_megatron/launch/cpu_demo.sbatch`` (2 CPU ranks on one node) and reads the job's state with
``scontrol show job`` (no accounting database is needed) and its output file:

1. a job that completes commits a checkpoint (``latest_checkpointed_iteration.txt`` names an
   ``iter_*/manifest.json``), and a second job on the same ``--save`` resumes from it and advances;
2. a running job that is pre-empted -- by the script's own protocol (``SIGUSR1`` to the batch shell,
   as ``#SBATCH --signal=B:USR1@...`` does; the script forwards ``SIGTERM`` and requeues itself) or
   by ``scontrol requeue`` (what Slurm's ``PreemptMode=REQUEUE`` does) -- runs again, says
   ``resumed from iteration M`` with M at least the last checkpoint committed before the
   pre-emption, and commits checkpoints past M.

What the tests need and the environment they read: :mod:`tests.integration.slurm_jobs`;
``DSM_SLURM_DEMO_ARGS`` adds flags to the demo trainer.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.integration.slurm_jobs import (
    REPO,
    TIMEOUT_S,
    Submitter,
    committed_iteration,
    poll,
    preempt,
    require,
    slurm_unavailable,
    wait_for_commit_after,
    wait_for_end,
    wait_requeued_and_running,
)

SBATCH_SCRIPT = REPO / "datastates_megatron" / "launch" / "cpu_demo.sbatch"
DEMO_TRAINER = REPO / "datastates_megatron" / "demo" / "train.py"
DEMO_MODULE = "datastates_megatron.demo.train"
RESUMED_RE = re.compile(r"resumed from iteration (\d+)")
LONG_RUN_ITERS = 1_000_000  # "forever": the pre-emption tests cancel the job themselves


def resumed_from(job) -> list[int]:
    return [int(m) for m in RESUMED_RE.findall(job.text())]


@pytest.fixture
def submit(tmp_path):
    """submit(save_dir, train_iters) -> Job (the demo through cpu_demo.sbatch); every job still
    queued at the end is cancelled."""
    require(slurm_unavailable() or (None if DEMO_TRAINER.exists() else f"{DEMO_TRAINER} does not exist"))
    submitter = Submitter(tmp_path)

    def _submit(save_dir: Path, train_iters: int):
        env = dict(
            PYTHON=sys.executable,
            DSM_REPO_DIR=str(REPO),
            DSM_PRESET="cpu-demo",
            DEMO_MODULE=DEMO_MODULE,
            DEMO_EXTRA_ARGS=os.environ.get("DSM_SLURM_DEMO_ARGS", ""),
            SAVE_DIR=str(save_dir),
            TRAIN_ITERS=str(train_iters),
            SAVE_INTERVAL="1",
        )
        return submitter(SBATCH_SCRIPT, save_dir, env, "--nodes=1", "--ntasks=2")

    yield _submit
    submitter.cancel_all()


def test_completed_job_commits_and_next_job_resumes(submit, tmp_path):
    save = tmp_path / "save"
    first = submit(save, train_iters=3)
    assert wait_for_end(first) == "COMPLETED", first.describe()
    assert committed_iteration(save) == 3, first.describe()
    assert resumed_from(first) == [], first.describe()

    second = submit(save, train_iters=5)
    assert wait_for_end(second) == "COMPLETED", second.describe()
    assert resumed_from(second) == [3], second.describe()
    assert committed_iteration(save) == 5, second.describe()


# Both pre-emptions go through lib.sh's dsm_run_step, which the GPU scripts share: CI runs them with
# Megatron-LM's pretrain_gpt.py (test_slurm_megatron_lm.py, compared to the bit), so here they are slow.
@pytest.mark.slow
@pytest.mark.parametrize("how", ["signal-B-USR1", "scontrol-requeue"])
def test_preempted_job_is_requeued_and_resumes(submit, tmp_path, how):
    save = tmp_path / "save"
    job = submit(save, train_iters=LONG_RUN_ITERS)
    before = wait_for_commit_after(job, 0)
    preempt(job, how)
    wait_requeued_and_running(job)

    resumed = poll(
        lambda: resumed_from(job) or None, TIMEOUT_S, "the requeued run to log 'resumed from iteration N'", job
    )
    assert len(resumed) == 1, f"expected one resume, got {resumed}\n{job.describe()}"
    assert resumed[0] >= before, (
        f"resumed from iteration {resumed[0]}, older than iteration {before} committed before the "
        f"pre-emption\n{job.describe()}"
    )
    if how == "signal-B-USR1":
        text = job.text()
        assert "SIGUSR1: pre-emption" in text and "requeueing job" in text, job.describe()
    wait_for_commit_after(job, resumed[0])
