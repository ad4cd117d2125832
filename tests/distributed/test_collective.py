"""Collective on real gloo ranks: named records gathered, one rank's failure seen by every rank."""

from .ranks import describe, run_ranks

WORKER = "tests.workers.collective_worker"


def test_collective_on_three_ranks():
    results = run_ranks(WORKER, 3, ["--fail-rank", "1"], timeout=90)
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    for r in results:
        res = r["result"]
        assert (res["rank"], res["world_size"], res["active"]) == (r["rank"], 3, True)
        assert res["gather"] == [{"rank": i, "neg": -i - 1, "big": (1 << 63) - 1 - i} for i in range(3)]
        assert res["gather_many"] == [[{"i": i, "k": k} for k in range(i)] for i in range(3)]
        assert res["broadcast"] == 1002
        assert res["agree"] == [1]
        ranks, src, error, message = res["failure"]
        assert (ranks, src, error, res["failure_class"]) == ([1], 1, "ForeignCheckpointError", "ForeignCheckpointError")
        assert message.startswith("rank 1: xxx") and message.endswith(" ...") and len(message) < 4096
        assert res["no_failure"]
        assert res["failures"] == [[1, 2], 2] and res["failures_named_1"] == [[1], 2]
        assert res["min_max"] == [-5, 15]
        expected = "bad flag" if r["rank"] == 1 else f"rank {r['rank']}: step failed on rank(s) [1]: [rank 1] bad flag"
        assert res["raised"] == ["LazyCkptArgsError", expected]
        assert "rank(s) [1] gathered other fields than rank 0" in res["schema"], res["schema"]
    assert "sub" not in results[0]["result"]
    assert [results[i]["result"]["sub"] for i in (1, 2)] == [[0, 2, 2001, [0]], [1, 2, 2001, [0]]]
