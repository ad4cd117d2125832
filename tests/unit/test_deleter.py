"""Retention off the commit path (``engine/tiers/deleter.py``): the next commit does not wait for a deletion,
``wait()`` does, a tier that never commits starts no thread, one never closed does not hang the exit,
and the writer's own new manifest is not read back by retention."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.tiers import tier
from datastates_megatron.engine.errors import CacheTimeoutError
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import iter_dir

REPO = Path(__file__).resolve().parents[2]
OPTS = EngineOptions(cache_bytes=1 << 20, timeout_s=30)


def _deleters() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dsm-delete")]


def test_a_slow_deletion_holds_back_neither_the_next_commit_nor_training_but_wait_waits_for_it(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real = tier.delete_checkpoint

    def held(root, iteration, recycle=False, **kw):
        started.set()
        assert release.wait(30)
        real(root, iteration, recycle=recycle, **kw)

    monkeypatch.setattr(tier, "delete_checkpoint", held)
    root = str(tmp_path / "ckpt")
    w = torch.zeros(16)
    with CheckpointManager(root, OPTS, keep_last=1) as mgr:
        mgr.register("w", w)
        mgr.save(1)
        mgr.wait()
        mgr.save(2)  # its commit retires iteration 1: the deletion starts and is held
        mgr._first_tier.drain(30)
        assert started.wait(30)
        mgr.save(3)  # committed while the deletion of 1 is still held
        mgr._first_tier.drain(30)
        assert mgr.latest_committed == 3 and os.path.isdir(iter_dir(root, 1))
        with pytest.raises(CacheTimeoutError, match="retention not done"):
            mgr.persistent.drain_deletions(0.2)
        release.set()
        mgr.wait()  # returns once retention is done
        assert not os.path.exists(iter_dir(root, 1)) and not os.path.exists(iter_dir(root, 2))
        assert os.path.isdir(iter_dir(root, 3))
    assert _deleters() == []  # joined by close()


def test_a_tier_that_never_commits_starts_no_deleter(tmp_path):
    with CheckpointManager(str(tmp_path / "ckpt"), OPTS, keep_last=1) as mgr:
        mgr.register("w", torch.zeros(4))
        assert mgr.persistent._deleter is None and _deleters() == []


def test_a_manager_never_closed_does_not_hang_the_exit(tmp_path):
    """A process that commits (retention's thread started) and exits without closing anything."""
    code = (
        "import torch\n"
        "from datastates_megatron.engine import EngineOptions\n"
        "from datastates_megatron.engine.manager import CheckpointManager\n"
        "import datastates_megatron.engine.runtime.threads as th\n"
        "th.close_at_exit = lambda obj: None\n"  # no atexit close either: the deleter is left running
        "import datastates_megatron.engine.manager as m\n"
        "m.close_at_exit = lambda obj: None\n"
        f"mgr = CheckpointManager({str(tmp_path / 'c')!r}, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=1)\n"
        "mgr.register('w', torch.zeros(4))\n"
        "for it in (1, 2, 3):\n"
        "    mgr.save(it)\n"
        "    mgr.wait()\n"
        # the engine's and the commit thread: closed, not what this test is about; the deleter is not
        "mgr.engine.close()\n"
        "mgr.persistent._committer.close()\n"
        "print('deleter' if mgr.persistent._deleter._thread.is_alive() else 'none', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "deleter"


def test_retention_does_not_read_back_the_manifest_just_written(tmp_path, monkeypatch):
    read = []
    real = tier.read_manifest
    monkeypatch.setattr(tier, "read_manifest", lambda d: read.append(os.path.basename(d)) or real(d))
    with CheckpointManager(str(tmp_path / "ckpt"), OPTS, keep_last=2) as mgr:
        mgr.register("w", torch.zeros(4))
        for it in (1, 2, 3):
            mgr.save(it)
            mgr.wait()
    assert read == []  # each survey found the writer's own manifests in the cache
    # ... the one process-wide cache: any survey in this process (a restore's) reads none back either
    tier.survey(str(tmp_path / "ckpt"))
    assert read == []
