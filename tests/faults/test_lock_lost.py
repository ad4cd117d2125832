"""The save directory's lock lost under a live job (issue 33, finding 2): the lock file deleted (or
replaced) while the job holds it lets a second job start on the same ``--save``.  The first job
must notice at its next commit and stop committing -- and so never run retention over the second
job's checkpoints -- and the second job's start-up must not die of entries vanishing while it lists."""

from __future__ import annotations

import os
import shutil

import pytest

from datastates_megatron.engine import CheckpointError, EngineOptions
from datastates_megatron.engine.fs.dirlock import SaveDirLock
from datastates_megatron.engine.errors import LockLostError
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.engine.names import LOCK_NAME, RECYCLE_DIR
from datastates_megatron.engine.tiers import tier as tier_module
from datastates_megatron.engine.tiers.tier import committed_iterations

from tests.workers.fault_worker import fill, make_state


def _manager(root, **kw):
    kw.setdefault("keep_last", 0)
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _registered(mgr, rank=0):
    ts = make_state(rank, 5_000)
    for n, t in ts.items():
        mgr.register(n, t)
    return ts


def _save(mgr, ts, it):
    fill(ts, 0, it)
    ok = mgr.save(it, {"iteration": it})
    mgr.wait()
    return ok


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lock_check_names_the_lock_file_when_it_is_no_longer_the_one_held(tmp_path, how):
    with SaveDirLock(str(tmp_path)) as lock:
        lock.check()  # still ours
        path = tmp_path / LOCK_NAME
        path.unlink()
        if how == "replaced":
            path.write_text("someone else\n")
        with pytest.raises(LockLostError, match=rf"{LOCK_NAME}.*(removed|replaced).*stops committing"):
            lock.check()
        with pytest.raises(LockLostError):  # stays lost: no commit after that
            lock.check()


def test_a_job_whose_lock_was_deleted_stops_committing_and_never_deletes_the_second_jobs_checkpoints(tmp_path, caplog):
    root = tmp_path / "ckpt"
    first = _manager(root, keep_last=1, on_error="warn")
    ts = _registered(first)
    assert _save(first, ts, 1)
    (root / LOCK_NAME).unlink()  # an operator "cleaning up" a live job's lock file
    with _manager(root, keep_last=0) as second:  # a second job now starts on the same --save
        ts2 = _registered(second)
        for it in (10, 11, 12):
            assert _save(second, ts2, it)
        # the first job goes on: its commit is refused, and so its retention never runs
        _save(first, ts, 2)
        _save(first, ts, 3)
        assert committed_iterations(str(root)) == [1, 10, 11, 12]
        assert first.latest_committed == 1
        assert f"{LOCK_NAME}" in caplog.text and "stops committing" in caplog.text
        assert _save(second, ts2, 13)  # the second job is unaffected
        pool = root / RECYCLE_DIR
        pool.mkdir(exist_ok=True)
        (pool / f"0000011-{rank_file_name(0, 'a' * 16, 3)}").write_bytes(b"the second job's retired file")
        first.close()  # does not empty a pool the second job may be using
        assert len(os.listdir(pool)) == 1
    assert committed_iterations(str(root)) == [1, 10, 11, 12, 13]
    assert not os.path.exists(iter_dir(str(root), 2)) and not os.path.exists(iter_dir(str(root), 3))


def test_with_on_error_raise_the_lost_lock_is_raised_on_the_training_thread(tmp_path):
    root = tmp_path / "ckpt"
    with _manager(root, on_error="raise") as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1)
        (root / LOCK_NAME).unlink()
        with pytest.raises(CheckpointError, match=r"lock"):
            _save(mgr, ts, 2)
    assert committed_iterations(str(root)) == [1]


def test_start_up_cleanup_tolerates_directories_that_vanish_while_it_lists(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    with _manager(root) as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1)
        _save(mgr, ts, 2)
    # leftovers of ours: an uncommitted directory, a stray temp beside a committed checkpoint
    os.makedirs(iter_dir(str(root), 3))
    (tmp_path / "ckpt" / "iter_0000003" / "manifest.json.tmp-1").write_bytes(b"x")
    (tmp_path / "ckpt" / "iter_0000002" / "manifest.json.tmp-1").write_bytes(b"x")
    real = os.listdir
    vanish = {iter_dir(str(root), 3), iter_dir(str(root), 1)}

    def listdir(path="."):
        path = os.fspath(path)
        if path in vanish:  # another job's retention removes it just now
            vanish.discard(path)
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with _manager(root) as mgr:  # no raw FileNotFoundError
        ts = _registered(mgr)
        _save(mgr, ts, 4)
    monkeypatch.setattr(os, "listdir", real)
    assert committed_iterations(str(root)) == [2, 4]
    assert tier_module.survey(str(root)).damaged == {}


def test_a_dead_holder_whose_forked_child_keeps_the_lock_is_not_named_as_the_holder(tmp_path):
    import signal

    from datastates_megatron.engine.errors import SaveDirBusyError

    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:  # the job: takes the lock, forks a helper (which inherits it), then dies
        try:
            os.close(r)
            SaveDirLock(str(tmp_path)).acquire()
            child = os.fork()
            if child == 0:
                signal.pause()
                os._exit(0)
            os.write(w, f"{child}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child = int(f.readline())
    os.waitpid(holder, 0)
    try:
        with pytest.raises(SaveDirBusyError) as err:
            SaveDirLock(str(tmp_path)).acquire()
        msg = str(err.value)
        assert f"pid {holder}" in msg and "no longer running" in msg and str(child) in msg, msg
    finally:
        os.kill(child, signal.SIGKILL)


def _two_ranks_lock_deleted(args) -> dict:
    """Forked rank: iteration 1 commits; rank 0's lock file is then deleted; saves 2 and 3 follow."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, report = args
    ts = make_state(rank, 5_000)
    out = {}
    with _manager(root, keep_last=1, on_error="warn") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        fill(ts, rank, 1)
        mgr.save(1)
        mgr.wait()
        if rank == 0:
            os.unlink(os.path.join(root, LOCK_NAME))
        dist.barrier()
        for it in (2, 3):
            fill(ts, rank, it)
            mgr.save(it)
            mgr.wait()
        out["latest"] = mgr.latest_committed
    with open(f"{report}.rank{rank}", "w") as f:
        json.dump(out, f)
    return out


def test_with_two_ranks_every_rank_stops_committing_once_the_lock_is_lost(tmp_path):
    import json

    from tests.distributed.ranks import describe, run_ranks

    root, report = str(tmp_path / "ckpt"), str(tmp_path / "report")
    res = run_ranks(_two_ranks_lock_deleted, 2, [root, report], timeout=120)
    assert all(r["returncode"] == 0 for r in res), describe(res)  # no rank waits forever, none dies
    for rank in (0, 1):
        assert json.loads((tmp_path / f"report.rank{rank}").read_text())["latest"] == 1
    assert committed_iterations(root) == [1]
