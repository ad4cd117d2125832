"""Hostile files we parse (one process, real files): a manifest or tracker that is huge, endless
(/dev/zero), a FIFO, a directory, too deeply nested, or has fields of the wrong type.  Each is a
quick ``CorruptCheckpointError`` naming the file (or a tracker shown as unreadable); ``ls`` and
start-up treat the directory as damaged and go on; the CLI never prints a traceback."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import tracemalloc

import pytest

from datastates_megatron.cli import EXIT_DAMAGED, EXIT_OK, list_checkpoints, main
from datastates_megatron.engine import CorruptCheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format import manifest as manifest_mod
from datastates_megatron.engine.tiers import tier as tier_mod
from datastates_megatron.engine.format.manifest import read_manifest, read_tracker
from datastates_megatron.engine.names import MANIFEST_NAME, TRACKER_NAME, iter_dir

from .damage import edit_manifest
from tests.workers.fault_worker import fill, make_state


@pytest.fixture
def root(tmp_path):
    """A save directory with iterations 1 and 2 committed (one rank, a tiny state)."""
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2):
            fill(ts, 0, it)
            mgr.save(it, {"iteration": it})
            mgr.wait()
    return root


@contextlib.contextmanager
def _bounded(seconds=10, extra_bytes=512 << 20):
    """Fail (instead of hanging or eating the machine) when the code under test blocks or reads
    without bound: SIGALRM after ``seconds``, address space capped ``extra_bytes`` above now."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds}s")

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    old_handler = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, old_limit[1]))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
        signal.signal(signal.SIGALRM, old_handler)


def _manifest(root, it=2):
    return os.path.join(iter_dir(str(root), it), MANIFEST_NAME)


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _ls_damaged(root, it=2) -> str:
    doc = list_checkpoints(str(root))
    row = next(r for r in doc["checkpoints"] if r["iteration"] == it)
    assert row["state"] == "damaged", row
    return row["error"]


# ------------------------------------------------------------------------------------- unbounded reads
@pytest.mark.parametrize("world_size", [200_000_000, 10**12])
def test_a_huge_world_size_with_a_bad_checksum_is_refused_quickly_in_little_memory(root, world_size):
    edit_manifest(iter_dir(str(root), 2), lambda b: b.update(world_size=world_size), reseal=False)
    tracemalloc.start()
    try:
        with _bounded(), pytest.raises(CorruptCheckpointError, match="checksum") as e:
            read_manifest(iter_dir(str(root), 2))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _manifest(root) in str(e.value) and peak < 64 << 20


def test_a_resealed_huge_world_size_is_refused_against_the_ranks_listed(root):
    edit_manifest(iter_dir(str(root), 2), lambda b: b.update(world_size=200_000_000))
    with _bounded(), pytest.raises(CorruptCheckpointError, match="world size 200000000"):
        read_manifest(iter_dir(str(root), 2))


def test_a_manifest_that_is_a_symlink_to_dev_zero_is_refused(root, capsys):
    os.unlink(_manifest(root))
    os.symlink("/dev/zero", _manifest(root))
    with _bounded():
        with pytest.raises(CorruptCheckpointError, match="symlink"):
            read_manifest(iter_dir(str(root), 2))
        assert "symlink" in _ls_damaged(root)
        assert _cli(capsys, "inspect", iter_dir(str(root), 2))[0] == EXIT_DAMAGED


def test_a_manifest_larger_than_the_cap_is_refused_without_reading_it(root, monkeypatch):
    from datastates_megatron.engine.fs import safe_io

    monkeypatch.setattr(safe_io, "MANIFEST_MAX_BYTES", 100)
    with pytest.raises(CorruptCheckpointError, match="larger than"):
        read_manifest(iter_dir(str(root), 2))


def test_a_tracker_that_is_a_symlink_to_dev_zero_is_shown_unreadable(root, capsys):
    os.unlink(root / TRACKER_NAME)
    os.symlink("/dev/zero", root / TRACKER_NAME)
    with _bounded():
        assert read_tracker(str(root)) is None
        doc = list_checkpoints(str(root))
        code, out, _ = _cli(capsys, "ls", root)
    assert doc["tracker"] is None and doc["tracker_text"].startswith("<unreadable") and doc["latest"] == 2
    assert code == EXIT_OK


def test_a_manifest_or_tracker_that_is_a_fifo_does_not_hang(root, capsys):
    os.unlink(_manifest(root))
    os.mkfifo(_manifest(root))
    os.unlink(root / TRACKER_NAME)
    os.mkfifo(root / TRACKER_NAME)
    with _bounded():
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            read_manifest(iter_dir(str(root), 2))
        assert "not a regular file" in _ls_damaged(root)
        assert _cli(capsys, "ls", root)[0] == EXIT_DAMAGED
        assert _cli(capsys, "inspect", iter_dir(str(root), 2))[0] == EXIT_DAMAGED
        assert _cli(capsys, "verify", iter_dir(str(root), 2))[0] == EXIT_DAMAGED
        with CheckpointManager(str(root), EngineOptions(cache_bytes=64 << 10, timeout_s=30)):
            pass  # start-up: the directory is damaged, left alone, and start-up goes on
    assert os.path.exists(_manifest(root))


