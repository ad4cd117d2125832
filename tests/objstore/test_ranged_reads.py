"""Reading part of a checkpoint in a bucket (:mod:`datastates_megatron.engine.storage.ranges`): the
reader fetches by ranged GETs a rank object's header and metadata when it opens it, then only the
checksum chunks a read touches, each verified before use -- a damaged chunk the read does not touch
is never fetched, one it touches is refused naming the bucket, rank and tensor."""

from __future__ import annotations

import os

import pytest
import torch

from datastates_megatron.engine.errors import CorruptCheckpointError
from datastates_megatron.engine.format.file_format import HEADER_BYTES
from datastates_megatron.engine.load.load_plan import ElementRange
from datastates_megatron.engine.load.reader import CheckpointReader
from datastates_megatron.engine.names import rank_file_name
from datastates_megatron.engine.storage.fetch import fetch_manifest
from datastates_megatron.engine.storage.ranges import RangeFetcher, coalesce

from ..unit.rank_files import write_checkpoint
from .jobs import TOKEN, WORLD, Job, storage

NUMEL = 1_000_000  # 4 MB per rank object: several checksum chunks


def _promoted(bucket: str, tmp_path) -> None:
    local = str(tmp_path / "local")
    write_checkpoint(local, 1, WORLD, TOKEN, numel=NUMEL)
    job = Job(bucket, local)
    try:
        assert job.promote(1) == [[1]] * WORLD
    finally:
        job.close()


def _reader(st, d: str):
    m = fetch_manifest(st, 1)
    os.makedirs(d)
    fetcher = RangeFetcher(st, m, d, threads=2)
    return fetcher, CheckpointReader(d, m, rank=0, fetcher=fetcher, threads=2)


def test_coalesce_merges_touching_spans():
    assert coalesce([(10, 20), (0, 5), (20, 30), (40, 41), (5, 5)]) == [(0, 5), (10, 30), (40, 41)]
    assert coalesce([(0, 5), (8, 9)], gap=3) == [(0, 9)]


def test_a_read_fetches_the_metadata_and_the_chunks_it_touches_only(bucket, s3_env, tmp_path):
    _promoted(bucket, tmp_path)
    with storage(bucket) as st:
        fetcher, reader = _reader(st, str(tmp_path / "a"))
        with reader:
            rf = reader.rank_file(1)
            opened = fetcher.fetched_bytes
            h = rf.header
            assert opened == HEADER_BYTES + h.index_bytes + h.objects_bytes
            cb, e = h.chunk_bytes, rf.entries["w"]
            assert e.nbytes >= 3 * cb  # several chunks: the test can tell one from all
            got = reader.read(ElementRange(1, "w", cb // 4 + 3, 5))  # inside chunk 1
            assert torch.equal(got, torch.full((5,), 1.0))
            assert fetcher.fetched_bytes - opened == cb  # one chunk, not the object
            assert reader.opened == {1}  # rank 0's object: not a byte of it
            assert fetcher.fetched_bytes < h.file_bytes // 2


def test_a_damaged_chunk_is_refused_only_when_read(bucket, s3_env, tmp_path):
    _promoted(bucket, tmp_path)
    key = f"job/save/iter_0000001/{rank_file_name(1, TOKEN, 1)}"
    c = s3_env.client()
    with storage(bucket) as st:
        fetcher, reader = _reader(st, str(tmp_path / "a"))
        with reader:
            rf = reader.rank_file(1)
            cb, e = rf.header.chunk_bytes, rf.entries["w"]
        raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[e.offset + 2 * cb + 7] ^= 0x01  # chunk 2 of 'w': the store's damage
        c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
        fetcher, reader = _reader(st, str(tmp_path / "b"))
        with reader:
            assert torch.equal(reader.read(ElementRange(1, "w", 0, 100)), torch.full((100,), 1.0))  # chunk 0
            with pytest.raises(CorruptCheckpointError) as err:
                reader.read(ElementRange(1, "w", 2 * cb // 4, 10))
        text = str(err.value)
        assert "rank 1" in text and "'w'" in text and "chunk 2" in text and f"s3://{bucket}/job/save" in text
