"""The verifying reader keeps at most ``max_open`` rank files open, however many a plan reads."""

from __future__ import annotations

import torch

from datastates_megatron.engine.load import reader as reader_mod
from datastates_megatron.engine.load.load_plan import ElementRange, LoadPlan, ReadItem
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.load.reader import CheckpointReader

from .rank_files import write_checkpoint

WORLD = 12


def test_a_plan_over_every_file_holds_at_most_max_open(tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    write_checkpoint(root, 3, WORLD, "00000000000000bb", numel=1000)
    d = iter_dir(root, 3)
    open_at_once = []
    real_open = reader_mod.open_rank

    def counting_open(ckpt, manifest, rank, record=None, memory_fd=None):
        rf = real_open(ckpt, manifest, rank, record, memory_fd)
        open_at_once.append(len(reader._files) + 1)  # the files open once this one is added
        return rf

    monkeypatch.setattr(reader_mod, "open_rank", counting_open)
    dests = [torch.zeros(10) for _ in range(WORLD)]
    items = tuple(ReadItem(ElementRange(r, "w", 5, 10), dests[r]) for r in reversed(range(WORLD)))
    with CheckpointReader(d, read_manifest(d), verify=True, threads=2, max_open=3) as reader:
        stats = reader.execute(LoadPlan("test", items))
        objects = [reader.objects(r) for r in range(WORLD)]  # re-opens the closed files, still bounded
    assert all(torch.equal(dests[r], torch.full((10,), float(r))) for r in range(WORLD))
    assert objects == [{"rank": r} for r in range(WORLD)]
    assert stats.bytes == WORLD * 40 and stats.verified_bytes == WORLD * 4000
    assert len(open_at_once) >= WORLD and max(open_at_once) <= 3
