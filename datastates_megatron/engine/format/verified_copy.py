"""The verified copy of a rank file into a directory: every checksum of the source is verified, the
verified bytes are copied (O_DIRECT where the destination allows, else ``sendfile``) to a temp name,
fsynced, renamed into place and the directory fsynced.  The promotion's copy into a directory tier
(:meth:`..tiers.tier.Tier.promote_file`); object storage uploads instead (:mod:`..storage.upload`)."""

from __future__ import annotations

import errno
import os
import time

import numpy as np

from ..errors import FlushError
from ..fs.durable import fsync_dir, unlinked_on_error
from ..fs.safe_io import create_temp, reopen_same
from ..names import PROMOTING_SUFFIX
from ..runtime.faults import crash_point
from .file_format import HEADER_BYTES, FileReceipt, RankFile
from .writer import ALIGN, pwrite_direct

__all__ = ["copy_verified"]

_COPY_BLOCK = 16 << 20


def _copy_bytes(fd_in: int, fd_out: int, size: int, start: int = 0, pace=None) -> None:
    """Copy bytes ``[start, size)`` in the kernel (``sendfile``: one page-cache-to-page-cache copy,
    no user buffer); where the platform or file system refuses, through one reused buffer.
    ``pace(n)`` is called after each block (:class:`.promote_throttle.Pace`)."""
    done = start
    try:
        os.lseek(fd_out, start, os.SEEK_SET)  # sendfile writes at the output's file position
        while done < size:
            n = os.sendfile(fd_out, fd_in, done, min(_COPY_BLOCK, size - done))
            if n == 0:
                break
            done += n
            if pace is not None:
                pace(n)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK) or done > start:
            raise
    except AttributeError:  # pragma: no cover - no os.sendfile on this platform
        pass
    buf = memoryview(bytearray(_COPY_BLOCK)) if done < size else None
    while done < size:
        n = os.preadv(fd_in, [buf[: min(_COPY_BLOCK, size - done)]], done)
        if n == 0:
            break
        written = 0
        while written < n:
            written += os.pwrite(fd_out, buf[written:n], done + written)
        done += n
        if pace is not None:
            pace(n)
    if done != size:
        raise FlushError(f"copied {done} of {size} bytes: the source file is shorter than its header says")


def _copy_direct(source: np.ndarray, path: str, fd_out: int, pace=None) -> int:
    """Write the 4 KiB-aligned prefix of ``source`` (a page-aligned mapping of the local file) to
    ``path`` (the inode ``fd_out`` has open) with O_DIRECT; returns the bytes written, 0 where
    O_DIRECT is refused.

    Why: a buffered copy (``sendfile``) fills the page cache with a checkpoint nobody reads back,
    and the kernel's per-page work and dirty-page throttling cost more CPU than the O_DIRECT
    write (docs/BENCHMARKS.md) -- CPU the training threads share on a busy node.  A write the file system refuses (EINVAL) stops here;
    the caller copies the rest buffered."""
    aligned = source.nbytes // ALIGN * ALIGN
    if not aligned or not hasattr(os, "O_DIRECT"):
        return 0
    try:
        fd = reopen_same(path, fd_out, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return 0
    done = 0
    try:
        while done < aligned:  # in blocks of _COPY_BLOCK, like the buffered copy
            block = min(_COPY_BLOCK, aligned - done)
            n = pwrite_direct(fd, source[done : done + block], done, path)
            done += n
            if pace is not None:
                pace(n)
            if n < block:  # refused
                break
    finally:
        os.close(fd)
    return done


def _copy_file(rf: RankFile, fd_out: int, path_out: str, size: int, pace=None) -> None:
    """Copy the first ``size`` bytes of ``rf`` to ``fd_out`` (open on ``path_out``): O_DIRECT from
    its mapping as far as the destination allows, the rest through ``_copy_bytes``."""
    done = _copy_direct(rf.span(0, size), path_out, fd_out, pace)
    if done < size:
        _copy_bytes(rf.fileno(), fd_out, size, start=done, pace=pace)


def copy_verified(src: str, dst: str, version: int, pace=None) -> FileReceipt:
    """Verify every checksum of ``src`` then copy it to ``dst`` (temp name, fsync, rename), paced
    by ``pace`` (:class:`.promote_throttle.Pace`) when given."""
    t0 = time.perf_counter()
    tmp = dst + PROMOTING_SUFFIX
    with RankFile(src) as rf:
        data_bytes = rf.verify_all()
        header = rf.header
        fd_tmp = create_temp(tmp)  # O_EXCL | O_NOFOLLOW: a link planted at the temp name is refused
        with unlinked_on_error(tmp):
            with os.fdopen(fd_tmp, "wb") as fout:  # copied from the file just verified, not the path again
                _copy_file(rf, fout.fileno(), tmp, header.file_bytes, pace)
                os.fsync(fout.fileno())
            # a rewrite of the source in place (a recycled file) zeroes its header first: if the
            # header is still the verified one, the bytes copied are the ones verified
            if os.pread(rf.fileno(), HEADER_BYTES, 0) != header.pack():
                raise FlushError(f"{src}: the local file was rewritten while it was promoted")
    crash_point("promote")
    os.replace(tmp, dst)
    fsync_dir(os.path.dirname(dst))
    dt = time.perf_counter() - t0
    return FileReceipt.of(header, data_bytes, version, dst, copy_s=dt, flush_s=dt)
