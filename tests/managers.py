"""In-process CheckpointManagers the tests build alike."""

from __future__ import annotations

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager


def two_tier_manager(tmp_path, w, interval: int, local_keep_last: int) -> CheckpointManager:
    """A persistent tier under ``tmp_path/persistent`` keeping everything and a node-local one under
    ``tmp_path/local`` promoting every ``interval``-th iteration, with ``w`` registered as ``"w"``."""
    mgr = CheckpointManager(
        str(tmp_path / "persistent"),
        EngineOptions(cache_bytes=1 << 20, timeout_s=30),
        keep_last=0,
        local_root=str(tmp_path / "local"),
        persist_interval=interval,
        local_keep_last=local_keep_last,
    )
    mgr.register("w", w)
    return mgr


def one_checkpoint(root, numel: int = 16):
    """A committed checkpoint of iteration 1 (one tensor) under ``root``; returns ``root``."""
    import torch

    with CheckpointManager(str(root), EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=0) as mgr:
        mgr.register("w", torch.zeros(numel))
        mgr.save(1, {"iteration": 1})
        mgr.wait()
    return root


def stand_in_megatron_lm(root, script: str = "raise SystemExit('not a real Megatron-LM')\n"):
    """A Megatron-LM checkout's layout only (``megatron/`` and ``pretrain_gpt.py``); returns ``root``."""
    (root / "megatron").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text(script)
    return root
