"""The demo trainer (megatron-core GPT, DistributedOptimizer, 2 gloo ranks) killed by a crash point
on one rank in the middle of a flush, then restarted: it resumes from the newest committed
checkpoint and trains bit-exactly like an uninterrupted run (every loss after the resume and the
final digest of every param shard, main param and Adam state).

tests/integration/test_lazy_checkpointer.py already covers an external kill of all ranks after a
commit; tests/faults/sweep.py runs this for every phase."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from datastates_megatron.engine.tiers.tier import committed_iterations, latest_committed  # noqa: E402

from ..distributed.ranks import describe, run_ranks  # noqa: E402

DEMO = "datastates_megatron.demo.train"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--vocab-size", "256", "--train-iters", "8"]
LAZY = [*MODEL, "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.002", "--lazy-ckpt-keep-last", "2"]


def records(prefix, world=2):
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(world)]


def demo_crash_and_resume(tmp_path, reference, env, name="run"):
    """Run the demo with ``env`` (a crash point), restart it, compare with ``reference``; returns the
    iteration it resumed from."""
    save = str(tmp_path / name)
    crashed = run_ranks(DEMO, 2, [*LAZY, "--save", save], env=env)
    assert any(r["returncode"] == -9 for r in crashed), "no rank was killed\n" + describe(crashed)
    on_disk = latest_committed(save) if committed_iterations(save) else None
    log = str(tmp_path / f"{name}-resumed")
    resumed = run_ranks(DEMO, 2, [*LAZY, "--save", save, "--log-json", log])
    assert all(r["returncode"] == 0 for r in resumed), describe(resumed)
    for ref, got in zip(reference, records(log)):
        assert got["resumed_from"] == on_disk, (got["resumed_from"], on_disk)
        want = {x["iteration"]: x["loss"] for x in ref["iterations"]}
        after = {x["iteration"]: x["loss"] for x in got["iterations"]}
        assert sorted(after) == list(range((on_disk or 0) + 1, 9))
        assert all(after[i] == want[i] for i in after), (after, want)  # to the bit
        assert got["digest"] == ref["digest"]
    return on_disk


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    full = run_ranks(DEMO, 2, [*MODEL, "--log-json", str(d / "full")])
    assert all(r["returncode"] == 0 for r in full), describe(full)
    return records(d / "full")


def test_demo_resumes_bit_exactly_after_one_rank_dies_mid_flush(tmp_path, reference):
    resumed_from = demo_crash_and_resume(tmp_path, reference, {"DSM_CRASH_AT": "flush:12", "DSM_CRASH_RANK": "1"})
    assert resumed_from is not None and 1 <= resumed_from < 8
