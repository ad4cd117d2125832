"""verified_copy.copy_verified: the byte copy a promotion makes from the local tier to the persistent one."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError, FlushError, load_file
from datastates_megatron.engine.format import verified_copy

from .rank_files import write_rank_file


def _rank_file(path: str) -> dict[str, torch.Tensor]:
    return write_rank_file(path, tensors=4, numel=1_500_000, seed=3, cache_bytes=8 << 20)  # 24 MB: several blocks


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(verified_copy, "_COPY_BLOCK", 5 << 20)  # not a divisor of the file size


def _check_copy(tmp_path, state) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    receipt = verified_copy.copy_verified(src, dst, 1)
    assert open(src, "rb").read() == open(dst, "rb").read()
    assert receipt.file_bytes == os.path.getsize(dst) and not os.path.exists(dst + ".promoting")
    tensors, _ = load_file(dst)
    assert all(torch.equal(tensors[n], state[n]) for n in state)


def _refuse_o_direct(monkeypatch) -> list:
    """Make opening with O_DIRECT fail as on a file system without it; returns the refused paths."""
    refused, real = [], os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    return refused


def test_the_aligned_bytes_are_copied_with_o_direct_and_only_the_tail_buffered(tmp_path, small_blocks, monkeypatch):
    state = _rank_file(str(tmp_path / "src"))
    size = os.path.getsize(tmp_path / "src")
    starts, real = [], verified_copy._copy_bytes
    monkeypatch.setattr(
        verified_copy,
        "_copy_bytes",
        lambda fi, fo, n, start=0, **kw: starts.append(start) or real(fi, fo, n, start, **kw),
    )
    _check_copy(tmp_path, state)
    aligned = size // 4096 * 4096
    assert starts == ([aligned] if aligned < size else [])


def test_a_direct_write_refused_midway_is_finished_buffered(tmp_path, small_blocks, monkeypatch):
    state = _rank_file(str(tmp_path / "src"))
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls.append(offset)
            if len(calls) == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _check_copy(tmp_path, state)
    assert calls == [0, 5 << 20]  # the first block went direct, the second was refused


def test_the_copy_is_byte_identical_through_sendfile(tmp_path, small_blocks, monkeypatch):
    state = _rank_file(str(tmp_path / "src"))
    refused = _refuse_o_direct(monkeypatch)
    sent, real = [], os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda *a: sent.append(a[3]) or real(*a))
    monkeypatch.setattr(os, "pwrite", lambda *a: pytest.fail("the fallback copy ran"))
    _check_copy(tmp_path, state)
    assert refused and sum(sent) >= os.path.getsize(tmp_path / "src") and max(sent) <= 5 << 20


def test_the_copy_is_byte_identical_where_sendfile_is_refused(tmp_path, small_blocks, monkeypatch):
    state = _rank_file(str(tmp_path / "src"))
    _refuse_o_direct(monkeypatch)
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(errno.EINVAL, "sendfile not supported between these file systems")

    monkeypatch.setattr(os, "sendfile", refuse)
    _check_copy(tmp_path, state)
    assert calls  # the fast path was tried first


def test_a_corrupt_source_is_refused_and_nothing_is_left_at_the_destination(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _rank_file(src)
    with open(src, "r+b") as f:
        f.seek(os.path.getsize(src) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError):
        verified_copy.copy_verified(src, dst, 1)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".promoting")


def test_a_failed_copy_leaves_no_partial_file_and_the_source_intact(tmp_path, monkeypatch):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _rank_file(src)
    before = open(src, "rb").read()

    def disk_full(rf, fd_out, path_out, size, pace=None):
        os.write(fd_out, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(verified_copy, "_copy_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        verified_copy.copy_verified(src, dst, 1)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".promoting")
    assert open(src, "rb").read() == before


def test_a_source_shorter_than_its_header_is_refused(tmp_path):
    src = tmp_path / "short"
    src.write_bytes(b"y" * 1000)
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(FlushError, match="copied 1000 of 4096 bytes"):
            verified_copy._copy_bytes(fd_in, fd_out, 4096)
    finally:
        os.close(fd_in)
        os.close(fd_out)


def test_a_source_rewritten_in_place_during_the_copy_fails_the_promotion(tmp_path, monkeypatch):
    """Recycling rewrites a retired local file in place, header first: a promotion that copied
    while that happened must not commit the mixed bytes."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _rank_file(src)
    real = verified_copy._copy_file

    def copy_then_recycled(rf, fd_out, path_out, size, pace=None):
        real(rf, fd_out, path_out, size)
        with open(src, "r+b") as f:  # what take_recycled + the writer do first: zero the header
            f.write(b"\0" * 4096)

    monkeypatch.setattr(verified_copy, "_copy_file", copy_then_recycled)
    with pytest.raises(FlushError, match="rewritten while it was promoted"):
        verified_copy.copy_verified(src, dst, 1)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".promoting")
