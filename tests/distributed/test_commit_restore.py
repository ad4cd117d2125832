"""Multi-process commit/restore tests: real gloo ranks, real files, real kill -9."""

import json
import os

import pytest

from datastates_megatron.engine.format.manifest import _body_xxh64  # noqa: PLC2701 - to reseal a hand edit
from datastates_megatron.engine.format.manifest import read_manifest, read_tracker
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from .ranks import describe, run_ranks

WORKER = "tests.workers.manager_worker"


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
    return [r["result"] for r in results]


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_bit_exact(tmp_path, world):
    root = str(tmp_path / "ckpt")
    saved = _ok(run_ranks(WORKER, world, ["save", "--root", root, "--iters", "3"]))
    assert all(r["committed"] == [1, 2, 3] and not r["errors"] for r in saved)
    m = read_manifest(iter_dir(root, 3))
    assert m.world_size == world and len(m.ranks) == world and read_tracker(root) == 3
    loaded = _ok(run_ranks(WORKER, world, ["load", "--root", root]))
    assert all(r["iteration"] == 3 and r["exact"] and r["objects"]["rank"] == r["rank"] for r in loaded), loaded


def test_failure_on_one_rank_commits_nothing_and_every_rank_hears(tmp_path):
    root = str(tmp_path / "ckpt")
    res = _ok(run_ranks(WORKER, 2, ["save", "--root", root, "--iters", "3", "--fail-rank", "1", "--fail-iter", "2"]))
    assert res[0]["committed"] == [1, 3] and res[1]["committed"] == [1, 3]
    assert any("rank(s) [1] failed" in e and "iteration 2" in e for e in res[0]["errors"]), res[0]
    assert any("No space left" in e and "rank 1" in e for e in res[1]["errors"]), res[1]
    assert committed_iterations(root) == [1, 3]
    assert not os.path.exists(iter_dir(root, 2))  # cleaned: no rank file of the failed iteration remains loadable
    loaded = _ok(run_ranks(WORKER, 2, ["load", "--root", root, "--iteration", "1"]))
    assert all(r["exact"] for r in loaded)


def test_on_error_warn_keeps_training(tmp_path):
    root = str(tmp_path / "ckpt")
    res = _ok(
        run_ranks(
            WORKER,
            2,
            ["save", "--root", root, "--iters", "3", "--fail-rank", "0", "--fail-iter", "3", "--on-error", "warn"],
        )
    )
    assert all(r["committed"] == [1, 2] and not r["errors"] for r in res), res
    assert read_tracker(root) == 2


@pytest.mark.parametrize(
    "point,expect_latest",
    [
        ("flush:20", 1),
        ("before_finish:2", 1),
        ("before_manifest:2", 1),
        ("before_tracker:2", 2),
        ("retention:1", 2),
    ],
)
def test_kill_9_at_each_phase_leaves_a_loadable_latest(tmp_path, point, expect_latest):
    """Iteration 1 commits, then the process is killed (-9) at ``point`` during iteration 2."""
    root = str(tmp_path / "ckpt")
    crashed = run_ranks(
        WORKER, 2, ["save", "--root", root, "--iters", "3", "--keep-last", "1"], env={"DSM_CRASH_AT": point}
    )
    assert any(r["returncode"] == -9 for r in crashed), describe(crashed)
    assert committed_iterations(root)[-1] == expect_latest
    resumed = _ok(run_ranks(WORKER, 2, ["resume", "--root", root, "--iters", "1"]))
    assert all(r["iteration"] == expect_latest and r["exact"] for r in resumed), resumed
    assert all(r["committed"] == [expect_latest + 1] and not r["errors"] for r in resumed), resumed
    for it in os.listdir(root):
        if it.startswith("iter_"):
            assert os.path.exists(os.path.join(root, it, "manifest.json")), it  # leftovers were cleaned


def test_retention_keeps_exactly_the_policy(tmp_path):
    root = str(tmp_path / "ckpt")
    _ok(run_ranks(WORKER, 2, ["save", "--root", root, "--iters", "9", "--keep-last", "2", "--keep-every", "4"]))
    assert sorted(committed_iterations(root)) == [4, 8, 9]


