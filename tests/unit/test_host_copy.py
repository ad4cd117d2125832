"""Host copies (engine/tiers/host_copy.py): each save's rank file also in a memfd; after an
in-process restart (a manager closed with keep_cache=True, a new one in the same process) the
restore reads this rank's state from memory, 0 bytes from storage."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import HOST_MEMORY, CheckpointManager
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.tiers import host_copy

OPTS = EngineOptions(cache_bytes=1 << 20, timeout_s=30)


def _manager(root, w, **policy) -> CheckpointManager:
    mgr = CheckpointManager(str(root), OPTS, keep_last=0, host_copy=True, **policy)
    mgr.register("w", w)
    return mgr


def _memfds() -> int:
    """This process's open memory files of host copies."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "dsm-host-" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _memfds_in_a_forked_child() -> int:
    """How many host-copy memory files a child forked now holds."""
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(wr, bytes([_memfds()]))
        os._exit(0)
    os.close(wr)
    held = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return held[0]


@pytest.fixture(autouse=True)
def _nothing_kept():
    yield
    leftover = host_copy.take(-1, "")  # closes whatever a test left
    assert leftover is None


def _saved(tmp_path, w, iterations=(1, 2, 3), **policy) -> CheckpointManager:
    mgr = _manager(tmp_path / "save", w, **policy)
    for it in iterations:
        w.copy_(torch.arange(w.numel(), dtype=w.dtype) + it)
        mgr.save(it, {"it": it}, {"iteration": it})
        mgr.wait()
    return mgr


def test_the_host_copy_is_the_committed_file_byte_for_byte(tmp_path):
    w = torch.zeros(3000)
    mgr = _saved(tmp_path, w)
    copy = mgr.host.newest()
    assert copy.iteration == 3
    with open(os.path.join(iter_dir(mgr.root, 3), copy.name), "rb") as f:
        on_disk = f.read()
    assert os.pread(copy.fd, len(on_disk) + 1, 0) == on_disk
    assert _memfds() == 1  # the copies of iterations 1 and 2 were closed as newer ones committed
    mgr.close()
    assert _memfds() == 0


def test_after_an_in_process_restart_the_restore_reads_nothing_from_storage(tmp_path, caplog):
    w = torch.zeros(3000)
    mgr = _saved(tmp_path, w)
    mgr.close(keep_cache=True)  # the aborted attempt's manager: its copy goes to the next one
    assert _memfds() == 1
    for name in os.listdir(iter_dir(mgr.root, 3)):  # storage can no longer serve the rank file
        if name.startswith("rank"):
            os.truncate(os.path.join(iter_dir(mgr.root, 3), name), 0)
    w.zero_()
    with caplog.at_level(logging.INFO), _manager(tmp_path / "save", w) as again:
        choice = again.choose()
        assert (choice.iteration, choice.source, choice.root) == (3, "host", HOST_MEMORY)
        got = again.load(choice)
    assert got.iteration == 3 and got.root == HOST_MEMORY and got.objects == {"it": 3}
    assert got.metadata["iteration"] == 3
    assert torch.equal(w, torch.arange(3000, dtype=w.dtype) + 3)
    assert "restored iteration 3 from host memory: 0 bytes read from storage" in caplog.text
    assert _memfds() == 0


