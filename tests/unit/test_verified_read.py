"""The restore's read-and-verify pass and its copy into live tensors (engine/load/verified_read.py)."""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError
from datastates_megatron.engine.load import verified_read
from datastates_megatron.engine.format.hashing import xxh64
from datastates_megatron.engine.load.verified_read import ChunkSpan, copy_into, read_and_verify


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 50_000, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield str(path), fd, data
    os.close(fd)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_every_span_is_read_and_hashed_across_block_boundaries(data_file, monkeypatch, threads):
    path, fd, data = data_file
    monkeypatch.setattr(verified_read, "BLOCK", 96)  # many blocks per span, a ragged last one
    bounds = [(0, 1000), (1000, 1), (1001, 4095), (7000, 20_000), (30_000, 20_000), (27_000, 0)]
    spans = [ChunkSpan((0, "t", i), off, n) for i, (off, n) in enumerate(bounds)]
    with cf.ThreadPoolExecutor(threads) as pool:
        got = read_and_verify(fd, path, spans, pool, threads)
    assert got == [xxh64(data[off : off + n]) for off, n in bounds]


def test_a_span_past_the_end_of_the_file_is_corrupt(data_file):
    path, fd, _ = data_file
    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(CorruptCheckpointError, match=r"ends at byte 50000"):
        read_and_verify(fd, path, [ChunkSpan((0, "t", 0), 49_000, 2000)], pool, 2)


def test_the_stripes_are_contiguous_and_about_equal():
    spans = [ChunkSpan((0, "t", i), i * 100, 100) for i in range(10)]
    runs = verified_read._stripes(spans, 3)
    assert [s for run in runs for s in run] == spans and [len(r) for r in runs] == [4, 4, 2]
    assert verified_read._stripes(spans, 20) == [[s] for s in spans]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_contiguous_cpu_destination_is_read_into_directly(data_file, dtype):
    path, fd, data = data_file
    dst = torch.zeros(100, dtype=dtype)
    nbytes = 100 * dst.element_size()
    assert copy_into(fd, 1234, dst, path)
    assert bytes(dst.view(torch.uint8).numpy()) == data[1234 : 1234 + nbytes].tobytes()


def test_a_strided_destination_is_left_untouched_for_the_caller(data_file):
    path, fd, _ = data_file
    dst = torch.zeros(10, 20)[:, ::2]
    assert not copy_into(fd, 0, dst, path)
    assert not dst.any()
