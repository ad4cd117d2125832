"""Rolling back with a local tier (``load(N)``, Megatron's ``--ckpt-step N``): the new run's
checkpoints supersede the abandoned ones from its first persistent commit on; before it, a restart
resumes the abandoned timeline (documented in docs/reliability.md, "Rolling back")."""

from __future__ import annotations

import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.promotion import Promotion


def _manager(tmp_path, w):
    mgr = CheckpointManager(
        str(tmp_path / "persistent"),
        EngineOptions(cache_bytes=1 << 20, timeout_s=30),
        keep_last=0,
        local_root=str(tmp_path / "local"),
        persist_interval=4,
        local_keep_last=2,
    )
    mgr.register("w", w)
    return mgr


def _run(tmp_path, iterations, value, load=None):
    w = torch.zeros(1000)
    with _manager(tmp_path, w) as mgr:
        if load is not None:
            assert mgr.load(load).iteration == load and w[0].item() == load
        for it in iterations:
            w.fill_(value(it))
            mgr.save(it)
            mgr.wait()


def _restart(tmp_path):
    w = torch.zeros(1000)
    with _manager(tmp_path, w) as mgr:
        return mgr.load().iteration, w[0].item()


def test_rollback_sticks_from_the_new_runs_first_persistent_commit(tmp_path):
    _run(tmp_path, range(1, 11), float)  # run A: 1..10; 4 and 8 promoted, 10 at its end
    _run(tmp_path, (5, 6, 7, 8), lambda it: 100.0 + it, load=4)  # run B rolls back to 4; 8 promoted
    assert _restart(tmp_path) == (8, 108.0)  # run B's 8, not run A's 8 or 10


def test_before_that_commit_a_restart_resumes_the_abandoned_timeline(tmp_path, monkeypatch):
    _run(tmp_path, range(1, 11), float)
    with monkeypatch.context() as m:  # run B is killed before its end-of-run promotion
        m.setattr(Promotion, "promote_newest", lambda self: False)
        _run(tmp_path, (5, 6), lambda it: 100.0 + it, load=4)  # nothing of run B reached the persistent tier
    assert _restart(tmp_path) == (10, 10.0)  # as Megatron's own tracker file does before its first save


def test_a_clean_end_of_the_new_run_makes_the_rollback_stick(tmp_path):
    _run(tmp_path, range(1, 11), float)
    _run(tmp_path, (5, 6), lambda it: 100.0 + it, load=4)  # its end promotes 6: its first persistent commit
    assert _restart(tmp_path) == (6, 106.0)
