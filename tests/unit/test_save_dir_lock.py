"""One writer per save directory: a second job is refused naming the holder; a killed holder does not block."""

import json
import os
import signal
import socket

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.fs.dirlock import SaveDirLock
from datastates_megatron.engine.errors import CheckpointError, OptionsError, SaveDirBusyError
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import LOCK_NAME
from datastates_megatron.engine.options import ManagerOptions


def _opts():
    return EngineOptions(cache_bytes=1 << 20, timeout_s=30)


def _hold_in_child(directory):
    """Fork a process that takes the lock, says so, then waits to be killed.  Returns its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: nothing but the lock, then block on a pipe nobody writes
        try:
            os.close(r)
            SaveDirLock(str(directory)).acquire()
            os.write(w, b"locked\n")
            signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert f.readline() == b"locked\n"
    return pid


def test_a_second_process_is_refused_with_the_holder_named_and_a_killed_holder_does_not_block(tmp_path):
    pid = _hold_in_child(tmp_path)
    try:
        with pytest.raises(SaveDirBusyError) as err:
            SaveDirLock(str(tmp_path)).acquire()
        msg = str(err.value)
        assert str(tmp_path) in msg and f"pid {pid}" in msg and socket.gethostname() in msg
        assert isinstance(err.value, CheckpointError)
        with pytest.raises(SaveDirBusyError, match=f"pid {pid}"):
            CheckpointManager(str(tmp_path), _opts())
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with SaveDirLock(str(tmp_path)) as lock:  # the kernel released the dead holder's lock
        assert lock.held
        holder = json.loads((tmp_path / LOCK_NAME).read_text().splitlines()[0])
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"] > 0


def test_two_managers_in_one_process_on_one_dir_are_refused_and_close_releases(tmp_path):
    t = torch.arange(100, dtype=torch.float32)
    with CheckpointManager(str(tmp_path), _opts()) as first:
        first.register("t", t)
        assert first.save(1, {"iteration": 1})
        with pytest.raises(SaveDirBusyError, match=f"pid {os.getpid()}"):
            CheckpointManager(str(tmp_path), _opts())
        first.wait()
        assert first.committed() == [1]  # the refused start deleted nothing of the first's
    with CheckpointManager(str(tmp_path), _opts()) as second:  # released on close
        second.register("t", torch.zeros(100))
        assert second.load().iteration == 1
    assert (tmp_path / LOCK_NAME).exists()  # the lock file stays; it is not a checkpoint


def test_a_symlink_in_place_of_the_lock_file_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"precious")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(target, root / LOCK_NAME)
    with pytest.raises(CheckpointError, match="symlink"):
        CheckpointManager(str(root), _opts())
    assert target.read_bytes() == b"precious"


def test_bad_options_fail_before_the_directory_is_touched(tmp_path):
    root = tmp_path / "save"
    with pytest.raises(OptionsError, match="on_error must be one of raise, warn, got 'ignore'"):
        CheckpointManager(str(root), _opts(), on_error="ignore")
    with pytest.raises(TypeError, match="not both"):
        CheckpointManager(str(root), _opts(), ManagerOptions(), keep_last=0)
    assert not root.exists()
