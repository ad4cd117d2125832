"""The promotion throttle (``engine/tiers/promote_throttle.py``): at most ``slots`` ranks of a node copy to the
persistent tier at once, a dead holder frees its slot, and a bandwidth cap spaces a copy's blocks."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import pytest

from datastates_megatron.engine.tiers import promotion
from datastates_megatron.engine.format import verified_copy
from datastates_megatron.engine.tiers.commit import Ticket
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.engine.tiers.promote_throttle import Pace, PromoteSlots
from datastates_megatron.engine.tiers.tier import Tier

from .rank_files import write_rank_file

TOKEN, RANKS = "00000000000000bb", 4


def _promote_node(tmp_path, slots: int, monkeypatch) -> tuple[int, list]:
    """Four ranks of one node (one local tier directory) each promote their file of iteration 1 on
    their own promotion thread; returns the most copies seen at once and the receipts.  Each copy
    waits (up to 2 s) for a second one to be copying at the same time: with no cap two always
    meet, under a cap of 1 none can."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    for r in range(RANKS):
        path = os.path.join(iter_dir(local, 1), rank_file_name(r, TOKEN, 1))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_rank_file(path, tensors=2, numel=1000, seed=r, cache_bytes=1 << 20)
    os.makedirs(persistent)
    lock, active, peak = threading.Lock(), [0], [0]
    meet = threading.Barrier(2)
    real = verified_copy.copy_verified

    def observed(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            meet.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass  # alone: under a cap, as it must be (later waits return at once)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(verified_copy, "copy_verified", observed)
    links = []
    for r in range(RANKS):
        src = Tier("local", local, rank=r, token=TOKEN, writes=[])
        dst = Tier("persistent", persistent, rank=r, token=TOKEN, writes=[])
        links.append(promotion.Promotion(src, dst, interval=1, slots=slots))
    futures = [cf.Future() for _ in links]
    try:
        for link, future in zip(links, futures):
            link.put((1, Ticket(1, 1, future, {}, 0.0, TOKEN), future))
        receipts = [f.result(timeout=60) for f in futures]
    finally:
        for link in links:
            link.close()
    return peak[0], receipts


def test_with_one_slot_a_node_copies_one_file_at_a_time(tmp_path, monkeypatch):
    peak, receipts = _promote_node(tmp_path, 1, monkeypatch)
    assert peak == 1
    assert sorted(os.listdir(iter_dir(str(tmp_path / "persistent"), 1))) == sorted(
        rank_file_name(r, TOKEN, 1) for r in range(RANKS)
    )
    assert all(r.file_bytes > 0 for r in receipts)


def test_without_a_cap_the_copies_overlap(tmp_path, monkeypatch):
    peak, _ = _promote_node(tmp_path, 0, monkeypatch)
    assert peak >= 2


def test_a_holder_that_dies_frees_its_slot(tmp_path):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: takes the only slot, says so, and is killed holding it
        try:
            with PromoteSlots(str(tmp_path), 1, 1).held():
                os.write(w, b"1")
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    with PromoteSlots(str(tmp_path), 1, 0) as slots, slots.held() as got:
        assert got == 0


def test_a_slot_name_taken_by_a_link_is_left_alone_and_the_copy_goes_uncapped(tmp_path, caplog):
    os.symlink("/etc/passwd", tmp_path / ".promote-slot-0")
    with PromoteSlots(str(tmp_path), 2, 0) as slots, slots.held() as got:
        assert got is None
    assert os.path.islink(tmp_path / ".promote-slot-0") and "promoting without a cap" in caplog.text


def test_a_bandwidth_cap_spaces_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(verified_copy, "_COPY_BLOCK", 1 << 20)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_rank_file(src, tensors=2, numel=1_000_000, seed=1, cache_bytes=8 << 20)  # 8 MB: 8 blocks
    size = os.path.getsize(src)
    pace = Pace(40)  # MB/s
    calls = []
    real = pace.__class__.__call__
    monkeypatch.setattr(Pace, "__call__", lambda self, n: calls.append(n) or real(self, n))
    t0 = time.perf_counter()
    verified_copy.copy_verified(src, dst, 1, pace)
    assert sum(calls) == size and len(calls) >= 8
    assert time.perf_counter() - t0 >= 0.95 * size / 40e6
    assert open(src, "rb").read() == open(dst, "rb").read()


@pytest.mark.parametrize("bad", [-1, "x"])
def test_bad_throttle_options_are_named(bad):
    from datastates_megatron.engine import OptionsError
    from datastates_megatron.engine.options import ManagerOptions

    with pytest.raises(OptionsError, match="promote_slots"):
        ManagerOptions(promote_slots=bad)
    with pytest.raises(OptionsError, match="promote_mbps"):
        ManagerOptions(promote_mbps=bad)
