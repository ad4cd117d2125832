"""A save while this rank's storage is behind is skipped and reported, never waited for (one process).

Writes are held in ``RankFileWriter.write`` (an in-process hold: the version stays in flight until
the test lets go), and in the last test by the fault filesystem (``fault_fs``: the writes stall in
the kernel).  ``when_behind="skip"`` (the default): ``save`` returns at once with ``False``,
the checkpoint is abandoned at its commit, one warning starts the stall and one ends it, and the
next save after the storage caught up commits.  ``when_behind="wait"`` keeps the back-pressure,
bounded by ``timeout_s``; a ``final`` save is never skipped."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.format import writer
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

MiB = 1 << 20
PROMPT_S = 2.0  # a save that returns "at once" on a loaded two-core machine; the hold lasts 60 s


@pytest.fixture
def held_writes(monkeypatch):
    """Every rank-file write blocks until the returned event is set (60 s at most: a failing test
    ends); the event is set at teardown."""
    release = threading.Event()
    real = writer.RankFileWriter.write

    def write(self, data, offset):
        release.wait(60)
        return real(self, data, offset)

    monkeypatch.setattr(writer.RankFileWriter, "write", write)
    yield release
    release.set()


def _manager(root, *, cache_mb: float = 64, timeout_s: float = 60, **kw):
    opts = EngineOptions(cache_bytes=int(cache_mb * MiB), flush_threads=2, chunk_bytes=MiB, timeout_s=timeout_s)
    return CheckpointManager(str(root), opts, keep_last=0, **kw)


def _register(mgr, mb: int):
    for i in range(mb):
        mgr.register(f"w{i}", torch.full((MiB // 4,), float(i)))  # 1 MiB each


def _timed_save(mgr, it, **kw):
    t0 = time.perf_counter()
    started = mgr.save(it, **kw)
    return started, time.perf_counter() - t0


def _no_files_of(root, it):
    d = iter_dir(str(root), it)
    return not os.path.exists(d) or not os.listdir(d)


def test_a_save_behind_stuck_versions_is_skipped_at_once_and_the_next_commits(tmp_path, held_writes, caplog):
    root = tmp_path / "c"
    with caplog.at_level(logging.WARNING, logger="datastates_megatron.engine.manager"):
        with _manager(root) as mgr:
            _register(mgr, 2)
            assert mgr.save(1) and mgr.save(2)  # two versions in flight (max_inflight=2), both stuck
            for it in (3, 4, 5):
                started, took = _timed_save(mgr, it)
                assert started is False and took < PROMPT_S, (it, took)
                mgr.wait_for_snapshot()  # the gate: nothing to wait for in a skipped version
            assert mgr.skipped == 3
            assert committed_iterations(str(root)) == []
            held_writes.set()  # the storage recovers
            mgr.wait()
            assert mgr.abandoned_skips == 3
            assert mgr.save(6)  # attempted as usual, and committed
            mgr.wait()
    assert committed_iterations(str(root)) == [1, 2, 6]
    assert all(_no_files_of(root, it) for it in (3, 4, 5))
    stall = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(stall) == 2, stall  # one warning at each end of the stall, not one per iteration
    assert "rank 0" in stall[0] and str(root) in stall[0] and "iteration 3" in stall[0], stall[0]
    assert "3 checkpoint(s) skipped (iterations 3..5)" in stall[1], stall[1]


def test_the_saves_skipped_during_a_stall_are_abandoned_in_one_commit_round(tmp_path, held_writes):
    """Issue 41: a stall skips one save per iteration; once storage recovers, those skips must not
    cost one commit round each (a gather and a broadcast, and the writer's unlinks), or the backlog
    of rounds, as long as the stall, makes every save after it wait for its commit and be skipped in
    turn.  Every rank skipped them: they are abandoned together, and the next save commits."""
    root = tmp_path / "c"
    n = 500
    with _manager(root) as mgr:
        _register(mgr, 2)
        assert mgr.save(1) and mgr.save(2)  # stuck: the commit thread waits for 1's file
        for it in range(3, 3 + n):
            assert mgr.save(it) is False
        assert mgr.skipped == n
        held_writes.set()  # the storage recovers
        mgr.wait()
        assert mgr.abandoned_skips == n
        committer = mgr.persistent._committer
        assert committer.rounds == 3, committer.rounds  # 1, 2, and one for the 500 skipped
        assert mgr.save(3 + n)
        mgr.wait()
        assert committer.rounds == 4
    assert committed_iterations(str(root)) == [1, 2, 3 + n]
    assert all(_no_files_of(root, it) for it in (3, 2 + n))


def test_a_cache_without_room_skips_although_a_slot_is_free(tmp_path, held_writes):
    """3 MiB of state, a 4 MiB cache: version 1's regions hold the cache while its writes are
    stuck, so version 2 would wait for them (max_inflight=2 leaves it a slot)."""
    root = tmp_path / "c"
    with _manager(root, cache_mb=4) as mgr:
        _register(mgr, 3)
        assert mgr.save(1)
        mgr.wait_for_snapshot()  # copied into the cache: version 1 now holds 3 of its 4 MiB
        started, took = _timed_save(mgr, 2)
        assert started is False and took < PROMPT_S
        assert "host cache" in mgr.engine.behind()
        held_writes.set()
        mgr.wait()
        assert mgr.save(3)
        mgr.wait()
    assert committed_iterations(str(root)) == [1, 3]


def test_wait_mode_keeps_the_back_pressure_bounded_by_the_timeout(tmp_path, held_writes):
    mgr = _manager(tmp_path / "c", timeout_s=1.0, when_behind="wait", on_error="warn")
    try:
        _register(mgr, 2)
        assert mgr.save(1) and mgr.save(2)
        t0 = time.perf_counter()
        assert mgr.save(3) is False  # waited for a slot, then gave up (on_error="warn": logged)
        assert 0.9 <= time.perf_counter() - t0 < 5.0
        assert mgr.skipped == 0 and mgr.engine.slot_wait_s >= 0.9
    finally:
        held_writes.set()
        mgr.close()


def test_a_final_save_is_never_skipped_it_waits_and_says_so(tmp_path, held_writes, caplog):
    root = tmp_path / "c"
    with caplog.at_level(logging.WARNING, logger="datastates_megatron.engine.manager"):
        with _manager(root) as mgr:
            _register(mgr, 2)
            assert mgr.save(1) and mgr.save(2)
            threading.Timer(0.5, held_writes.set).start()  # storage recovers while the final save waits
            assert mgr.save(3, final=True)
            mgr.wait()
            assert mgr.skipped == 0
    assert committed_iterations(str(root)) == [1, 2, 3]
    assert any("final checkpoint of iteration 3 waited" in r.getMessage() for r in caplog.records)


def test_through_a_stalling_filesystem_a_save_behind_is_skipped_at_once(fault_fs):
    """Under real syscalls (the fault filesystem): the first write of checkpoints 1 and 2 stalls
    5 s in the kernel; the save of 3 returns at once, skipped; 1 and 2 commit once the writes
    return, and the next save commits."""
    root = os.path.join(fault_fs.root, "ckpt")
    rules = [fault_fs.fault("write", f"ckpt/iter_{it:07d}/**", stall_s=5.0, times=1) for it in (1, 2)]
    with _manager(root) as mgr:
        _register(mgr, 2)
        assert mgr.save(1) and mgr.save(2)
        assert fault_fs.wait_blocked(1, timeout=30), "no write reached the filesystem"
        started, took = _timed_save(mgr, 3)
        assert started is False and took < PROMPT_S, took
        mgr.wait()
        assert mgr.save(4)
        mgr.wait()
    assert [fault_fs.hits(r) for r in rules] == [1, 1]
    assert committed_iterations(root) == [1, 2, 4]
    assert _no_files_of(root, 3)


def test_save_and_the_gate_make_no_storage_call_while_every_call_under_save_is_held(fault_fs):
    """Issue 41: every call under ``--save`` (any operation: mkdir, create, write, even a lookup
    that reaches the filesystem) is held; ``save`` of a new iteration (its directory not made yet)
    and the gate return at once, the held calls are the flush thread's, and once the storage
    answers the checkpoint commits.  (Before, the writer made the directory in ``save``.)"""
    root = os.path.join(fault_fs.root, "ckpt")
    with _manager(root) as mgr:
        _register(mgr, 2)
        assert mgr.save(1)
        mgr.wait()
        rule = fault_fs.fault(op="*", path="ckpt/**", hold=True)
        got: dict = {}

        def training_thread():
            t0 = time.perf_counter()
            got["started"] = mgr.save(2)
            mgr.wait_for_snapshot()
            got["took"] = time.perf_counter() - t0

        thread = threading.Thread(target=training_thread)
        try:
            thread.start()
            thread.join(30)
            blocked = fault_fs.wait_blocked(1, timeout=30)  # the flush thread's mkdir, held
        finally:
            fault_fs.clear(rule)
        thread.join(60)
        assert got.get("started") is True and got["took"] < PROMPT_S, got
        assert blocked, "no call reached the filesystem"
        mgr.wait()
    assert committed_iterations(root) == [1, 2]
