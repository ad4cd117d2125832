"""An older iteration directory that is a symlink, or whose manifest is damaged (issue 33, finding
5): reported (a warning; ``ls`` shows it DAMAGED) and skipped -- resuming from the newest committed
checkpoint goes on.  A damaged or linked directory *newer* than every committed one still stops the
loader from choosing (it may be the checkpoint the user means).  Nothing outside changes."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from datastates_megatron.cli import main
from datastates_megatron.engine import CheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir
from datastates_megatron.engine.tiers.tier import latest_committed

from tests.faults.damage import flip
from tests.workers.fault_worker import fill, is_state_of, make_state


def _manager(root, **kw):
    kw.setdefault("keep_last", 0)
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _digests(directory):
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def three(tmp_path):
    """Iterations 1, 2, 3 committed; iter_1 moved to an archive outside and linked back; iter_2's
    manifest damaged."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    ts = make_state(0, 5_000)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2, 3):
            fill(ts, 0, it)
            mgr.save(it, {"iteration": it})
            mgr.wait()
    outside.mkdir()
    shutil.move(iter_dir(str(root), 1), outside / "archive")
    os.symlink(outside / "archive", iter_dir(str(root), 1))
    manifest = os.path.join(iter_dir(str(root), 2), MANIFEST_NAME)
    st = os.stat(manifest)
    flip(manifest, 40)
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: the file's times stay
    return root, outside


def test_resuming_skips_an_older_linked_and_an_older_damaged_iteration_with_a_warning(three, caplog):
    root, outside = three
    before = _digests(outside)
    assert latest_committed(str(root)) == 3
    ts = make_state(0, 5_000)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        assert mgr.load().iteration == 3 and is_state_of(ts, 0, 3)
        fill(ts, 0, 4)
        mgr.save(4, {"iteration": 4})
        mgr.wait()
    assert "iter_0000001" in caplog.text and "iter_0000002" in caplog.text and "skipped" in caplog.text
    assert os.path.islink(iter_dir(str(root), 1)) and _digests(outside) == before


def test_ls_reports_the_older_ones_damaged_and_names_the_latest(three, capsys):
    root, _ = three
    assert main(["ls", str(root)]) == 1  # a damaged manifest: exit 1, as the help says
    out = capsys.readouterr().out
    assert "latest: 3" in out and out.count("DAMAGED") == 2 and "symlink" in out


def test_a_damaged_iteration_newer_than_every_committed_one_still_refuses_to_choose(three):
    root, _ = three
    shutil.copytree(iter_dir(str(root), 3), iter_dir(str(root), 4))
    flip(os.path.join(iter_dir(str(root), 4), MANIFEST_NAME), 40)
    with pytest.raises(CheckpointError, match=r"iter_0000004"):
        latest_committed(str(root))


def test_an_older_iteration_whose_manifest_changed_after_the_newest_commit_still_refuses(three):
    """It may be a later commit of a run that resumed from an older checkpoint: skipping it could
    roll training back, so the loader refuses to choose (as for a newer damaged one)."""
    root, _ = three
    flip(os.path.join(iter_dir(str(root), 2), MANIFEST_NAME), 41)  # edited now: after iteration 3's commit
    with pytest.raises(CheckpointError, match=r"iter_0000002"):
        latest_committed(str(root))
