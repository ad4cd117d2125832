"""A deletion the file system refuses (EPERM) is logged with its path and changes nothing else: the
checkpoint that triggered retention stays committed, promotion goes on, and ``close()`` still
promotes what is pending.  One process, real files; the refusal is injected (we run as root, where
``chmod`` refuses nothing)."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.tiers import retention
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.runtime.threads import forget
from datastates_megatron.engine.tiers.tier import committed_iterations


@pytest.fixture
def refuse_deletions(monkeypatch):
    """Every unlink or rmdir under the given root fails with EPERM."""
    roots: list[str] = []
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def _refused(path):
        return any(os.path.abspath(path).startswith(r + os.sep) for r in roots)

    def unlink(path, *a, **kw):
        if _refused(path):
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_unlink(path, *a, **kw)

    def rmdir(path, *a, **kw):
        if _refused(path):
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_rmdir(path, *a, **kw)

    monkeypatch.setattr(retention.os, "unlink", unlink)
    monkeypatch.setattr(retention.os, "rmdir", rmdir)
    return roots


def _save(mgr, w, iterations):
    records = []
    for it in iterations:
        w.fill_(float(it))
        mgr.save(it)
        records += mgr.wait()
    return records


def test_refused_deletion_on_the_persistent_tier_keeps_the_commit(tmp_path, refuse_deletions, caplog):
    root = str(tmp_path / "ckpt")
    refuse_deletions.append(root)
    w = torch.zeros(1000)
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=1) as mgr:
        mgr.register("w", w)
        with caplog.at_level(logging.WARNING):
            records = _save(mgr, w, [1, 2, 3])
        assert [r.iteration for r in records] == [1, 2, 3]
        assert mgr.latest_committed == 3
    assert committed_iterations(root)[-1] == 3
    assert "iter_0000001" in caplog.text and "Operation not permitted" in caplog.text
    w.zero_()
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=1) as mgr:
        mgr.register("w", w)
        assert mgr.load().iteration == 3
    assert torch.equal(w, torch.full((1000,), 3.0))


def test_refused_local_deletion_never_blocks_promotion(tmp_path, refuse_deletions, caplog):
    persistent, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    refuse_deletions.append(local)
    w = torch.zeros(1000)
    mgr = CheckpointManager(
        persistent,
        EngineOptions(cache_bytes=1 << 20, timeout_s=30),
        keep_last=0,
        local_root=local,
        persist_interval=2,
        local_keep_last=1,
    )
    mgr.register("w", w)
    with caplog.at_level(logging.WARNING):
        records = _save(mgr, w, [1, 2, 3, 4, 5])
        mgr.close()
    assert [r.iteration for r in records if r.tier == "local"] == [1, 2, 3, 4, 5]
    # 2 and 4 by the interval, 5 by close(): a refused local deletion blocks none of them
    assert committed_iterations(persistent) == [2, 4, 5]
    assert "Operation not permitted" in caplog.text


def test_refused_deletions_never_stop_a_restart(tmp_path, refuse_deletions):
    """Start-up cleanup (recycle pool, leftovers) meets EPERM: logged, and the run starts."""
    persistent, local = str(tmp_path / "persistent"), str(tmp_path / "local")
    w = torch.zeros(1000)

    def manager():
        mgr = CheckpointManager(
            persistent,
            EngineOptions(cache_bytes=1 << 20, timeout_s=30),
            keep_last=0,
            local_root=local,
            local_keep_last=1,
        )
        mgr.register("w", w)
        return mgr

    mgr = manager()
    _save(mgr, w, [1, 2, 3, 4])  # retention filled the recycle pool
    pool = os.path.join(mgr.local_root, ".recycle")
    mgr.engine.close()  # killed: the pool is not emptied at close
    mgr._abandon_start(timeout_s=30)
    forget(mgr)
    assert os.listdir(pool)
    refuse_deletions.append(local)
    with manager() as again:
        assert again.load().iteration == 4
        assert os.listdir(pool)  # still there: refused, reported, not fatal
