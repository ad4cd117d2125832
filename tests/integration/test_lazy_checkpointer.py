"""LazyCheckpointer with real megatron-core on 2 CPU ranks: bit-exact resume after kill -9, the gate,
no duplicated bytes across data-parallel ranks, and resuming at another data-parallel size."""

import json

import pytest

pytest.importorskip("megatron.core")

from datastates_megatron.engine.format.manifest import read_tracker  # noqa: E402
from datastates_megatron.engine.tiers.tier import committed_iterations  # noqa: E402
from tests.distributed.ranks import describe, run_ranks  # noqa: E402

WORKER = "tests.workers.lazy_worker"
DEMO = "datastates_megatron.demo.train"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--vocab-size", "256"]
SMALL = [*MODEL, "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.01", "--lazy-ckpt-keep-last", "2"]


def _records(prefix, world=2):
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_after_kill_9_is_bit_exact(tmp_path, precision):
    extra = ["--bf16"] if precision == "bf16" else []
    iters = ["--train-iters", "8"]
    # the reference never checkpoints: checkpointing must not change training at all
    full = run_ranks(DEMO, 2, [*MODEL, *extra, *iters, "--log-json", str(tmp_path / "full")])
    assert all(r["returncode"] == 0 for r in full), describe(full)
    save = str(tmp_path / "ckpt")
    killed = run_ranks(
        DEMO, 2, [*SMALL, *extra, *iters, "--save", save], kill_when=lambda: (read_tracker(save) or 0) >= 3
    )
    assert any(r["returncode"] == -9 for r in killed), describe(killed)
    resumed = run_ranks(DEMO, 2, [*SMALL, *extra, *iters, "--save", save, "--log-json", str(tmp_path / "resumed")])
    assert all(r["returncode"] == 0 for r in resumed), describe(resumed)
    for a, b in zip(_records(tmp_path / "full"), _records(tmp_path / "resumed")):
        assert 3 <= b["resumed_from"] < 8
        losses = {x["iteration"]: x["loss"] for x in a["iterations"]}
        after = {x["iteration"]: x["loss"] for x in b["iterations"]}
        assert after and all(after[i] == losses[i] for i in after), (after, losses)  # to the bit
        assert a["digest"] == b["digest"]  # every param shard, main param and Adam state


@pytest.mark.parametrize("mode", ["copy", "source_writes", "optimizer_subclass"])
def test_step_waits_for_slow_snapshot_copies(tmp_path, mode):
    """``optimizer_subclass``: the inner optimizer is a subclass with its own ``step`` and extra
    per-parameter state (held_state.MasterWeightAdam, as TE's FusedAdam): its step waits too."""
    extra = {"source_writes": ["--source-writes"], "optimizer_subclass": ["--master-weight-adam"]}.get(mode, [])
    res = run_ranks(WORKER, 2, ["slow_copy", *extra, "--save", str(tmp_path / "a")])
    assert all(r["returncode"] == 0 for r in res), describe(res)
    for r in res:
        out = r["result"]
        assert out["equal_to_save_time"] and out["n_tensors"] > 10, out
        # save returned at once and the step waited for the slow copies (had save waited for them,
        # the step would find them done): relative, so a busy machine does not fail it
        assert out["save_call_s"] < 0.5 * out["step_s"] and out["step_s"] > 0.05, out
        assert (out["source_bytes"] > 0) == (mode == "source_writes"), out
    control = run_ranks(WORKER, 2, ["slow_copy", *extra, "--no-hooks", "--save", str(tmp_path / "b")])
    assert all(r["returncode"] == 0 for r in control), describe(control)
    assert not all(r["result"]["equal_to_save_time"] for r in control)  # without the gate the step races the copy


def test_replicated_parameters_are_written_once_across_dp_ranks(tmp_path):
    res = run_ranks(WORKER, 2, ["replicated", "--save", str(tmp_path / "a")])
    assert all(r["returncode"] == 0 for r in res), describe(res)
    shard = [r["result"]["param_shard_bytes"] for r in res]
    assert sum(shard) == res[0]["result"]["param_buffer_bytes"] and shard[0] == shard[1]


def test_load_in_the_same_run_takes_the_newest_local_tier_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    res = run_ranks(WORKER, 2, ["local_tier", "--save", save, "--local", str(tmp_path / "local{node}")])
    assert all(r["returncode"] == 0 for r in res), describe(res)
    assert committed_iterations(save) == [3, 4]  # 3 promoted by the interval (before the load), 4 at close
    assert all(r["result"]["loaded"] == 4 and r["result"]["exact"] for r in res), [r["result"] for r in res]
    _one_decision_one_load([r["result"] for r in res], local=True)


def _one_decision_one_load(results, local):
    """Following ``LazyCheckpointer.load``: the manager decides once (one resolve round, rank 0's
    ``_decide`` on rank 0 only, one survey of the local tier, no process-group collective) and loads
    once, deciding nothing again."""
    for r in results:
        want = {"choose": 1, "resolve": 1, "_decide": int(r["rank"] == 0), "_restorable": int(local), "load": 1}
        want["choose_collectives"] = 0  # the decision is one round through the store: no all-gather, no all-reduce
        assert r["decisions"] == want, r


def test_load_into_a_different_dp_size_reshards(tmp_path):
    save = str(tmp_path / "ckpt")
    ok = run_ranks(DEMO, 2, [*SMALL, "--train-iters", "2", "--save", save])
    assert all(r["returncode"] == 0 for r in ok), describe(ok)
    one = run_ranks(DEMO, 1, [*SMALL, "--train-iters", "3", "--save", save])
    assert one[0]["returncode"] == 0 and "resumed from iteration 2" in one[0]["stdout"], describe(one)


def test_extra_state_buffers_and_subclass_optimizer_state_resume_exactly(tmp_path):
    """A module's ``get_extra_state()`` (a TE-like FP8 amax history in a uint8 tensor), a persistent
    buffer, and an inner optimizer subclass's own state (a float64 ``master_param`` and an int
    ``step``) are saved at 3 and resumed: at 6 everything equals a run that never stopped."""
    common = ["held_state", "--master-weight-adam"]
    straight = run_ranks(WORKER, 2, [*common, "--phase", "straight", "--save", str(tmp_path / "unused")])
    assert all(r["returncode"] == 0 for r in straight), describe(straight)
    save = str(tmp_path / "ckpt")
    saved = run_ranks(WORKER, 2, [*common, "--phase", "save", "--save", save])
    assert all(r["returncode"] == 0 for r in saved), describe(saved)
    resumed = run_ranks(WORKER, 2, [*common, "--phase", "resume", "--save", save])
    assert all(r["returncode"] == 0 for r in resumed), describe(resumed)
    for want, got in zip((r["result"] for r in straight), (r["result"] for r in resumed)):
        assert got["state_keys"] == ["exp_avg", "exp_avg_sq", "master_param", "step"], got["state_keys"]
        assert got["plain_step"] == want["plain_step"] == [6]
        assert got["probe"] == want["probe"] and want["probe"]["forwards"] == 6, (got["probe"], want["probe"])
        assert got["digest"] == want["digest"]
    # start-up and restore: the newest checkpoint is found and its manifest read by rank 0 alone
    assert resumed[0]["result"]["manifest_reads"] >= 1 and resumed[1]["result"]["manifest_reads"] == 0, describe(
        resumed
    )
    _one_decision_one_load([r["result"] for r in resumed], local=False)
