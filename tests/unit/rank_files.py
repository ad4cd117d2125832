"""Writes one rank file with the snapshot engine, for tests that need a real file on disk."""

from __future__ import annotations

import torch

from datastates_megatron.engine import EngineOptions, SnapshotEngine


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
