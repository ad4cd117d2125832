"""A save directory that holds what we did not write: Megatron-LM's own checkpoints, stray files,
symlinks.  Start-up and retention must refuse or leave them alone, never delete them."""

import hashlib
import logging
import os

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.errors import CheckpointError, ForeignCheckpointError, NoCheckpointError
from datastates_megatron.engine.tiers.foreign import find_foreign
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import TRACKER_NAME, iter_dir
from datastates_megatron.engine.names import LOCK_NAME, RUN_ID_NAME


def _opts():
    return EngineOptions(cache_bytes=1 << 20, timeout_s=30)


def _native_torch_dist(root, iteration, tracker=True):
    """Megatron-LM's own torch_dist checkpoint: the names are what matters, the bytes are random."""
    d = iter_dir(str(root), iteration)
    os.makedirs(d)
    for name in ("common.pt", ".metadata", "__0_0.distcp", "__0_1.distcp", "metadata.json"):
        with open(os.path.join(d, name), "wb") as f:
            f.write(os.urandom(257))
    if tracker:
        with open(os.path.join(str(root), TRACKER_NAME), "w") as f:
            f.write(f"{iteration}")
    return d


def _native_legacy(root, iteration):
    d = os.path.join(iter_dir(str(root), iteration), "mp_rank_00")
    os.makedirs(d)
    with open(os.path.join(d, "model_optim_rng.pt"), "wb") as f:
        f.write(os.urandom(300))


