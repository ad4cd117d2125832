"""A process group that Megatron-LM passes to the glue must span the ranks of the megatron-core
``parallel_state`` group the lazy checkpointer shards by; another one is refused, never ignored."""

from .ranks import describe, run_ranks

WORKER = "tests.workers.call_params_worker"


def test_process_groups_are_checked_against_parallel_state():
    results = run_ranks(WORKER, 2, [], timeout=90)
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    for r in results:
        out = r["result"]
        assert out["none"] == out["parallel_state's own"] == out["same ranks, another group"] == "ok", out
        assert out["other ranks"].startswith("iteration 7: dp_group spans other ranks than ")
        assert "get_data_parallel_group()" in out["other ranks"]
        assert out["other ranks, tp"].startswith("iteration 7: tp_group spans other ranks than ")
