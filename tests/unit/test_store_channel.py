"""StoreChannel: gather to rank 0, scatter and broadcast from it, over one in-process c10d store
(``HashStore``) shared by N threads standing for N ranks."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import torch.distributed as dist

from datastates_megatron.engine.errors import CheckpointError, CommitError
from datastates_megatron.engine.dist.store_channel import StoreChannel

FIELDS = ("a", "b")


def _world(n: int, body, timeout_s: float = 20.0):
    """Run ``body(channel)`` on n threads, one channel each over one store; results by rank."""
    store = dist.HashStore()
    chans = [StoreChannel(store, r, n, "t", timeout_s) for r in range(n)]
    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(body, c) for c in chans]
        return [f.result(timeout=60) for f in futures], chans, store


def test_gather_reaches_rank0_only_in_rank_order_then_broadcast():
    def body(c):
        cols = c.gather({"a": c.rank, "b": -(c.rank << 40)}, FIELDS)
        out = c.broadcast({"sum": int(cols["a"].sum())} if c.is_root else None)
        return cols and {f: v.tolist() for f, v in cols.items()}, out

    res, _, store = _world(6, body)
    assert res[0][0] == {"a": list(range(6)), "b": [-(r << 40) for r in range(6)]}
    assert all(rows is None for rows, _ in res[1:])
    assert all(out == {"sum": 15} for _, out in res)
    assert store.num_keys() <= 1  # only the last outcome is left (removed at the next gather)


def test_rounds_repeat_and_old_keys_are_removed():
    def body(c):
        got = []
        for i in range(5):
            cols = c.gather({"a": i, "b": c.rank}, FIELDS)
            got.append(
                c.broadcast({"i": i, "n": len(cols["b"]), "a": set(cols["a"].tolist()) == {i}} if c.is_root else None)
            )
        return got

    res, _, store = _world(4, body)
    assert all(got == [{"i": i, "n": 4, "a": True} for i in range(5)] for got in res)
    assert store.num_keys() <= 1


def test_scatter_reaches_the_named_ranks_only():
    def body(c):
        docs = {0: {"to": 0}, 2: {"to": 2}, 3: {"to": 3}} if c.is_root else None
        return c.scatter(docs, expect=c.rank in (0, 2, 3))

    res, _, _ = _world(5, body)
    assert res == [{"to": 0}, None, {"to": 2}, {"to": 3}, None]


def test_bytes_per_other_rank_do_not_grow_with_the_world():
    def body(c):
        c.gather({"a": 1, "b": 2}, FIELDS)
        c.broadcast({"go": True} if c.is_root else None)
        return c.sent + c.received

    small, _, _ = _world(4, body)
    large, _, _ = _world(48, body)
    assert small[1] == large[1] < 400
    assert large[0] > small[0]  # rank 0 receives every row


def test_a_missing_rank_times_out_on_rank0_and_on_the_others():
    store = dist.HashStore()
    chans = [StoreChannel(store, r, 3, "t", 0.3) for r in range(3)]
    # rank 2 never joins
    chans[1].gather({"a": 1, "b": 1}, FIELDS)
    with pytest.raises(CommitError, match="no answer through the store"):
        chans[0].gather({"a": 0, "b": 0}, FIELDS)
    with pytest.raises(CommitError, match="rank 0's outcome"):
        chans[1].broadcast(None)


def test_records_of_another_schema_are_refused():
    store = dist.HashStore()
    a, b = StoreChannel(store, 0, 2, "t", 5), StoreChannel(store, 1, 2, "t", 5)
    b.gather({"x": 1, "b": 1}, ("x", "b"))
    with pytest.raises(CheckpointError, match="other fields"):
        a.gather({"a": 0, "b": 0}, FIELDS)


def test_world_of_one_needs_no_store():
    c = StoreChannel(None, 0, 1, "t", 1)
    assert {f: v.tolist() for f, v in c.gather({"a": 1, "b": 2}, FIELDS).items()} == {"a": [1], "b": [2]}
    assert c.broadcast({"go": 1}) == {"go": 1}
    assert c.scatter({0: {"x": 1}}, expect=True) == {"x": 1}
    with pytest.raises(ValueError):
        StoreChannel(None, 0, 2, "t", 1)


def test_a_gather_waiting_for_a_dead_rank_ends_once_rank0_is_told_it_is_gone():
    """An in-process restart went on without rank 2 (killed): rank 0's commit thread, blocked in a
    gather on a TCPStore connection, is woken by ``forget`` from another thread (on a connection of
    its own: a client's calls queue behind its blocked wait), and counts rank 2 as a row of zeros (a
    failed status); later rounds do not wait for it either."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    chans = [StoreChannel(dist.TCPStore("127.0.0.1", server.port), r, 3, "t", 60.0) for r in range(3)]
    chans[1].gather({"a": 1, "b": 1}, FIELDS)  # rank 2 never sends
    with cf.ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(chans[0].gather, {"a": 5, "b": 5}, FIELDS)
        while server.add("t/0/count", 0) < 2:  # rank 0's row is in: it waits, or is about to
            time.sleep(0.01)
        with pytest.raises(cf.TimeoutError):
            blocked.result(timeout=0.5)
        chans[0].forget([2])
        cols = blocked.result(timeout=10)
    assert {f: v.tolist() for f, v in cols.items()} == {"a": [5, 1, 0], "b": [5, 1, 0]}
    assert chans[0].gone == {2}
    chans[1].gather({"a": 2, "b": 2}, FIELDS)
    assert chans[0].gather({"a": 6, "b": 6}, FIELDS)["a"].tolist() == [6, 2, 0]


def test_a_gone_rank_whose_row_arrived_keeps_it_and_a_live_rank_is_still_awaited():
    store = dist.HashStore()
    chans = [StoreChannel(store, r, 3, "t", 0.5) for r in range(3)]
    chans[2].gather({"a": 2, "b": 2}, FIELDS)  # rank 2 sent, then died
    chans[0].forget([2])
    with pytest.raises(CommitError, match=r"no answer from rank\(s\) \[1\]"):
        chans[0].gather({"a": 0, "b": 0}, FIELDS)  # rank 1 is alive: not counted as gone
    store = dist.HashStore()
    chans = [StoreChannel(store, r, 3, "t", 5.0) for r in range(3)]
    chans[2].gather({"a": 2, "b": 2}, FIELDS)
    chans[1].gather({"a": 1, "b": 1}, FIELDS)
    chans[0].forget([2])
    assert chans[0].gather({"a": 0, "b": 0}, FIELDS)["a"].tolist() == [0, 1, 2]


def test_forget_adds_to_the_ranks_gone_and_a_real_row_of_a_gone_rank_is_not_filled():
    store = dist.HashStore()
    chans = [StoreChannel(store, r, 4, "t", 5.0) for r in range(4)]
    chans[0].forget([2])
    chans[0].forget([3])
    chans[0].forget([])
    assert chans[0].gone == {2, 3}
    chans[1].gather({"a": 1, "b": 1}, FIELDS)
    chans[3].gather({"a": 3, "b": 3}, FIELDS)  # sent before it died
    assert chans[0].gather({"a": 0, "b": 0}, FIELDS)["a"].tolist() == [0, 1, 0, 3]
    assert chans[0].filled == {2}
