"""Durable changes to a directory: a directory fsync, and a file replaced atomically and durably.

A create or rename is durable only once its directory is fsynced; a small file (a manifest, the
tracker, the run id, the global index) is replaced whole or not at all by writing a temp name,
fsyncing it, renaming it over the target and fsyncing the directory.  Neither ever goes through a
symlink (:mod:`.safe_io`).
"""

from __future__ import annotations

import contextlib
import os

from ..names import temp_name
from .safe_io import create_temp, open_dir

__all__ = ["fsync_dir", "atomic_write", "unlinked_on_error"]


def fsync_dir(path: str) -> None:
    """fsync a directory so a create/rename inside it is durable (never through a symlink)."""
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably: temp file, fsync, rename, directory fsync.
    The temp name (:func:`.names.temp_name`) is created ``O_EXCL | O_NOFOLLOW``
    (:func:`.safe_io.create_temp`): a symlink planted there is refused (:class:`FlushError`), never
    written through or removed."""
    directory = os.path.dirname(path) or "."
    tmp = temp_name(path, os.getpid())
    fd = create_temp(tmp)
    with unlinked_on_error(tmp):  # ours: created above (a full disk must not leave temp files behind)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never its target
    fsync_dir(directory)


@contextlib.contextmanager
def unlinked_on_error(tmp: str):
    """Run the block that fills (and may rename) the temp file ``tmp`` -- one the caller created
    (``O_EXCL``): ours; when the block raises, ``tmp`` is removed before the error goes on (a full
    disk, a failed check must not leave temp files behind).  The one tail of every verified copy:
    a save's manifest, a promotion's copy, a fetch, a put on a directory store."""
    try:
        yield
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
