"""A save location on S3 without a node-local directory (issue #49): each rank file is written into
a memory file and uploaded from it (:mod:`datastates_megatron.engine.storage.stream`), and a restore
fetches by ranged GETs into memory: nothing is written to local disk -- the process's working
directory and ``TMPDIR`` stay empty, also after a ``kill -9`` --, a job killed after a commit resumes
from the bucket bit-exact, and a part damaged in transit fails that save (nothing committed) as it
fails a promotion."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import datastates_megatron
from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.errors import CheckpointError
from datastates_megatron.engine.manager import CheckpointManager

from .test_s3_faults import URL_PREFIX, proxy  # noqa: F401 - the fixture

_CHILD = textwrap.dedent(
    """
    import sys, torch
    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.manager import CheckpointManager

    w = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: a multipart upload of three parts
    mgr = CheckpointManager(sys.argv[1], EngineOptions(cache_bytes=32 << 20, timeout_s=120))
    mgr.register("w", w)
    for it in (1, 2):
        w.add_(1.0)
        mgr.save(it, {"iteration": it})
        mgr.wait(persist=True)
    print("committed", flush=True)
    sys.stdin.read()  # the job goes on until it is killed
    """
)
_REPO = str(pathlib.Path(datastates_megatron.__file__).resolve().parents[1])


def _manager(url: str, cache_bytes: int = 32 << 20) -> CheckpointManager:
    return CheckpointManager(url, EngineOptions(cache_bytes=cache_bytes, timeout_s=60))


def _empty_dirs(tmp_path, monkeypatch) -> tuple[pathlib.Path, pathlib.Path]:
    """A working directory and a TMPDIR, both empty, for this process and its children."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    return cwd, tmp


def _open_uploads(client, bucket: str) -> list:
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_kill_9_after_a_commit_then_resume_from_the_bucket_with_nothing_on_local_disk(
    bucket, s3_env, tmp_path, monkeypatch
):
    monkeypatch.setenv("DSM_JOB_ID", "slurm-4343")  # kept across a requeue: the restart takes its own lock
    cwd, tmp = _empty_dirs(tmp_path, monkeypatch)
    url = f"s3://{bucket}/run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()  # the child's own timeouts bound it; its death closes the pipe
        assert line.strip() == "committed", f"the job ended with {child.wait(60)} before committing"
    finally:
        child.kill()  # SIGKILL, by its pid
        child.wait(60)
        child.stdin.close()
        child.stdout.close()
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "run/iter_0000002/manifest.json" in keys

    fresh = torch.zeros(3_000_000)
    with _manager(url) as mgr:
        mgr.register("w", fresh)
        result = mgr.load()
        assert result.iteration == 2 and result.objects == {"iteration": 2}
    assert torch.equal(fresh, torch.arange(3_000_000, dtype=torch.float32) + 2.0)
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []
    assert _open_uploads(s3_env.client(), bucket) == []


def test_a_part_damaged_in_transit_fails_that_save_and_the_next_commits(proxy, s3_env, tmp_path, monkeypatch):  # noqa: F811
    cwd, tmp = _empty_dirs(tmp_path, monkeypatch)
    url = f"s3://{proxy.bucket}/{URL_PREFIX}"
    proxy.rules(damage_part=f"{URL_PREFIX}/iter_0000001/")  # one byte of the first part flipped, once
    w = torch.arange(10_000_000, dtype=torch.float32)  # 40 MB: two parts of the default 32 MiB
    with _manager(url, cache_bytes=64 << 20) as mgr:
        mgr.register("w", w)
        mgr.save(1, {"iteration": 1})
        with pytest.raises(CheckpointError, match="damaged in transit"):
            mgr.wait()
        keys = {o["Key"] for o in proxy.client.list_objects_v2(Bucket=proxy.bucket).get("Contents", [])}
        assert not any(k.startswith(f"{URL_PREFIX}/iter_0000001/") for k in keys), keys
        w.add_(1.0)
        mgr.save(2, {"iteration": 2})
        mgr.wait()
        assert mgr.latest_committed == 2
    assert _open_uploads(proxy.client, proxy.bucket) == []
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []
