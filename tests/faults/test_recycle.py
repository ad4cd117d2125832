"""Rank-file recycling (one process, real files): retention moves retired rank files into a pool,
the next save overwrites one in place, and nothing of the old contents can pass for the new file."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.tiers import tier as tier_mod
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.retention import take_recycled
from datastates_megatron.engine.names import RECYCLE_DIR

from tests.workers.fault_worker import fill, is_state_of, make_state


@pytest.fixture(params=["disk", "tmpfs"])
def base(request, tmp_path):
    """Where checkpoints go: the test's directory (disk), or one on /dev/shm, where the rank files
    are written through kept mappings (``mapped_writes``) and recycling reuses them."""
    return tmp_path if request.param == "disk" else request.getfixturevalue("shm_dir")


def _manager(root, **kw):
    kw.setdefault("recycle_files", "all")  # a single (persistent) tier recycles only when asked to
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _rank_file(root, iteration):
    m = read_manifest(iter_dir(str(root), iteration))
    return os.path.join(iter_dir(str(root), iteration), m.ranks[0].file), m.ranks[0].file_bytes


def _save(mgr, ts, it):
    fill(ts, 0, it)
    mgr.save(it, {"iteration": it})
    mgr.wait()


def test_retired_rank_file_is_overwritten_in_place_and_loads_exactly(base):
    root = base / "ckpt"
    pool = root / RECYCLE_DIR
    ts = make_state(0, 50_000)
    with _manager(root, keep_last=1) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        _save(mgr, ts, 1)
        inode_1 = os.stat(_rank_file(root, 1)[0]).st_ino
        _save(mgr, ts, 2)  # retention retires 1: its rank file goes to the pool
        assert not os.path.exists(iter_dir(str(root), 1))
        assert [os.stat(pool / n).st_ino for n in os.listdir(pool)] == [inode_1]
        _save(mgr, ts, 3)  # reuses it
        path_3, size_3 = _rank_file(root, 3)
        assert os.stat(path_3).st_ino == inode_1 and os.path.getsize(path_3) == size_3
    assert os.listdir(pool) == []  # emptied on close: only keep_last checkpoints hold space

    ts = make_state(0, 50_000)
    with _manager(root, keep_last=1) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        result = mgr.load()  # verifies every checksum
    assert result.iteration == 3 and is_state_of(ts, 0, 3)


def test_the_pool_is_read_on_a_flush_thread_not_in_save(tmp_path, monkeypatch):
    taken = []
    real = tier_mod.take_recycled

    def spy(root, dst):
        ok = real(root, dst)
        taken.append((threading.current_thread().name, ok))
        return ok

    monkeypatch.setattr(tier_mod, "take_recycled", spy)
    root = tmp_path / "ckpt"
    ts = make_state(0, 50_000)
    with _manager(root, keep_last=1) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2, 3):
            _save(mgr, ts, it)
    assert [ok for _, ok in taken] == [False, False, True]  # the third save reused the first one's file
    assert all(name.startswith("dsm-flush-r0") for name, _ in taken), taken  # off the gate's path too


def test_a_larger_stale_file_in_the_pool_is_never_shrunk_and_its_header_never_survives(base):
    """Reused, not truncated smaller (a process mapping it would die of SIGBUS): the new file's
    index and objects go at its old end; the manifest records the padded size."""
    root = base / "ckpt"
    ts = make_state(0, 50_000)
    with _manager(root, keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        _save(mgr, ts, 1)
        path_1, size_1 = _rank_file(root, 1)
        pool = root / RECYCLE_DIR
        os.makedirs(pool)
        stale = pool / "0000001-stale.dsck"
        with open(path_1, "rb") as f:
            junk = f.read() * 3  # a valid-looking header at 0 and far more bytes than a new file has
        stale.write_bytes(junk)
        _save(mgr, ts, 2)
        path_2, size_2 = _rank_file(root, 2)
        assert os.path.getsize(path_2) == size_2 >= len(junk) > size_1
        assert not os.path.exists(stale)
    ts = make_state(0, 50_000)
    with _manager(root, keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        assert mgr.load().iteration == 2 and is_state_of(ts, 0, 2)
        assert mgr.load(1).iteration == 1 and is_state_of(ts, 0, 1)


def test_start_up_empties_a_pool_left_by_a_crash(tmp_path):
    root = tmp_path / "ckpt"
    pool = root / RECYCLE_DIR
    os.makedirs(pool)
    (pool / "0000007-left.dsck").write_bytes(b"x" * 8192)
    with _manager(root, keep_last=1):
        assert os.listdir(pool) == []


def test_by_default_the_persistent_tier_does_not_recycle_so_a_reader_keeps_its_file(tmp_path):
    """A reader outside the job (eval job, CLI) holding a retired checkpoint's file open must keep
    reading what was committed: without a local tier, retention unlinks instead of recycling."""
    root = tmp_path / "ckpt"
    ts = make_state(0, 50_000)
    with _manager(root, keep_last=1, recycle_files="local") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        _save(mgr, ts, 1)
        path, _ = _rank_file(root, 1)
        with open(path, "rb") as reader:
            committed = reader.read()
            for it in (2, 3, 4):
                _save(mgr, ts, it)
            assert not os.path.exists(path) and not (root / RECYCLE_DIR).exists()
            reader.seek(0)
            assert reader.read() == committed


def test_local_retention_keeps_a_checkpoint_until_its_persistent_commit_is_done(tmp_path):
    """The local tier's retention (node's first rank) must not recycle a checkpoint whose promotion
    this rank finished copying but whose persistent commit still waits -- in a multi-rank job, for
    the node's other ranks, still copying their own files of it.  The wait is simulated by holding
    the persistent commit thread; world size 1."""
    import threading

    from datastates_megatron.engine.tiers.tier import committed_iterations

    local, persistent = tmp_path / "local", tmp_path / "persistent"
    ts = make_state(0, 50_000)
    hold = threading.Event()
    with _manager(persistent, keep_last=0, local_root=str(local), persist_interval=1, local_keep_last=1) as mgr:
        real = mgr.persistent._committer._handle
        mgr.persistent._committer._handle = lambda ticket: (hold.wait(30), real(ticket))
        local = pathlib.Path(mgr.local_root)  # this run's directory under the node-local root
        for n, t in ts.items():
            mgr.register(n, t)
        try:
            for it in (1, 2, 3):
                fill(ts, 0, it)
                mgr.save(it, {"iteration": it})
                mgr.wait(persist=False)  # committed locally; promotions copied or queued
            assert not mgr.promotion.in_flight() - {2, 3}  # this rank is done copying 1 ...
            assert committed_iterations(str(persistent)) == []  # ... but its persistent commit waits
            assert committed_iterations(str(local)) == [1, 2, 3]  # so local_keep_last=1 kept 1 (and 2)
            path, size = _rank_file(local, 1)
            assert os.path.getsize(path) == size and not (local / RECYCLE_DIR).exists()
        finally:
            hold.set()
        mgr.wait()
        assert committed_iterations(str(persistent)) == [1, 2, 3]


def test_a_rank_takes_back_a_file_it_retired_before_an_older_one_of_another_rank(tmp_path):
    """Ranks of a node share the pool; the one that retired a file may still have it mapped."""
    pool = tmp_path / RECYCLE_DIR
    os.makedirs(pool)
    (pool / "0000001-r00001-aaaa-000001.dsck").write_bytes(b"1")  # older, rank 1's
    (pool / "0000002-r00000-aaaa-000002.dsck").write_bytes(b"0")  # newer, rank 0's
    dst = tmp_path / "r00000-bbbb-000003.dsck"
    assert take_recycled(str(tmp_path), str(dst)) and dst.read_bytes() == b"0"
    dst2 = tmp_path / "r00000-bbbb-000004.dsck"  # nothing of rank 0's left: any file will do
    assert take_recycled(str(tmp_path), str(dst2)) and dst2.read_bytes() == b"1"
    assert not take_recycled(str(tmp_path), str(tmp_path / "r00000-bbbb-000005.dsck"))