def test_a_damaged_host_copy_falls_back_to_storage(tmp_path, caplog):
    w = torch.zeros(3000)
    mgr = _saved(tmp_path, w)
    mgr.close(keep_cache=True)
    copy = host_copy._kept[(0, mgr.root)].newest()
    os.pwrite(copy.fd, b"\xff" * 64, copy.receipt.file_bytes - copy.receipt.data_bytes // 2 - 64)
    w.zero_()
    with caplog.at_level(logging.INFO), _manager(tmp_path / "save", w) as again:
        got = again.load()
    assert got.iteration == 3 and got.root == mgr.root
    assert torch.equal(w, torch.arange(3000, dtype=w.dtype) + 3)
    assert "from host memory: 0 bytes" not in caplog.text


def test_a_newer_persistent_checkpoint_than_the_copy_is_restored_from_storage(tmp_path):
    w = torch.zeros(300)
    mgr = _saved(tmp_path, w)
    mgr.close(keep_cache=True)
    with CheckpointManager(str(tmp_path / "save"), OPTS, keep_last=0) as other:  # no host copy
        other.register("w", w)
        w.fill_(9)
        other.save(4, {"it": 4})
        other.wait()
    w.zero_()
    with _manager(tmp_path / "save", w) as again:
        got = again.load()
    assert (got.iteration, got.root) == (4, again.root) and torch.equal(w, torch.full((300,), 9.0))


def test_a_copy_kept_for_another_save_directory_is_never_read(tmp_path):
    w = torch.zeros(300)
    mgr = _saved(tmp_path, w)
    mgr.close(keep_cache=True)
    shutil.copytree(tmp_path / "save", tmp_path / "other")
    w.zero_()
    with _manager(tmp_path / "other", w) as again:
        assert again.host.newest() is None and _memfds() == 0  # the kept copy was closed
        got = again.load()
    assert got.root == again.root and torch.equal(w, torch.arange(300, dtype=w.dtype) + 3)


def test_without_host_copy_nothing_is_kept(tmp_path):
    w = torch.zeros(300)
    with CheckpointManager(str(tmp_path / "save"), OPTS, keep_last=0) as mgr:
        mgr.register("w", w)
        mgr.save(1, {})
        mgr.wait()
        assert mgr.host is None and _memfds() == 0


@pytest.fixture
def shm_dir(tmp_path):
    """A node-local directory on tmpfs (rank files written through kept mappings), removed after."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    d = tempfile.mkdtemp(prefix="dsm-test-host-copy-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_with_a_node_local_tier_on_tmpfs_the_copy_is_the_local_file_and_wins_over_it(tmp_path, shm_dir):
    w = torch.zeros(5000)
    mgr = _saved(tmp_path, w, local_root=shm_dir, persist_interval=1)
    copy = mgr.host.newest()
    local = os.path.join(iter_dir(mgr.local_root, 3), copy.name)
    with open(local, "rb") as f:
        assert os.pread(copy.fd, copy.receipt.file_bytes + 1, 0) == f.read()
    mgr.close(keep_cache=True)
    w.zero_()
    with _manager(tmp_path / "save", w, local_root=shm_dir, persist_interval=1) as again:
        choice = again.choose()
        assert (choice.tier, choice.source) == ("local", "host")
        got = again.load(choice)
    assert got.root == HOST_MEMORY and torch.equal(w, torch.arange(5000, dtype=w.dtype) + 3)


def test_copies_of_saves_that_never_commit_are_bounded_by_the_saves_in_flight():
    """An abandoned save's commit names no copy: its copy is closed once ``limit`` newer saves started."""
    copies = host_copy.HostCopies(0, "/nowhere", limit=2)
    for seq in range(1, 6):  # durable, never committed (abandoned on every rank)
        copies.start(seq, "00ab", seq, f"f{seq}", {}, {})
        assert _memfds() == min(seq, 2)
    copies.close()
    assert _memfds() == 0


def test_a_commit_seen_before_the_receipts_callback_still_keeps_the_copy(tmp_path):
    """A future wakes its waiter (the commit thread) before it runs its callbacks: the commit takes
    the receipt from the save's future itself."""
    import concurrent.futures as cf

    w = torch.zeros(3000)
    mgr = _saved(tmp_path, w, iterations=(1,))
    receipt = mgr.host.newest().receipt
    copies = host_copy.HostCopies(0, "/nowhere")
    fd = copies.start(7, "00ab", 1, "f", {}, {})
    with open(os.path.join(iter_dir(mgr.root, 1), mgr.host.newest().name), "rb") as f:
        os.pwrite(fd, f.read(), 0)
    done = cf.Future()
    done.set_result(receipt)
    copies.committed("00ab", 1, done)  # attach's callback has not run
    assert copies.newest() is not None and copies.newest().iteration == 7
    copies.close()
    mgr.close()


def test_a_host_copy_that_cannot_be_written_never_fails_the_save(tmp_path, monkeypatch, caplog):
    w = torch.zeros(3000)
    real = host_copy.HostCopies.start

    def read_only(self, *args):  # the mirror's writes fail (EBADF), as a full memory cgroup would fail them
        fd = real(self, *args)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        self._pending[next(reversed(self._pending))].fd = ro
        os.close(fd)
        return ro

    monkeypatch.setattr(host_copy.HostCopies, "start", read_only)
    with caplog.at_level(logging.WARNING):
        mgr = _saved(tmp_path, w, iterations=(1,))
    assert mgr.committed() == [1] and mgr.host.newest() is None and _memfds() == 0
    assert "its host copy failed" in caplog.text
    mgr.close(keep_cache=True)
    w.zero_()
    with _manager(tmp_path / "save", w) as again:
        got = again.load()
    assert got.root == again.root and torch.equal(w, torch.arange(3000, dtype=w.dtype) + 1)


def test_a_forked_child_holds_no_copy(tmp_path):
    """A DataLoader worker forked after a save must not keep the copies alive once the parent closes them."""
    w = torch.zeros(300)
    mgr = _saved(tmp_path, w, iterations=(1,))
    assert _memfds() == 1
    assert _memfds_in_a_forked_child() == 0 and _memfds() == 1  # the parent keeps its own
    mgr.close()


def test_a_forked_child_holds_no_descriptor_a_restore_borrowed(tmp_path):
    w = torch.zeros(300)
    mgr = _saved(tmp_path, w, iterations=(1,))
    copy, fd = mgr.host.borrow(1)
    assert _memfds() == 2
    assert _memfds_in_a_forked_child() == 0
    from datastates_megatron.engine.fs import fork_close

    fork_close.close(fd)
    mgr.close()
    assert _memfds() == 0
