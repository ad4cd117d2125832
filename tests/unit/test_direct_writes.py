"""RankFileWriter.write: O_DIRECT for aligned data; a refusal at any point finishes buffered, byte for byte."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest

from datastates_megatron.engine.format.writer import ALIGN, RankFileWriter


def _aligned(nbytes: int, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip : skip + nbytes]


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def writer(tmp_path):
    w = RankFileWriter(str(tmp_path / "f"), direct="auto")
    if w._direct_fd is None:
        w.close()
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    yield w
    w.close()


def test_aligned_data_goes_direct_and_unaligned_data_buffered(writer, monkeypatch):
    direct, real = [], os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: direct.append(_is_direct(fd)) or real(fd, b, off))
    a, b = _aligned(3 * ALIGN, 1), _aligned(ALIGN + 10, 2)
    writer.write(a, 0)
    writer.write(b, 3 * ALIGN)  # length not a multiple of 4 KiB
    assert direct == [True, False]
    body = open(writer.path, "rb").read()
    assert body == a.tobytes() + b.tobytes()


def test_a_direct_write_refused_midway_is_finished_buffered_and_later_writes_stay_buffered(writer, monkeypatch):
    flags, real = [], os.pwrite

    def pwrite(fd, data, offset):
        flags.append(_is_direct(fd))
        if _is_direct(fd) and offset >= 2 * ALIGN:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, memoryview(data)[: 2 * ALIGN] if _is_direct(fd) else data, offset)  # a short direct write

    monkeypatch.setattr(os, "pwrite", pwrite)
    a, b = _aligned(5 * ALIGN, 3), _aligned(2 * ALIGN, 4)
    writer.write(a, 0)
    writer.write(b, 5 * ALIGN)
    assert flags == [True, True, False, False] and writer._direct_fd is None
    assert open(writer.path, "rb").read() == a.tobytes() + b.tobytes()


def test_other_errors_are_raised(writer, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space"):
        writer.write(_aligned(ALIGN, 5), 0)
