"""The persistent tier on a real S3 endpoint (moto's server, its own process): the lease lock
between two jobs, promotion of local checkpoints (rank objects, then the manifest as one
conditional PUT, the tracker), retention manifest first, foreign objects never touched, and a
restore read back by ranged GETs, verified -- a damaged object refused by its checksums."""

from __future__ import annotations

import json
import os

import pytest
import torch

from datastates_megatron.engine.errors import (
    CommitError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    LockLostError,
    SaveDirBusyError,
)
from datastates_megatron.engine.format.manifest import Manifest, read_manifest
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.engine.load.reader import CheckpointReader, open_checkpoint
from datastates_megatron.engine.storage import ObjectChecksumError
from datastates_megatron.engine.storage.fetch import fetch_checkpoint
from datastates_megatron.engine.storage.lock import ObjectLock

from ..unit.rank_files import write_checkpoint
from .jobs import TOKEN, WORLD, Job as _Job, storage as _storage


# ---------------------------------------------------------------------- the lock
def test_a_second_job_is_refused_naming_the_holder(bucket, monkeypatch):
    monkeypatch.setenv("DSM_JOB_ID", "job-1")
    with _storage(bucket) as st, ObjectLock(st):
        monkeypatch.setenv("DSM_JOB_ID", "job-2")
        with pytest.raises(SaveDirBusyError) as e:
            ObjectLock(_storage(bucket)).acquire()
        assert f"pid {os.getpid()}" in str(e.value) and "job job-1" in str(e.value)
        assert "/job/save/.datastates.lock" in str(e.value)
    with _storage(bucket) as st, ObjectLock(st) as again:  # released: free for the next job
        assert again.held


def test_a_dead_holder_s_lease_runs_out_and_a_requeued_job_takes_its_own_lock(bucket, monkeypatch):
    now = [1000.0]
    monkeypatch.setenv("DSM_JOB_ID", "job-1")
    st = _storage(bucket)
    dead = ObjectLock(st, lease_s=60, clock=lambda: now[0]).acquire()
    dead._stop.set()  # a holder killed -9: never renews, never releases
    monkeypatch.setenv("DSM_JOB_ID", "job-2")
    with pytest.raises(SaveDirBusyError):
        ObjectLock(st, lease_s=60, clock=lambda: now[0]).acquire()
    monkeypatch.setenv("DSM_JOB_ID", "job-1")  # the same job, requeued: takes it at once
    requeued = ObjectLock(st, lease_s=60, clock=lambda: now[0]).acquire()
    with pytest.raises(LockLostError):
        dead.check()  # the dead incarnation, were it alive, would stop committing
    requeued._stop.set()
    monkeypatch.setenv("DSM_JOB_ID", "job-3")
    now[0] += 61  # the lease ran out
    other = ObjectLock(st, lease_s=60, clock=lambda: now[0]).acquire()
    with pytest.raises(LockLostError, match="replaced by another job"):
        requeued.check()
    other.release()
    st.close()


