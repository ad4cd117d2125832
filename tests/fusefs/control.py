"""Mount, steer and unmount the fault filesystem (:mod:`tests.fusefs.server`) from a test.

:class:`FaultFS` starts the server in its own process, mounts ``source`` on ``mount`` and waits
(bounded) until the kernel's first request reached it.  ``fault()`` returns once the server holds the
rule: every call made after it sees it.  ``close()`` lets every stalled call go, unmounts
(``fusermount3 -u``, then lazily) and ends the server, each step bounded in time.

Thread-safe: every request is one connection of its own.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

__all__ = ["Control", "FaultFS", "MountError", "why_not_available"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOUNT_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 10.0


class MountError(RuntimeError):
    """The fault filesystem could not be mounted here (the message says why)."""


def why_not_available() -> str | None:
    """Why no FUSE filesystem can be mounted here (``None``: it can be tried)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401 - loads libfuse3 too
    except (ImportError, OSError) as e:
        return f"mfusepy or libfuse3 cannot be loaded: {e}"
    return None


class Control:
    """The control channel of a running fault filesystem (``socket_path``: its unix socket; ``root``: its mount), e.g. from
    a rank process that the test forked; every request is one connection of its own."""

    def __init__(self, socket_path: str, root: str) -> None:
        self.control_path = socket_path
        self.root = root

    # ---------------------------------------------------------------- control
    def _request(self, cmd: str, timeout: float = STEP_TIMEOUT_S, **args) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.control_path)
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError(f"fault filesystem at {self.root}: no reply to {cmd}")
                reply += chunk
        out = json.loads(reply)
        if "error" in out:
            raise ValueError(f"fault filesystem: {cmd} {args}: {out['error']}")
        return out

    def fault(
        self,
        op="*",
        path: str = "**",
        *,
        errno: int | str | None = None,
        stall_s: float = 0.0,
        hold: bool = False,
        s_per_mib: float = 0.0,
        times: int | None = None,
    ) -> int:
        """Switch a fault on for operation(s) ``op`` on paths matching ``path`` (relative to the
        mount); returns its id once the server holds it."""
        spec = dict(op=op, path=path, errno=errno, stall_s=stall_s, hold=hold, s_per_mib=s_per_mib, times=times)
        return self._request("fault", **spec)["id"]

    def clear(self, rule: int | None = None) -> int:
        """Switch rule ``rule`` off (``None``: every rule) and let go of the calls it stalls."""
        return self._request("clear", id=rule)["cleared"]

    release = clear

    def stats(self) -> dict:
        """``{"blocked": calls stalled now, "rules": [{"id", "hits", ...}], "calls": {op: count}}``."""
        return self._request("stats")

    def hits(self, rule: int) -> int:
        for r in self.stats()["rules"]:
            if r["id"] == rule:
                return r["hits"]
        raise KeyError(f"no rule {rule} in force")

    def wait_blocked(self, n: int = 1, timeout: float = 30.0) -> bool:
        """True once at least ``n`` calls are stalled (False after ``timeout``)."""
        return self._request("wait_blocked", timeout=timeout + STEP_TIMEOUT_S, n=n, timeout_s=timeout)["ok"]


class FaultFS(Control):
    """A FUSE passthrough of ``source`` mounted on ``mount``, with faults switched on per path and
    operation (see :mod:`tests.fusefs.server` for the rules).  A context manager."""

    def __init__(self, source: str, mount: str, log_path: str | None = None) -> None:
        self.source = os.path.abspath(source)
        os.makedirs(self.source, exist_ok=True)
        os.makedirs(mount, exist_ok=True)
        # a unix socket path must stay short (108 bytes): not under a deep tmp_path
        super().__init__(
            os.path.join("/tmp", f"dsm-faultfs-{os.getpid()}-{os.urandom(4).hex()}.sock"), os.path.abspath(mount)
        )
        self.log_path = log_path or os.path.join(os.path.dirname(self.root), "faultfs.log")
        self._log = open(self.log_path, "ab")
        ready_r, ready_w = os.pipe()
        # the server reads EOF here once this process (and what it forked) is gone: it then detaches
        # the mount and ends, also after a SIGKILL of the test
        life_r, self._life_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.fusefs.server",
                    self.source,
                    self.root,
                    self.control_path,
                    str(ready_w),
                    str(life_r),
                ],
                pass_fds=(ready_w, life_r),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                start_new_session=True,  # a ^C to the test does not reach the filesystem first
            )
        finally:
            os.close(ready_w)
            os.close(life_r)
        try:
            self._wait_ready(ready_r)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(ready_r)

    def _wait_ready(self, fd: int) -> None:
        got, deadline = b"", time.monotonic() + MOUNT_TIMEOUT_S
        while b"\n" not in got:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise MountError(f"{self.root}: the fault filesystem did not come up in {MOUNT_TIMEOUT_S:.0f}s")
            chunk = os.read(fd, 64)
            if not chunk:  # the server exited before the kernel's INIT reached it
                self._proc.wait(STEP_TIMEOUT_S)
                raise MountError(f"{self.root}: cannot mount the fault filesystem: {self._tail()}")
            got += chunk

    def _tail(self) -> str:
        self._log.flush()
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(no output)"

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Let every stalled call go, unmount and end the server; bounded, idempotent."""
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            try:
                self.clear()
            except (OSError, ValueError):
                pass
            wait = STEP_TIMEOUT_S
            if not _run(["fusermount3", "-u", self.root]):
                # busy (a file still open on it): detach it; the server would serve the open files
                # until they close, so it is ended soon after
                _run(["fusermount3", "-u", "-z", self.root])
                wait = 2.0
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only the server
                proc.wait(STEP_TIMEOUT_S)
        if os.path.ismount(self.root):
            _run(["fusermount3", "-u", "-z", self.root]) or _run(["umount", "-l", self.root])
        try:
            os.unlink(self.control_path)
        except FileNotFoundError:
            pass
        self._log.close()
        os.close(self._life_w)

    def __enter__(self) -> FaultFS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=STEP_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False
