"""The persist interval counts iterations, not this run's commits: a requeued run promotes the same
iterations as one that never stopped, so ``keep_every`` multiples of it are always persisted."""

from __future__ import annotations

import torch

from datastates_megatron.engine.tiers.tier import committed_iterations
from tests.managers import two_tier_manager


def _manager(tmp_path, w, interval):
    return two_tier_manager(tmp_path, w, interval, local_keep_last=2)


def _promoted_while_saving(mgr, w, iterations) -> list[int]:
    promoted = []
    for it in iterations:
        w.fill_(float(it))
        mgr.save(it)
        promoted += [r.iteration for r in mgr.wait() if r.tier == "persistent"]
    return promoted


def test_a_requeued_run_persists_the_same_iterations_as_an_uninterrupted_one(tmp_path):
    w = torch.zeros(1000)
    with _manager(tmp_path, w, interval=3) as mgr:  # the first job: 1..4, requeued after 4
        assert _promoted_while_saving(mgr, w, range(1, 5)) == [3]
    assert committed_iterations(str(tmp_path / "persistent")) == [3, 4]  # 4: the end-of-run promotion
    with _manager(tmp_path, w, interval=3) as mgr:  # the requeued job resumes at 4
        assert mgr.load().iteration == 4
        assert _promoted_while_saving(mgr, w, range(5, 11)) == [6, 9]  # not 7 and 10
    assert committed_iterations(str(tmp_path / "persistent")) == [3, 4, 6, 9, 10]
