"""Slurm end to end with the real Megatron-LM: the GPU launch scripts users submit
(``datastates_megatron/launch/gpu_per_task.sbatch``, ``datastates_megatron/launch/gpu_multinode.sbatch``), their own command line
(``datastates_megatron/launch/lib.sh``: preset, ``dsm_megatron_args``, rendezvous, pre-emption protocol) run in CPU
mode (``DSM_CPU=1``, preset ``cpu-tiny``) on Megatron-LM's ``pretrain_gpt.py``.

A pre-empted job -- ``SIGUSR1`` to the batch shell (here while a slowed flush runs) (``#SBATCH --signal=B:USR1@...``; the script
sends ``SIGTERM`` to the ranks and requeues) or ``scontrol requeue`` (``SIGTERM`` to everything) --
must commit a final checkpoint through Megatron's ``--exit-signal-handler`` before its ranks exit,
run again, resume from exactly that iteration, finish, and log after the resume the grad norms and
params norms of a job that was never pre-empted, to the bit (``DSM_TRAINING_RECORD``).

Slurm set-up and environment: :mod:`tests.integration.slurm_jobs`; ``MEGATRON_LM_DIR`` is a patched
tree (``.ci/run`` and ``scripts/test.sh`` unpack one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from datastates_megatron.engine.format.manifest import read_tracker
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.megatron.cpu import training_record
from tests.integration.slurm_jobs import (
    REPO,
    Submitter,
    poll,
    preempt,
    require,
    slurm_unavailable,
    wait_for_commit_after,
    wait_for_end,
    wait_requeued_and_running,
)

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
ITERS = 24
RANKS = 2
SCRIPTS = {  # script, sbatch options that fit one CPU node with 2 ranks
    "per-task": (
        REPO / "datastates_megatron" / "launch" / "gpu_per_task.sbatch",
        ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0"],
    ),
    "multinode": (
        REPO / "datastates_megatron" / "launch" / "gpu_multinode.sbatch",
        ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0"],
    ),
}

# Makes every rank file write sleep DSM_TEST_SLOW_WRITE_MS, so that a pre-emption lands while a
# background flush is still running; put first on the job's PYTHONPATH. Python ignores an error in
# sitecustomize, so each process that patched the writer leaves a file the test checks for.
SLOW_WRITES = """
import os, time
_ms = float(os.environ.get("DSM_TEST_SLOW_WRITE_MS", "0"))
if _ms:
    from datastates_megatron.engine.format import writer as _writer
    _real = _writer.RankFileWriter.write
    def _slow(self, data, offset):
        time.sleep(_ms / 1000.0)
        return _real(self, data, offset)
    _writer.RankFileWriter.write = _slow
    open(os.path.join(os.environ["DSM_TEST_SLOW_WRITE_MARKS"], str(os.getpid())), "w").close()
"""


class MegatronJobs:
    """Submits a GPU launch script in CPU mode on one save directory and training record."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.submit = Submitter(tmp)

    def __call__(self, script: str, name: str, **env: str):
        path, options = SCRIPTS[script]
        save = self.tmp / f"{name}-save"
        env = dict(
            PYTHON=sys.executable,
            DSM_REPO_DIR=str(REPO),
            DSM_CPU="1",
            DSM_PRESET="cpu-tiny",
            MEGATRON_LM_DIR=MEGATRON_LM_DIR,
            SAVE_DIR=str(save),
            TRAIN_ITERS=str(ITERS),
            OMP_NUM_THREADS="1",
            TORCH_ELASTIC_SHUTDOWN_TIMEOUT="25",
            **{training_record.ENV: str(self.tmp / f"{name}-record")},
            **env,
        )
        return self.submit(path, save, env, *options)

    def runs(self, name: str, rank: int):
        return training_record.read_runs(str(self.tmp / f"{name}-record"), rank)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    if not MEGATRON_LM_DIR:
        pytest.skip("MEGATRON_LM_DIR is not set (a patched Megatron-LM tree; .ci/run unpacks one)")
    require(slurm_unavailable())
    jobs = MegatronJobs(tmp_path_factory.mktemp("slurm-megatron-lm"))
    yield jobs
    jobs.submit.cancel_all()


