"""Start-up refusals on rank 0 (save directory busy, a newer Megatron-native checkpoint) reach every
rank as an error: none hangs in the next collective."""

import os

import pytest

from datastates_megatron.engine.fs.dirlock import SaveDirLock

from .ranks import describe, run_ranks

WORKER = "tests.workers.manager_worker"


@pytest.mark.parametrize("refusal", ["SaveDirBusyError", "ForeignCheckpointError"])
def test_rank_0_refusing_to_start_fails_every_rank(tmp_path, refusal):
    root = tmp_path / "ckpt"
    native = root / "iter_0000500"
    native.mkdir(parents=True)
    if refusal == "ForeignCheckpointError":
        for name in ("common.pt", ".metadata", "__0_0.distcp", "metadata.json"):
            (native / name).write_bytes(os.urandom(64))
    lock = SaveDirLock(str(root)).acquire() if refusal == "SaveDirBusyError" else None
    try:
        results = run_ranks(WORKER, 2, ["save", "--root", str(root), "--iters", "1"], timeout=90)
    finally:
        if lock is not None:
            lock.release()
    assert not any(r["timed_out"] for r in results), describe(results)
    assert all(r["returncode"] not in (0, None) and r["result"] is None for r in results), describe(results)
    assert refusal in results[0]["stderr"], describe(results)
    assert refusal in results[1]["stderr"] and "start-up failed on rank(s) [0]" in results[1]["stderr"], describe(
        results
    )
    assert sorted(os.listdir(native)) == ([] if lock else [".metadata", "__0_0.distcp", "common.pt", "metadata.json"])
