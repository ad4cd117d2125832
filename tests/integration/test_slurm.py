"""Integration: lazy checkpoints of the demo trainer under a real Slurm, through launch/cpu_demo.sbatch.

Each test submits ``launch/cpu_demo.sbatch`` (2 CPU ranks on one node) and reads the job's state with
``scontrol show job`` (no accounting database is needed) and its output file:

1. a job that completes commits a checkpoint (``latest_checkpointed_iteration.txt`` names an
   ``iter_*/manifest.json``), and a second job on the same ``--save`` resumes from it and advances;
2. a running job that is pre-empted -- by the script's own protocol (``SIGUSR1`` to the batch shell,
   as ``#SBATCH --signal=B:USR1@...`` does; the script forwards ``SIGTERM`` and requeues itself) or
   by ``scontrol requeue`` (what Slurm's ``PreemptMode=REQUEUE`` does) -- runs again, says
   ``resumed from iteration M`` with M at least the last checkpoint committed before the
   pre-emption, and commits checkpoints past M.

Needs ``sbatch`` on PATH and an idle node (``.ci/slurm_setup.sh`` makes a one-node cluster);
otherwise the tests skip, or fail when ``DSM_SLURM=1`` demands Slurm. The batch jobs run this
interpreter (``PYTHON``) on files under ``tmp_path``, so the node must share this file system
(true for the one-node CI cluster). ``DSM_SLURM_PARTITION`` picks a partition, ``DSM_SLURM_TIMEOUT``
bounds every wait (seconds, default 180), ``DSM_SLURM_DEMO_ARGS`` adds flags to the demo trainer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "launch" / "cpu_demo.sbatch"
DEMO_TRAINER = REPO / "datastates_megatron" / "demo" / "train.py"
DEMO_MODULE = "datastates_megatron.demo.train"
TIMEOUT_S = float(os.environ.get("DSM_SLURM_TIMEOUT", "180"))
POLL_S = 0.5
RESUMED_RE = re.compile(r"resumed from iteration (\d+)")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
RELEASE_AFTER_S = 2.5  # see restarted() in the pre-emption test
LONG_RUN_ITERS = 1_000_000  # "forever": the pre-emption tests cancel the job themselves

T = TypeVar("T")


def _slurm_unavailable() -> str | None:
    """Why Slurm cannot run these tests here, or None."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (run .ci/slurm_setup.sh as root for a one-node cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if out.returncode != 0:
        return f"sinfo failed (exit {out.returncode}): {out.stderr.strip()}"
    states = out.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mix") for s in states):
        return f"no idle Slurm node (sinfo states: {states or 'none'})"
    if not DEMO_TRAINER.exists():
        return f"the demo trainer {DEMO_TRAINER.relative_to(REPO)} does not exist yet"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    reason = _slurm_unavailable()
    if reason is None:
        return
    if os.environ.get("DSM_SLURM") == "1":
        pytest.fail(f"DSM_SLURM=1 demands these tests, but {reason}", pytrace=False)
    pytest.skip(reason)


class Job:
    """One submitted batch job: its id, output file and --save directory."""

    def __init__(self, job_id: str, log: Path, save_dir: Path) -> None:
        self.id = job_id
        self.log = log
        self.save_dir = save_dir

    def fields(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True,
                             text=True, timeout=30, check=False)
        return dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)

    def state(self) -> str:
        return self.fields().get("JobState", "UNKNOWN")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def resumed_from(self) -> list[int]:
        return [int(m) for m in RESUMED_RE.findall(self.text())]

    def describe(self) -> str:
        f = self.fields()
        keys = ("JobState", "Reason", "Restarts", "ExitCode")
        tail = "\n".join(self.text().splitlines()[-40:])
        return (f"job {self.id}: " + " ".join(f"{k}={f.get(k)}" for k in keys)
                + f"\nsave dir {self.save_dir}: {sorted(p.name for p in self.save_dir.glob('*'))}"
                + f"\n---- last lines of {self.log} ----\n{tail}")


