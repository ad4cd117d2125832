"""CheckpointManager.choose: the one restore decision, handed to load as a value (one process, a
node-local tier and the persistent one)."""

from __future__ import annotations

import shutil

import pytest
import torch

from datastates_megatron.engine import LayoutMismatchError, NoCheckpointError
from datastates_megatron.engine.load import restorer as restorer_module
from datastates_megatron.engine.load.restorer import Restorer
from datastates_megatron.engine.manager import CheckpointManager, RestoreChoice
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.tier import committed_iterations, committed_saves
from tests.managers import two_tier_manager


@pytest.fixture
def saved(tmp_path):
    """Iterations 1..3 committed on both tiers (each promoted), ``w`` = the iteration."""
    w = torch.zeros(8)
    mgr = two_tier_manager(tmp_path, w, interval=1, local_keep_last=0)
    for it in (1, 2, 3):
        w.fill_(it)
        mgr.save(it, {"it": it})
        mgr.wait()
    assert committed_iterations(mgr.root) == [1, 2, 3]
    w.zero_()
    yield mgr, w
    mgr.close()


def _count(monkeypatch, *names) -> dict:
    """Calls from now on into the restorer module's resolve step, the manager's ``choose`` and the
    restorer's decision helpers."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        owner = {"resolve": restorer_module, "choose": CheckpointManager}.get(name, Restorer)
        original = getattr(owner, name)

        def call(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)
    return calls


def test_the_newest_local_checkpoint_is_chosen_with_its_persistent_manifest(saved):
    mgr, _ = saved
    choice = mgr.choose()
    assert isinstance(choice, RestoreChoice)
    assert (choice.tier, choice.iteration, choice.source, choice.root) == ("local", 3, "local", mgr.local_root)
    assert choice.save is not None and choice.shared == mgr.root and not choice.reshard
    # the persistent tier holds it too: its header and this rank's record, for a layout check
    assert choice.view.ckpt == iter_dir(mgr.root, 3) and choice.manifest.iteration == 3
    assert [r.rank for r in choice.manifest.ranks] == [0] and choice.layout == {}


def test_load_of_a_choice_decides_nothing_again(saved, monkeypatch):
    mgr, w = saved
    choice = mgr.choose(2)
    calls = _count(monkeypatch, "resolve", "choose", "_decide", "_restorable")
    got = mgr.load(choice)
    assert calls == {"resolve": 0, "choose": 0, "_decide": 0, "_restorable": 0}
    assert got.iteration == 2 and got.root == mgr.local_root and torch.equal(w, torch.full((8,), 2.0))


def test_a_load_by_iteration_decides_once(saved, monkeypatch):
    mgr, w = saved
    calls = _count(monkeypatch, "resolve", "choose", "_decide", "_restorable")
    assert mgr.load().iteration == 3 and torch.equal(w, torch.full((8,), 3.0))
    assert calls == {"resolve": 1, "choose": 1, "_decide": 1, "_restorable": 1}
    assert mgr.latest() == 3  # the same decision's iteration


def test_a_newer_persistent_checkpoint_wins_over_the_local_tier(saved):
    mgr, w = saved
    shutil.rmtree(iter_dir(mgr.local_root, 3))  # the node lost its newest local copy
    choice = mgr.choose()
    assert (choice.tier, choice.iteration, choice.source, choice.root) == ("persistent", 3, "persistent", mgr.root)
    assert "newer than the newest node-local checkpoint every rank has (2)" in choice.why
    got = mgr.load(choice)
    assert got.root == mgr.root and torch.equal(w, torch.full((8,), 3.0))


def test_the_layout_check_runs_on_the_chosen_manifest_and_its_answer_travels_with_the_choice(saved):
    mgr, _ = saved
    seen = []

    def another_layout(manifest, ckpt):
        seen.append((manifest.iteration, ckpt))
        return True

    choice = mgr.choose(check=another_layout)
    assert seen == [(3, iter_dir(mgr.root, 3))]
    # a reshard reads every rank's file: the persistent tier, whatever the local tier holds
    assert choice.reshard and (choice.tier, choice.source, choice.root) == ("persistent", "persistent", mgr.root)

    def refuse(manifest, ckpt):
        raise LayoutMismatchError(f"{ckpt}: tp=2 in checkpoint, 1 now")

    with pytest.raises(LayoutMismatchError, match="tp=2 in checkpoint"):
        mgr.choose(check=refuse)


def test_nothing_to_restore_is_no_checkpoint(tmp_path):
    mgr = two_tier_manager(tmp_path, torch.zeros(4), interval=1, local_keep_last=0)
    with mgr:
        with pytest.raises(NoCheckpointError):
            mgr.choose()
        with pytest.raises(NoCheckpointError, match="iter_0000005"):
            mgr.choose(5)


def test_committed_saves_lists_this_runs_saves_of_a_rank_with_their_commit_times(saved, caplog):
    mgr, _ = saved
    got = committed_saves(mgr.local_root, mgr.run_id, 0)
    assert sorted(got) == [1, 2, 3]
    assert [s[1] for s in got.values()] == [1, 2, 3]  # save sequences
    assert all(s[0] == int(mgr.token, 16) for s in got.values())
    assert got[1][2] <= got[2][2] <= got[3][2]  # commit times, ms
    assert committed_saves(mgr.local_root, mgr.run_id, 1) == {}  # no file of rank 1
    assert committed_saves(mgr.local_root, "0" * 16, 0) == {} and "not this run" in caplog.text
