"""A commit on object storage and its retention send as many requests with 200 checkpoints kept as
with 10: the tier knows what it committed (one survey at start-up), so neither a listing of every
``iter_*`` prefix nor a HEAD of every kept manifest is sent at each commit.  Requests are counted by
a botocore event hook on the job's own clients (every request our process sends); the server is
moto's, in its own process."""

from __future__ import annotations

import collections
import dataclasses


from datastates_megatron.engine.format.manifest import Manifest
from datastates_megatron.engine.names import LOCK_NAME

from ..unit.rank_files import write_checkpoint
from .jobs import TOKEN, WORLD, Job

PREFIX = "job/save/"


def _seed(client, bucket: str, local: str, kept: int) -> None:
    """``kept`` committed checkpoints (iterations 1..kept) in the bucket: iteration 1 promoted by a
    job, the others its server-side copies with their own manifests."""
    write_checkpoint(local, 1, WORLD, TOKEN, numel=1000)
    job = Job(bucket, local)
    try:
        assert job.promote(1) == [[1]] * WORLD
    finally:
        job.close()
    first = f"{PREFIX}iter_0000001/"
    m = Manifest.from_json(client.get_object(Bucket=bucket, Key=first + "manifest.json")["Body"].read(), "m")
    for it in range(2, kept + 1):
        d = f"{PREFIX}iter_{it:07d}/"
        for r in m.ranks:
            client.copy_object(Bucket=bucket, Key=d + r.file, CopySource={"Bucket": bucket, "Key": first + r.file})
        body = dataclasses.replace(m, iteration=it, commit_seq=it - 1).to_json()
        client.put_object(Bucket=bucket, Key=d + "manifest.json", Body=body)


def _count_requests(job: Job) -> collections.Counter:
    """Every S3 request the job's clients send from now on, by operation (the lock's renewals,
    timed by the clock, left out)."""
    sent: collections.Counter = collections.Counter()

    def hook(params, model, **_):
        if not str(params.get("Key", "")).endswith(LOCK_NAME):
            sent[model.name] += 1

    for st in job.storages:
        st._client.meta.events.register("before-parameter-build.s3", hook)
    return sent


def _one_commit(bucket: str, client, tmp_path, kept: int) -> collections.Counter:
    local = str(tmp_path / f"local{kept}")
    _seed(client, bucket, local, kept)
    for it in (kept + 1, kept + 2):
        write_checkpoint(local, it, WORLD, TOKEN, numel=1000)
    job = Job(bucket, local, keep_last=kept)
    try:
        assert job.promote(kept + 1) == [[kept + 1]] * WORLD  # retention deletes iteration 1
        sent = _count_requests(job)
        assert job.promote(kept + 2) == [[kept + 2]] * WORLD  # and this one iteration 2
        sent = collections.Counter(sent)
    finally:
        job.close()
    keys = [
        o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page["Contents"]
    ]
    iterations = {k[len(PREFIX) :].split("/")[0] for k in keys if k.startswith(PREFIX + "iter_")}
    assert iterations == {f"iter_{it:07d}" for it in range(3, kept + 3)}  # retention did its work
    return sent


def test_a_commit_and_its_retention_send_the_same_requests_at_10_and_200_checkpoints_kept(s3_env, tmp_path):
    counts = {}
    for kept in (10, 200):
        bucket = f"dsm-requests-{kept}"
        client = s3_env.client()
        client.create_bucket(Bucket=bucket)
        counts[kept] = _one_commit(bucket, client, tmp_path, kept)
    assert counts[10] == counts[200], counts
    assert counts[10]["DeleteObject"] >= 1 + WORLD  # a checkpoint was deleted in the counted commit
    assert counts[10]["HeadObject"] <= 8, counts  # not one per kept manifest
