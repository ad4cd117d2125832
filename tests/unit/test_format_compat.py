"""The upgrade story (issue 35): every older format stays readable -- a format-1 checkpoint stored in the
repository (``tests/fixtures/format1.py``) loads forever -- and a newer format is refused with who wrote
it and what to do ("upgrade"), by load, ``ls``, ``inspect`` and ``verify``, without being called damaged
and without making the older checkpoints beside it unloadable."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import pytest
import torch

from datastates_megatron import __version__
from datastates_megatron.cli import EXIT_DAMAGED, EXIT_NEWER, EXIT_OK, main
from datastates_megatron.engine import CorruptCheckpointError, EngineOptions, FormatVersionError
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import Manifest, read_manifest
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir
from datastates_megatron.engine.load.reader import open_rank
from datastates_megatron.engine.tiers.tier import latest_committed

from tests.faults.damage import edit_manifest
from tests.fixtures import format1

UPGRADE = (
    r"written by datastates-megatron 9\.9\.9 \(manifest format 2\); this is datastates-megatron "
    + __version__.replace(".", r"\.")
    + r" \(reads manifest formats <= 1\): upgrade"
)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------- the stored format 1
@pytest.fixture
def format1_root(tmp_path):
    """A copy of the stored checkpoint (a load must not write, but the repository is not ours to risk)."""
    root = tmp_path / "format1"
    shutil.copytree(format1.CKPT_DIR, root)
    return str(root)


def test_the_stored_format1_checkpoint_loads(format1_root, capsys):
    assert latest_committed(format1_root) == format1.ITERATION
    d = iter_dir(format1_root, format1.ITERATION)
    m = read_manifest(d)
    assert (m.world_size, m.run_token, m.writer_version) == (format1.WORLD, format1.TOKEN, "0.1.0")
    for rank in range(format1.WORLD):
        rf = open_rank(d, m, rank)
        try:
            expected = format1.expected_tensors(rank)
            assert sorted(rf.entries) == sorted(expected)
            for name, want in expected.items():
                rf.verify_entry(rf.entries[name])
                got = rf.tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
            assert rf.objects["objects"] == format1.expected_objects(rank)
        finally:
            rf.close()
    code, out, _ = _run(capsys, "verify", d, "-q")
    assert code == EXIT_OK and out.splitlines()[-1].startswith(f"OK iter_{format1.ITERATION:07d}")


def test_a_manifest_from_before_writer_version_was_recorded_reads(format1_root):
    d = iter_dir(format1_root, format1.ITERATION)
    path = os.path.join(d, MANIFEST_NAME)
    old = dataclasses.replace(read_manifest(d), writer_version="").to_json()  # as written before the field
    assert b"writer_version" not in old
    assert Manifest.from_json(old, path).writer_version == ""


def test_a_writer_version_that_is_not_a_version_is_refused(format1_root):
    d = iter_dir(format1_root, format1.ITERATION)
    edit_manifest(d, lambda b: b.update(writer_version="1.0\n; rm -rf /"))
    with pytest.raises(CorruptCheckpointError, match="manifest field 'writer_version' .* is not a version"):
        read_manifest(d)


# ------------------------------------------------------------------------------- a newer format
@pytest.fixture
def with_newer(tmp_path):
    """Iterations 1 and 2 saved by this version, and iteration 3 claiming manifest format 2, written by
    datastates-megatron 9.9.9 (a copy of 2 with an edited manifest: a newer format's checksum may be
    anything, so it is not resealed)."""
    root = str(tmp_path / "ckpt")
    w = torch.zeros(64)
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=0) as mgr:
        mgr.register("w", w)
        for it in (1, 2):
            w.fill_(it)
            mgr.save(it, {"iteration": it})
            mgr.wait()
    shutil.copytree(iter_dir(root, 2), iter_dir(root, 3))
    edit_manifest(
        iter_dir(root, 3), lambda b: b.update(format_version=2, writer_version="9.9.9", iteration=3), reseal=False
    )
    return root


def test_load_refuses_a_newer_format_with_the_upgrade_message_and_loads_older_ones(with_newer):
    root = with_newer
    w = torch.full((64,), -1.0)
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=0) as mgr:
        mgr.register("w", w)
        with pytest.raises(FormatVersionError, match=UPGRADE):
            mgr.load(3)
        with pytest.raises(FormatVersionError, match=UPGRADE):  # the latest: never silently an older one
            mgr.load()
        assert torch.equal(w, torch.full((64,), -1.0))  # a refused load writes nothing
        mgr.load(2)  # an older checkpoint stays loadable by its iteration
        assert torch.equal(w, torch.full((64,), 2.0))
    assert os.path.isdir(iter_dir(root, 3))  # never removed


def test_ls_shows_a_newer_format_not_damaged_with_exit_3(with_newer, capsys):
    code, out, err = _run(capsys, "ls", with_newer)
    assert code == EXIT_NEWER and err == ""
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()}
    assert "NEWER FORMAT" in rows["3"] and "DAMAGED" not in out
    assert "committed" in rows["1"] and "committed" in rows["2"]
    assert re.search(UPGRADE, out), out
    doc = json.loads(_run(capsys, "ls", with_newer, "--json")[1])
    states = {c["iteration"]: c["state"] for c in doc["checkpoints"]}
    assert states == {1: "committed", 2: "committed", 3: "newer"}


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_refuse_a_newer_format_with_exit_3(with_newer, capsys, command):
    code, out, err = _run(capsys, command, iter_dir(with_newer, 3))
    assert code == EXIT_NEWER and out == "" and err.count("\n") == 1, err
    assert re.search(UPGRADE, err) and "damaged" not in err.lower() and "Traceback" not in err
    assert _run(capsys, command, iter_dir(with_newer, 2))[0] == EXIT_OK


def test_export_refuses_a_newer_format_with_exit_3(with_newer, tmp_path, capsys):
    code, out, err = _run(capsys, "export", iter_dir(with_newer, 3), tmp_path / "out", "--format", "torch")
    assert code == EXIT_NEWER and out == "" and re.search(UPGRADE, err) and not (tmp_path / "out").exists(), err


def test_ls_exit_status_is_1_for_a_damaged_manifest_even_beside_a_newer_one(with_newer, capsys):
    os.makedirs(iter_dir(with_newer, 4))
    with open(os.path.join(iter_dir(with_newer, 4), MANIFEST_NAME), "w") as f:
        f.write("{ not json")
    code, out, _ = _run(capsys, "ls", with_newer)
    assert code == EXIT_DAMAGED and "DAMAGED" in out and "NEWER FORMAT" in out


def _newer_rank_file(root: str, rank: int) -> None:
    """Rank ``rank``'s file in ``root`` claims rank-file format 2 (the u32 after the 8-byte magic)."""
    m = read_manifest(root)
    path = os.path.join(root, m.record(rank).file)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((2).to_bytes(4, "little"))


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_newer_rank_file_is_upgrade_not_damage_unless_something_is_damaged(format1_root, capsys, command):
    ckpt = iter_dir(format1_root, 7)
    _newer_rank_file(ckpt, 1)
    code, out, _ = _run(capsys, command, ckpt)
    assert code == EXIT_NEWER and re.search(r"written by a newer|upgrade", out), out
    if command == "inspect":
        assert "NEWER FORMAT" in out and "DAMAGED" not in out
    # and beside a damaged file, damage wins
    rec = read_manifest(ckpt).record(0)
    with open(os.path.join(ckpt, rec.file), "r+b") as f:
        f.truncate(rec.file_bytes - 1)
    assert _run(capsys, command, ckpt)[0] == EXIT_DAMAGED
