"""Fixtures of the fault-injection suite."""

from __future__ import annotations

import os
import subprocess

import pytest


def mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a size-limited tmpfs on ``path``; returns ``None`` on success, else why it is not possible."""
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root"
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot mount a tmpfs here (container without CAP_SYS_ADMIN?): {done.stderr.strip()}"
    return None


def unmount(path: str) -> None:
    subprocess.run(["umount", "-l", path], check=False, capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A real 64 MiB file system (tmpfs) created for the test, unmounted afterwards."""
    path = str(tmp_path / "fs")
    why = mount_tmpfs(path, "64m")
    if why:
        pytest.skip(why)
    try:
        yield path
    finally:
        unmount(path)
