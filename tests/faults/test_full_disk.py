"""A real full disk (a 64 MiB tmpfs mounted by the test), two gloo ranks sharing it.

Iteration 1 commits (~24 MiB); a filler file then takes the space; iteration 2 fails mid-flush (or,
with ``--fill manifest``, exactly when the manifest is written); the filler is removed; iteration 3
must commit.  Sizes: a checkpoint is ~24 MiB, so 1 + 3 fit in 64 MiB but not 1 + a leftover 2 + 3."""

from __future__ import annotations

import os

import pytest

from datastates_megatron.engine import load_file
from datastates_megatron.engine.format.manifest import read_manifest, read_tracker
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers.tier import committed_iterations

from ..distributed.ranks import describe, run_ranks
from tests.workers.fault_worker import is_state_of, make_state

WORKER = "tests.workers.fault_worker"
BIG = "3000000"  # 12 MB of fp32 per rank


def _run(small_fs, on_error, fill="data"):
    root = os.path.join(small_fs, "ckpt")
    res = run_ranks(
        WORKER,
        2,
        [
            "fulldisk",
            "--root",
            root,
            "--big",
            BIG,
            "--cache-kb",
            "4096",
            "--keep-last",
            "2",
            "--on-error",
            on_error,
            "--fill",
            fill,
            "--timeout",
            "60",
        ],
    )
    assert all(r["returncode"] == 0 and r["result"] for r in res), describe(res)
    return root, [r["result"] for r in res]


def _check_failure_left_no_trace(root, out):
    after = out[0]["after_failure"]
    assert after["latest"] == 1 and after["tracker"] == 1, after  # the previous checkpoint is intact and latest
    assert after["iter2_entries"] in (None, []), f"partial checkpoint 2 left behind: {after['iter2_entries']}"
    for r in out:
        assert r["iter2_loadable"] is False, r  # asking for it is "no checkpoint", never a partial load
        assert r["untouched_by_failed_load"], r


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_full_disk_mid_flush(small_fs, on_error):
    root, out = _run(small_fs, on_error)
    _check_failure_left_no_trace(root, out)
    for r in out:
        assert r["committed"] == [1, 3], r  # nothing for 2; 3 commits once space is freed
        errors = r["errors"]
        assert "3" not in errors and "close" not in errors, errors
        if on_error == "warn":
            assert not errors, errors
            continue
        # every rank hears, with its rank; the rank that hit ENOSPC names its file
        (msg,) = errors["2"]
        assert f"rank {r['rank']}" in msg, msg
        assert (
            "No space left on device" in msg and f"r{r['rank']:05d}-" in msg and ".dsck" in msg
        ) or "failed to write their files" in msg, msg
    assert committed_iterations(root) == [1, 3] and read_tracker(root) == 3
    _check_loads_exactly(root, 3)


def _check_loads_exactly(root, it):
    """Every rank file of ``it`` verifies and holds the state of iteration ``it``."""
    m = read_manifest(iter_dir(root, it))
    for rec in m.ranks:
        tensors, objects = load_file(os.path.join(iter_dir(root, it), rec.file))
        ts = make_state(rec.rank, int(BIG))
        for name, t in ts.items():
            t.copy_(tensors[name])
        assert is_state_of(ts, rec.rank, it) and objects["objects"] == {"iteration": it, "rank": rec.rank}


def test_full_disk_when_the_manifest_is_written(small_fs):
    """The rank files fit, the manifest does not.  Nothing is committed for iteration 2, and its rank
    files must not keep holding the space: once the filler is removed, iteration 3 must commit."""
    root, out = _run(small_fs, "raise", fill="manifest")
    for r in out:  # every rank hears that iteration 2 was not committed because of the manifest
        msg = r["errors"]["2"][0]
        assert f"rank {r['rank']}: iteration 2" in msg and "manifest" in msg, msg
    assert "No space left on device" in out[0]["errors"]["2"][0], out[0]  # rank 0 wrote it: it says why
    _check_failure_left_no_trace(root, out)
    assert not [n for n in os.listdir(root) if ".tmp-" in n], os.listdir(root)
    for r in out:
        assert r["committed"] == [1, 3] and "3" not in r["errors"], r
    assert committed_iterations(root) == [1, 3] and not os.path.exists(iter_dir(root, 2))
    _check_loads_exactly(root, 3)