@pytest.fixture(scope="module")
def uninterrupted(jobs):
    """Per rank, {iteration: record entry} of a job that was never pre-empted."""
    job = jobs("per-task", "uninterrupted")
    assert wait_for_end(job) == "COMPLETED", job.describe()
    out = []
    for rank in range(RANKS):
        ((its, final),) = jobs.runs("uninterrupted", rank)
        assert sorted(its) == list(range(1, ITERS + 1)) and final is not None, job.describe()
        out.append(its)
    return out


def _tracker_names_only_complete(save: Path):
    """A probe: the tracker, whenever it exists, names a checkpoint whose manifest is there."""

    def probe() -> None:
        it = read_tracker(str(save)) if save.is_dir() else None
        assert it is None or os.path.isfile(os.path.join(iter_dir(str(save), it), "manifest.json")), it

    return probe


def _check_preempted_and_resumed(jobs, name: str, job, uninterrupted) -> None:
    assert wait_for_end(job) == "COMPLETED", job.describe()
    text = job.text()
    assert "exiting program after receiving SIGTERM" in text, job.describe()
    for rank in range(RANKS):
        runs = jobs.runs(name, rank)
        assert len(runs) == 2, (rank, [sorted(r[0]) for r in runs], job.describe())
        (first, _), (second, final) = runs
        last = max(first)
        assert last < ITERS, "the pre-emption came after the last iteration"
        # the final save of the SIGTERM path was committed before the ranks exited: the requeued
        # run resumed from exactly the last iteration the pre-empted one trained
        assert f"loaded lazy checkpoint of iteration {last}" in text, job.describe()
        assert sorted(second) == list(range(last + 1, ITERS + 1)) and final is not None, job.describe()
        for it in second:
            for key in ("grad_norm", "params_norm"):
                assert second[it][key] == uninterrupted[rank][it][key], (rank, it, key)
    newest = iter_dir(str(job.save_dir), read_tracker(str(job.save_dir)))
    verify = subprocess.run(
        [sys.executable, "-m", "datastates_megatron.cli", "verify", newest], capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _slow_writes(tmp_path: Path) -> dict[str, str]:
    """Job environment that makes every rank-file write sleep, so a flush outlasts an iteration."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WRITES)
    (tmp_path / "slowed").mkdir()
    return dict(
        SAVE_INTERVAL="1",
        DSM_TEST_SLOW_WRITE_MS="400",
        DSM_TEST_SLOW_WRITE_MARKS=str(tmp_path / "slowed"),
        PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )


def _preempt_and_check(jobs, uninterrupted, script: str, how: str, env: dict[str, str]) -> None:
    """Pre-empt a job once it has committed a checkpoint; with slow writes (SAVE_INTERVAL=1) a
    flush is still running then. The tracker never names a half-written checkpoint meanwhile."""
    name = f"{script}-{how}"
    job = jobs(script, name, **env)
    probe = _tracker_names_only_complete(job.save_dir)
    wait_for_commit_after(job, 1)
    if "DSM_TEST_SLOW_WRITE_MS" in env:  # pre-empt while a save is still being written
        assert any(Path(env["DSM_TEST_SLOW_WRITE_MARKS"]).iterdir()), "no process slowed its writes"
        poll(
            lambda: [p.name for p in job.save_dir.glob("iter_*") if not (p / "manifest.json").exists()] or None,
            30,
            "a checkpoint still being written",
            job,
        )
    probe()
    preempt(job, how)
    wait_requeued_and_running(job, probe=probe)
    if how == "signal-B-USR1":
        assert "SIGUSR1: pre-emption" in job.text() and "requeueing job" in job.text(), job.describe()
    _check_preempted_and_resumed(jobs, name, job, uninterrupted)


def test_gpu_per_task_job_preempted_by_its_signal_during_a_flush(jobs, uninterrupted, tmp_path):
    _preempt_and_check(jobs, uninterrupted, "per-task", "signal-B-USR1", _slow_writes(tmp_path))


def test_gpu_per_task_job_requeued_by_scontrol(jobs, uninterrupted):
    _preempt_and_check(jobs, uninterrupted, "per-task", "scontrol-requeue", {})


@pytest.mark.slow  # the same protocol through torchrun; ~2 minutes more of CI
def test_gpu_multinode_job_preempted_by_its_signal_during_a_flush(jobs, uninterrupted, tmp_path):
    _preempt_and_check(jobs, uninterrupted, "multinode", "signal-B-USR1", _slow_writes(tmp_path))
