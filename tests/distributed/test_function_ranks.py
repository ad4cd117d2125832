"""The test harness itself: a rank ``os.fork()``-ed from the pytest process (``run_ranks`` given a
function) must not inherit a hang.  After a parallel torch op in the parent, a child's first
parallel op waited forever in the intra-op thread pool the fork cut off (both ranks were killed at
the timeout, with no output): 4 function-rank tests failed when the unit tests ran before them."""

from __future__ import annotations

import torch

from .ranks import describe, run_ranks


def _parallel_op(args) -> dict:
    import torch

    return {"sum_is_finite": bool(torch.isfinite(torch.ones(4_000_000).sum()))}


def test_a_function_rank_runs_parallel_ops_after_the_parent_did():
    assert torch.get_num_threads() >= 1
    torch.ones(4_000_000).sum()  # the parent's intra-op pool now exists (2 threads on 2 cores)
    results = run_ranks(_parallel_op, 2, [], timeout=30)
    assert all(r["returncode"] == 0 and r["result"] == {"sum_is_finite": True} for r in results), describe(results)
