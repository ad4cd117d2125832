"""The fault filesystem's server: a FUSE passthrough of one directory that stalls or fails chosen calls.

Run as its own process (``python -m tests.fusefs.server SOURCE MOUNT CONTROL READY_FD LIFE_FD``, from the
repository root, started by :class:`tests.fusefs.control.FaultFS`): a stalled call is then a real
blocked syscall in the process under test, and a test can never deadlock itself on its own
filesystem.  Standard library and ``mfusepy`` (over Debian's libfuse3) only; the rules are
:mod:`tests.fusefs.rules`.

Faults are rules, matched per call on the operation and the path relative to the mount (a glob:
``*`` and ``?`` within one path component, ``**`` across components; ``iter_*/**`` is every path
under an ``iter_*`` directory).  A rule may stall the call (``stall_s``, or ``hold`` until released),
slow it down (``s_per_mib`` of data written or read), and then fail it (``errno``) or let it pass
through.  ``times`` limits a rule to its first N matching calls.  The newest matching rule wins.

Control: a unix socket, one JSON request per connection, one JSON reply once it took effect
(``fault``, ``clear``, ``stats``, ``wait_blocked``).  Each connection has its own thread, so a
request waiting for a stalled call (``wait_blocked``) never holds another one up.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import mfusepy

from tests.fusefs.rules import Faults

log = logging.getLogger("faultfs")


class Passthrough(mfusepy.Operations):
    """Every call goes to the same path under ``source``, after the fault rules had their say."""

    use_ns = True
    flag_nullpath_ok = True  # calls on an open file unlinked meanwhile (hard_remove) come by handle

    def __init__(self, source: str, faults: Faults, ready_fd: int) -> None:
        self.source = os.path.realpath(source)
        self.faults = faults
        self._ready_fd = ready_fd
        self._paths: dict[int, str] = {}  # open handle -> the path it was opened under

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def _check(self, op: str, *paths, fh: int | None = None, nbytes: int = 0) -> None:
        rel = [p.lstrip("/") for p in paths if p is not None]
        if not rel and fh is not None:
            rel = [self._paths.get(fh)]
        self.faults.apply(op, rel, nbytes)

    def init(self, path: str) -> None:
        os.write(self._ready_fd, b"ready\n")
        os.close(self._ready_fd)

    # ---------------------------------------------------------------- metadata
    def getattr(self, path, fh=None):
        self._check("getattr", path, fh=fh)
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        out = {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size")}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        out.update(st_blocks=st.st_blocks, st_blksize=st.st_blksize)
        return out

    def access(self, path, amode):
        self._check("access", path)
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path):
        self._check("readlink", path)
        return os.readlink(self._real(path))

    def opendir(self, path):
        self._check("opendir", path)
        if not os.path.isdir(self._real(path)):
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return 0

    def readdir(self, path, fh):
        self._check("readdir", path)
        real = self._real(path)
        st = os.lstat(real)
        out = [(".", {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0), ("..", {"st_mode": st.st_mode, "st_ino": 1}, 0)]
        with os.scandir(real) as entries:  # use_ino: an entry without its inode number is skipped by readdir(3)
            for e in entries:
                s = e.stat(follow_symlinks=False)
                out.append((e.name, {"st_mode": s.st_mode, "st_ino": s.st_ino}, 0))
        return out

    def statfs(self, path):
        self._check("statfs", path)
        sv = os.statvfs(self._real(path))
        keys = ("f_bsize f_frsize f_blocks f_bfree f_bavail f_files f_ffree f_favail f_flag f_namemax").split()
        return {k: getattr(sv, k) for k in keys}

    def chmod(self, path, mode):
        self._check("chmod", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        self._check("chown", path)
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        self._check("utimens", path)
        os.utime(self._real(path), ns=times)
        return 0

    # ---------------------------------------------------------------- names
    def mkdir(self, path, mode):
        self._check("mkdir", path)
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path):
        self._check("rmdir", path)
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path):
        self._check("unlink", path)
        os.unlink(self._real(path))
        return 0

    def rename(self, old, new):
        self._check("rename", old, new)
        os.rename(self._real(old), self._real(new))
        return 0

    def link(self, target, source):
        self._check("link", target, source)
        os.link(self._real(source), self._real(target))
        return 0

    def symlink(self, target, source):
        self._check("symlink", target)
        os.symlink(source, self._real(target))
        return 0

    # ---------------------------------------------------------------- files
    @staticmethod
    def _flags(flags: int) -> int:
        # the kernel already applied O_DIRECT to its page cache; the backing file takes plain writes
        # (FUSE hands buffers with no alignment promise)
        return flags & ~getattr(os, "O_DIRECT", 0)

    def open(self, path, flags):
        self._check("open", path)
        fh = os.open(self._real(path), self._flags(flags))
        self._paths[fh] = path.lstrip("/")
        return fh

    def create(self, path, mode, flags):
        self._check("create", path)
        fh = os.open(self._real(path), self._flags(flags) | os.O_CREAT, mode)
        self._paths[fh] = path.lstrip("/")
        return fh

    def read(self, path, size, offset, fh):
        self._check("read", path, fh=fh, nbytes=size)
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._check("write", path, fh=fh, nbytes=len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._check("truncate", path, fh=fh)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        self._check("fallocate", path, fh=fh)
        if mode:
            raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
        os.posix_fallocate(fh, offset, size)
        return 0

    def flush(self, path, fh):
        self._check("flush", path, fh=fh)
        os.close(os.dup(fh))
        return 0

    def release(self, path, fh):
        self._paths.pop(fh, None)
        os.close(fh)
        return 0

    def fsync(self, path, datasync, fh):
        self._check("fsync", path, fh=fh)
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        self._check("fsyncdir", path)
        fd = os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0


def _serve_control(sock: socket.socket, faults: Faults) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_answer, args=(conn, faults), name="faultfs-control", daemon=True).start()


def _answer(conn: socket.socket, faults: Faults) -> None:
    with conn, conn.makefile("rwb") as f:
        try:
            req = json.loads(f.readline())
            cmd = req.pop("cmd")
            if cmd == "fault":
                reply = {"id": faults.add(req)}
            elif cmd == "clear":
                reply = {"cleared": faults.clear(req.get("id"))}
            elif cmd == "stats":
                reply = faults.stats()
            elif cmd == "wait_blocked":
                reply = {"ok": faults.wait_blocked(int(req.get("n", 1)), float(req["timeout_s"]))}
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # noqa: BLE001 - the client raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        f.write(json.dumps(reply).encode() + b"\n")
        f.flush()


def _outlive_no_test(life_fd: int, mount: str, faults: Faults) -> None:
    """End with the test process: ``life_fd`` reads EOF once every holder of the pipe's other end
    (the test process, the ranks it forked) has exited or let go; then every stalled call is let go
    and the mount detached, which ends the FUSE loop."""
    while os.read(life_fd, 64):
        pass
    faults.clear()
    subprocess.run(["fusermount3", "-u", "-z", mount], capture_output=True, timeout=30)


def main(argv: list[str]) -> int:
    source, mount, control, ready_fd, life_fd = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    logging.basicConfig(level=logging.WARNING, format="faultfs %(levelname)s %(message)s", stream=sys.stderr)
    faults = Faults()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(control)
    sock.listen(64)
    threading.Thread(target=_serve_control, args=(sock, faults), name="faultfs-accept", daemon=True).start()
    args = (life_fd, mount, faults)
    threading.Thread(target=_outlive_no_test, args=args, name="faultfs-life", daemon=True).start()
    t0 = time.monotonic()
    mfusepy.FUSE(
        Passthrough(source, faults, ready_fd),
        mount,
        foreground=True,
        fsname="dsm-faultfs",
        hard_remove=True,  # an unlinked open file keeps no .fuse_hidden* name in the directory
        use_ino=True,
        attr_timeout=0,  # every stat reaches the rules
        entry_timeout=0,
        negative_timeout=0,
    )
    log.info("unmounted after %.1fs", time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
