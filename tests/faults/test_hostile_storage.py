"""Hostile storage (one process, real files): a symlink or a non-regular file planted at a name we
write or read.  Nothing outside the checkpoint is ever written through a link, and a rank file or
manifest that is not a regular file is refused on load and by ``verify`` with the path and rank."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from datastates_megatron.cli import EXIT_DAMAGED, main
from datastates_megatron.engine import CheckpointError, CorruptCheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import MANIFEST_NAME, TRACKER_NAME, iter_dir, rank_file_name
from datastates_megatron.engine.names import RECYCLE_DIR

from tests.workers.fault_worker import fill, make_state


def _manager(root, **kw):
    kw.setdefault("keep_last", 0)
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _save(mgr, ts, it):
    fill(ts, 0, it)
    mgr.save(it, {"iteration": it})
    mgr.wait()


@pytest.fixture
def victim(tmp_path_factory):
    """A file outside every checkpoint (its path, its digest): it must never change."""
    path = tmp_path_factory.mktemp("outside") / "precious.bin"
    path.write_bytes(os.urandom(8192))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _unchanged(victim) -> bool:
    path, digest = victim
    return hashlib.sha256(path.read_bytes()).hexdigest() == digest


@pytest.fixture
def saving(tmp_path):
    """A manager with one tiny registered state and iteration 1 committed."""
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        _save(mgr, ts, 1)
        yield root, mgr, ts


# ------------------------------------------------------------------------------------------ writing
def test_a_symlink_at_the_next_rank_file_name_is_not_written_through(saving, victim):
    root, mgr, ts = saving
    os.makedirs(iter_dir(str(root), 2))
    planted = os.path.join(iter_dir(str(root), 2), rank_file_name(0, mgr.token, mgr._seq + 1))
    os.symlink(victim[0], planted)
    with pytest.raises(CheckpointError, match="symlink") as e:
        _save(mgr, ts, 2)
    assert planted in str(e.value)
    assert _unchanged(victim) and os.path.islink(planted)  # not followed, not removed
    assert not os.path.exists(os.path.join(iter_dir(str(root), 2), MANIFEST_NAME))


def test_a_symlink_at_the_manifest_temp_name_is_not_written_through(saving, victim):
    root, mgr, ts = saving
    os.makedirs(iter_dir(str(root), 2))
    planted = os.path.join(iter_dir(str(root), 2), f"{MANIFEST_NAME}.tmp-{os.getpid()}")
    os.symlink(victim[0], planted)
    with pytest.raises(CheckpointError) as e:
        _save(mgr, ts, 2)
    assert planted in str(e.value)
    assert _unchanged(victim) and os.path.islink(planted)
    assert not os.path.exists(os.path.join(iter_dir(str(root), 2), MANIFEST_NAME))


def test_a_symlink_at_the_tracker_temp_name_is_not_written_through(saving, victim):
    root, mgr, ts = saving
    planted = os.path.join(str(root), f"{TRACKER_NAME}.tmp-{os.getpid()}")
    os.symlink(victim[0], planted)
    _save(mgr, ts, 2)  # committed: the tracker is only a hint, its update is skipped with a warning
    assert _unchanged(victim) and os.path.islink(planted)
    assert read_manifest(iter_dir(str(root), 2)).iteration == 2


def test_recycling_never_moves_nor_reuses_a_symlink(tmp_path, victim):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with _manager(root, keep_last=1, recycle_files="all") as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        _save(mgr, ts, 1)
        rank_file = os.path.join(iter_dir(str(root), 1), read_manifest(iter_dir(str(root), 1)).ranks[0].file)
        os.unlink(rank_file)
        os.symlink(victim[0], rank_file)  # iteration 1's rank file is now a link to the outside
        pool = root / RECYCLE_DIR
        os.makedirs(pool, exist_ok=True)
        os.symlink(victim[0], pool / f"{0:07d}-{rank_file_name(0, mgr.token, 99)}")  # and one in the pool
        for it in (2, 3, 4):  # 2 retires 1 (its "file" must not enter the pool); 3 and 4 take from it
            _save(mgr, ts, it)
        assert _unchanged(victim)
        assert all(not os.path.islink(pool / n) or n.startswith("0000000-") for n in os.listdir(pool))
    assert _unchanged(victim)


# ------------------------------------------------------------------------------------------ reading
def test_a_rank_file_that_is_a_symlink_is_refused_on_load_and_by_verify(saving, tmp_path, capsys):
    root, mgr, ts = saving
    m = read_manifest(iter_dir(str(root), 1))
    path = os.path.join(iter_dir(str(root), 1), m.ranks[0].file)
    outside = tmp_path / "copy.dsck"
    shutil.move(path, outside)
    os.symlink(outside, path)  # a valid file, but not inside the checkpoint
    with pytest.raises(CorruptCheckpointError, match="symlink") as e:
        mgr.load(1)
    assert path in str(e.value) and "rank 0" in str(e.value)
    assert main(["verify", iter_dir(str(root), 1)]) == EXIT_DAMAGED
    assert "symlink" in capsys.readouterr().out


def test_a_rank_file_that_is_not_a_regular_file_is_refused(saving, capsys):
    root, mgr, ts = saving
    m = read_manifest(iter_dir(str(root), 1))
    path = os.path.join(iter_dir(str(root), 1), m.ranks[0].file)
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(CorruptCheckpointError, match="not a regular file") as e:
        mgr.load(1)
    assert path in str(e.value) and "rank 0" in str(e.value)
    assert main(["verify", iter_dir(str(root), 1)]) == EXIT_DAMAGED
    assert "not a regular file" in capsys.readouterr().out


def test_a_manifest_that_is_a_symlink_is_refused_on_load_and_by_verify(saving, tmp_path, capsys):
    root, mgr, ts = saving
    path = os.path.join(iter_dir(str(root), 1), MANIFEST_NAME)
    outside = tmp_path / "manifest-copy.json"
    shutil.move(path, outside)
    os.symlink(outside, path)
    with pytest.raises(CorruptCheckpointError, match="symlink") as e:
        read_manifest(iter_dir(str(root), 1))
    assert path in str(e.value)
    with pytest.raises(CorruptCheckpointError):
        mgr.load(1)
    assert main(["verify", iter_dir(str(root), 1)]) == EXIT_DAMAGED
    assert "symlink" in capsys.readouterr().err


def test_an_iteration_directory_that_is_a_symlink_is_not_saved_into(saving, victim, tmp_path):
    root, mgr, ts = saving
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    os.symlink(outside, iter_dir(str(root), 2))
    with pytest.raises(CheckpointError, match="symlink"):
        _save(mgr, ts, 2)
    assert os.listdir(outside) == [] and os.path.islink(iter_dir(str(root), 2))
