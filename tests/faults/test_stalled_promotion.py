"""A stalled ``--save`` (the promotion's copy held in-process) costs the node-local commits nothing,
and the link keeps one copy in flight and one waiting: newer checkpoints replace the waiting one,
which is dropped (its persistent commit abandoned, reported) and left to local retention."""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest
import torch

from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.format import verified_copy
from datastates_megatron.engine.tiers.tier import committed_iterations
from tests.managers import two_tier_manager

ITERS = 8


@pytest.fixture
def held_copies(monkeypatch):
    """Every promotion copy blocks until the returned event is set (60 s at most); set at teardown."""
    release = threading.Event()
    started = threading.Event()
    real = verified_copy.copy_verified

    def copy(*a, **kw):
        started.set()
        release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(verified_copy, "copy_verified", copy)
    release.started = started
    yield release
    release.set()


def _local_commit_latencies(mgr, w, first: int) -> list[float]:
    """Save ITERS iterations from ``first``, each waited for on the local tier only."""
    out = []
    for it in range(first, first + ITERS):
        w.fill_(float(it))
        t0 = time.perf_counter()
        assert mgr.save(it)
        mgr.wait(persist=False)
        out.append(time.perf_counter() - t0)
    return out


def test_a_stalled_promotion_never_delays_a_local_commit_and_keeps_one_waiting(tmp_path, held_copies):
    w = torch.zeros(1 << 16)
    with two_tier_manager(tmp_path / "free", w, interval=1, local_keep_last=2) as mgr:
        held_copies.set()  # no stall: the baseline
        free = _local_commit_latencies(mgr, w, 1)
        mgr.wait()
    held_copies.clear()
    mgr = two_tier_manager(tmp_path / "held", w, interval=1, local_keep_last=2)
    try:
        stalled = _local_commit_latencies(mgr, w, 1)  # iteration 1's copy is held, the rest wait
        assert held_copies.started.wait(30)
        link = mgr.promotion
        assert link.skipped == ITERS - 2, link.skipped  # 1 in flight, ITERS waiting last, the rest dropped
        assert link.pending() <= {1, ITERS}, link.pending()
        # local retention deleted what was dropped (keeping the last 2 and the copy in flight)
        local = committed_iterations(mgr.local_root)
        assert set(local) <= {1, ITERS - 1, ITERS}, local
        held_copies.set()  # --save recovers
        mgr.wait()
    finally:
        held_copies.set()
        mgr.close()
    assert committed_iterations(str(tmp_path / "held" / "persistent")) == [1, ITERS]
    for it in range(2, ITERS):
        assert not os.path.exists(iter_dir(str(tmp_path / "held" / "persistent"), it)), it
    # generous: the held copy must not show in local commits at all (a held one would add 60 s)
    assert statistics.median(stalled) < statistics.median(free) + 1.0, (free, stalled)
    assert max(stalled) < 10.0, stalled