def _corrupt_and_load(tmp_path, mutate, world=2):
    root = str(tmp_path / "ckpt")
    _ok(run_ranks(WORKER, world, ["save", "--root", root, "--iters", "1"]))
    mutate(root, read_manifest(iter_dir(root, 1)))
    res = run_ranks(WORKER, world, ["load", "--root", root])
    return [r["result"] for r in res]


def test_bit_flip_is_detected_and_nothing_is_restored(tmp_path):
    def flip(root, m):
        path = os.path.join(iter_dir(root, 1), m.ranks[1].file)
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 4]))

    res = _corrupt_and_load(tmp_path, flip)
    assert "checksum mismatch in tensor" in res[1]["error"] and m_file_named(res[1]["error"]) and res[1]["untouched"]
    # the load is collective: rank 0's own file is fine, but it must not restore alone
    assert "rank(s) [1]" in res[0]["error"] and res[0]["untouched"], res[0]


def m_file_named(msg):
    return ".dsck" in msg


def test_truncated_missing_and_foreign_files_are_detected(tmp_path):
    def truncate(root, m):
        path = os.path.join(iter_dir(root, 1), m.ranks[0].file)
        os.truncate(path, os.path.getsize(path) - 10)

    assert "manifest says" in _corrupt_and_load(tmp_path / "a", truncate)[0]["error"]

    def remove(root, m):
        os.unlink(os.path.join(iter_dir(root, 1), m.ranks[1].file))

    assert "rank 1 file" in _corrupt_and_load(tmp_path / "b", remove)[1]["error"]

    def foreign(root, m):
        other = str(tmp_path / "other")
        _ok(run_ranks(WORKER, 2, ["save", "--root", other, "--iters", "1"]))
        om = read_manifest(iter_dir(other, 1))
        os.replace(os.path.join(iter_dir(other, 1), om.ranks[0].file), os.path.join(iter_dir(root, 1), m.ranks[0].file))

    assert "not the one committed" in _corrupt_and_load(tmp_path / "c", foreign)[0]["error"]

    def traversal(root, m):
        path = os.path.join(iter_dir(root, 1), "manifest.json")
        body = json.load(open(path))
        body["ranks"][0]["file"] = "../../etc/passwd"
        body.pop("checksum")
        body["checksum"] = _body_xxh64(body)  # resealed: the checksum is checked first, the name check must refuse
        json.dump(body, open(path, "w"))

    assert "not a plain file name" in _corrupt_and_load(tmp_path / "d", traversal)[0]["error"]


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    root = str(tmp_path / "ckpt")
    _ok(run_ranks(WORKER, 2, ["save", "--root", root, "--iters", "1"]))
    res = [r["result"] for r in run_ranks(WORKER, 4, ["load", "--root", root])]
    assert all("world size 2 in checkpoint, 4 now" in r["error"] for r in res), res


def test_a_rank_that_cannot_open_the_checkpoint_makes_every_rank_fail_without_a_hang(tmp_path):
    """Rank 1 asks for another directory than rank 0 (which resolves the checkpoint for every
    rank): an error before it reaches the restore; the others wait for agreement: it must still
    join it."""
    root = str(tmp_path / "ckpt")
    _ok(run_ranks(WORKER, 3, ["save", "--root", root, "--iters", "2"]))
    res = run_ranks(
        WORKER, 3, ["load", "--root", root], timeout=90, rank_env={1: {"DSM_TEST_LOAD_ROOT": str(tmp_path / "empty")}}
    )
    assert all(r["returncode"] == 0 for r in res), describe(res)  # nobody hung (or was killed)
    results = {r["result"]["rank"]: r["result"] for r in res}
    assert "asked to load" in results[1]["error"] and results[1]["untouched"], results
    for rank in (0, 2):
        assert "rank(s) [1]" in results[rank]["error"] and results[rank]["untouched"], results
