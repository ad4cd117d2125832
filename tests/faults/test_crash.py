"""kill -9 at the phases tests/distributed does not reach, on one rank and on all ranks: after each,
a restart loads the newest committed checkpoint (checksums verified), no acknowledged commit is
lost, start-up cleanup leaves only committed directories, and training resumes bit-exactly.

The exhaustive version (every phase, many points, one rank and all ranks) is tests/faults/sweep.py;
this is the CI subset.  Real interpreters via tests/distributed/ranks.py."""

from __future__ import annotations

import json
import os

import pytest

from datastates_megatron.engine.format.manifest import read_tracker
from datastates_megatron.engine.names import MANIFEST_NAME
from datastates_megatron.engine.tiers.tier import committed_iterations, latest_committed

from ..distributed.ranks import describe, run_ranks
from tests.workers.fault_worker import acknowledged, read_progress

WORKER = "tests.workers.fault_worker"


def _crash(root, progress, *extra, env=None, kill_when=None):
    res = run_ranks(
        WORKER,
        2,
        ["save", "--root", root, "--iters", "3", "--keep-last", "1", "--progress", progress, *extra],
        env=env,
        kill_when=kill_when,
    )
    assert any(r["returncode"] == -9 for r in res), "the fault did not kill any rank\n" + describe(res)
    return res


def _resume(root, progress, until=4, *extra):
    """Restart; check the loaded state and that nothing acknowledged before the crash was lost."""
    acked = acknowledged(progress, 2)
    on_disk = latest_committed(root) if committed_iterations(root) else None
    res = run_ranks(WORKER, 2, ["resume", "--root", root, "--until", str(until), "--keep-last", "1", *extra])
    assert all(r["returncode"] == 0 and r["result"] for r in res), describe(res)
    out = [r["result"] for r in res]
    for r in out:
        assert "error" not in r, r
        assert r["iteration"] == on_disk, (r, on_disk)  # the newest committed checkpoint
        assert (r["iteration"] or 0) >= (acked or 0), f"acknowledged commit {acked} lost: loaded {r['iteration']}"
        assert r["exact"] and r["objects_ok"], r
        assert r["committed"] == list(range((r["iteration"] or 0) + 1, until + 1)) and not r["errors"], r
    for name in os.listdir(root):  # start-up cleanup + retention left committed directories only
        if name.startswith("iter_"):
            assert os.path.exists(os.path.join(root, name, MANIFEST_NAME)), name
    assert read_tracker(root) == until and committed_iterations(root) == [until]
    return out


def test_one_rank_killed_mid_flush_then_all_killed_during_restore(tmp_path):
    """Rank 1 dies in the middle of iteration 2's flush; the restart is itself killed (external
    SIGKILL, all ranks) while loading; the second restart loads iteration 1 bit-exactly."""
    root, progress = str(tmp_path / "ckpt"), str(tmp_path / "progress")
    _crash(root, progress, "--big", "400000", env={"DSM_CRASH_AT": "flush:40", "DSM_CRASH_RANK": "1"})
    assert committed_iterations(root) == [1] and acknowledged(progress, 2) in (None, 1)
    killed = run_ranks(
        WORKER,
        2,
        [
            "resume",
            "--root",
            root,
            "--until",
            "4",
            "--big",
            "400000",
            "--progress",
            str(tmp_path / "load"),
            "--slow-restore-ms",
            "30",
            "--kill-at",
            "load",
            "--kill-after-ms",
            "150",
        ],
    )
    assert all(r["returncode"] == -9 for r in killed), describe(killed)
    for lines in read_progress(str(tmp_path / "load"), 2):
        assert "load_start" in lines and not any(x.startswith("load_done") for x in lines), lines  # died mid-load
    _resume(root, progress, 4, "--big", "400000")


def test_one_rank_killed_mid_flush_through_a_kept_mapping_on_tmpfs(tmp_path, shm_dir):
    """On tmpfs with recycling, iteration 3 overwrites iteration 1's retired rank file through the
    mapping kept since iteration 1 (``mapped_writes``); rank 1 dies in the middle of it.  The restart
    loads iteration 2 bit-exactly and training goes on."""
    root, progress = str(shm_dir / "ckpt"), str(tmp_path / "progress")
    # ~27 regions per save (64 KiB chunks of a 1.6 MB tensor, and the packs): the 65th is in save 3
    _crash(
        root, progress, "--big", "400000", "--recycle", "all", env={"DSM_CRASH_AT": "flush:65", "DSM_CRASH_RANK": "1"}
    )
    assert committed_iterations(root) == [2] and acknowledged(progress, 2) in (1, 2)
    _resume(root, progress, 4, "--big", "400000", "--recycle", "all")


@pytest.mark.parametrize("who", ["all", "rank1"])
def test_sigkill_during_the_device_to_host_copy(tmp_path, who):
    """Copies are slowed (20 ms per region); SIGKILL arrives 120 ms into iteration 2's snapshot."""
    root, progress = str(tmp_path / "ckpt"), str(tmp_path / "progress")
    extra = ["--slow-copy-ms", "20", "--kill-at", "save:2", "--kill-after-ms", "120"]
    if who == "rank1":
        extra += ["--kill-rank", "1"]
    _crash(root, progress, *extra)
    assert committed_iterations(root) == [1] and acknowledged(progress, 2) == 1
    for rank, lines in enumerate(read_progress(progress, 2)):  # the kill landed before the gate returned
        if who == "all" or rank == 1:
            assert "snapshot 1" in lines and "snapshot 2" not in lines, (rank, lines)
    _resume(root, progress)


def test_crash_while_retention_deletes_files(tmp_path):
    """Retention has removed iteration 1's manifest but not its files when rank 0 dies."""
    root, progress = str(tmp_path / "ckpt"), str(tmp_path / "progress")
    _crash(root, progress, env={"DSM_CRASH_AT": "retention_files:1"})
    assert os.path.isdir(os.path.join(root, "iter_0000001"))  # files still there, manifest gone
    assert committed_iterations(root) == [2]
    _resume(root, progress)


def test_external_sigkill_of_all_ranks_right_after_a_commit(tmp_path):
    """A launcher kills every rank as soon as the tracker names iteration 2 (anywhere in the next phase)."""
    root, progress = str(tmp_path / "ckpt"), str(tmp_path / "progress")
    _crash(root, progress, "--slow-write-ms", "30", kill_when=lambda: (read_tracker(root) or 0) >= 2)
    assert latest_committed(root) >= 2
    _resume(root, progress)


def test_restore_crash_point_is_placed(tmp_path):
    """``DSM_CRASH_AT=restore`` is documented in engine/runtime/faults.py: it must kill a load half-way."""
    root = str(tmp_path / "ckpt")
    ok = run_ranks(WORKER, 2, ["save", "--root", root, "--iters", "1"])
    assert all(r["returncode"] == 0 for r in ok), describe(ok)
    res = run_ranks(
        WORKER, 2, ["load", "--root", root, "--progress", str(tmp_path / "load")], env={"DSM_CRASH_AT": "restore:3"}
    )
    assert all(r["returncode"] == -9 for r in res), "DSM_CRASH_AT=restore:3 did not kill the load:\n" + json.dumps(
        [r["result"] for r in res]
    )
    for lines in read_progress(str(tmp_path / "load"), 2):
        assert "load_start" in lines and not any(x.startswith("load_done") for x in lines), lines
