"""Reading a cold rank file into the page cache before restore (engine/fs/page_cache.py)."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.fs import page_cache
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.fs.page_cache import read_range, resident_fraction, warm_file

from .rank_files import write_rank_file

_OPTIONS = EngineOptions(cache_bytes=4 << 20, timeout_s=60)


def _write_rank_file(path: str) -> dict[str, torch.Tensor]:
    # 48 MB: well past a readahead window (8 MiB on the development machine)
    return write_rank_file(path, tensors=6, numel=2_000_000, seed=7, cache_bytes=4 << 20)


def _write_checkpoint(root: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of :func:`_write_rank_file`, committed as iteration 1 of ``root``; and its rank file."""
    g = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randn(2_000_000, generator=g) for i in range(6)}
    with CheckpointManager(root, _OPTIONS, keep_last=0) as mgr:
        for name, t in state.items():
            mgr.register(name, t)
        mgr.save(1, {})
        mgr.wait()
    return state, os.path.join(iter_dir(root, 1), read_manifest(iter_dir(root, 1)).ranks[0].file)


def _restore(root: str, targets: dict[str, torch.Tensor]):
    with CheckpointManager(root, _OPTIONS, keep_last=0, restore_threads=2) as mgr:
        for name, t in targets.items():
            mgr.register(name, t)
        return mgr.load(1, verify=True).stats


def _evict(path: str) -> None:
    """Drop ``path`` from the page cache, or skip where this file system keeps it (tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = resident_fraction(path)
    if left is None or left > 0.5:
        pytest.skip(f"cannot evict {path} from the page cache here (resident fraction {left})")


def test_a_cold_file_is_read_in_and_a_resident_one_is_left_alone(tmp_path):
    path = str(tmp_path / "rank0")
    _write_rank_file(path)
    _evict(path)
    with cf.ThreadPoolExecutor(3) as pool:
        with open(path, "rb") as f:
            assert warm_file(path, f.fileno(), pool, stripes=3) is True
            assert resident_fraction(path) == pytest.approx(1.0)
            assert warm_file(path, f.fileno(), pool, stripes=3) is False


def test_restore_of_a_cold_file_reads_ahead_and_restores_the_saved_values(tmp_path):
    root = str(tmp_path / "ckpt")
    state, path = _write_checkpoint(root)
    _evict(path)
    targets = {name: torch.zeros_like(t) for name, t in state.items()}
    stats = _restore(root, targets)
    assert stats.read_ahead_s > 0 and stats.bytes == sum(t.numel() * 4 for t in state.values())
    assert stats.read_bytes == os.path.getsize(path)  # the whole file, once, counted for the profile
    assert all(torch.equal(targets[n], state[n]) for n in state)
    again = _restore(root, targets)
    assert again.read_ahead_s == 0.0 and again.read_bytes == 0  # now resident: no second read


def test_read_range_stops_at_the_end_of_the_file(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_range(fd, 4096, 1 << 20) == 904  # asks for far more than is there
        assert read_range(fd, 10_000, 10) == 0  # starts past the end
        assert read_range(fd, 0, 5000) == 5000
    finally:
        os.close(fd)


def test_a_cold_file_is_read_in_contiguous_stripes_that_cover_it_exactly(tmp_path, monkeypatch):
    """Runs everywhere (no eviction needed): residency is reported as 0 and the reads recorded."""
    path = str(tmp_path / "rank0")
    size = 3 * (1 << 20) + 12345
    open(path, "wb").write(os.urandom(size))
    monkeypatch.setattr(page_cache, "resident_fraction_of", lambda fd, p: 0.0)
    reads, lock = [], threading.Lock()
    real = page_cache.read_range

    def spy(fd, start, nbytes):
        with lock:
            reads.append((start, nbytes))
        return real(fd, start, nbytes)

    monkeypatch.setattr(page_cache, "read_range", spy)
    with open(path, "rb") as f, cf.ThreadPoolExecutor(4) as pool:
        assert warm_file(path, f.fileno(), pool, stripes=4) is True
    reads.sort()
    assert len(reads) == 4 and reads[0][0] == 0 and sum(n for _, n in reads) == size
    assert all(a + n == b for (a, n), (b, _) in zip(reads, reads[1:]))


def test_a_failing_read_ahead_does_not_fail_the_restore(tmp_path, monkeypatch, caplog):
    """A read-ahead that fails for a reason of its own (here ENOMEM) leaves the reads to page
    faults; one the storage fails (EIO) does not: test_a_storage_error_in_the_read_ahead_fails_the_load."""
    root = str(tmp_path / "ckpt")
    state, _ = _write_checkpoint(root)
    targets = {name: torch.zeros_like(t) for name, t in state.items()}
    monkeypatch.setattr(page_cache, "resident_fraction_of", lambda fd, p: 0.0)

    def broken(fd, start, nbytes):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(page_cache, "read_range", broken)
    stats = _restore(root, targets)
    assert stats.read_ahead_s == 0.0 and "read-ahead failed" in caplog.text
    assert all(torch.equal(targets[n], state[n]) for n in state)


def test_a_storage_error_in_the_read_ahead_fails_the_load(tmp_path, monkeypatch):
    """EIO from the read-ahead: through the mapping the same page would be a SIGBUS, so it is a
    ``StorageReadError`` naming the rank and file (the manager then falls back), nothing copied."""
    from datastates_megatron.engine import StorageReadError

    root = str(tmp_path / "ckpt")
    state, _ = _write_checkpoint(root)
    targets = {name: torch.zeros_like(t) for name, t in state.items()}
    monkeypatch.setattr(page_cache, "resident_fraction_of", lambda fd, p: 0.0)

    def broken(fd, start, nbytes, tick=None):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(page_cache, "read_range", broken)
    with pytest.raises(StorageReadError, match=r"rank 0: .*\.dsck: read failed: EIO \(Input/output error\)"):
        _restore(root, targets)
    assert all(not t.any() for t in targets.values())


def test_a_file_larger_than_half_the_available_memory_is_not_read_ahead(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    open(path, "wb").write(b"z" * (1 << 20))
    monkeypatch.setattr(page_cache, "resident_fraction_of", lambda fd, p: 0.0)
    monkeypatch.setattr(page_cache, "_memory_available", lambda: 1 << 20)
    with open(path, "rb") as f, cf.ThreadPoolExecutor(2) as pool:
        assert warm_file(path, f.fileno(), pool, stripes=2) is False


def test_resident_fraction_of_an_empty_file_is_zero(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert resident_fraction(str(tmp_path / "empty")) == 0.0
