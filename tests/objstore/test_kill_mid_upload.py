"""A job killed with SIGKILL in the middle of a promotion's upload to S3, then restarted on the same
node: nothing of the cut-short upload is committed, the restart takes its own job's lock at once,
resumes bit-exact from the newest local checkpoint and promotes it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager

_CHILD = textwrap.dedent(
    """
    import sys, torch
    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.manager import CheckpointManager

    url, local = sys.argv[1], sys.argv[2]
    w = torch.full((2_000_000,), 1.0)  # 8 MB
    opts = EngineOptions(cache_bytes=16 << 20, timeout_s=600)
    with CheckpointManager(url, opts, local_root=local, persist_interval=1) as mgr:
        mgr.register("w", w)
        mgr.save(1, {"iteration": 1})
        mgr.wait(persist=True)
    # the same job goes on with its promotions paced to 0.05 MB/s: the upload of iteration 2 stays
    # open for minutes, and is killed in the middle
    mgr = CheckpointManager(url, opts, local_root=local, persist_interval=1, promote_mbps=0.05)
    mgr.register("w", w)
    w.fill_(2.0)
    mgr.save(2, {"iteration": 2})
    mgr.wait(persist=True)
    """
)


def _open_uploads(client, bucket: str, prefix: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ())]


def _keys(client, bucket: str) -> set[str]:
    return {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", ())}


def test_kill_9_mid_upload_then_resume(bucket, s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("DSM_JOB_ID", "slurm-4242")  # kept across a requeue, as Slurm keeps it
    url, local = f"s3://{bucket}/run", str(tmp_path / "local")
    c = s3_env.client()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, local], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while not _open_uploads(c, bucket, "run/iter_0000002/"):  # a condition, polled with a deadline
            assert child.poll() is None, "the job ended before its upload of iteration 2 was seen"
            assert time.monotonic() < deadline, "no upload of iteration 2 began"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    keys = _keys(c, bucket)
    assert "run/iter_0000001/manifest.json" in keys and "run/iter_0000002/manifest.json" not in keys
    assert "run/.datastates.lock" in keys  # the dead job's lease

    w = torch.zeros(2_000_000)
    with CheckpointManager(url, EngineOptions(cache_bytes=16 << 20, timeout_s=120), local_root=local) as mgr:
        mgr.register("w", w)
        result = mgr.load()  # the newest local checkpoint (2), newer than the bucket's (1)
        assert result.iteration == 2 and result.objects == {"iteration": 2}
        assert torch.equal(w, torch.full_like(w, 2.0))
        mgr.wait(persist=True)
    assert not _open_uploads(c, bucket, "run/")  # the dead job's unfinished upload aborted at start-up
    keys = _keys(c, bucket)
    assert "run/iter_0000002/manifest.json" in keys  # promoted again by the restart
    assert "run/.datastates.lock" not in keys and "run/latest_checkpointed_iteration.txt" in keys
    rank_objects = sorted(k for k in keys if k.startswith("run/iter_0000002/") and k.endswith(".dsck"))
    assert len(rank_objects) == 1  # nothing of the cut-short upload is left visible
