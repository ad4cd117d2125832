"""What the POSIX fault tests check, on a bucket of the local S3 server: rolling back, a deletion
the store refuses, and objects another client deletes while we list them.  The refusal and the other
client are a proxy process in front of the server (:mod:`.s3_proxy`); nothing is mocked in ours."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.errors import CorruptCheckpointError
from datastates_megatron.engine.manager import CheckpointManager

from .conftest import _answers, _free_port

URL_PREFIX = "run"


class Proxy:
    """The proxy process (started here, ended by its pid) and its rules file."""

    def __init__(self, upstream: str, tmp_path) -> None:
        self.rules_path = tmp_path / "proxy-rules.json"
        self.rules()
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.objstore.s3_proxy", str(self.port), upstream, str(self.rules_path)]
        )
        deadline = time.monotonic() + 60
        while not _answers(self.port):  # polls a condition with a deadline: up, or it failed
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the S3 proxy did not start on port {self.port}")
            time.sleep(0.05)

    def rules(self, **rules) -> None:
        self.rules_path.write_text(json.dumps(rules))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def proxy(s3_env, bucket, tmp_path, monkeypatch):
    p = Proxy(s3_env.endpoint, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)  # the job's requests go through it
    p.bucket = bucket
    p.client = s3_env.client()  # the server's, not through the proxy
    try:
        yield p
    finally:
        p.stop()


def _manager(url: str, local: str, **kw) -> CheckpointManager:
    return CheckpointManager(url, EngineOptions(cache_bytes=1 << 20, timeout_s=60), local_root=local, **kw)


def _keys(client, bucket: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            out[o["Key"]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def _manifests(client, bucket: str) -> list[int]:
    return sorted(int(k.split("/")[1][5:]) for k in _keys(client, bucket) if k.endswith("/manifest.json"))


# ---------------------------------------------------------------------- rolling back
def _run(url, local, iterations, value, load=None):
    w = torch.zeros(1000)
    with _manager(url, local, keep_last=0, persist_interval=4, local_keep_last=2) as mgr:
        mgr.register("w", w)
        if load is not None:
            assert mgr.load(load).iteration == load and w[0].item() == load
        for it in iterations:
            w.fill_(value(it))
            mgr.save(it)
            mgr.wait()


def test_rollback_on_s3_sticks_from_the_new_runs_first_persistent_commit(bucket, s3_env, tmp_path):
    url, local = f"s3://{bucket}/{URL_PREFIX}", str(tmp_path / "local")
    _run(url, local, range(1, 11), float)  # run A: 1..10; 4 and 8 promoted, 10 at its end
    _run(url, local, (5, 6, 7, 8), lambda it: 100.0 + it, load=4)  # run B rolls back to 4; its 8 promoted
    w = torch.zeros(1000)
    with _manager(url, str(tmp_path / "fresh-node"), persist_interval=4) as mgr:  # from the bucket alone
        mgr.register("w", w)
        assert mgr.load().iteration == 8
    assert torch.equal(w, torch.full((1000,), 108.0))  # run B's 8, not run A's 8 or 10


# ---------------------------------------------------------------------- a refused deletion
def test_a_deletion_the_store_refuses_is_logged_keeps_the_commit_and_is_retried(proxy, s3_env, tmp_path, caplog):
    url = f"s3://{proxy.bucket}/{URL_PREFIX}"
    c = s3_env.client()
    proxy.rules(refuse_delete=[f"{URL_PREFIX}/iter_"])  # a policy denying DeleteObject under iter_*
    w = torch.zeros(1000)
    with _manager(url, str(tmp_path / "node"), keep_last=1, persist_interval=1) as mgr:
        mgr.register("w", w)
        with caplog.at_level(logging.WARNING, logger="datastates_megatron"):
            for it in (1, 2, 3):
                w.fill_(float(it))
                mgr.save(it)
                assert [r.iteration for r in mgr.wait() if r.tier == "persistent"] == [it]
                if it == 1:  # someone else's object under an iteration retention deletes
                    c.put_object(Bucket=proxy.bucket, Key=f"{URL_PREFIX}/iter_0000001/README", Body=b"not ours")
        assert _manifests(c, proxy.bucket) == [1, 2, 3]  # refused: every commit stays, none failed
        assert f"retention of {url} after iteration 2 failed" in caplog.text
        assert f"{url}/iter_0000001/manifest.json: delete failed: S3 AccessDenied (HTTP 403)" in caplog.text
        proxy.rules()  # the policy is lifted: the next commit's retention catches up
        w.fill_(4.0)
        mgr.save(4)
        mgr.wait()
    keys = _keys(c, proxy.bucket)
    assert _manifests(c, proxy.bucket) == [4]
    assert not [k for k in keys if k.startswith(tuple(f"{URL_PREFIX}/iter_000000{i}/r" for i in (1, 2, 3)))]
    assert keys[f"{URL_PREFIX}/iter_0000001/README"] == b"not ours"
    fresh = torch.zeros(1000)
    with _manager(url, str(tmp_path / "fresh-node")) as mgr:
        mgr.register("w", fresh)
        assert mgr.load().iteration == 4
    assert torch.equal(fresh, torch.full((1000,), 4.0))


# ---------------------------------------------------------------------- objects vanishing while listed
def _save_three(url, local) -> None:
    w = torch.zeros(1000)
    with _manager(url, local, keep_last=0, persist_interval=1) as mgr:
        mgr.register("w", w)
        for it in (1, 2, 3):
            w.fill_(float(it))
            mgr.save(it)
            mgr.wait()


def test_a_manifest_deleted_between_the_listing_and_its_read_is_skipped_whole(proxy, s3_env, tmp_path):
    url = f"s3://{proxy.bucket}/{URL_PREFIX}"
    _save_three(url, str(tmp_path / "node-a"))
    c = s3_env.client()
    foreign = {f"{URL_PREFIX}/iter_0000002/README": b"not ours", f"{URL_PREFIX}/notes": b"a user's"}
    for k, v in foreign.items():
        c.put_object(Bucket=proxy.bucket, Key=k, Body=v)
    # another client (an operator, another job's retention) deletes 3's manifest right after our
    # first listing of the save prefix: the start-up survey lists iteration 3, its manifest is gone
    proxy.rules(vanish_after_list={"prefix": f"{URL_PREFIX}/", "delete": [f"{URL_PREFIX}/iter_0000003/manifest.json"]})
    w = torch.full((1000,), -1.0)
    with _manager(url, str(tmp_path / "node-b")) as mgr:  # a fresh node: from the bucket
        mgr.register("w", w)
        result = mgr.load()
    assert result.iteration == 2 and torch.equal(w, torch.full((1000,), 2.0))  # the older one, whole
    keys = _keys(c, proxy.bucket)
    assert f"{URL_PREFIX}/iter_0000003/manifest.json" not in keys  # the rule fired
    # 3's rank objects, ours and now uncommitted, were removed at start-up as leftovers
    assert not [k for k in keys if k.startswith(f"{URL_PREFIX}/iter_0000003/")]
    for k, v in foreign.items():  # never deleted what we did not write
        assert keys[k] == v


def test_retention_finds_a_manifest_already_deleted_and_deletes_only_our_objects(proxy, s3_env, tmp_path, caplog):
    url = f"s3://{proxy.bucket}/{URL_PREFIX}"
    c = s3_env.client()
    # retention of iteration 1 lists its prefix; right then another client deletes its manifest
    proxy.rules(
        vanish_after_list={
            "prefix": f"{URL_PREFIX}/iter_0000001/",
            "delete": [f"{URL_PREFIX}/iter_0000001/manifest.json"],
        }
    )
    w = torch.zeros(1000)
    with _manager(url, str(tmp_path / "node"), keep_last=1, persist_interval=1) as mgr:
        mgr.register("w", w)
        with caplog.at_level(logging.INFO, logger="datastates_megatron"):
            for it in (1, 2):
                w.fill_(float(it))
                mgr.save(it)
                mgr.wait()
                if it == 1:  # someone else's object under the iteration retention deletes
                    c.put_object(Bucket=proxy.bucket, Key=f"{URL_PREFIX}/iter_0000001/README", Body=b"not ours")
    keys = _keys(c, proxy.bucket)
    assert _manifests(c, proxy.bucket) == [2]
    assert sorted(k for k in keys if k.startswith(f"{URL_PREFIX}/iter_0000001/")) == [
        f"{URL_PREFIX}/iter_0000001/README"
    ]
    assert f"retention deleted {url}/iter_0000001" in caplog.text


def test_a_rank_object_deleted_after_the_listing_fails_the_load_whole_naming_it(proxy, s3_env, tmp_path):
    url = f"s3://{proxy.bucket}/{URL_PREFIX}"
    _save_three(url, str(tmp_path / "node-a"))
    c = s3_env.client()
    rank_key = next(k for k in _keys(c, proxy.bucket) if k.startswith(f"{URL_PREFIX}/iter_0000003/r"))
    proxy.rules(vanish_after_list={"prefix": f"{URL_PREFIX}/", "delete": [rank_key]})
    w = torch.full((1000,), -1.0)
    with _manager(url, str(tmp_path / "node-b")) as mgr:  # a fresh node: it must fetch the object
        mgr.register("w", w)
        with pytest.raises(CorruptCheckpointError, match="rank 0 object is missing") as e:
            mgr.load()  # the newest, committed, lost an object: refused, not silently an older one
    assert f"s3://{proxy.bucket}/{rank_key}" in str(e.value), e.value
    assert torch.equal(w, torch.full((1000,), -1.0))  # no tensor written: never a partial restore
    assert rank_key not in _keys(c, proxy.bucket)  # the rule fired


def test_a_part_damaged_in_transit_never_becomes_the_object(proxy, s3_env):
    """One byte of one part flipped between us and the store: the store's object is never taken for
    the source -- the upload fails naming the object and leaves nothing, or it is re-sent whole."""
    import numpy as np

    from datastates_megatron.engine.storage import ObjectChecksumError, open_storage
    from datastates_megatron.engine.storage.s3 import MIN_PART_BYTES

    data = np.random.default_rng(1).integers(0, 256, 2 * MIN_PART_BYTES + 777, dtype=np.uint8)
    proxy.rules(damage_part=f"{URL_PREFIX}/iter_0000001/")
    key = "iter_0000001/r00000-x-000000.dsck"
    c = s3_env.client()
    with open_storage(f"s3://{proxy.bucket}/{URL_PREFIX}", part_bytes=MIN_PART_BYTES, concurrency=3) as st:
        with pytest.raises(ObjectChecksumError, match="damaged in transit") as e:
            st.put_file(key, data)
    assert f"s3://{proxy.bucket}/{URL_PREFIX}/{key}" in str(e.value)
    assert f"{URL_PREFIX}/{key}" not in _keys(c, proxy.bucket)  # nothing left that could be committed
