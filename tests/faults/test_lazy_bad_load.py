"""Bad input on load at the LazyCheckpointer level (megatron-core GPT, DistributedOptimizer, 2 gloo
ranks): every damaged checkpoint is refused with an error naming the file/rank/tensor, and the live
model and optimizer are bit-for-bit unchanged (``megatron.shards.state_digest`` before and after)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.core")

from ..distributed.ranks import describe, run_ranks  # noqa: E402

WORKER = "tests.workers.lazy_bad_load_worker"

# what each rank's error must say (rank 1 only for the *_rank1 scenarios: rank 0's file is fine there)
EXPECT = {
    "data_flip": r"r0000{rank}-.*\.dsck: checksum mismatch in tensor '.+'",
    "index_flip": r"r0000{rank}-.*\.dsck: index checksum mismatch",
    "header_flip": r"r0000{rank}-.*\.dsck: header checksum mismatch",
    "truncated": r"r0000{rank}-.*\.dsck: rank {rank} file has \d+ bytes, manifest says \d+",
    "missing": r"rank {rank} file r0000{rank}-.*\.dsck is missing",
    "other_iteration": r"r0000{rank}-.*\.dsck: rank {rank} file is not the one committed",
    "manifest_not_json": r"iter_0000002/manifest\.json: manifest is not valid JSON",
    "manifest_version": r"iter_0000002/manifest\.json: written by datastates-megatron \S+ \(manifest format 99\)",
    "manifest_path_outside": r"rank 0 file '\.\./iter_0000001/.*' is not a plain file name inside the checkpoint",
    "manifest_layout": r"cannot restore the checkpoint \(TP2×PP1×DP2, world size 2\) in this run \(TP1×PP1×DP2, world "
    r"size 2\): the checkpoint's layout does not multiply to its world size",
    "data_flip_rank1": r"rank 1\b|rank\(s\) \[1\]|r00001-",
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lazy-bad-load") / "ckpt")
    res = run_ranks(WORKER, 2, [root], timeout=300)
    assert all(r["result"] and r["result"]["scenarios"] for r in res), describe(res)
    return [r["result"] for r in res], describe(res)


@pytest.mark.parametrize("scenario", [s for s in EXPECT if not s.endswith("_rank1")])
def test_damage_on_every_rank_is_refused_and_changes_nothing(outcome, scenario):
    results, log = outcome
    for r in results:
        got = r["scenarios"].get(scenario)
        assert got is not None, f"not reached (an earlier scenario was accepted): {r['scenarios']}"
        assert got["error"] is not None, f"rank {r['rank']}: a damaged checkpoint ({scenario}) was loaded"
        assert re.search(EXPECT[scenario].format(rank=r["rank"]), got["error"]), got["error"]
        assert got["unchanged"], f"rank {r['rank']}: the failed load ({scenario}) changed the live model/optimizer"


@pytest.mark.parametrize("scenario", ["data_flip_rank1"])
def test_damage_on_one_rank_is_refused_on_every_rank_and_changes_nothing(outcome, scenario):
    """Rank 0's own file is intact: it must still refuse (load is collective) and keep its state, or
    the ranks would resume from different points."""
    results, log = outcome
    for r in results:
        got = r["scenarios"].get(scenario)
        assert got is not None, f"not reached: {r['scenarios']}"
        assert got["error"] is not None and re.search(EXPECT[scenario], got["error"]), (r["rank"], got)
        assert got["unchanged"], f"rank {r['rank']}: restored its own shard although rank 1's file is damaged"


def test_a_rank_file_unreadable_on_one_rank_is_the_same_error_on_every_rank(outcome):
    """Rank 1 alone gets EACCES opening its file: every rank raises the same error, naming that
    file, rank 1 and the cause, and keeps its state."""
    results, log = outcome
    got = [r["scenarios"].get("eacces_rank1") for r in results]
    assert all(g is not None for g in got), f"not reached: {[r['scenarios'] for r in results]}"
    errors = [g["error"] for g in got]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert re.search(r"r00001-.*\.dsck: rank 1 file cannot be read: .*Permission denied", errors[0]), errors[0]
    assert all(g["unchanged"] for g in got), got


def test_pristine_checkpoint_still_loads_exactly_after_the_failures(outcome):
    results, log = outcome
    for r in results:
        assert r.get("final") == {"iteration": 2, "exact": True}, (r.get("final"), log[-3000:])
