"""The end of a run promotes the newest local checkpoint once, whatever ``persist_interval`` says;
an earlier run's checkpoint re-promoted at start-up does not count as this run's newest."""

from __future__ import annotations

import torch

from datastates_megatron.engine.tiers.tier import committed_iterations
from tests.managers import two_tier_manager


def _manager(tmp_path, w, interval):
    return two_tier_manager(tmp_path, w, interval, local_keep_last=0)


def _save(mgr, w, iterations):
    records = []
    for it in iterations:
        w.fill_(float(it))
        mgr.save(it)
        records += mgr.wait()
    return records


def _persistent(records):
    return [r.iteration for r in records if r.tier == "persistent"]


def test_the_newest_is_promoted_at_the_end_and_only_then(tmp_path):
    w = torch.zeros(1000)
    with _manager(tmp_path, w, interval=3) as mgr:
        during = _persistent(_save(mgr, w, range(1, 5)))
        end = _persistent(mgr.wait(promote_newest=True))
        again = _persistent(mgr.wait(promote_newest=True))
    assert (during, end, again) == ([3], [4], [])
    assert committed_iterations(str(tmp_path / "persistent")) == [3, 4]


def test_a_newest_already_promoted_by_its_interval_is_not_promoted_twice(tmp_path):
    w = torch.zeros(1000)
    with _manager(tmp_path, w, interval=2) as mgr:
        during = _persistent(_save(mgr, w, range(1, 5)))
        end = _persistent(mgr.wait(promote_newest=True))
    assert (during, end) == ([2, 4], [])


def test_a_restart_re_promotion_is_not_this_runs_newest(tmp_path, monkeypatch):
    w = torch.zeros(1000)
    with monkeypatch.context() as m:  # run A is killed before its end-of-run promotion
        m.setattr("datastates_megatron.engine.tiers.promotion.Promotion.promote_newest", lambda self: False)
        with _manager(tmp_path, w, interval=10) as mgr:
            _save(mgr, w, (1, 2))
    assert committed_iterations(str(tmp_path / "persistent")) == []
    with _manager(tmp_path, w, interval=10) as mgr:  # run B re-promotes A's 2 at start-up, saves nothing
        start = _persistent(mgr.wait(promote_newest=True))
    assert start == [2]
    assert committed_iterations(str(tmp_path / "persistent")) == [2]
