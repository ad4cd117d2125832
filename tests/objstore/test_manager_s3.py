"""``CheckpointManager`` with its save location on S3 (the local server): saves land on the
node-local tier, the promotion uploads them, the persistent commit is in the bucket; a restart on a
node whose local directory is gone restores from the bucket, bit-exact."""

from __future__ import annotations

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.errors import CorruptCheckpointError, NoCheckpointError
from datastates_megatron.engine.manager import CheckpointManager


def _manager(url: str, local: str, **kw) -> CheckpointManager:
    return CheckpointManager(
        url, EngineOptions(cache_bytes=4 << 20, timeout_s=60), local_root=local, persist_interval=1, **kw
    )


def test_save_to_s3_then_restore_on_a_fresh_node(bucket, s3_env, tmp_path):
    url = f"s3://{bucket}/run1"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(400_000, generator=g)
    with _manager(url, str(tmp_path / "node-a"), keep_last=2) as mgr:
        mgr.register("w", w)
        for it in (1, 2, 3):
            w.add_(1.0)
            mgr.save(it, {"iteration": it})
            mgr.wait(persist=True)
        expected = w.clone()
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "run1/iter_0000003/manifest.json" in keys and "run1/iter_0000002/manifest.json" in keys
    assert "run1/iter_0000001/manifest.json" not in keys  # keep_last=2 on the bucket
    assert "run1/latest_checkpointed_iteration.txt" in keys and "run1/.datastates.run" in keys
    assert "run1/.datastates.lock" not in keys  # released at close

    fresh = torch.zeros_like(w)
    with _manager(url, str(tmp_path / "node-b")) as mgr:  # another node: no local copy
        mgr.register("w", fresh)
        with pytest.raises(NoCheckpointError, match="iter_0000007"):
            mgr.choose(7)
        choice = mgr.choose()  # the one decision: rank 0 listed the bucket and read the manifest object
        assert choice.tier == "persistent" and choice.source == "persistent" and choice.iteration == 3
        assert choice.manifest.iteration == 3 and choice.layout == {} and choice.view.file_of(0) is not None
        result = mgr.load(choice)
        assert mgr.committed() == [2, 3]
    assert result.iteration == 3 and result.objects == {"iteration": 3}
    assert result.root == url  # read from the bucket: this rank's object fetched to node-b, verified
    assert [p.name for p in (tmp_path / "node-b").glob("run-*/fetched/iter_0000003/*")] == [
        k.rsplit("/", 1)[1] for k in keys if k.startswith("run1/iter_0000003/r")
    ]
    assert torch.equal(fresh, expected)
    with _manager(url, str(tmp_path / "node-b")) as mgr:  # again, for iteration 2: 3's copy goes
        mgr.register("w", fresh)
        assert mgr.load(2).iteration == 2
    assert [p.name for p in (tmp_path / "node-b").glob("run-*/fetched/*")] == ["iter_0000002"]

    # one byte of the newest rank object changed in the bucket: the restore refuses it, untouched
    c = s3_env.client()
    key = next(
        k["Key"]
        for k in c.list_objects_v2(Bucket=bucket, Prefix="run1/iter_0000003/")["Contents"]
        if k["Key"].endswith(".dsck")
    )
    raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[4096 + 123] ^= 0x10
    c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    untouched = torch.full_like(w, 7.0)
    with _manager(url, str(tmp_path / "node-c")) as mgr:
        mgr.register("w", untouched)
        with pytest.raises(CorruptCheckpointError, match=f"s3://{bucket}/{key}"):
            mgr.load()
    assert torch.equal(untouched, torch.full_like(w, 7.0))


def test_the_global_index_object_holds_the_manifests_records(bucket, s3_env, tmp_path):
    """Rank 0's commit to the bucket writes the index object (format 2) with the manifest's
    records in it, as on a file system (read back here from a downloaded copy)."""
    import os

    from datastates_megatron.engine.format.global_index import read_index
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.names import INDEX_NAME, MANIFEST_NAME
    from datastates_megatron.megatron.checkpointing.reshard import index_summary

    url = f"s3://{bucket}/run2"
    w = torch.arange(16, dtype=torch.float32)
    meta = {"kind": "param_shard", "identity": 2, "chunk": 0, "params": [["w", [16], "float32", 0, 16, 0]]}
    with _manager(url, str(tmp_path / "node"), summarize=index_summary) as mgr:
        mgr.register("w", w, meta=meta)
        mgr.save(1, {"iteration": 1})
        mgr.wait(persist=True)
    got = tmp_path / "got" / "iter_0000001"
    got.mkdir(parents=True)
    c = s3_env.client()
    for name in (MANIFEST_NAME, INDEX_NAME):
        (got / name).write_bytes(c.get_object(Bucket=bucket, Key=f"run2/iter_0000001/{name}")["Body"].read())
    manifest = read_manifest(str(got))
    gi = read_index(str(got), manifest)
    try:
        assert gi.record(0) == manifest.record(0) and os.path.basename(gi.path) == INDEX_NAME
        assert [p[0] for p in gi.pieces('["", 0, "w", "param"]', 0, 16)] == [0]
    finally:
        gi.close()
