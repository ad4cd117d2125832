"""Four CPU ranks as two "nodes" with their save location on S3 (the local server): the promotion
uploads every rank's file, rank 0 commits the manifest in the bucket, and after node 1 is replaced
(its local directory gone) every rank restores from the bucket -- rank 0 reading the manifest
once, each rank fetching its own object -- bit-exact."""

from __future__ import annotations

import shutil

from ..distributed.ranks import describe, run_ranks

WORKER = "tests.workers.manager_worker"
NODES = {"LOCAL_WORLD_SIZE": "2"}


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    return [r["result"] for r in results]


def test_four_ranks_save_to_s3_and_restore_from_it_after_a_node_is_lost(bucket, s3_env, tmp_path):
    url = f"s3://{bucket}/job"
    args = ["--root", url, "--local-root", str(tmp_path / "local{node}"), "--replicas", "0"]
    _ok(run_ranks(WORKER, 4, ["save", *args, "--iters", "4", "--persist-interval", "2", "--keep-last", "1"], env=NODES))
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "job/iter_0000004/manifest.json" in keys and "job/iter_0000002/manifest.json" not in keys
    assert len([k for k in keys if k.startswith("job/iter_0000004/r")]) == 4

    shutil.rmtree(tmp_path / "local1")  # node 1 replaced: every rank falls back to the bucket
    loaded = _ok(run_ranks(WORKER, 4, ["load", *args], env=NODES))
    assert all(r["iteration"] == 4 and r["exact"] and r["root"] == url for r in loaded), loaded
