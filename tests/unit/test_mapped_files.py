"""Kept mappings of memory-backed rank files (``engine/fs/mapped_files.py``) and the engine's writes
through them (``EngineOptions.mapped_writes``)."""

import errno
import os

import numpy as np
import pytest
import torch

from datastates_megatron.engine import EngineOptions, SnapshotEngine, load_file
from datastates_megatron.engine.format.file_format import HEADER_BYTES
from datastates_megatron.engine.fs.mapped_files import MappedFiles
from datastates_megatron.engine.format.writer import RankFileWriter

MB = 1 << 20


@pytest.fixture
def shm(shm_dir):
    return str(shm_dir)


def _open(path):
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def test_a_file_is_mapped_once_and_written_through_the_same_mapping_after_a_rename(shm):
    pool = MappedFiles()
    fd = _open(f"{shm}/a")
    view = pool.acquire(fd, 3 * MB)
    view[:] = 7
    pool.release(fd)
    os.close(fd)
    assert os.path.getsize(f"{shm}/a") == 3 * MB and open(f"{shm}/a", "rb").read(16) == bytes([7] * 16)
    os.rename(f"{shm}/a", f"{shm}/b")  # what recycling does between two saves
    fd = _open(f"{shm}/b")
    view = pool.acquire(fd, 3 * MB)
    view[-1] = 9
    pool.release(fd)
    os.close(fd)
    assert (pool.mapped, pool.reused, len(pool)) == (1, 1, 1)
    with open(f"{shm}/b", "rb") as f:
        f.seek(3 * MB - 1)
        assert f.read() == b"\x09"
    pool.close()


def test_the_mapping_of_a_deleted_file_is_dropped_so_its_memory_is_freed(shm):
    pool = MappedFiles()
    for name in ("a", "b"):
        fd = _open(f"{shm}/{name}")
        pool.acquire(fd, MB)
        pool.release(fd)
        os.close(fd)
    os.unlink(f"{shm}/a")
    fd = _open(f"{shm}/b")
    pool.acquire(fd, MB)
    pool.release(fd)
    os.close(fd)
    assert len(pool) == 1  # a's mapping (and the pages it pinned) is gone
    pool.close()
    assert len(pool) == 0
    with pytest.raises(OSError, match="closed"):
        fd = _open(f"{shm}/b")
        try:
            pool.acquire(fd, MB)
        finally:
            os.close(fd)


def test_at_most_max_files_are_kept_least_recently_used_first_out(shm):
    pool = MappedFiles(max_files=2)
    for name in ("a", "b", "a", "c"):
        fd = _open(f"{shm}/{name}")
        pool.acquire(fd, MB)
        pool.release(fd)
        os.close(fd)
    assert len(pool) == 2
    fd = _open(f"{shm}/a")  # used after b: still kept
    pool.acquire(fd, MB)
    pool.release(fd)
    os.close(fd)
    assert (pool.mapped, pool.reused) == (3, 2)
    pool.close()


def test_a_file_shrunk_or_grown_since_it_was_mapped_is_allocated_again_before_use(shm):
    pool = MappedFiles()
    fd = _open(f"{shm}/a")
    pool.acquire(fd, 2 * MB)
    pool.release(fd)
    os.ftruncate(fd, 4096)  # a store past the end of the file would be a SIGBUS
    view = pool.acquire(fd, 2 * MB)
    view[:] = 1  # reaches the last byte: no SIGBUS
    pool.release(fd)
    assert os.fstat(fd).st_size == 2 * MB
    view = pool.acquire(fd, 5 * MB)  # grown: mapped again at the new size
    view[-1] = 2
    pool.release(fd)
    assert os.fstat(fd).st_size == 5 * MB and pool.mapped == 2
    os.close(fd)
    pool.close()


def test_a_file_in_use_is_not_handed_out_twice(shm):
    pool = MappedFiles()
    fd = _open(f"{shm}/a")
    pool.acquire(fd, MB)
    with pytest.raises(OSError, match="already being written"):
        pool.acquire(fd, MB)
    os.close(fd)
    pool.close()


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = {f"layer{i}.weight": torch.randn(256, 300 + i, generator=g) for i in range(3)}
    ts["big"] = torch.randn(600_000, generator=g)  # several chunks
    ts["bf16"] = torch.randn(7, 9, generator=g).to(torch.bfloat16)  # small: packed, through the cache
    ts["step"] = torch.tensor(3.0)
    return ts


def _save(path, ts, version=1, **kw):
    opts = EngineOptions(cache_bytes=4 * MB, chunk_bytes=MB, timeout_s=30, **kw)
    with SnapshotEngine(opts) as eng:
        for n, t in ts.items():
            eng.register(n, t)
        eng.save(version, path, {"iteration": version})
        eng.wait()
        return eng._mapped


@pytest.mark.parametrize("source_writes", [True, False])
def test_a_mapped_write_is_byte_identical_to_a_pwrite(shm, tmp_path, source_writes):
    ts = _state()
    pool = _save(f"{shm}/mapped", ts, source_writes=source_writes)
    assert pool is not None and pool.mapped == 1  # it did go through a mapping
    _save(f"{shm}/plain", ts, source_writes=source_writes, mapped_writes=False)
    _save(str(tmp_path / "disk"), ts, source_writes=source_writes)  # not memory-backed: pwrite
    mapped = open(f"{shm}/mapped", "rb").read()
    assert mapped == open(f"{shm}/plain", "rb").read() == (tmp_path / "disk").read_bytes()
    tensors, objects = load_file(f"{shm}/mapped")
    assert objects["objects"] == {"iteration": 1}
    for n, t in ts.items():
        assert torch.equal(tensors[n], t), n


def test_an_overwrite_of_a_recycled_file_reuses_its_mapping_and_leaves_no_old_bytes(shm):
    ts = _state(0)
    opts = EngineOptions(cache_bytes=4 * MB, chunk_bytes=MB, timeout_s=30)
    with SnapshotEngine(opts) as eng:
        for n, t in ts.items():
            eng.register(n, t)
        eng.save(1, f"{shm}/v1", {"iteration": 1})
        eng.wait()
        for t in ts.values():
            t.add_(1)
        eng.save(2, f"{shm}/v2", {"iteration": 2}, before_open=lambda: os.rename(f"{shm}/v1", f"{shm}/v2"))
        eng.wait()
        assert (eng._mapped.mapped, eng._mapped.reused) == (1, 1)
    assert not os.path.exists(f"{shm}/v1")
    tensors, objects = load_file(f"{shm}/v2")
    assert objects["objects"] == {"iteration": 2}
    for n, t in ts.items():
        assert torch.equal(tensors[n], t), n


def test_a_file_that_cannot_be_mapped_is_written_with_pwrite(shm, monkeypatch):
    def full(self, fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MappedFiles, "acquire", full)
    w = RankFileWriter(f"{shm}/f", "auto", MappedFiles(), HEADER_BYTES + MB)
    assert w.memory_backed and w.mapping is None
    w.write(np.full(4096, 5, np.uint8), HEADER_BYTES)
    w.close()
    with open(f"{shm}/f", "rb") as f:
        f.seek(HEADER_BYTES)
        assert f.read(4096) == bytes([5] * 4096)
