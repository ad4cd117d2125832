"""A node-local checkpoint belongs to the run of the ``--save`` it promotes to: a new run over a
node-local root an earlier run left behind starts fresh and leaves every old byte as it was; runs
may share one node-local root; one writer per run directory.  One process, real files."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.fs.dirlock import SaveDirLock
from datastates_megatron.engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    SaveDirBusyError,
)
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.tier import committed_iterations


def _manager(save, local, w, **kw):
    kw = {"keep_last": 0, "persist_interval": 100, "local_keep_last": 2, **kw}
    mgr = CheckpointManager(str(save), EngineOptions(cache_bytes=1 << 20, timeout_s=30), local_root=str(local), **kw)
    mgr.register("w", w)
    return mgr


def _train(mgr, w, iterations, offset=0.0):
    for it in iterations:
        w.fill_(it + offset)
        mgr.save(it)
        mgr.wait(persist=False)


def _digest(root):
    return {
        str(p.relative_to(root)): (p.stat().st_ino, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_new_run_never_loads_promotes_or_deletes_an_earlier_runs_local_checkpoints(tmp_path, caplog):
    local = tmp_path / "shm"
    w = torch.zeros(1000)
    with _manager(tmp_path / "old-save", local, w) as old:  # its local checkpoints 7 and 8 stay on the node
        _train(old, w, range(1, 9))
        old_dir = old.local_root
    # and a checkpoint of a version that wrote directly under the root
    shutil.copytree(os.path.join(old_dir, "iter_0000008"), local / "iter_0000008")
    before = _digest(local)

    w.zero_()
    with caplog.at_level(logging.WARNING):
        new = _manager(tmp_path / "new-save", local, w, local_keep_last=1)
    with new:
        assert new.local_root != old_dir
        with pytest.raises(NoCheckpointError):
            new.load()
        assert torch.equal(w, torch.zeros(1000))  # nothing of the old run restored
        assert committed_iterations(str(tmp_path / "new-save")) == []  # nor copied into the new --save
        _train(new, w, range(1, 5), offset=0.5)
    assert committed_iterations(str(tmp_path / "new-save")) == [4]  # its own newest, at close
    after = _digest(local)
    assert {k: v for k, v in after.items() if k in before} == before  # every old byte, same inode
    warned = [r.getMessage() for r in caplog.records if "other runs" in r.getMessage()]
    assert len(warned) == 1 and "run-" in warned[0] and "iter_0000008" in warned[0], warned


def test_two_runs_share_one_local_root(tmp_path):
    local = tmp_path / "shm"
    wa, wb = torch.zeros(1000), torch.zeros(1000)
    a = _manager(tmp_path / "a", local, wa, local_keep_last=1)
    b = _manager(tmp_path / "b", local, wb, local_keep_last=1)
    with a, b:
        for it in range(1, 6):  # interleaved: each run's retention runs while the other saves
            _train(a, wa, [it], offset=100)
            _train(b, wb, [it], offset=200)
        assert committed_iterations(a.local_root) == [5] and committed_iterations(b.local_root) == [5]
    for save, w, offset in ((tmp_path / "a", wa, 100), (tmp_path / "b", wb, 200)):
        w.zero_()
        with _manager(save, local, w) as mgr:
            res = mgr.load()
            assert res.iteration == 5 and res.root == mgr.local_root
        assert torch.equal(w, torch.full((1000,), 5.0 + offset))


def test_one_writer_per_run_directory(tmp_path):
    """Two jobs on one run directory (one --save on a file system without flock, where the save
    directory's own lock is skipped): the node-local directory's lock refuses the second."""
    local = tmp_path / "shm"
    w = torch.zeros(1000)
    with _manager(tmp_path / "save", local, w) as mgr:
        _train(mgr, w, [1])
        run_dir = mgr.local_root
    with SaveDirLock(run_dir):  # held by "another job"
        with pytest.raises(SaveDirBusyError, match="node-local directory is in use") as e:
            _manager(tmp_path / "save", local, torch.zeros(1000))
    assert run_dir in str(e.value)


def test_a_copy_of_a_save_directory_is_a_new_run(tmp_path, caplog):
    """``cp -r`` of a --save (a branch, a restored backup) carries the run id file: the copy must
    not adopt the original run's node-local checkpoints (newer than what the copy holds)."""
    local = tmp_path / "shm"
    w = torch.zeros(1000)
    with _manager(tmp_path / "a", local, w, persist_interval=1) as mgr:
        _train(mgr, w, [1, 2, 3])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with _manager(tmp_path / "a", local, w, persist_interval=100) as mgr:
        _train(mgr, w, [4, 5, 6])  # local only until close
        original = mgr.run_id
    w.zero_()
    with caplog.at_level(logging.WARNING):
        branch = _manager(tmp_path / "b", local, w)
    with branch:
        assert branch.run_id != original and "is a copy of the save directory" in caplog.text
        res = branch.load()
        assert res.iteration == 3 and res.root == str(tmp_path / "b")
    assert torch.equal(w, torch.full((1000,), 3.0))
    assert committed_iterations(str(tmp_path / "b")) == [1, 2, 3]


def test_a_run_id_out_of_range_or_a_link_at_the_run_directory_is_refused(tmp_path):
    local, save = tmp_path / "shm", tmp_path / "save"
    save.mkdir()
    (save / ".datastates.run").write_text('{"run_id": "ffffffffffffffff"}\n')  # would overflow an int64
    with pytest.raises(CorruptCheckpointError, match="below 2\\*\\*63"):
        _manager(save, local, torch.zeros(1000))
    (save / ".datastates.run").write_text(f'{{"run_id": "0123456789abcdef", "save_inode": {save.stat().st_ino}}}\n')
    victim = tmp_path / "victim"
    victim.mkdir()
    local.mkdir()
    os.symlink(victim, local / "run-0123456789abcdef")  # planted where this run's directory goes
    with pytest.raises(CheckpointError, match="run-0123456789abcdef"):
        _manager(save, local, torch.zeros(1000))
    assert os.listdir(victim) == []  # nothing written through the link
