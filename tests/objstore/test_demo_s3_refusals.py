"""The demo trainer's start-up refusals on object storage are one line and exit status 2, never a
traceback (finding of issue #49): ``--save s3://`` without ``--lazy-ckpt-local-dir``, and a save
prefix whose lock a job killed with ``kill -9`` still holds -- whose refusal names the variable
that takes the lock over, and with it set the run starts at once."""

from __future__ import annotations

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


def test_save_to_a_bucket_without_a_local_dir_is_one_line():
    (r,) = run_ranks(DEMO, 1, ["--save", "s3://bucket/run", *LAZY])
    line = _error_line(r)
    assert line == (
        "train.py: error: invalid --lazy-ckpt arguments: --lazy-ckpt-local-dir is required when --save is on "
        "object storage (s3://bucket/run)"
    ), line


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
