"""Write failures on the save path (issue 33, finding 4; issue 41): an unwritable save directory
(EACCES, EROFS, ``chattr +i``: injected, we run as root) or a path the file system cannot name never
reaches the training thread as a raw ``OSError``.  ``save()`` makes no storage call on the training
thread (the iteration directory is made on a flush thread), so it returns ``True`` (started) and the
error comes through the commit: every rank abandons that checkpoint, nothing of it commits, the
error is one :class:`CheckpointError` line naming the rank, the directory, the operation and the
errno, handled by ``on_error`` at the caller's next ``save``/``poll``/``wait``/``close`` (logged
under ``warn``, raised under ``raise``), and the next save commits."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from datastates_megatron.cli import main
from datastates_megatron.engine import CheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from tests.workers.fault_worker import fill, make_state


def _manager(root, **kw):
    kw.setdefault("keep_last", 0)
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _deny_mkdir_of(monkeypatch, target: str, err: int):
    """``mkdir`` of ``target`` fails with ``err`` (what a read-only mount or ``chattr +i`` gives)."""
    real = os.mkdir

    def mkdir(path, *a, **kw):
        if os.path.abspath(path) == os.path.abspath(target):
            raise OSError(err, os.strerror(err), path)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS, errno.EPERM])
def test_unwritable_save_dir_is_warned_skipped_and_the_next_save_commits(tmp_path, monkeypatch, caplog, err):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with _manager(root, on_error="warn") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        fill(ts, 0, 1)
        assert mgr.save(1) is True
        mgr.wait()
        with monkeypatch.context() as m:
            _deny_mkdir_of(m, iter_dir(str(root), 2), err)
            fill(ts, 0, 2)
            assert mgr.save(2) is True  # started: the mkdir is not on the training thread
            mgr.wait()  # the error surfaces here, logged (on_error=warn), never raised
            assert not os.path.exists(iter_dir(str(root), 2))
        fill(ts, 0, 3)
        assert mgr.save(3) is True
        mgr.wait()
    assert committed_iterations(str(root)) == [1, 3]
    lines = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "iter_0000002" in r.getMessage()
    ]
    assert len(lines) == 1, lines  # one line, no traceback
    line = lines[0]
    assert "rank 0" in line and "mkdir" in line and errno.errorcode[err] in line and os.strerror(err) in line
    assert "\n" not in line and "Traceback" not in caplog.text


def test_unwritable_save_dir_raises_a_checkpoint_error_and_the_next_save_still_commits(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with _manager(root, on_error="raise") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        with monkeypatch.context() as m:
            _deny_mkdir_of(m, iter_dir(str(root), 1), errno.EACCES)
            assert mgr.save(1) is True  # started: the mkdir runs on a flush thread
            with pytest.raises(
                CheckpointError, match=r"rank 0: .*iter_0000001.*mkdir.*EACCES.*Permission denied"
            ) as got:
                mgr.wait()  # the next call after the failure raises it
            assert "Traceback" not in str(got.value)
        mgr.wait()  # raised once: nothing more pending
        assert committed_iterations(str(root)) == []
        fill(ts, 0, 2)
        assert mgr.save(2) is True  # the committer did not wait forever for save 1's sequence number
        mgr.wait()
    assert committed_iterations(str(root)) == [2]


def test_the_error_of_a_failed_mkdir_is_raised_by_the_next_save_when_no_wait_came_between(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with _manager(root, on_error="raise") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        with monkeypatch.context() as m:
            _deny_mkdir_of(m, iter_dir(str(root), 1), errno.EROFS)
            assert mgr.save(1) is True
            mgr.persistent.drain(
                30
            )  # committed (abandoned) on the commit thread; the error is stored, not yet surfaced
        fill(ts, 0, 2)
        with pytest.raises(CheckpointError, match=r"rank 0: .*iter_0000001.*mkdir.*EROFS"):
            mgr.save(2)  # raised before anything of iteration 2 starts
        fill(ts, 0, 3)
        assert mgr.save(3) is True
        mgr.wait()
    assert committed_iterations(str(root)) == [3]


def test_a_failed_mkdir_not_yet_surfaced_is_raised_by_close(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    mgr = _manager(root, on_error="raise")
    for n, t in ts.items():
        mgr.register(n, t)
    with monkeypatch.context() as m:
        _deny_mkdir_of(m, iter_dir(str(root), 1), errno.EIO)
        assert mgr.save(1) is True
        with pytest.raises(CheckpointError, match=r"rank 0: .*iter_0000001.*mkdir.*EIO"):
            mgr.close()
    assert committed_iterations(str(root)) == []
    assert not os.path.exists(iter_dir(str(root), 1))


def test_a_path_component_over_255_bytes_is_a_clear_error(tmp_path, capsys):
    root = tmp_path / ("x" * 300) / "ckpt"
    with pytest.raises(CheckpointError, match=r"longer than .*255"):
        _manager(root)
    for command in ("ls", "verify", "inspect"):
        assert main([command, str(root / "iter_0000001")]) != 0
        err = capsys.readouterr().err
        assert "no such" not in err and "255" in err and "Traceback" not in err, (command, err)


def test_a_root_too_long_for_the_files_it_would_hold_is_refused_at_start(tmp_path):
    # components of 200 bytes up to ~4050 bytes in all: the directory can be made, a rank file in it cannot
    root = str(tmp_path)
    while len(root) < 4096 - 60:
        root = os.path.join(root, "d" * min(200, 4096 - 60 - len(root)))
    os.makedirs(root)
    before = sorted(os.listdir(root))
    with pytest.raises(CheckpointError, match=r"too long"):
        _manager(root)
    assert sorted(os.listdir(root)) == before  # no empty iteration directories left behind


def _two_ranks_one_cannot_mkdir(args) -> dict:
    """Forked rank: iteration 2's directory cannot be made by rank 0, its writer (EACCES), on its
    flush thread after save() returned; the other rank makes it on its own flush thread (it is
    missing), on_error=warn."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = args[0]
    ts = make_state(rank, 5_000)
    out = {"saved": {}}
    with _manager(root, on_error="warn") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2, 3):
            fill(ts, rank, it)
            if it == 2 and rank == 0:
                real = os.makedirs

                def makedirs(path, *a, **kw):
                    if os.path.basename(path) == "iter_0000002":
                        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
                    return real(path, *a, **kw)

                os.makedirs = makedirs
                try:
                    out["saved"][it] = mgr.save(it)
                    mgr.wait()  # the flush thread's mkdir fails in here
                finally:
                    os.makedirs = real
            else:
                out["saved"][it] = mgr.save(it)
                mgr.wait()
        out["committed"] = mgr.committed()
    with open(f"{args[1]}.rank{rank}", "w") as f:  # not stdout: pytest's capture owns sys.stdout here
        json.dump(out, f)
    return out