# ---------------------------------------------------------------------- promotion and commit
def _keys(client, bucket: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            out[o["Key"]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_promotion_commits_on_s3_and_retention_deletes_only_ours(bucket, s3_env, tmp_path):
    local = str(tmp_path / "local")
    for it in (1, 2, 3):
        write_checkpoint(local, it, WORLD, TOKEN, numel=300_000)  # 1.2 MB per rank file
    c = s3_env.client()
    foreign = {
        "job/save/notes.txt": b"a user's notes",
        "job/other/iter_0000009/manifest.json": b"outside our prefix",
    }
    for k, v in foreign.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)
    job = _Job(bucket, local, keep_last=2)
    try:
        assert job.promote(1) == [[1]] * WORLD
        # someone else's object under an iteration retention will delete
        foreign["job/save/iter_0000001/README"] = b"not ours"
        c.put_object(Bucket=bucket, Key="job/save/iter_0000001/README", Body=b"not ours")
        objects = _keys(c, bucket)
        for r in range(WORLD):  # each rank object is the local file, byte for byte
            name = rank_file_name(r, TOKEN, 1)
            with open(os.path.join(iter_dir(local, 1), name), "rb") as f:
                assert objects[f"job/save/iter_0000001/{name}"] == f.read()
        m = Manifest.from_json(objects["job/save/iter_0000001/manifest.json"], "m")
        assert (m.iteration, m.world_size, m.commit_seq) == (1, WORLD, 0)
        assert objects["job/save/latest_checkpointed_iteration.txt"] == b"1"
        assert job.promote(2) == [[2]] * WORLD and job.promote(3) == [[3]] * WORLD
        objects = _keys(c, bucket)
        assert "job/save/iter_0000001/manifest.json" not in objects  # retention: keep_last=2
        assert not [k for k in objects if k.startswith("job/save/iter_0000001/r")]
        assert {"job/save/iter_0000002/manifest.json", "job/save/iter_0000003/manifest.json"} <= objects.keys()
        assert objects["job/save/latest_checkpointed_iteration.txt"] == b"3"
        for k, v in foreign.items():  # never deleted nor overwritten
            assert objects[k] == v
        assert json.loads(objects["job/save/.datastates.lock"])["pid"] == os.getpid()
    finally:
        job.close()
    assert ".datastates.lock" not in {k.rsplit("/", 1)[-1] for k in _keys(c, bucket)}  # released


def test_a_manifest_is_not_written_once_the_lock_is_lost(bucket, s3_env, tmp_path):
    local = str(tmp_path / "local")
    write_checkpoint(local, 1, WORLD, TOKEN, numel=1000)
    job = _Job(bucket, local)
    try:
        s3_env.client().delete_object(Bucket=bucket, Key="job/save/.datastates.lock")  # an operator, another job
        out = job.promote(1)
        assert isinstance(out[0], CommitError) and "lock object was removed" in str(out[0])
        assert isinstance(out[1], CommitError)
        keys = _keys(s3_env.client(), bucket)
        assert "job/save/iter_0000001/manifest.json" not in keys
        assert not [k for k in keys if k.startswith("job/save/iter_0000001/")]  # the save's objects removed
    finally:
        job.close()


def test_start_up_removes_our_leftovers_and_keeps_the_rest(bucket, s3_env, tmp_path):
    c = s3_env.client()
    ours = f"job/save/iter_0000005/{rank_file_name(0, TOKEN, 1)}"  # a promotion cut short: no manifest
    c.put_object(Bucket=bucket, Key=ours, Body=b"partial")
    c.put_object(Bucket=bucket, Key="job/save/README", Body=b"a user's")
    job = _Job(bucket, str(tmp_path / "local"))
    job.close()
    keys = _keys(c, bucket)
    assert ours not in keys and keys["job/save/README"] == b"a user's"


def test_a_newer_checkpoint_we_did_not_write_is_refused_before_the_lock(bucket, s3_env, tmp_path):
    c = s3_env.client()
    c.put_object(Bucket=bucket, Key="job/save/iter_0000004/.metadata", Body=b"torch_dist")  # Megatron's own
    with pytest.raises(ForeignCheckpointError, match=r"iter_0000004: holds objects we did not write \(.metadata\)"):
        _Job(bucket, str(tmp_path / "local"))
    assert set(_keys(c, bucket)) == {"job/save/iter_0000004/.metadata"}  # nothing written, no lock taken


# ---------------------------------------------------------------------- restore
def test_restore_reads_back_bit_exact_and_a_damaged_object_is_refused(bucket, s3_env, tmp_path):
    local = str(tmp_path / "local")
    write_checkpoint(local, 1, WORLD, TOKEN, numel=300_000)
    job = _Job(bucket, local)
    try:
        assert job.promote(1) == [[1]] * WORLD
    finally:
        job.close()
    with _storage(bucket) as st:
        d, m = fetch_checkpoint(st, 1, str(tmp_path / "fetched"), ranks=[1], threads=3)
        assert read_manifest(d).commit_seq == m.commit_seq
        ckpt, manifest = open_checkpoint(str(tmp_path / "fetched"), 1)
        with CheckpointReader(ckpt, manifest, rank=1) as reader:
            got = reader.rank_file(1).tensor("w")
            assert torch.equal(got, torch.full((300_000,), 1.0)) and reader.objects(1) == {"rank": 1}
        # one byte of rank 0's object changed in the bucket (the store's damage, not a transfer's)
        key = f"job/save/iter_0000001/{rank_file_name(0, TOKEN, 1)}"
        c = s3_env.client()
        raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[4096 + 100_000] ^= 0x01
        c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
        with pytest.raises(ObjectChecksumError) as e:
            fetch_checkpoint(st, 1, str(tmp_path / "fetched2"), ranks=[0])
        assert isinstance(e.value, CorruptCheckpointError)
        assert f"s3://{bucket}/{key}" in str(e.value) and "rank 0" in str(e.value) and "'w'" in str(e.value)
        assert os.listdir(iter_dir(str(tmp_path / "fetched2"), 1)) == []  # nothing left behind
