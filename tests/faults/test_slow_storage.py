"""Slow or stuck storage (an injected delay in RankFileWriter.write), one process, real files.

Slow storage must cost training only what the host cache cannot absorb: with a cache that holds the
state the gate does not wait for the disk; with a smaller one the wait is bounded by the flush (and
recorded in ``cache.wait_seconds`` / ``slot_wait_s``).  Storage that stops answering becomes a
``CacheTimeoutError`` after ``timeout_s``, never a hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from datastates_megatron.engine import CacheTimeoutError, EngineOptions
from datastates_megatron.engine.format import writer
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.tier import committed_iterations

MiB = 1 << 20


def _slow_writes(monkeypatch, delay_s: float, block: threading.Event | None = None, block_s: float = 30.0):
    real = writer.RankFileWriter.write
    stats = {"writes": 0}

    def write(self, data, offset):
        if block is not None:
            block.wait(block_s)
        time.sleep(delay_s)
        stats["writes"] += 1
        return real(self, data, offset)

    monkeypatch.setattr(writer.RankFileWriter, "write", write)
    return stats


def _manager(root, cache_mb: float, **kw):
    opts = EngineOptions(
        cache_bytes=int(cache_mb * MiB),
        flush_threads=2,
        chunk_bytes=MiB // 4,
        timeout_s=kw.pop("timeout_s", 60),
        max_inflight=kw.pop("max_inflight", 2),
    )
    return CheckpointManager(str(root), opts, keep_last=0, **kw)


def _state(mb: int = 8):
    return {f"w{i}": torch.full((MiB // 4,), float(i)) for i in range(mb)}  # 1 MiB tensors


def _save_and_gate(mgr, it):
    t0 = time.perf_counter()
    mgr.save(it)
    t_call = time.perf_counter() - t0
    mgr.wait_for_snapshot()
    return t_call, time.perf_counter() - t0


def test_cache_that_holds_the_state_hides_slow_storage(tmp_path, monkeypatch):
    stats = _slow_writes(monkeypatch, 0.05)
    with _manager(tmp_path / "c", cache_mb=16) as mgr:
        for n, t in _state().items():
            mgr.register(n, t)
        t_call, stall = _save_and_gate(mgr, 1)
        t0 = time.perf_counter()
        (rec,) = mgr.wait()
        flush = rec.flush_s
        assert mgr.engine.cache.wait_seconds == 0
    injected = stats["writes"] * 0.05 / 2  # two flush threads
    assert flush >= injected * 0.9
    assert stall < 0.5 * flush, (
        f"the gate waited {stall:.3f}s for a {flush:.3f}s flush although the cache holds the state"
    )
    assert time.perf_counter() - t0 <= flush + 1.0


def test_cache_smaller_than_the_state_gives_a_bounded_recorded_wait(tmp_path, monkeypatch):
    stats = _slow_writes(monkeypatch, 0.02)
    with _manager(tmp_path / "c", cache_mb=1) as mgr:
        for n, t in _state().items():
            mgr.register(n, t)
        t_call, stall = _save_and_gate(mgr, 1)
        (rec,) = mgr.wait()
        cache = mgr.engine.cache
        assert 0 < cache.peak_used <= cache.capacity
        assert cache.wait_seconds > 0  # backpressure, recorded
    injected = stats["writes"] * 0.02 / 2
    # training waited for the part of the state that did not fit, never for more than the whole flush
    assert 0.3 * injected < stall <= rec.flush_s + 0.5, (stall, injected, rec.flush_s)
    assert cache.wait_seconds <= stall + 0.5
    assert t_call < 0.5, t_call  # save() itself never waits for the disk


def test_in_flight_limit_is_a_bounded_recorded_wait(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, 0.03)
    with _manager(tmp_path / "c", cache_mb=16, max_inflight=1) as mgr:
        for n, t in _state().items():
            mgr.register(n, t)
        mgr.save(1)
        t0 = time.perf_counter()
        mgr.save(2)  # waits for version 1 to become durable
        waited = time.perf_counter() - t0
        records = mgr.wait()
        assert [r.iteration for r in records] == [1, 2]
        assert mgr.engine.slot_wait_s > 0.05 and abs(mgr.engine.slot_wait_s - waited) < 0.25
        assert waited <= records[0].flush_s + 0.5


def test_stuck_storage_becomes_an_error_not_a_hang(tmp_path, monkeypatch):
    """Every write blocks (until the test lets go, 12 s later): waiting, saving again and closing must
    each raise ``CacheTimeoutError`` within about ``timeout_s`` (1 s here)."""
    unblock = threading.Event()
    _slow_writes(monkeypatch, 0.0, block=unblock)
    watchdog = threading.Timer(12.0, unblock.set)
    watchdog.start()
    mgr = _manager(tmp_path / "c", cache_mb=1, timeout_s=1.0)
    try:
        for n, t in _state().items():
            mgr.register(n, t)
        mgr.save(1)
        t0 = time.perf_counter()
        with pytest.raises(CacheTimeoutError, match=r"rank 0: .*not (durable|committed) after 1s"):
            mgr.wait()
        assert time.perf_counter() - t0 < 3.0
        t0 = time.perf_counter()
        with pytest.raises(CacheTimeoutError, match=r"rank 0: "):
            for it in (2, 3, 4):  # the training loop keeps checkpointing: it gets an error, bounded
                mgr.save(it)
        assert time.perf_counter() - t0 < 5.0
        t0 = time.perf_counter()
        try:
            mgr.close()
        except CacheTimeoutError:
            pass
        closed_after = time.perf_counter() - t0
        assert closed_after < 5.0, f"close() hung {closed_after:.1f}s on the stuck write (until the test let it go)"
    finally:
        unblock.set()
        watchdog.cancel()
        try:
            mgr.close()
        except Exception:  # noqa: BLE001
            pass
    assert committed_iterations(str(tmp_path / "c")) == []