def test_one_rank_failing_to_make_the_directory_makes_every_rank_skip_that_iteration(tmp_path):
    from tests.distributed.ranks import describe, run_ranks

    root, report = str(tmp_path / "ckpt"), str(tmp_path / "report")
    res = run_ranks(_two_ranks_one_cannot_mkdir, 2, [root, report], timeout=120)
    assert all(r["returncode"] == 0 for r in res), describe(res)
    got = [json.loads((tmp_path / f"report.rank{rank}").read_text()) for rank in (0, 1)]
    assert got[0]["saved"] == {"1": True, "2": True, "3": True}  # started; 2 failed after save() returned
    for r in got:
        assert r["committed"] == [1, 3], r  # in step: 2 skipped on every rank, 3 commits
    assert committed_iterations(root) == [1, 3]


def _read_only(path: str, on: bool) -> None:
    """Make ``path`` read-only by mounting a read-only bind of it over itself (a remount of the
    whole file system would be refused while the job holds its lock file open for writing), or
    writable again by unmounting that bind."""
    import subprocess

    if on:
        subprocess.run(["mount", "--bind", path, path], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True, capture_output=True)
    else:
        subprocess.run(["umount", path], check=True, capture_output=True)


def test_a_save_dir_made_read_only_mid_run_skips_saves_until_it_is_writable_again(small_fs, caplog):
    """A real read-only mount (EROFS from the kernel), not an injected error."""
    root = os.path.join(small_fs, "ckpt")
    ts = make_state(0, 5_000)
    with _manager(root, on_error="warn") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        fill(ts, 0, 1)
        assert mgr.save(1)
        mgr.wait()
        _read_only(root, True)
        try:
            fill(ts, 0, 2)
            assert mgr.save(2) is True  # started: the mkdir (EROFS) runs on a flush thread
            mgr.wait()  # logged here (on_error=warn)
        finally:
            _read_only(root, False)
        fill(ts, 0, 3)
        assert mgr.save(3)
        mgr.wait()
    assert committed_iterations(root) == [1, 3]
    assert "iter_0000002" in caplog.text and "EROFS (Read-only file system)" in caplog.text
