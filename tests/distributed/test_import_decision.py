"""Which Megatron checkpoint a ``--load`` imports is decided alike on every rank: a rank importing
alone would wait in Megatron's collective load for ranks that took the lazy path."""

import os

from datastates_megatron.engine.names import iter_dir
from tests.unit.test_foreign_checkpoints import _native_torch_dist

from .ranks import describe, run_ranks

WORKER = "tests.workers.import_decision_worker"


def _run(*dirs):
    results = run_ranks(WORKER, len(dirs), ["--load-of-rank", ",".join(str(d) for d in dirs)], timeout=90)
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    return [r["result"] for r in results]


def test_every_rank_imports_the_same_checkpoint(tmp_path):
    _native_torch_dist(tmp_path, 100)
    assert _run(tmp_path, tmp_path) == [{"iteration": 100}, {"iteration": 100}]


def test_ranks_that_see_different_checkpoints_all_refuse(tmp_path):
    _native_torch_dist(tmp_path / "a", 100)
    _native_torch_dist(tmp_path / "b", 200)
    for res in _run(tmp_path / "a", tmp_path / "b"):
        assert res["error"] == "ConversionError" and "different checkpoints to import" in res["message"], res


def test_one_ranks_error_is_every_ranks(tmp_path):
    _native_torch_dist(tmp_path / "a", 100)
    d = iter_dir(str(tmp_path / "b"), 100)
    os.makedirs(d)
    with open(os.path.join(d, "weights.bin"), "wb") as f:
        f.write(b"x")
    with open(os.path.join(str(tmp_path / "b"), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("100")
    for res in _run(tmp_path / "a", tmp_path / "b"):
        assert res["error"] == "ForeignCheckpointError" and "unknown format" in res["message"], res
