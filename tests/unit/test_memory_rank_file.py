"""A rank file written into a memory file (``SnapshotEngine.save(memory_fd=...)``, the save path to
object storage without a local directory): its bytes are the file format's, and once the caller
closes it no mapping of ours pins its pages -- a memfd is never written again, so the mapped-file
pool must not keep it until the next save."""

from __future__ import annotations

import os

import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.format.file_format import RankFile
from datastates_megatron.engine.save.snapshot import SnapshotEngine


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(f"/memfd:{name}" in line for line in f)


def test_a_memory_file_is_verified_and_left_unmapped_once_closed():
    w = torch.arange(1 << 20, dtype=torch.float32)
    name = f"dsm-test-{os.getpid()}"
    with SnapshotEngine(EngineOptions(cache_bytes=8 << 20, timeout_s=60)) as eng:
        eng.register("w", w)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            receipt = eng.save(3, f"memfd:{name}", {"k": 1}, tag="t", memory_fd=fd).durable.result(60)
            with RankFile(f"memfd:{name}", fd) as rf:
                assert rf.verify_all() == w.numel() * 4
                assert rf.header.file_bytes == receipt.file_bytes == os.fstat(fd).st_size
                assert torch.equal(rf.tensor("w"), w)
        finally:
            os.close(fd)
        assert not _mapped(name)  # the engine still open: its pool keeps no mapping of it
