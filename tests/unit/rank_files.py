"""Writes one rank file with the snapshot engine, for tests that need a real file on disk."""

from __future__ import annotations

import torch

import os

from datastates_megatron.engine import EngineOptions, SnapshotEngine
from datastates_megatron.engine.format.manifest import Manifest, RankRecord, write_manifest
from datastates_megatron.engine.names import iter_dir, rank_file_name


def write_rank_file(path: str, *, tensors: int, numel: int, seed: int, cache_bytes: int) -> dict[str, torch.Tensor]:
    """Save ``tensors`` random fp32 tensors of ``numel`` elements to ``path`` (version 1); returns them."""
    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}
    with SnapshotEngine(EngineOptions(cache_bytes=cache_bytes, timeout_s=30)) as eng:
        for name, t in state.items():
            eng.register(name, t)
        eng.save(1, path)
        eng.wait()
    return state


def write_checkpoint(root: str, iteration: int, world: int, token: str, *, numel: int = 4, commit_seq: int = 0) -> None:
    """A committed ``world``-rank checkpoint: rank r's file holds ``w`` = ``numel`` copies of r and
    the objects ``{"rank": r}``; layout ``{"dp": world}``, metadata ``{"note": "x"}``."""
    d = iter_dir(root, iteration)
    os.makedirs(d)
    records = []
    with SnapshotEngine(EngineOptions(cache_bytes=1 << 20, timeout_s=30)) as eng:
        for r in range(world):
            eng.clear()
            eng.register("w", torch.full((numel,), float(r)))
            name = rank_file_name(r, token, 1)
            got = eng.save(iteration, os.path.join(d, name), {"rank": r}, tag=name).durable.result(30)
            records.append(
                RankRecord(r, name, got.file_bytes, got.data_bytes, got.n_tensors, got.index_xxh64, got.header_xxh64)
            )
    manifest = Manifest(iteration, world, token, tuple(records), {"dp": world}, {"note": "x"}, commit_seq=commit_seq)
    write_manifest(root, manifest)
