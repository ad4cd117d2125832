"""Hard links and temp names (issue 33, finding 1), and readers of recycled files (finding 5): a
file with other hard links is never truncated or rewritten in place (the other name keeps its
bytes), a temp name is never written through a link, and a process that has a retired rank file
mapped never dies of SIGBUS when recycling reuses it.  Every test checks the bytes outside the save
directory did not change."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess

import pytest
import torch

from datastates_megatron.engine import CheckpointError, EngineOptions, load_file
from datastates_megatron.engine.format.file_format import RankFile
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.names import LOCK_NAME, RECYCLE_DIR
from datastates_megatron.engine.tiers.tier import committed_iterations

from tests.workers.fault_worker import fill, is_state_of, make_state


def _manager(root, **kw):
    kw.setdefault("keep_last", 0)
    return CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), **kw)


def _digests(directory) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _rank_file(root, it) -> str:
    return os.path.join(iter_dir(str(root), it), read_manifest(iter_dir(str(root), it)).ranks[0].file)


def _registered(mgr):
    ts = make_state(0, 20_000)
    for n, t in ts.items():
        mgr.register(n, t)
    return ts


def _save(mgr, ts, it, objects=None):
    fill(ts, 0, it)
    mgr.save(it, objects if objects is not None else {"iteration": it})
    mgr.wait()


def test_a_lock_file_hard_linked_to_a_file_elsewhere_is_not_truncated(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_bytes(os.urandom(4096))
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(precious, root / LOCK_NAME)
    before = _digests(outside)
    with pytest.raises(CheckpointError, match=rf"{LOCK_NAME}.*2 hard links"):
        _manager(root)
    assert _digests(outside) == before


def test_a_cp_al_backup_of_a_committed_checkpoint_keeps_its_bytes_through_recycling(tmp_path):
    root, backup = tmp_path / "ckpt", tmp_path / "backup"
    with _manager(root, keep_last=1, recycle_files="all") as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1)
        subprocess.run(["cp", "-al", iter_dir(str(root), 1), str(backup)], check=True)  # a hard-link backup
        before = _digests(backup)
        for it in (2, 3, 4, 5):  # 1 and later ones are retired into the pool and taken again
            _save(mgr, ts, it)
        assert committed_iterations(str(root)) == [5]
    assert _digests(backup) == before
    name = read_manifest(str(backup)).ranks[0].file
    got, _ = load_file(str(backup / name))
    ts = make_state(0, 20_000)
    assert is_state_of({n: got[n] for n in ts}, 0, 1)


def test_a_pool_file_with_other_links_is_never_taken(tmp_path):
    """The pool itself: a retired file someone linked to after retention moved it there."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    with _manager(root, keep_last=1, recycle_files="all") as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1)
        _save(mgr, ts, 2)  # 1 retired into the pool
        (pool_file,) = os.listdir(root / RECYCLE_DIR)
        os.link(root / RECYCLE_DIR / pool_file, outside / "kept.dsck")
        before = _digests(outside)
        _save(mgr, ts, 3)
        _save(mgr, ts, 4)
    assert _digests(outside) == before


def test_export_torch_never_writes_through_a_link_at_its_temp_name(tmp_path, monkeypatch):
    from datastates_megatron.megatron.export import exporter as export_mod

    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.bin"
    precious.write_bytes(os.urandom(8192))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # the checkpoint side of the export is not under test here: a consolidated state of one tensor
    monkeypatch.setattr(export_mod, "_locate", lambda ckpt_dir, iteration: (ckpt_dir, 7))
    monkeypatch.setattr(export_mod, "consolidate", lambda path, it, verify=True: {"w": torch.ones(4)})
    tmp_name = out_dir / f"iter_0000007.pt.tmp-{os.getpid()}"
    os.symlink(precious, tmp_name)
    before = _digests(outside)
    with pytest.raises(CheckpointError, match=r"tmp-.*symlink"):
        export_mod.export(str(tmp_path / "ckpt"), str(out_dir), "torch")
    assert _digests(outside) == before and os.path.islink(tmp_name)
    assert not (out_dir / "iter_0000007.pt").exists()
    os.unlink(tmp_name)
    path = export_mod.export(str(tmp_path / "ckpt"), str(out_dir), "torch")
    assert torch.load(path)["w"].sum() == 4 and os.listdir(out_dir) == ["iter_0000007.pt"]


def _map_then_recycle(root: str) -> None:
    """Child: map iteration 1's rank file (a reader), then let recycling reuse it for a smaller save."""
    with _manager(root, keep_last=1, recycle_files="all") as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1, {"pad": "x" * 200_000})  # a bigger objects section: the file is ~200 KB longer
        reader = RankFile(_rank_file(root, 1))
        ino = os.fstat(reader.fileno()).st_ino
        reused = False
        for it in (2, 3, 4):
            _save(mgr, ts, it)
            reused |= os.stat(_rank_file(root, it)).st_ino == ino
        reader.span(0, reader.header.file_bytes).sum()  # touch every mapped page, the last ones too
        reader.close()
    os._exit(0 if reused else 3)


def test_a_reader_mapping_a_retired_file_survives_its_recycling(tmp_path):
    root = str(tmp_path / "ckpt")
    pid = os.fork()
    if pid == 0:
        try:
            _map_then_recycle(root)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"the reader died of signal {signal.Signals(os.WTERMSIG(status)).name}"
    assert os.waitstatus_to_exitcode(status) == 0  # and the file was reused, not only replaced
    assert committed_iterations(root) == [4]
    shutil.rmtree(root)


@pytest.mark.parametrize("size", [0, 8192])
def test_a_hard_link_planted_at_the_next_rank_file_name_is_not_written_through(tmp_path, size):
    from datastates_megatron.engine.names import rank_file_name

    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.bin"
    precious.write_bytes(os.urandom(size))
    before = _digests(outside)
    with _manager(root) as mgr:
        ts = _registered(mgr)
        _save(mgr, ts, 1)
        os.makedirs(iter_dir(str(root), 2))
        os.link(precious, os.path.join(iter_dir(str(root), 2), rank_file_name(0, mgr.token, mgr._seq + 1)))
        _save(mgr, ts, 2)
    assert _digests(outside) == before and os.stat(precious).st_nlink == 1
    assert committed_iterations(str(root)) == [1, 2]