# ------------------------------------------------------------------------------------- not our exceptions
def test_a_deeply_nested_manifest_is_corrupt_not_a_recursion_error(root, capsys):
    with open(_manifest(root), "w") as f:
        f.write("[" * 1500 + "]" * 1500)
    with pytest.raises(CorruptCheckpointError) as e:
        read_manifest(iter_dir(str(root), 2))
    assert _manifest(root) in str(e.value)
    _ls_damaged(root)
    assert _cli(capsys, "ls", root)[0] == EXIT_DAMAGED
    assert _cli(capsys, "inspect", iter_dir(str(root), 2))[0] == EXIT_DAMAGED


def test_a_manifest_that_is_a_directory_is_damaged_for_ls_and_start_up(root, capsys):
    os.unlink(_manifest(root))
    os.mkdir(_manifest(root))
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read_manifest(iter_dir(str(root), 2))
    assert "not a regular file" in _ls_damaged(root)
    code, out, _ = _cli(capsys, "ls", root)
    assert code == EXIT_DAMAGED and "DAMAGED" in out
    assert _cli(capsys, "verify", iter_dir(str(root), 2))[0] == EXIT_DAMAGED
    with CheckpointManager(str(root), EngineOptions(cache_bytes=64 << 10, timeout_s=30)):
        pass
    assert os.path.isdir(_manifest(root))


def _edit_and_reseal(path, edit):
    """Edit the manifest's JSON and recompute its checksum as the writer does (whatever the edit)."""
    with open(path) as f:
        body = json.load(f)
    edit(body)
    body.pop("checksum")
    body["checksum"] = manifest_mod._body_xxh64(body)
    with open(path, "w") as f:
        json.dump(body, f)


def _set_file(value):
    def edit(body):
        body["ranks"][0]["file"] = value

    return edit


@pytest.mark.parametrize(
    "edit, what",
    [
        (_set_file(123), "file"),
        (_set_file(None), "file"),
        (_set_file("r0 0.dsck"), "file"),
        (lambda b: b.update(created=math.nan), "created"),
        (lambda b: b.update(created=math.inf), "created"),
        (lambda b: b.update(world_size=True), "world_size"),
        (lambda b: b.update(commit_seq=1.5), "commit_seq"),
        (lambda b: b["ranks"][0].update(n_tensors=False), "n_tensors"),
        (lambda b: b["ranks"][0].update(file_bytes=-1), "file_bytes"),
        (lambda b: b["ranks"][0].update(index_xxh64=1 << 64), "index_xxh64"),
        (lambda b: b.update(run_token="a b"), "run_token"),
        (lambda b: b.update(tier="nvme"), "tier"),
        (lambda b: b.update(layout=[1, 2]), "layout"),
        (lambda b: b.update(ranks={"0": 1}), "ranks"),
    ],
    ids=[
        "file-int",
        "file-null",
        "file-space",
        "created-nan",
        "created-inf",
        "world-bool",
        "seq-float",
        "ntensors-bool",
        "filebytes-negative",
        "xxh-too-big",
        "token-space",
        "tier-unknown",
        "layout-list",
        "ranks-dict",
    ],
)
def test_a_resealed_manifest_with_a_bad_field_is_corrupt_and_names_it(root, capsys, edit, what):
    _edit_and_reseal(_manifest(root), edit)  # valid checksum: the field check must refuse it
    with pytest.raises(CorruptCheckpointError, match=what) as e:
        read_manifest(iter_dir(str(root), 2))
    assert _manifest(root) in str(e.value)
    for command in ("inspect", "verify"):
        assert _cli(capsys, command, iter_dir(str(root), 2))[0] == EXIT_DAMAGED
    assert _cli(capsys, "ls", root)[0] == EXIT_DAMAGED


@pytest.mark.parametrize("text", ["\u00b2", "1\u0661", " 12 3", "-1", "0x10"])
def test_a_tracker_that_is_not_ascii_digits_is_not_an_iteration(root, capsys, text):
    (root / TRACKER_NAME).write_text(text, encoding="utf-8")
    assert read_tracker(str(root)) is None
    code, out, _ = _cli(capsys, "ls", root)
    assert code == EXIT_OK and "latest: 2" in out
    assert list_checkpoints(str(root))["tracker"] is None


def test_the_tracker_still_reads_a_plain_iteration(root):
    assert read_tracker(str(root)) == 2
    (root / TRACKER_NAME).write_text("release\n")
    assert read_tracker(str(root)) is None
    json.dumps(list_checkpoints(str(root)))  # the ls document stays plain JSON


def test_an_iteration_directory_that_is_a_symlink_is_damaged_not_committed(root, tmp_path, capsys):
    """``iter_0000003`` -> an archived checkpoint elsewhere: not ours, so never listed as committed
    nor loaded through (latest_committed says why), shown damaged by ``ls``, and left as it is by
    start-up and retention (the archive byte for byte)."""
    archive = tmp_path / "archive"
    os.rename(iter_dir(str(root), 2), archive)
    before = {p.name: p.read_bytes() for p in archive.iterdir()}
    os.symlink(archive, iter_dir(str(root), 3))
    assert tier_mod.committed_iterations(str(root)) == [1]
    with pytest.raises(CorruptCheckpointError, match="symlink") as e:
        tier_mod.latest_committed(str(root))
    assert iter_dir(str(root), 3) in str(e.value)
    assert "symlink" in _ls_damaged(root, 3)
    assert _cli(capsys, "ls", root)[0] == EXIT_DAMAGED
    with CheckpointManager(str(root), EngineOptions(cache_bytes=64 << 10, timeout_s=30), keep_last=1):
        pass
    assert os.path.islink(iter_dir(str(root), 3))
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == before
