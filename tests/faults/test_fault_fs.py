"""The fault filesystem itself (tests/fusefs): the engine's normal save, commit, retention, promotion
and load work through it with no fault; faults reach the calling process as real syscall results;
a stalled call is a blocked syscall in the caller and a teardown lets it go."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.tier import committed_iterations

from tests.fusefs.rules import glob_regex
from tests.managers import two_tier_manager
from tests.workers.fault_worker import fill, is_state_of, make_state


def test_globs_match_within_and_across_components():
    assert glob_regex("iter_*/**").match("iter_0000002/r00000-ab.dsck")
    assert glob_regex("iter_*/**").match("iter_0000002/sub/x")
    assert not glob_regex("iter_*/**").match("latest_checkpointed_iteration.txt")
    assert not glob_regex("iter_*").match("iter_0000002/r0.dsck")
    assert glob_regex("**/manifest.json*").match("iter_0000002/manifest.json.tmp-12")
    assert glob_regex("**/manifest.json*").match("manifest.json")
    assert glob_regex("r?.dsck").match("r1.dsck") and not glob_regex("r?.dsck").match("r/.dsck")


def test_the_syscalls_the_engine_uses_work_through_the_mount(fault_fs):
    """O_DIRECT writes, fsync, rename, fallocate, ftruncate, statvfs, flock and private and shared
    mappings, as the writer, reader, commit and locks use them."""
    d = os.path.join(fault_fs.root, "d")
    os.mkdir(d)
    path = os.path.join(d, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other = os.open(path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # a second lock on the same file is refused
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
        os.posix_fallocate(fd, 0, 1 << 20)
        direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 1 << 20)  # page-aligned
        buf.write(b"z" * (1 << 20))
        assert os.pwrite(direct, buf, 0) == 1 << 20
        os.close(direct)
        os.ftruncate(fd, (1 << 20) + 10)
        os.pwrite(fd, b"tail", 1 << 20)
        os.fsync(fd)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as m:
            assert m[:2] == b"zz" and m[(1 << 20) : (1 << 20) + 4] == b"tail"
        with mmap.mmap(fd, 4096, mmap.MAP_SHARED) as m:
            m[:1] = b"y"
            m.flush()
        assert os.pread(fd, 2, 0) == b"yz"
    finally:
        os.close(fd)
    os.rename(path, os.path.join(d, "g"))
    assert os.listdir(d) == ["g"] and os.statvfs(fault_fs.root).f_bsize > 0
    # it really went through the filesystem to the directory underneath
    assert os.path.getsize(os.path.join(fault_fs.source, "d", "g")) == (1 << 20) + 10


def test_a_fault_is_the_errno_of_the_call_and_is_switched_off_again(fault_fs):
    path = os.path.join(fault_fs.root, "f")
    with open(path, "wb") as f:
        f.write(b"x")
    rule = fault_fs.fault("write", "f", errno="EDQUOT")
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"y", 0)
        assert e.value.errno == errno.EDQUOT and fault_fs.hits(rule) == 1
        fault_fs.clear(rule)
        assert os.pwrite(fd, b"y", 0) == 1
    finally:
        os.close(fd)
    once = fault_fs.fault("mkdir", "a*", errno=errno.EROFS, times=1)
    with pytest.raises(OSError) as e:
        os.mkdir(os.path.join(fault_fs.root, "a1"))
    assert e.value.errno == errno.EROFS and fault_fs.hits(once) == 1
    os.mkdir(os.path.join(fault_fs.root, "a1"))  # times=1: the second call passes
    os.mkdir(os.path.join(fault_fs.root, "b"))


def test_a_held_call_blocks_the_caller_until_released_and_teardown_lets_go(fault_fs):
    path = os.path.join(fault_fs.root, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    done = threading.Event()
    got = {}

    def fsync():
        t0 = time.monotonic()
        os.fsync(fd)
        got["s"] = time.monotonic() - t0
        done.set()

    rule = fault_fs.fault("fsync", "f", hold=True)
    t = threading.Thread(target=fsync, name="held-fsync")
    t.start()
    try:
        assert fault_fs.wait_blocked(1, timeout=30), "the fsync never reached the filesystem"
        assert not done.wait(0.5), "a held fsync returned before it was released"
        fault_fs.release(rule)
        assert done.wait(30), "the released fsync did not return"
    finally:
        fault_fs.clear()
        t.join(30)
        os.close(fd)
    assert got["s"] >= 0.5


def test_a_stall_of_t_seconds_then_continues_and_a_slow_target_costs_per_mib(fault_fs):
    path = os.path.join(fault_fs.root, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fault_fs.fault("fsync", "f", stall_s=1.0)
        t0 = time.monotonic()
        os.fsync(fd)
        assert 1.0 <= time.monotonic() - t0 < 20
        fault_fs.clear()
        fault_fs.fault("write", "f", s_per_mib=1.0)
        t0 = time.monotonic()
        os.pwrite(fd, bytes(2 << 20), 0)  # 2 MiB at 1 s per MiB
        assert 2.0 <= time.monotonic() - t0 < 30
    finally:
        os.close(fd)


def test_close_with_a_call_still_held_is_bounded(fault_fs):
    """Unmounting while a call is held (never released by the test) ends in bounded time and the
    blocked caller gets its call back."""
    fs = fault_fs
    path = os.path.join(fs.root, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    returned = threading.Event()

    def fsync():
        try:
            os.fsync(fd)
        except OSError:
            pass
        returned.set()

    fs.fault("fsync", "**", hold=True)
    t = threading.Thread(target=fsync, name="held-fsync")
    t.start()
    try:
        assert fs.wait_blocked(1, timeout=30)
    finally:
        t0 = time.monotonic()
        fs.close()
        closed = time.monotonic() - t0
    assert returned.wait(30) and closed < 30, closed
    t.join(30)
    try:
        os.close(fd)
    except OSError as e:  # the server is gone: the kernel answers for it
        assert e.errno in (errno.ENOTCONN, errno.ECONNABORTED), e
    assert not os.path.ismount(fs.root)


def test_save_commit_retention_and_load_through_the_mount(fault_fs):
    root = os.path.join(fault_fs.root, "ckpt")
    ts = make_state(0, 300_000)
    with CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, timeout_s=60), keep_last=2) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2, 3):
            fill(ts, 0, it)
            assert mgr.save(it, {"iteration": it})
            mgr.wait_for_snapshot()
            assert [r.iteration for r in mgr.wait()] == [it]
        assert committed_iterations(root) == [2, 3]  # retention removed 1 through the mount
        fill(ts, 0, 0)
        got = mgr.load()
        assert got.iteration == 3 and got.objects == {"iteration": 3} and is_state_of(ts, 0, 3)
        got = mgr.load(2)
        assert is_state_of(ts, 0, 2)
    calls = fault_fs.stats()["calls"]
    for op in ("create", "write", "fsync", "rename", "mkdir", "unlink", "read"):
        assert calls.get(op), f"the engine made no {op} call through the mount: {calls}"


def test_two_tiers_and_promotion_through_the_mount(fault_fs, tmp_path):
    """Node-local tier and persistent tier both on the mount: promotion's O_DIRECT copy and slot
    flocks, the run id file, and the load."""
    w = torch.arange(50_000, dtype=torch.float32)
    with two_tier_manager(tmp_path / "fuse", w, interval=2, local_keep_last=1) as mgr:
        for it in (1, 2, 3, 4):
            w.add_(1)
            assert mgr.save(it)
            mgr.wait()
    assert committed_iterations(str(tmp_path / "fuse" / "persistent")) == [2, 4]
    with two_tier_manager(tmp_path / "fuse", torch.zeros(50_000), interval=2, local_keep_last=1) as mgr:
        got = mgr.load()
        assert got.iteration == 4
        assert torch.equal(mgr.engine.registered["w"], torch.arange(50_000, dtype=torch.float32) + 4)


_MOUNT_AND_WAIT = """
import sys
from tests.fusefs.control import FaultFS
fs = FaultFS(sys.argv[1], sys.argv[2])
fs.fault("fsync", "**", hold=True)
print(fs._proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_test_process_killed_takes_its_filesystem_with_it(fault_fs, tmp_path):
    """SIGKILL of the process that mounted it (no teardown runs): the server lets go of its stalled
    calls, detaches the mount and ends."""
    import subprocess
    import sys

    import psutil

    from tests.fusefs.control import REPO

    mount = str(tmp_path / "killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", _MOUNT_AND_WAIT, str(tmp_path / "killed-source"), mount],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server = psutil.Process(int(proc.stdout.readline()))
        assert os.path.ismount(mount)
    finally:
        proc.kill()
        proc.wait(30)
    server.wait(timeout=30)
    assert not os.path.ismount(mount)
