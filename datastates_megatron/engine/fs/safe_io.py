"""Opening the files we write and parse without trusting what sits at their names.

A save directory may be shared, restored from a backup or tampered with: any name we use may hold a
symlink (pointing outside the checkpoint), a FIFO, a device or a directory.  Every path we create
or read goes through here:

* written files are opened ``O_NOFOLLOW`` and must be regular files; temp names are created
  ``O_EXCL`` (a stale temp of ours, a regular file, is unlinked first; anything else is refused);
* parsed files are opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO does not block the open), ``fstat``-ed,
  refused unless regular, and read with a size cap (:data:`MANIFEST_MAX_BYTES`,
  :data:`TRACKER_MAX_BYTES`), so a link to ``/dev/zero`` or a huge file cannot exhaust memory;
* a descriptor re-opened by name (O_DIRECT) must be the same inode as the first one.

Refusals raise :class:`CorruptCheckpointError` (reading) or :class:`FlushError` (writing), naming
the path.  Stateless; thread-safe.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..errors import CheckpointAccessError, CorruptCheckpointError, FlushError

__all__ = [
    "MANIFEST_MAX_BYTES",
    "TRACKER_MAX_BYTES",
    "describe",
    "open_regular",
    "read_capped",
    "open_for_write",
    "create_temp",
    "reopen_same",
    "real_dir",
    "make_dir",
    "open_dir",
    "os_error_text",
    "check_path_fits",
]

MANIFEST_MAX_BYTES = 64 << 20  # a manifest of 100k ranks is ~30 MiB
TRACKER_MAX_BYTES = 64  # an iteration number, or "release"

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def describe(mode: int) -> str:
    """What a non-regular file is, for a message: 'a symlink', 'a directory', 'a FIFO', ..."""
    for test, what in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _refusal(path: str, mode: int) -> str:
    what = describe(mode)
    tail = "" if what == "not a regular file" else " (not a regular file)"
    return f"{path}: is {what}{tail}; refusing to follow or use it"


def _is_symlink(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str, flags: int = os.O_RDONLY, error=CorruptCheckpointError) -> int:
    """A descriptor of ``path`` if it is a regular file reached without following a symlink
    (``O_NOFOLLOW | O_NONBLOCK``; the non-blocking flag is cleared again once it is known regular).
    ``FileNotFoundError`` passes through; a symlink or non-regular file raises ``error``."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and _is_symlink(path):
            raise error(_refusal(path, stat.S_IFLNK)) from e
        if e.errno in (errno.ENXIO, errno.EISDIR) and not isinstance(e, FileNotFoundError):
            # a FIFO opened for writing without a reader, a socket, or a directory opened for writing
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                raise e from None
            raise error(_refusal(path, mode)) from e
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(_refusal(path, mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: str, cap: int, what: str) -> bytearray:
    """The whole of ``path`` (a regular file, not a link, at most ``cap`` bytes) -- else
    :class:`CorruptCheckpointError` naming it.  ``FileNotFoundError`` passes through; other
    ``OSError``\\ s become :class:`CorruptCheckpointError` too."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise
    except PermissionError as e:  # not damage: say what it is
        raise CheckpointAccessError(f"{path}: permission denied: cannot read the {what}") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the {what}: {e}") from e
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise CorruptCheckpointError(f"{path}: {what} is larger than {cap} bytes ({size}); refusing to read it")
        # one buffer of the size fstat gave (+1 to see a file that grew): never twice the file in memory
        buf = bytearray(size + 1)
        view, total = memoryview(buf), 0
        while total < len(buf):
            n = os.readv(fd, [view[total : total + (1 << 20)]])
            if not n:
                break
            total += n
        view.release()
        if total > size:
            raise CorruptCheckpointError(f"{path}: {what} grew while it was read; refusing to read it")
        del buf[total:]
        return buf
    except PermissionError as e:
        raise CheckpointAccessError(f"{path}: permission denied: cannot read the {what}") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the {what}: {e}") from e
    finally:
        os.close(fd)


def open_for_write(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """Open (creating it if absent) a file we write in place, e.g. a rank file: never through a
    symlink, and only a regular file.  Refusals are :class:`FlushError` naming the path."""
    return open_regular(path, flags, error=FlushError)


def create_temp(path: str) -> int:
    """Create the temp file ``path`` (``O_EXCL | O_NOFOLLOW``, write-only).  A stale one of ours (a
    regular file a crash left) is unlinked first; a symlink or anything else there is left alone and
    refused with :class:`FlushError` naming it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise FlushError(
            f"{path}: our temp file name is taken by {describe(mode)} (not made by us); "
            "refusing to write through it or remove it"
        )
    os.unlink(path)
    return os.open(path, flags, 0o644)


def reopen_same(path: str, fd: int, flags: int) -> int:
    """Open ``path`` again (e.g. with ``O_DIRECT``) and check it is the inode ``fd`` has open: the
    name may have been replaced in between.  Raises ``OSError`` otherwise."""
    fd2 = os.open(path, flags | _NOFOLLOW | _CLOEXEC)
    a, b = os.fstat(fd), os.fstat(fd2)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(fd2)
        raise FlushError(f"{path}: was replaced while it was being written")
    return fd2


def real_dir(path: str) -> bool:
    """Whether ``path`` is a directory that is not a symlink."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def os_error_text(e: OSError) -> str:
    """The reason of ``e`` for a message that already names the path: ``strerror``, and for a name
    the file system cannot hold, which limit it exceeds (the raw ``File name too long`` does not
    say whether one component or the whole path is too long)."""
    why = e.strerror or str(e)
    if e.errno == errno.ENAMETOOLONG:
        why += f" (a path component is longer than {NAME_MAX} bytes, or the path longer than {PATH_MAX})"
    return why


NAME_MAX = 255  # Linux file systems: bytes in one path component
PATH_MAX = 4096  # Linux: bytes in a path handed to a system call, with its terminating NUL


def check_path_fits(path: str, longest_name: str) -> None:
    """Refuse (:class:`FlushError`, naming the path) a directory whose components or whose length
    leave no room for ``longest_name`` inside it: found at start-up, not as ``ENAMETOOLONG`` half-way
    through a save (after its directory was made)."""
    path = os.path.abspath(path)
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > NAME_MAX:
            raise FlushError(
                f"{path}: path component {part[:40]!r}... is {len(os.fsencode(part))} bytes, longer than "
                f"the {NAME_MAX} bytes a file system allows in one name"
            )
    need = len(os.fsencode(os.path.join(path, longest_name))) + 1
    if need > PATH_MAX:
        raise FlushError(
            f"{path[:60]}...: path is too long ({len(os.fsencode(path))} bytes): the files saved in it "
            f"({longest_name!r}) would need {need} bytes, over the {PATH_MAX} a path may have"
        )


def make_dir(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, then refuse (:class:`FlushError`) when ``path`` is a
    symlink or not a directory: we never write into a directory reached through a link.  Any
    ``OSError`` (EACCES, EROFS, ENAMETOOLONG, ENOSPC) is a :class:`FlushError` naming the path and
    the operation: the save path handles only :class:`.errors.CheckpointError`."""
    try:
        os.makedirs(path, exist_ok=True)
        mode = os.lstat(path).st_mode
    except FlushError:
        raise
    except OSError as e:
        raise FlushError(f"{path}: cannot create the directory (mkdir): {os_error_text(e)}") from e
    if not stat.S_ISDIR(mode):
        raise FlushError(_refusal(path, mode))


def make_root(path: str) -> None:
    """A root the user named (``--save``, a node-local root): made if missing; it may itself be a
    link the user made to a directory (only what we create under it is never a link).  Any
    ``OSError`` is a :class:`FlushError` naming the path and the operation."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise FlushError(f"{path}: cannot create the directory (mkdir): {os_error_text(e)}") from e
    if not os.path.isdir(path):
        raise FlushError(f"{path}: is not a directory")


def open_dir(path: str) -> int:
    """A descriptor of the directory ``path`` (``O_DIRECTORY | O_NOFOLLOW``), e.g. to fsync it."""
    return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
