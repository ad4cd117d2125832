"""The storage interface against a real S3 endpoint (moto's server, its own process): every
operation a tier needs, the bounds of the retries, and what never reaches a message."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import zlib

import numpy as np
import pytest

from datastates_megatron.engine.storage import (
    ObjectExistsError,
    ObjectMissingError,
    ObjectStorageError,
    Retry,
    open_storage,
    parse_url,
)
from datastates_megatron.engine.storage.s3 import MIN_PART_BYTES, S3Storage

from .conftest import DUMMY_KEY_ID, DUMMY_SECRET


def _storage(bucket: str, prefix: str = "run/ckpt", **kw) -> S3Storage:
    return open_storage(f"s3://{bucket}/{prefix}", part_bytes=MIN_PART_BYTES, concurrency=3, **kw)


def test_put_file_in_parts_then_get_and_ranged_get(bucket, s3_env):
    data = np.random.default_rng(0).integers(0, 256, 2 * MIN_PART_BYTES + 12345, dtype=np.uint8)
    paced = []
    with _storage(bucket) as st:
        receipt = st.put_file("iter_0000001/r00000-x-000000.dsck", data, pace=paced.append)
        assert receipt.size == data.nbytes and receipt.crc32 == zlib.crc32(data)
        assert sum(paced) == data.nbytes and len(paced) == 3  # three parts, each paced once
        assert st.get("iter_0000001/r00000-x-000000.dsck") == data.tobytes()
        assert st.get("iter_0000001/r00000-x-000000.dsck", 100, 5000) == data[100:5000].tobytes()
        out = bytearray(MIN_PART_BYTES + 7)  # across a part boundary
        assert st.get_into("iter_0000001/r00000-x-000000.dsck", MIN_PART_BYTES - 3, out) == len(out)
        assert bytes(out) == data[MIN_PART_BYTES - 3 : 2 * MIN_PART_BYTES + 4].tobytes()
        info = st.head("iter_0000001/r00000-x-000000.dsck")
        assert info.size == data.nbytes and info.etag
    raw = s3_env.client().get_object(Bucket=bucket, Key="run/ckpt/iter_0000001/r00000-x-000000.dsck")
    assert raw["ContentLength"] == data.nbytes  # under the prefix, nowhere else


def test_an_empty_and_a_tiny_file_upload(bucket):
    with _storage(bucket) as st:
        st.put_file("a", b"")
        st.put_file("b", b"xyz")
        assert st.get("a") == b"" and st.get("b") == b"xyz"


def test_conditional_create_refuses_an_existing_object(bucket):
    with _storage(bucket) as st:
        st.create("iter_0000002/manifest.json", b"first")
        with pytest.raises(ObjectExistsError, match=r"s3://.*/run/ckpt/iter_0000002/manifest.json"):
            st.create("iter_0000002/manifest.json", b"second")
        assert st.get("iter_0000002/manifest.json") == b"first"  # nothing replaced


def test_conditional_replace_and_delete_follow_the_tag(bucket):
    with _storage(bucket) as st:
        first = st.create("lock", b"a")
        second = st.replace_if("lock", b"b", first.etag)
        with pytest.raises(ObjectExistsError):
            st.replace_if("lock", b"c", first.etag)  # stale tag: someone else wrote since
        with pytest.raises(ObjectExistsError):
            st.delete("lock", etag=first.etag)
        assert st.get("lock") == b"b"
        st.delete("lock", etag=second.etag)
        assert st.head("lock") is None


def test_get_and_delete_of_a_missing_object(bucket):
    with _storage(bucket) as st:
        with pytest.raises(ObjectMissingError, match="run/ckpt/nothing"):
            st.get("nothing")
        st.delete("nothing")  # absent: not an error
        assert st.head("nothing") is None


def test_list_stays_under_the_prefix_and_pages(bucket, s3_env):
    c = s3_env.client()
    for k in ("run/ckpt-other/x", "run/ckptx", "elsewhere/y", "run/ckpt"):  # neighbours of the prefix
        c.put_object(Bucket=bucket, Key=k, Body=b"not ours")
    with _storage(bucket) as st:
        for i in range(1005):  # more than one page of 1000
            st.put_bytes(f"iter_{i:07d}/manifest.json", b"{}")
        keys = [o.key for o in st.list()]
        assert len(keys) == 1005 and keys[0] == "iter_0000000/manifest.json"
        assert [o.key for o in st.list("iter_0000007/")] == ["iter_0000007/manifest.json"]


def test_list_dirs_names_the_prefixes_one_level_down(bucket, tmp_path):
    for st in (_storage(bucket), open_storage(str(tmp_path / "save"))):
        for k in ("iter_0000002/manifest.json", "iter_0000002/r", "iter_0000010/r", "tracker", "a/b/c"):
            st.put_bytes(k, b"x")
        assert st.list_dirs() == ["a", "iter_0000002", "iter_0000010"]
        assert st.list_dirs("a/") == ["b"] and st.list_dirs("iter_0000002/") == []
        st.close()


def test_keys_that_leave_the_prefix_are_refused(bucket):
    with _storage(bucket) as st:
        for bad in ("../escape", "/abs", "a/./b"):
            with pytest.raises(ValueError):
                st.put_bytes(bad, b"x")


@pytest.mark.parametrize(
    "text",
    ["s3://AKIAXX:secret@bucket/x", "s3://Bad_Bucket/x", "s3://bucket/a/../b", "s3://bucket/x?y", "gs://bucket/x"],
)
def test_bad_urls_are_refused(text):
    with pytest.raises(ValueError) as e:
        parse_url(text)
    assert "secret" not in str(e.value)


def test_url_parsing():
    u = parse_url("s3://my-bucket//a/b/")
    assert (u.scheme, u.bucket, u.prefix, str(u)) == ("s3", "my-bucket", "a/b", "s3://my-bucket/a/b")
    assert parse_url("msc://train-profile/ckpt").bucket == "train-profile"


def _refusing_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused by the kernel


def test_unreachable_store_is_retried_a_bounded_number_of_times_then_named(s3_env, caplog):
    endpoint = f"http://127.0.0.1:{_refusing_port()}"
    caplog.set_level(logging.DEBUG)
    st = open_storage("s3://some-bucket/p", endpoint_url=endpoint, retry=Retry(attempts=3, base_s=0.01, cap_s=0.02))
    t0 = time.monotonic()
    with pytest.raises(ObjectStorageError) as e:
        st.put_bytes("iter_0000001/manifest.json", b"{}")
    assert time.monotonic() - t0 < 60
    assert "s3://some-bucket/p/iter_0000001/manifest.json" in str(e.value) and "after 3 tries" in str(e.value)
    assert e.value.key == "s3://some-bucket/p/iter_0000001/manifest.json"
    retried = [r for r in caplog.records if r.name.startswith("datastates_megatron") and "try" in r.getMessage()]
    assert len(retried) == 2
    for text in (str(e.value), *(r.getMessage() for r in caplog.records)):
        assert DUMMY_SECRET not in text
    st.close()


def test_a_store_that_never_answers_times_out_and_is_retried(s3_env):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        st = open_storage(
            "s3://some-bucket/p", endpoint_url=endpoint, read_timeout_s=0.3, retry=Retry(attempts=2, base_s=0.01)
        )
        with pytest.raises(ObjectStorageError, match=r"get failed after 2 tries: ReadTimeoutError"):
            st.get("iter_0000001/manifest.json")
        st.close()


def test_credentials_never_appear_in_errors_or_logs(bucket, s3_env, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="datastates_megatron")
    # an endpoint with user-info: what a message prints of it is scrubbed
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{DUMMY_KEY_ID}:{DUMMY_SECRET}@127.0.0.1:{_refusing_port()}")
    st = open_storage("s3://x-bucket/p", retry=Retry(attempts=2, base_s=0.01))
    with pytest.raises(ObjectStorageError) as e:
        st.get("k")
    with _storage(bucket, endpoint_url=s3_env.endpoint) as good, pytest.raises(ObjectMissingError) as missing:
        good.get("absent")
    for text in (str(e.value), str(missing.value), caplog.text):
        assert DUMMY_SECRET not in text and DUMMY_KEY_ID not in text
    st.close()


def test_posix_storage_has_the_same_contract(tmp_path):
    st = open_storage(str(tmp_path / "save"))
    data = os.urandom(100_000)
    st.put_file("iter_0000001/r", data)
    assert st.get("iter_0000001/r", 10, 20) == data[10:20]
    st.create("iter_0000001/manifest.json", b"m")
    with pytest.raises(ObjectExistsError):
        st.create("iter_0000001/manifest.json", b"n")
    os.symlink(tmp_path, tmp_path / "save" / "link")  # never listed, never followed
    assert [o.key for o in st.list()] == ["iter_0000001/manifest.json", "iter_0000001/r"]
    st.delete("iter_0000001/r")
    assert st.head("iter_0000001/r") is None


def test_an_msc_profile_of_s3_type_opens_its_bucket(bucket, s3_env, tmp_path, monkeypatch):
    config = {
        "profiles": {
            "train": {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": f"{bucket}/team",
                        "endpoint_url": s3_env.endpoint,
                        "region_name": "us-east-1",
                    },
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {"access_key": DUMMY_KEY_ID, "secret_key": DUMMY_SECRET},
                },
            },
            "blob": {"storage_provider": {"type": "azure", "options": {"base_path": "c"}}},
        }
    }
    (tmp_path / "msc.json").write_text(json.dumps(config))
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.json"))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)  # the profile alone says where and who
    with open_storage("msc://train/ckpt") as st:
        st.put_bytes("iter_0000001/manifest.json", b"{}")
        assert st.url("x") == f"s3://{bucket}/team/ckpt/x"
    got = s3_env.client().get_object(Bucket=bucket, Key="team/ckpt/iter_0000001/manifest.json")
    assert got["Body"].read() == b"{}"
    with pytest.raises(ObjectStorageError, match="storage provider 'azure'"):
        open_storage("msc://blob/x")
    with pytest.raises(ObjectStorageError, match="no profile 'nope'"):
        open_storage("msc://nope/x")
