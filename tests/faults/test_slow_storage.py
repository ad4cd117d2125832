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
    """``when_behind="wait"``: the back-pressure (the default skips: test_skip_when_behind.py)."""
    _slow_writes(monkeypatch, 0.03)
    with _manager(tmp_path / "c", cache_mb=16, max_inflight=1, when_behind="wait") as mgr:
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
    each raise ``CacheTimeoutError`` within about ``timeout_s`` (1 s here), with ``when_behind="wait"``
    (the default skips those saves instead: test_skip_when_behind.py)."""
    unblock = threading.Event()
    _slow_writes(monkeypatch, 0.0, block=unblock)
    watchdog = threading.Timer(12.0, unblock.set)
    watchdog.start()
    mgr = _manager(tmp_path / "c", cache_mb=1, timeout_s=1.0, when_behind="wait")
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


def _syscall_of(thread: threading.Thread) -> int | None:
    """The number of the syscall ``thread`` is blocked in (``/proc``), None when it runs in user space."""
    with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
        first = f.read().split()[0]
    return None if first == "running" or first.startswith("-") else int(first)


def test_a_stalled_write_on_a_real_filesystem_blocks_the_flush_thread_not_save(fault_fs):
    """Through the fault filesystem, the first write of checkpoint 1 stalls 5 s in the kernel: the
    training thread's ``save()`` and gate return at once (the cache holds the state), a flush thread
    is the one blocked in the syscall, and the checkpoint commits once the write returns."""
    import os

    root = os.path.join(fault_fs.root, "ckpt")
    rule = fault_fs.fault("write", "ckpt/iter_0000001/**", stall_s=5.0, times=1)
    with _manager(root, cache_mb=16) as mgr:
        for n, t in _state(4).items():
            mgr.register(n, t)
        t0 = time.perf_counter()
        t_call, t_gate = _save_and_gate(mgr, 1)
        assert fault_fs.wait_blocked(1, timeout=30), "no write reached the filesystem"
        t_blocked = time.perf_counter() - t0
        flush = [t for t in threading.enumerate() if t.name.startswith("dsm-flush-")]
        in_syscall = {t.name: _syscall_of(t) for t in flush}
        assert mgr.poll() == []  # not committed while the write is stalled; poll does not wait
        (rec,) = mgr.wait()
        t_commit = time.perf_counter() - t0
    assert fault_fs.hits(rule) == 1
    # save() and the gate came back well within the 5 s stall, and the write was still stalled after
    assert t_call < 2.0 and t_gate < 2.5, (t_call, t_gate)
    assert t_blocked < 5.0, t_blocked
    import platform

    pwrite = {"x86_64": 18, "aarch64": 68}.get(platform.machine())  # pwrite64's syscall number
    if pwrite is not None:
        assert pwrite in in_syscall.values(), f"no flush thread is blocked in pwrite64: {in_syscall}"
    assert rec.iteration == 1 and t_commit >= 5.0, t_commit
    print(f"save {t_call:.3f}s, gate {t_gate:.3f}s, write blocked at {t_blocked:.3f}s, committed at {t_commit:.2f}s")


def test_a_slow_real_filesystem_is_hidden_by_a_cache_that_holds_the_state(fault_fs):
    """A slow target (0.5 s per MiB written, in the fault filesystem's write calls): with a cache
    that holds the 4 MiB state, the gate does not wait for it; the flush does."""
    import os

    root = os.path.join(fault_fs.root, "ckpt")
    rule = fault_fs.fault("write", "ckpt/iter_*/**", s_per_mib=0.5)
    with _manager(root, cache_mb=16) as mgr:
        for n, t in _state(4).items():
            mgr.register(n, t)
        t_call, stall = _save_and_gate(mgr, 1)
        (rec,) = mgr.wait()
        assert mgr.engine.cache.wait_seconds == 0
    assert fault_fs.hits(rule) >= 4
    assert rec.flush_s >= 0.9 * 4 * 0.5 / 2, rec.flush_s  # 4 MiB at 0.5 s/MiB, two flush threads at once
    assert stall < 0.5 * rec.flush_s, (stall, rec.flush_s)


def _close_quietly(mgr) -> None:
    try:
        mgr.close()
    except CacheTimeoutError:
        pass


def test_a_write_held_by_a_real_filesystem_is_a_bounded_error_not_a_hang(fault_fs, caplog):
    """Through the fault filesystem every write of checkpoint 1 is held until the test lets go:
    waiting for it raises ``CacheTimeoutError`` after about ``timeout_s`` (1 s), ``close()`` returns
    within 10 s saying what it gave up on (the file, the seconds), and nothing is committed;
    released, the blocked flush threads end and close the abandoned file (no descriptor left)."""
    import logging
    import os

    root = os.path.join(fault_fs.root, "ckpt")
    rule = fault_fs.fault("write", "ckpt/iter_0000001/**", hold=True)
    mgr = _manager(root, cache_mb=1, timeout_s=1.0)
    closer = threading.Thread(target=_close_quietly, args=(mgr,), name="test-closer")
    caplog.set_level(logging.WARNING, logger="datastates_megatron")
    try:
        for n, t in _state(4).items():
            mgr.register(n, t)
        mgr.save(1)
        assert fault_fs.wait_blocked(1, timeout=30), "no write reached the filesystem"
        t0 = time.perf_counter()
        with pytest.raises(CacheTimeoutError, match=r"rank 0: "):
            mgr.wait()
        assert time.perf_counter() - t0 < 5.0
        closer.start()  # on a thread of its own: a close() that never returns must not hang the test
        closer.join(10.0)
        closed_in_time = not closer.is_alive()
        still_held = fault_fs.stats()["blocked"]
    finally:
        fault_fs.release(rule)
        if closer.is_alive() or not closer.ident:
            closer.join(60) if closer.ident else _close_quietly(mgr)
    assert closed_in_time, "close() did not return within 10 s while the filesystem held a write"
    assert still_held >= 1  # close() returned while the write was still held
    gave_up = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
    assert any("iter_0000001/r00000-" in m and " s in flight" in m for m in gave_up), gave_up
    for t in [t for t in threading.enumerate() if t.name.startswith("dsm-")]:
        t.join(120)  # the held writes returned: the flush threads end (a loaded machine is slow to)
        assert not t.is_alive(), f"{t.name} still blocked after the release"
    assert committed_iterations(root) == []
    leaked = [p for p in _open_paths() if p.startswith(fault_fs.root + "/")]
    assert not leaked, f"descriptors left open on the mount after close(): {leaked}"


_EXIT_SCRIPT = """
import sys, threading, time, torch
from datastates_megatron.engine import CacheTimeoutError, EngineOptions
from datastates_megatron.engine.format import writer
from datastates_megatron.engine.manager import CheckpointManager

never = threading.Event()
real = writer.RankFileWriter.write
def write(self, data, offset):
    never.wait()  # a write the storage never returns
    return real(self, data, offset)
writer.RankFileWriter.write = write
opts = EngineOptions(cache_bytes=1 << 20, flush_threads=2, chunk_bytes=1 << 18, timeout_s=1.0)
mgr = CheckpointManager(sys.argv[1], opts, keep_last=0, on_error="warn")
mgr.register("w", torch.ones(1 << 18))
mgr.save(1)
if sys.argv[2] == "close":
    t0 = time.perf_counter()
    try:
        mgr.close()
    except CacheTimeoutError as e:  # close() raises what it gave up on
        print(f"close raised {e}", flush=True)
    print(f"closed after {time.perf_counter() - t0:.1f} s", flush=True)
print("main thread done", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_whose_write_never_returns_still_exits(tmp_path, how):
    """A child process whose rank-file writes never return: ``close()`` (or the interpreter's exit,
    which closes the manager) gives up after ``timeout_s`` (1 s), and the process exits -- the
    threads left in the write are daemons, never joined -- well within 60 s; nothing is committed."""
    import os
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, root, how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    took = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    assert "main thread done" in done.stdout and took < 60.0, (took, done.stdout, done.stderr[-3000:])
    assert "gave up" in done.stderr and "in flight" in done.stderr, done.stderr[-3000:]
    assert committed_iterations(root) == []


def _open_paths() -> list[str]:
    """What this process's file descriptors point to (``/proc/self/fd``)."""
    import os

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out
