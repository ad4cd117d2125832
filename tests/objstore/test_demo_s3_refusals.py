"""The demo trainer on object storage (findings of issue #49): ``--save s3://`` without
``--lazy-ckpt-local-dir`` checkpoints from memory and resumes bit-exact after a ``kill -9``; a save
prefix whose lock a job killed with ``kill -9`` still holds is refused in one line and exit status 2,
never a traceback, naming the variable that takes the lock over -- and with it set the run starts at
once."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("megatron.core")

from datastates_megatron.engine.storage.lock import TAKE_OVER_ENV  # noqa: E402

from ..distributed.ranks import describe, run_ranks  # noqa: E402
from .test_lock_takeover import _killed_holder  # noqa: E402

DEMO = "datastates_megatron.demo.train"
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--vocab-size", "64"]
LAZY = [*MODEL, "--train-iters", "2", "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.002"]


def _error_line(r: dict) -> str:
    assert r["returncode"] == 2 and "Traceback" not in r["stderr"], describe([r])
    lines = [ln for ln in r["stderr"].splitlines() if "error:" in ln]
    assert len(lines) == 1, describe([r])
    return lines[0]


def _digest(log_json: str) -> str:
    with open(f"{log_json}.rank0.json") as f:
        return json.load(f)["digest"]


def test_save_to_a_bucket_without_a_local_dir_killed_after_a_commit_resumes_bit_exact(
    bucket, s3_env, tmp_path, monkeypatch
):
    """``--save s3://`` with no ``--lazy-ckpt-local-dir`` trains, checkpoints from memory, is
    killed with ``kill -9`` once a checkpoint is committed, and resumes from the bucket to the
    state of a run never killed; nothing is written to its working directory or ``TMPDIR``."""
    cwd, tmp, logs = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "logs"
    for d in (cwd, tmp, logs):
        d.mkdir()
    monkeypatch.chdir(cwd)
    env = {"DSM_JOB_ID": "slurm-4949", "TMPDIR": str(tmp)}  # a requeue of the same job: its own lock
    four = [*MODEL, "--train-iters", "4", "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.002"]
    (r,) = run_ranks(DEMO, 1, ["--save", f"s3://{bucket}/ref", *four, "--log-json", str(logs / "ref")], env=env)
    assert r["returncode"] == 0, describe([r])
    client = s3_env.client()

    def committed() -> bool:  # polled by run_ranks: kill -9 once iteration 2's manifest is in the bucket
        return "Contents" in client.list_objects_v2(Bucket=bucket, Prefix="run/iter_0000002/manifest.json")

    (r,) = run_ranks(DEMO, 1, ["--save", f"s3://{bucket}/run", *four], env=env, kill_when=committed)
    assert r["returncode"] == -9, describe([r])
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []
    (r,) = run_ranks(DEMO, 1, ["--save", f"s3://{bucket}/run", *four, "--log-json", str(logs / "run")], env=env)
    assert r["returncode"] == 0 and "resumed from iteration" in r["stdout"], describe([r])
    assert _digest(str(logs / "run")) == _digest(str(logs / "ref"))
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []


def test_a_killed_job_s_lock_refusal_names_the_variable_and_it_lets_the_run_start(bucket, monkeypatch, tmp_path):
    for var in ("DSM_JOB_ID", "SLURM_JOB_ID", TAKE_OVER_ENV):
        monkeypatch.delenv(var, raising=False)
    token, _ = _killed_holder(bucket)
    args = ["--save", f"s3://{bucket}/job/save", *LAZY, "--lazy-ckpt-local-dir", str(tmp_path / "local")]
    (r,) = run_ranks(DEMO, 1, args)
    line = _error_line(r)
    assert "save location is in use by another writer" in line and f"{TAKE_OVER_ENV}={token}" in line, line
    (r,) = run_ranks(DEMO, 1, args, env={TAKE_OVER_ENV: token})
    assert r["returncode"] == 0, describe([r])
