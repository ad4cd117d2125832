"""LazyCheckpointer over a megatron-core GPT on 2 CPU ranks, saving to S3 (the local server) through
its node-local tier, resumed on a node with an empty local directory: the restore comes from the
bucket, and at iteration 6 every parameter and optimizer state equals a run that never stopped."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.distributed.ranks import describe, run_ranks  # noqa: E402

WORKER = "tests.workers.lazy_worker"


def test_lazy_checkpointer_saves_to_s3_and_resumes_bit_exact_on_a_fresh_node(bucket, s3_env, tmp_path):
    url = f"s3://{bucket}/gpt"
    straight = run_ranks(WORKER, 2, ["held_state", "--phase", "straight", "--save", str(tmp_path / "unused")])
    assert all(r["returncode"] == 0 for r in straight), describe(straight)
    saved = run_ranks(WORKER, 2, ["held_state", "--phase", "save", "--save", url, "--local", str(tmp_path / "a")])
    assert all(r["returncode"] == 0 for r in saved), describe(saved)
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "gpt/iter_0000003/manifest.json" in keys
    resumed = run_ranks(WORKER, 2, ["held_state", "--phase", "resume", "--save", url, "--local", str(tmp_path / "b")])
    assert all(r["returncode"] == 0 for r in resumed), describe(resumed)
    for want, got in zip((r["result"] for r in straight), (r["result"] for r in resumed)):
        assert got["digest"] == want["digest"]
        assert got["probe"] == want["probe"]