@pytest.fixture
def submit(slurm, tmp_path):
    """submit(save_dir, train_iters) -> Job; every job still queued at the end is cancelled."""
    jobs: list[Job] = []

    def _submit(save_dir: Path, train_iters: int) -> Job:
        log = tmp_path / f"job-{len(jobs)}.out"
        env = dict(os.environ, PYTHON=sys.executable, DSM_REPO_DIR=str(REPO), DSM_PRESET="cpu-demo",
                   DEMO_MODULE=DEMO_MODULE, DEMO_EXTRA_ARGS=os.environ.get("DSM_SLURM_DEMO_ARGS", ""),
                   SAVE_DIR=str(save_dir), TRAIN_ITERS=str(train_iters), SAVE_INTERVAL="1")
        cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--time=00:15:00",
               f"--output={log}", f"--chdir={tmp_path}", f"--job-name=dsm-test-{tmp_path.name}"]
        if os.environ.get("DSM_SLURM_PARTITION"):
            cmd.append(f"--partition={os.environ['DSM_SLURM_PARTITION']}")
        out = subprocess.run(cmd + [str(SBATCH_SCRIPT)], env=env, capture_output=True, text=True,
                             timeout=60, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {SBATCH_SCRIPT} failed (exit {out.returncode}): {out.stderr}")
        job = Job(out.stdout.strip().split(";")[0], log, save_dir)
        jobs.append(job)
        return job

    yield _submit
    for job in jobs:
        subprocess.run(["scancel", job.id], capture_output=True, timeout=30, check=False)
    for job in jobs:  # let the ranks exit before pytest deletes tmp_path under them
        _poll(lambda: job.state() in TERMINAL_STATES or None, 60, f"job {job.id} to end", job)


def _poll(probe: Callable[[], T | None], timeout_s: float, what: str, job: Job) -> T:
    """Return probe()'s first non-None result; fail with the job's state and log after timeout_s.

    Slurm offers no completion future, so this polls scontrol and the file system every POLL_S."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{job.describe()}",
                        pytrace=False)
        time.sleep(POLL_S)


def _committed_iteration(save_dir: Path) -> int | None:
    """The iteration named by latest_checkpointed_iteration.txt if its manifest exists, else None."""
    try:
        iteration = int((save_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    manifest = save_dir / f"iter_{iteration:07d}" / "manifest.json"
    return iteration if manifest.is_file() else None


def _wait_for_end(job: Job) -> str:
    return _poll(lambda: (s := job.state()) in TERMINAL_STATES and s or None, TIMEOUT_S,
                 f"job {job.id} to end", job)


def _wait_for_commit_after(job: Job, iteration: int) -> int:
    """Wait while the job runs until it commits a checkpoint past ``iteration``."""
    def probe() -> int | None:
        committed = _committed_iteration(job.save_dir)
        if committed is not None and committed > iteration:
            return committed
        state = job.state()
        if state in TERMINAL_STATES:
            pytest.fail(f"job ended ({state}) before committing past iteration {iteration}\n"
                        f"{job.describe()}", pytrace=False)
        return None
    return _poll(probe, TIMEOUT_S, f"a checkpoint committed past iteration {iteration}", job)


def test_completed_job_commits_and_next_job_resumes(submit, tmp_path):
    save = tmp_path / "save"
    first = submit(save, train_iters=3)
    assert _wait_for_end(first) == "COMPLETED", first.describe()
    assert _committed_iteration(save) == 3, first.describe()
    assert first.resumed_from() == [], first.describe()

    second = submit(save, train_iters=5)
    assert _wait_for_end(second) == "COMPLETED", second.describe()
    assert second.resumed_from() == [3], second.describe()
    assert _committed_iteration(save) == 5, second.describe()


# How a running job is pre-empted: the batch script's own protocol (SIGUSR1 to the batch shell only,
# exactly what `#SBATCH --signal=B:USR1@N` delivers before the time limit), or an administrator's /
# PreemptMode=REQUEUE requeue (SIGTERM to every process, SIGKILL after KillWait, requeue).
PREEMPTIONS = {
    "signal-B-USR1": ["scancel", "--batch", "--signal=USR1"],
    "scontrol-requeue": ["scontrol", "requeue"],
}


@pytest.mark.parametrize("how", sorted(PREEMPTIONS))
def test_preempted_job_is_requeued_and_resumes(submit, tmp_path, how):
    save = tmp_path / "save"
    job = submit(save, train_iters=LONG_RUN_ITERS)
    before = _wait_for_commit_after(job, 0)

    out = subprocess.run(PREEMPTIONS[how] + [job.id], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, f"{PREEMPTIONS[how]} {job.id}: {out.stderr}\n{job.describe()}"

    held_since: dict[int, float] = {}  # restart count -> when the requeued job was first seen held
    released: set[int] = set()

    def restarted() -> str | None:
        f = job.fields()
        state, restarts = f.get("JobState", "UNKNOWN"), int(f.get("Restarts", "0") or 0)
        if state == "PENDING" and f.get("Reason") == "BeginTime" and restarts not in released:
            # Slurm holds a requeued job for ~2 minutes. Release it once it has been held for
            # RELEASE_AFTER_S: a start in the same second as the requeue fails with "Job credential
            # revoked". StartTime=now (not now+N) also makes the scheduler run at once.
            since = held_since.setdefault(restarts, time.monotonic())
            if time.monotonic() - since >= RELEASE_AFTER_S:
                released.add(restarts)
                subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"],
                               capture_output=True, timeout=30, check=False)
        if state in TERMINAL_STATES:
            pytest.fail(f"job ended ({state}) instead of being requeued\n{job.describe()}",
                        pytrace=False)
        return state if restarts >= 1 and state == "RUNNING" else None
    _poll(restarted, TIMEOUT_S, "the job to be requeued and running again", job)

    resumed = _poll(lambda: job.resumed_from() or None, TIMEOUT_S,
                    "the requeued run to log 'resumed from iteration N'", job)
    assert len(resumed) == 1, f"expected one resume, got {resumed}\n{job.describe()}"
    assert resumed[0] >= before, (
        f"resumed from iteration {resumed[0]}, older than iteration {before} committed before the "
        f"pre-emption\n{job.describe()}")
    if how == "signal-B-USR1":
        text = job.text()
        assert "SIGUSR1: pre-emption" in text and "requeueing job" in text, job.describe()
    _wait_for_commit_after(job, resumed[0])
