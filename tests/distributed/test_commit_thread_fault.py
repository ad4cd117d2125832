"""An exception on a commit thread: rank 1's commit thread fails while making its status record of
checkpoint 2 (an unexpected error, not a failed file).  It still takes part in that commit round, as
a failed rank, so rank 0 never waits for it: checkpoint 2 is abandoned on both ranks at once, rank 1's
training thread hears the error at its next poll, and checkpoint 3 commits on both."""

from __future__ import annotations

import time

from datastates_megatron.engine.tiers.tier import committed_iterations

from .ranks import describe, run_ranks

TIMEOUT_S = 30  # how long a rank would wait for a peer's record


def _save_three(args) -> dict:
    import torch
    import torch.distributed as dist

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.errors import CheckpointError
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.engine.tiers import commit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        real = commit.Committer._status

        def status(self, ticket):
            if ticket.iteration == 2:
                raise RuntimeError("injected: the commit thread failed making its status record")
            return real(self, ticket)

        commit.Committer._status = status
    mgr = CheckpointManager(args[0], EngineOptions(cache_bytes=1 << 20, timeout_s=TIMEOUT_S), keep_last=0)
    w = torch.full((1000,), float(rank))
    mgr.register("w", w)
    waited, errors = {}, []
    for it in (1, 2, 3):
        mgr.save(it, {"it": it})
        t0 = time.monotonic()
        try:
            mgr.wait()
        except CheckpointError as e:
            errors.append(str(e))
        waited[it] = time.monotonic() - t0
    mgr.close()
    return {"waited": waited, "errors": errors}


def test_a_failed_commit_thread_abandons_its_checkpoint_at_once_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_three, 2, [root], timeout=3 * TIMEOUT_S)
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    r0, r1 = (r["result"] for r in results)
    assert committed_iterations(root) == [1, 3]
    assert max(r0["waited"]["2"], r1["waited"]["2"]) < TIMEOUT_S / 3, (r0, r1)  # nobody waited for a record
    assert any("injected: the commit thread failed" in e for e in r1["errors"]), r1
    assert any("rank(s) [1] failed" in e for e in r0["errors"]), r0