def _hashes(root, lock=False):
    """sha256 of every file under ``root`` (a symlink: its target), without our lock file unless ``lock``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [n for n in dirnames if os.path.islink(os.path.join(dirpath, n))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                out[os.path.relpath(path, root)] = "link:" + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    if not lock:
        out.pop(LOCK_NAME, None)
        out.pop(RUN_ID_NAME, None)  # ours too: the run id, created at the first start
    return out


def _save(root, iterations, **kw):
    t = {"w": torch.arange(1000, dtype=torch.float32)}
    with CheckpointManager(str(root), _opts(), **kw) as mgr:
        mgr.register("w", t["w"])
        for it in iterations:
            assert mgr.save(it, {"iteration": it})
            mgr.wait()


def test_find_foreign_recognises_torch_dist_and_legacy_and_ignores_ours(tmp_path):
    _native_torch_dist(tmp_path, 500)
    _native_legacy(tmp_path, 300)
    os.makedirs(tmp_path / "release" / "mp_rank_00")
    (tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    os.makedirs(iter_dir(str(tmp_path), 600))  # our own partial save: only our names
    (tmp_path / "iter_0000600" / "r00000-0123456789abcdef-000003.dsck").write_bytes(b"partial")
    found = {(f.iteration, f.format) for f in find_foreign(str(tmp_path))}
    assert found == {(500, "torch_dist"), (300, "torch"), (None, "torch")}


def test_native_checkpoint_newer_than_ours_is_refused_and_survives_byte_for_byte(tmp_path):
    root = tmp_path / "ckpt"
    _native_torch_dist(root, 500)
    before = _hashes(root)
    with pytest.raises(ForeignCheckpointError) as err:
        CheckpointManager(str(root), _opts())
    msg = str(err.value)
    assert str(root) in msg and "500" in msg and "torch_dist" in msg
    assert "another --save directory" in msg and "pass this directory as --load and a new one as --save" in msg
    assert isinstance(err.value, CheckpointError)
    assert _hashes(root, lock=True) == before  # every byte of every file, the tracker included; nothing added


def test_legacy_native_checkpoint_is_refused_too(tmp_path):
    _native_legacy(tmp_path, 40)
    before = _hashes(tmp_path)
    with pytest.raises(ForeignCheckpointError, match=r"40.*torch\b"):
        CheckpointManager(str(tmp_path), _opts())
    assert _hashes(tmp_path, lock=True) == before


def test_our_uncommitted_partial_save_is_still_cleaned(tmp_path):
    _save(tmp_path, [10])
    partial = iter_dir(str(tmp_path), 20)
    os.makedirs(partial)
    with open(os.path.join(partial, "r00000-0123456789abcdef-000007.dsck"), "wb") as f:
        f.write(b"partial")
    with open(os.path.join(partial, "manifest.json.tmp-123"), "wb") as f:
        f.write(b"{")
    with CheckpointManager(str(tmp_path), _opts()):
        pass
    assert not os.path.exists(partial)
    assert os.path.isdir(iter_dir(str(tmp_path), 10))


def test_foreign_checkpoint_older_than_ours_survives_and_the_run_proceeds(tmp_path, caplog):
    _native_torch_dist(tmp_path, 5, tracker=False)
    (tmp_path / "iter_0000005" / "notes.txt").write_bytes(b"mine")
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ForeignCheckpointError):  # newer than ours: we have none yet
            CheckpointManager(str(tmp_path), _opts())
    # our checkpoints come first in another directory, then the older native one is put beside them
    os.rename(tmp_path / "iter_0000005", tmp_path / "keep")
    _save(tmp_path, [10, 20, 30], keep_last=1)
    os.rename(tmp_path / "keep", tmp_path / "iter_0000005")
    before = _hashes(tmp_path / "iter_0000005")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _save(tmp_path, [40, 50], keep_last=1)
    assert _hashes(tmp_path / "iter_0000005") == before
    assert any("iter_0000005" in r.getMessage() for r in caplog.records)


def test_stray_file_in_an_uncommitted_directory_keeps_the_directory(tmp_path):
    d = iter_dir(str(tmp_path), 7)
    os.makedirs(d)
    with open(os.path.join(d, "r00000-0123456789abcdef-000001.dsck"), "wb") as f:
        f.write(b"ours")
    with open(os.path.join(d, "README"), "wb") as f:
        f.write(b"not ours")
    before = _hashes(tmp_path)
    with CheckpointManager(str(tmp_path), _opts()):
        pass
    assert _hashes(tmp_path) == before


def test_cleanup_never_follows_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "r00000-0123456789abcdef-000001.dsck"
    victim.write_bytes(b"precious")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(outside, root / "iter_0000003")  # an iteration directory that is a link
    d = iter_dir(str(root), 4)
    os.makedirs(d)
    os.symlink(victim, os.path.join(d, "r00000-0123456789abcdef-000002.dsck"))  # a rank-file name that is a link
    with CheckpointManager(str(root), _opts()):
        pass
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(root / "iter_0000003")
    assert os.path.islink(os.path.join(d, "r00000-0123456789abcdef-000002.dsck"))


def test_retention_deletes_only_our_files(tmp_path):
    _save(tmp_path, [1, 2], keep_last=0)
    stray = tmp_path / "iter_0000001" / "eval_results.json"
    stray.write_bytes(b"someone else's")
    _save(tmp_path, [3, 4], keep_last=1)
    assert stray.read_bytes() == b"someone else's"
    assert sorted(os.listdir(tmp_path / "iter_0000001")) == ["eval_results.json"]
    assert not os.path.exists(tmp_path / "iter_0000002")


def test_resume_from_a_load_dir_holding_a_newer_native_checkpoint_is_refused(tmp_path):
    load = tmp_path / "load"
    _native_torch_dist(load, 500)
    before = _hashes(load)
    with CheckpointManager(str(tmp_path / "save"), _opts(), load_root=str(load)) as mgr:
        mgr.register("w", torch.zeros(4))
        with pytest.raises(ForeignCheckpointError, match="500"):
            mgr.load()
        with pytest.raises(ForeignCheckpointError):
            mgr.latest()
    assert _hashes(load) == before
    with CheckpointManager(str(tmp_path / "empty"), _opts()) as mgr:
        with pytest.raises(NoCheckpointError):
            mgr.load()
