"""Issue 41, item 7, finding 1: ``close()`` returns, within a bound, when a promotion cannot go on --
another process holds every promotion slot of the node, or ``promote_mbps`` is tiny -- and says
what it gave up on.  Before, ``Promotion.close()`` joined its thread without a timeout, and the
thread waited in ``flock(LOCK_EX)`` (or slept in the pacing) for ever."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

import pytest
import torch

from datastates_megatron.engine import CheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.promote_throttle import PROMOTE_SLOT_PREFIX
from datastates_megatron.engine.tiers.tier import committed_iterations

CLOSE_TIMEOUT_S = 2.0
BOUND_S = 60.0  # close()'s bound here: a few timeouts plus the promotion's grace, with room to spare


def _manager(tmp_path, **policy) -> CheckpointManager:
    mgr = CheckpointManager(
        str(tmp_path / "persistent"),
        EngineOptions(cache_bytes=1 << 20, timeout_s=30),
        keep_last=0,
        local_root=str(tmp_path / "local"),
        persist_interval=1,
        **policy,
    )
    mgr.register("w", torch.ones(4096))
    return mgr


def _close_in_thread(mgr) -> tuple[bool, float, BaseException | None]:
    """Close ``mgr`` on a thread; returns whether it returned within ``BOUND_S``, when, and what it raised."""
    raised: list[BaseException] = []

    def close():
        try:
            mgr.close(CLOSE_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            raised.append(e)

    t0 = time.perf_counter()
    closer = threading.Thread(target=close, name="test-close", daemon=True)
    closer.start()
    closer.join(BOUND_S)
    return not closer.is_alive(), time.perf_counter() - t0, raised[0] if raised else None


def _hold_slots(local_root: str, slots: int) -> list[int]:
    """Another holder of every promotion slot of the node (flock locks are per open file: these
    conflict with the manager's own, as another process's would)."""
    fds = []
    for i in range(slots):
        fd = os.open(os.path.join(local_root, f"{PROMOTE_SLOT_PREFIX}{i}"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    return fds


def test_close_returns_when_another_process_holds_every_promotion_slot(tmp_path, caplog):
    mgr = _manager(tmp_path, promote_slots=2)
    fds = _hold_slots(mgr.local_root, 2)
    try:
        mgr.save(1)
        mgr.wait(persist=False)  # committed locally: its promotion is queued
        with caplog.at_level(logging.WARNING):
            returned, seconds, raised = _close_in_thread(mgr)
        assert returned, f"close() still waiting after {BOUND_S:.0f} s (promotion slots held by another process)"
        assert raised is None or isinstance(raised, CheckpointError), raised
        said = caplog.text
        assert "promotion slot" in said and "iteration 1" in said, said
        assert committed_iterations(mgr.local_root) == [1]  # the local checkpoint stays
        assert committed_iterations(str(tmp_path / "persistent")) == []  # nothing half-promoted
    finally:
        for fd in fds:
            os.close(fd)


def test_close_returns_when_promotion_is_paced_to_almost_nothing(tmp_path, caplog):
    mgr = _manager(tmp_path, promote_mbps=1e-6)  # one byte a second
    mgr.save(1)
    mgr.wait(persist=False)
    with caplog.at_level(logging.WARNING):
        returned, seconds, raised = _close_in_thread(mgr)
    assert returned, f"close() still waiting after {BOUND_S:.0f} s (promotion paced to 1 B/s)"
    assert raised is None or isinstance(raised, CheckpointError), raised
    assert "paced" in caplog.text and "iteration 1" in caplog.text, caplog.text
    assert committed_iterations(mgr.local_root) == [1]
    left = (
        [n for n in os.listdir(os.path.join(str(tmp_path / "persistent"), "iter_0000001"))]
        if os.path.isdir(os.path.join(str(tmp_path / "persistent"), "iter_0000001"))
        else []
    )
    assert not [n for n in left if n.endswith(".promoting")], left


@pytest.mark.parametrize("what", ["queue thread", "deleter"])
def test_a_queue_thread_close_is_bounded_and_names_what_it_gave_up(what, caplog):
    """What the committer and the promotion are built on, and the deleter itself: ``close(timeout)``
    returns after ``timeout`` with the thread still stuck, and says so."""
    from datastates_megatron.engine.runtime.threads import QueueThread
    from datastates_megatron.engine.tiers.deleter import Deleter

    release = threading.Event()

    def stuck(item):
        release.wait(BOUND_S)

    if what == "deleter":
        t = Deleter(0, stuck)
        name = "dsm-delete-r0"
    else:

        class Stuck(QueueThread):
            def _handle(self, item):
                stuck(item)

        t, name = Stuck("dsm-test-queue"), "dsm-test-queue"
    t.put(1)
    t.put(2)
    try:
        with caplog.at_level(logging.ERROR):
            t0 = time.perf_counter()
            ended = t.close(0.2)
        assert not ended and time.perf_counter() - t0 < BOUND_S / 2
        assert name in caplog.text and "item(s) still queued" in caplog.text, caplog.text
    finally:
        release.set()
        assert t.close(BOUND_S)


def test_a_daemon_pool_runs_calls_in_order_and_never_holds_an_exit():
    """``DaemonPool``: results and errors through the futures; its threads are daemons (a call that
    never returns is not joined at interpreter exit); ``shutdown(wait=False)`` returns at once
    while a call is stuck, and what was queued before still runs once it returns."""
    from datastates_megatron.engine.runtime.threads import DaemonPool

    pool = DaemonPool(1, "dsm-test-pool")
    stuck, release = threading.Event(), threading.Event()

    def hold():
        stuck.set()
        release.wait(60)
        return "held"

    def boom():
        raise ValueError("boom")

    try:
        assert all(t.daemon and t.name.startswith("dsm-test-pool_") for t in pool.threads)
        first = pool.submit(hold)
        assert stuck.wait(30)
        queued = [pool.submit(lambda i=i: i) for i in range(3)] + [pool.submit(boom)]
        t0 = time.perf_counter()
        pool.shutdown(wait=False)
        assert time.perf_counter() - t0 < 1.0 and not first.done()
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(hold)
    finally:
        release.set()
    assert first.result(30) == "held" and [f.result(30) for f in queued[:3]] == [0, 1, 2]
    with pytest.raises(ValueError, match="boom"):
        queued[3].result(30)
    for t in pool.threads:
        t.join(30)
        assert not t.is_alive()
