"""Issue 41, item 4: a finished run's node-local ``run-<id>/`` is reclaimed by the next run on the
node -- only when that run ended cleanly, nothing there is newer than its ``--save``, and only what
we wrote (a foreign file stays, with the directories holding it; a link is never followed).  One
process, real files."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.format.manifest import iter_dir
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import ENDED_NAME
from datastates_megatron.engine.tiers.tier import committed_iterations


def _manager(save, local, **kw) -> CheckpointManager:
    kw = {"keep_last": 0, "persist_interval": 1, "local_keep_last": 2, **kw}
    mgr = CheckpointManager(str(save), EngineOptions(cache_bytes=1 << 20, timeout_s=30), local_root=str(local), **kw)
    mgr.register("w", torch.zeros(64))
    return mgr


def _finished_run(tmp_path, name: str, iterations=(1, 2), killed=False, **kw) -> tuple[str, str]:
    """A run on ``tmp_path/name`` over the shared node-local root ``tmp_path/local``; returns its
    node-local directory and its --save.  ``killed``: as if it never reached its end (no marker)."""
    save = tmp_path / name
    with _manager(save, tmp_path / "local", **kw) as mgr:
        for it in iterations:
            mgr.save(it)
            mgr.wait()
        run_dir = mgr.local_root
    if killed:
        os.unlink(os.path.join(run_dir, ENDED_NAME))
    return run_dir, str(save)


def _next_run(tmp_path, caplog) -> str:
    with caplog.at_level(logging.INFO, logger="datastates_megatron.engine.tiers.reclaim"):
        mgr = _manager(tmp_path / "next", tmp_path / "local")
    mgr.close()
    return caplog.text


def test_a_run_that_ended_cleanly_is_reclaimed_by_the_next_run_on_the_node(tmp_path, caplog):
    run_dir, save = _finished_run(tmp_path, "first")
    assert os.path.isfile(os.path.join(run_dir, ENDED_NAME)) and committed_iterations(run_dir) == [1, 2]
    said = _next_run(tmp_path, caplog)
    assert not os.path.lexists(run_dir)
    assert run_dir in said and "removed the node-local directory" in said and "iteration 2" in said, said
    assert committed_iterations(save) == [1, 2]  # --save is untouched


def test_a_run_that_did_not_end_cleanly_is_kept(tmp_path, caplog):
    run_dir, _ = _finished_run(tmp_path, "first", killed=True)
    _next_run(tmp_path, caplog)
    assert committed_iterations(run_dir) == [1, 2]


def test_an_unpromoted_newer_local_checkpoint_is_kept(tmp_path, caplog):
    """The run ended cleanly, but its --save's newest is older than the local one (iteration 2 was
    deleted from --save after): the local copy is the only one of iteration 2."""
    run_dir, save = _finished_run(tmp_path, "first")
    shutil.rmtree(iter_dir(save, 2))
    _next_run(tmp_path, caplog)
    assert committed_iterations(run_dir) == [1, 2]
    assert os.path.isfile(os.path.join(run_dir, ENDED_NAME))


def test_a_foreign_file_inside_stays_with_the_directories_holding_it(tmp_path, caplog):
    run_dir, _ = _finished_run(tmp_path, "first")
    notes = os.path.join(iter_dir(run_dir, 2), "notes.txt")
    with open(notes, "w") as f:
        f.write("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    os.symlink(outside, os.path.join(run_dir, "iter_0000009"))  # a link is never followed
    said = _next_run(tmp_path, caplog)
    assert open(notes).read() == "mine" and (outside / "precious").read_text() == "keep"
    # what stays: what is not ours, the directory holding it, and the lock (removed only with the directory)
    assert sorted(os.listdir(run_dir)) == [".datastates.lock", "iter_0000002", "iter_0000009"], os.listdir(run_dir)
    assert os.listdir(iter_dir(run_dir, 2)) == ["notes.txt"]  # our files of it went
    assert os.path.islink(os.path.join(run_dir, "iter_0000009"))
    assert "kept 2 entries not written by it" in said, said


def test_a_run_that_starts_again_on_the_node_is_not_reclaimed(tmp_path, caplog):
    """The run resumes (its marker removed at its start): a third run's start-up leaves it alone."""
    run_dir, save = _finished_run(tmp_path, "first")
    mgr = _manager(save, tmp_path / "local")  # the same --save: the same run, live again
    try:
        assert not os.path.exists(os.path.join(run_dir, ENDED_NAME))
        with caplog.at_level(logging.INFO):
            other = _manager(tmp_path / "third", tmp_path / "local")
            other.close()
        assert committed_iterations(run_dir) == [1, 2]
    finally:
        mgr.close()