def test_tracker_that_cannot_be_written_after_the_manifest_is_reported_consistently(tmp_path, monkeypatch):
    """The disk fills up between the manifest (the commit point) and the tracker (injected ENOSPC on
    the tracker only, one process).  Whatever the manager reports must match the disk: a checkpoint
    whose manifest is durable is committed, and commit sequence numbers stay unique."""
    import torch

    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.tiers import tier as tier_module
    from datastates_megatron.engine.manager import CheckpointManager
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.tiers.tier import latest_committed

    real = tier_module.write_tracker

    def write_tracker(root, iteration):
        if iteration == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(root, iteration)

    monkeypatch.setattr(tier_module, "write_tracker", write_tracker)
    root = str(tmp_path / "c")
    committed = []
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=0, on_error="warn") as mgr:
        mgr.register("w", torch.ones(1000))
        for it in (1, 2, 3):
            mgr.save(it)
            committed += [r.iteration for r in mgr.wait()]
            if it == 2:
                reported = mgr.latest_committed
                on_disk = latest_committed(root)
    assert reported == on_disk, f"the manager says the latest is {reported}, the manifests say {on_disk}"
    assert (2 in committed) == os.path.exists(os.path.join(iter_dir(root, 2), "manifest.json")), committed
    seqs = [read_manifest(iter_dir(root, it)).commit_seq for it in committed_iterations(root)]
    assert len(set(seqs)) == len(seqs), f"commit sequence numbers reused: {seqs}"
    assert latest_committed(root) == 3 and read_tracker(root) == 3


def test_a_full_tmpfs_refuses_the_mapping_with_enospc_and_the_write_fails_cleanly(small_fs):
    """Mapped writes (``mapped_writes``) on a full tmpfs: the pages are allocated before the mapping
    is used, so the pool reports ENOSPC (no SIGBUS later), the writer falls back to ``pwrite``, and
    that fails with ENOSPC like any full disk.  With room, the same file is written through a mapping."""
    import errno

    import numpy as np

    from datastates_megatron.engine.format.file_format import HEADER_BYTES
    from datastates_megatron.engine.fs.mapped_files import MappedFiles
    from datastates_megatron.engine.format.writer import RankFileWriter

    mb = 1 << 20
    pool = MappedFiles()
    filler = os.path.join(small_fs, "filler")
    with open(filler, "wb") as f:
        f.write(bytes(60 * mb))  # leaves ~4 MiB of the 64
    w = RankFileWriter(os.path.join(small_fs, "rank.dsck"), "auto", pool, HEADER_BYTES + 8 * mb)
    try:
        assert w.memory_backed and w.mapping is None and len(pool) == 0
        with pytest.raises(OSError) as e:
            w.write(np.ones(8 * mb, np.uint8), HEADER_BYTES)
        assert e.value.errno == errno.ENOSPC
    finally:
        w.close()
    os.unlink(filler)
    w = RankFileWriter(os.path.join(small_fs, "rank.dsck"), "auto", pool, HEADER_BYTES + 8 * mb)
    try:
        assert w.mapping is not None  # room again: mapped, and written without a syscall per page
        w.copy_hashed(np.ones(8 * mb, np.uint8), HEADER_BYTES, 8 * mb, [(0, 8 * mb)])
    finally:
        w.close()
        pool.close()
    with open(os.path.join(small_fs, "rank.dsck"), "rb") as f:
        f.seek(HEADER_BYTES + 8 * mb - 1)
        assert f.read(1) == b"\x01"
