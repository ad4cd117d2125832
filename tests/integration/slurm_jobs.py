"""Submitting batch jobs to a real Slurm and watching them, for the Slurm integration tests.

Jobs are read with ``scontrol show job`` (no accounting database is needed) and their output file.
Needs ``sbatch`` on PATH and an idle node (``.ci/slurm_setup.sh`` makes a one-node cluster);
otherwise the tests skip, or fail when ``DSM_SLURM=1`` demands Slurm. The batch jobs run this
interpreter (``PYTHON``) on files under ``tmp_path``, so the node must share this file system
(true for the one-node CI cluster). ``DSM_SLURM_PARTITION`` picks a partition, ``DSM_SLURM_TIMEOUT``
bounds every wait (seconds, default 180).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("DSM_SLURM_TIMEOUT", "180"))
POLL_S = 0.5
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
RELEASE_AFTER_S = 2.5  # see wait_requeued_and_running()

# How a running job is pre-empted: the batch script's own protocol (SIGUSR1 to the batch shell only,
# exactly what `#SBATCH --signal=B:USR1@N` delivers before the time limit), or an administrator's /
# PreemptMode=REQUEUE requeue (SIGTERM to every process, SIGKILL after KillWait, requeue).
PREEMPTIONS = {
    "signal-B-USR1": ["scancel", "--batch", "--signal=USR1"],
    "scontrol-requeue": ["scontrol", "requeue"],
}

T = TypeVar("T")


def slurm_unavailable() -> str | None:
    """Why Slurm cannot run these tests here, or None."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (run .ci/slurm_setup.sh as root for a one-node cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if out.returncode != 0:
        return f"sinfo failed (exit {out.returncode}): {out.stderr.strip()}"
    states = out.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mix") for s in states):
        return f"no idle Slurm node (sinfo states: {states or 'none'})"
    return None


def require(reason: str | None) -> None:
    """Skip for ``reason`` (fail instead when ``DSM_SLURM=1`` demands these tests)."""
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
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True, timeout=30, check=False
        )
        return dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)

    def state(self) -> str:
        return self.fields().get("JobState", "UNKNOWN")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def describe(self) -> str:
        f = self.fields()
        keys = ("JobState", "Reason", "Restarts", "ExitCode")
        tail = "\n".join(self.text().splitlines()[-60:])
        return (
            f"job {self.id}: "
            + " ".join(f"{k}={f.get(k)}" for k in keys)
            + f"\nsave dir {self.save_dir}: {sorted(p.name for p in self.save_dir.glob('*'))}"
            + f"\n---- last lines of {self.log} ----\n{tail}"
        )


class Submitter:
    """``submit(script, save_dir, env, *sbatch_args) -> Job``; :meth:`cancel_all` at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.jobs: list[Job] = []

    def __call__(self, script: Path, save_dir: Path, env: dict[str, str], *sbatch_args: str) -> Job:
        log = self.tmp_path / f"job-{len(self.jobs)}.out"
        cmd = [
            "sbatch",
            "--parsable",
            "--time=00:15:00",
            f"--output={log}",
            f"--chdir={self.tmp_path}",
            f"--job-name=dsm-test-{self.tmp_path.name}",
            *sbatch_args,
        ]
        if os.environ.get("DSM_SLURM_PARTITION"):
            cmd.append(f"--partition={os.environ['DSM_SLURM_PARTITION']}")
        out = subprocess.run(
            cmd + [str(script)], env=dict(os.environ, **env), capture_output=True, text=True, timeout=60, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed (exit {out.returncode}): {out.stderr}")
        job = Job(out.stdout.strip().split(";")[0], log, save_dir)
        self.jobs.append(job)
        return job

    def cancel_all(self) -> None:
        for job in self.jobs:
            subprocess.run(["scancel", job.id], capture_output=True, timeout=30, check=False)
        for job in self.jobs:  # let the ranks exit before pytest deletes tmp_path under them
            poll(lambda: job.state() in TERMINAL_STATES or None, 60, f"job {job.id} to end", job)


def poll(probe: Callable[[], T | None], timeout_s: float, what: str, job: Job) -> T:
    """Return probe()'s first non-None result; fail with the job's state and log after timeout_s.

    Slurm offers no completion future, so this polls scontrol and the file system every POLL_S."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{job.describe()}", pytrace=False)
        time.sleep(POLL_S)


def committed_iteration(save_dir: Path) -> int | None:
    """The iteration named by latest_checkpointed_iteration.txt if its manifest exists, else None."""
    try:
        iteration = int((save_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    manifest = save_dir / f"iter_{iteration:07d}" / "manifest.json"
    return iteration if manifest.is_file() else None


def wait_for_end(job: Job) -> str:
    return poll(lambda: (s := job.state()) in TERMINAL_STATES and s or None, TIMEOUT_S, f"job {job.id} to end", job)


def wait_for_commit_after(job: Job, iteration: int) -> int:
    """Wait while the job runs until it commits a checkpoint past ``iteration``."""

    def probe() -> int | None:
        committed = committed_iteration(job.save_dir)
        if committed is not None and committed > iteration:
            return committed
        state = job.state()
        if state in TERMINAL_STATES:
            pytest.fail(
                f"job ended ({state}) before committing past iteration {iteration}\n{job.describe()}", pytrace=False
            )
        return None

    return poll(probe, TIMEOUT_S, f"a checkpoint committed past iteration {iteration}", job)


def preempt(job: Job, how: str) -> None:
    out = subprocess.run(PREEMPTIONS[how] + [job.id], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, f"{PREEMPTIONS[how]} {job.id}: {out.stderr}\n{job.describe()}"


def wait_requeued_and_running(job: Job, probe: Callable[[], None] | None = None) -> None:
    """Wait until the pre-empted ``job`` runs again (Restarts >= 1), releasing Slurm's hold on it.
    ``probe`` is called on every poll (e.g. to check the save directory meanwhile)."""
    held_since: dict[int, float] = {}  # restart count -> when the requeued job was first seen held
    released: set[int] = set()

    def restarted() -> str | None:
        if probe is not None:
            probe()
        f = job.fields()
        state, restarts = f.get("JobState", "UNKNOWN"), int(f.get("Restarts", "0") or 0)
        if state == "PENDING" and f.get("Reason") == "BeginTime" and restarts not in released:
            # Slurm holds a requeued job for ~2 minutes. Release it once it has been held for
            # RELEASE_AFTER_S: a start in the same second as the requeue fails with "Job credential
            # revoked". StartTime=now (not now+N) also makes the scheduler run at once.
            since = held_since.setdefault(restarts, time.monotonic())
            if time.monotonic() - since >= RELEASE_AFTER_S:
                released.add(restarts)
                subprocess.run(
                    ["scontrol", "update", f"JobId={job.id}", "StartTime=now"],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
        if state in TERMINAL_STATES:
            pytest.fail(f"job ended ({state}) instead of being requeued\n{job.describe()}", pytrace=False)
        return state if restarts >= 1 and state == "RUNNING" else None

    poll(restarted, TIMEOUT_S, "the job to be requeued and running again", job)
