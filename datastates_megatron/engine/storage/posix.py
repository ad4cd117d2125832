"""The storage interface over a directory, with the POSIX tier's own guarantees.

A put writes a temp name (``O_EXCL | O_NOFOLLOW``), fsyncs it, renames it into place and fsyncs the
directory: the object appears whole or not at all, as an S3 PUT.  A conditional create links the
fsynced temp to the name (``link`` fails when the name exists: ``If-None-Match: *``).  Reads and
deletions never follow a symlink; only regular files are objects.  The tier's own POSIX code
(:mod:`..tiers.tier`, :mod:`..tiers.commit`) does not go through this class: it is here so that a caller
written against :class:`.base.Storage` (the CLI, tests, a benchmark) runs on a directory too.

Thread-safety: stateless apart from the root; every method may run on several threads.
"""

from __future__ import annotations

import errno
import os
import stat
import zlib
from collections.abc import Iterator

from ..fs.safe_io import create_temp, make_dir, open_regular
from ..fs.durable import fsync_dir, unlinked_on_error
from .base import ObjectExistsError, ObjectInfo, ObjectMissingError, ObjectStorageError, PutReceipt, Storage

__all__ = ["PosixStorage"]

_BLOCK = 16 << 20


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


class PosixStorage(Storage):
    """Objects as files under the directory ``root``; keys are ``/``-separated relative paths."""

    scheme = "posix"

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def url(self, key: str = "") -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{key!r}: not a relative object key")
        return os.path.join(self.root, *parts)

    def _fail(self, op: str, key: str, e: OSError) -> ObjectStorageError:
        where = self.url(key)
        cls = ObjectMissingError if e.errno == errno.ENOENT else ObjectStorageError
        return cls(f"{where}: {op} failed: {e.strerror or e}", key=where)

    def _write_temp(self, key: str, data, pace=None) -> tuple[str, str, int]:
        path = self._path(key)
        make_dir(os.path.dirname(path))
        tmp = f"{path}.tmp-{os.getpid()}"
        view = memoryview(data).cast("B")
        fd = create_temp(tmp)
        crc = 0
        with unlinked_on_error(tmp):
            try:
                for lo in range(0, len(view), _BLOCK):
                    block = view[lo : lo + _BLOCK]
                    crc = zlib.crc32(block, crc)
                    done = 0
                    while done < len(block):
                        done += os.pwrite(fd, block[done:], lo + done)
                    if pace is not None:
                        pace(len(block))
                os.fsync(fd)
            finally:
                os.close(fd)
        return path, tmp, crc

    def _put(self, key: str, data, pace=None) -> PutReceipt:
        try:
            path, tmp, crc = self._write_temp(key, data, pace)
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
            st = os.lstat(path)
        except OSError as e:
            raise self._fail("put", key, e) from e
        return PutReceipt(key, st.st_size, crc, _etag(st))

    def put_file(self, key: str, source, *, pace=None) -> PutReceipt:
        return self._put(key, source, pace)

    def put_bytes(self, key: str, data: bytes) -> PutReceipt:
        return self._put(key, data)

    def create(self, key: str, data: bytes) -> PutReceipt:
        try:
            path, tmp, crc = self._write_temp(key, data)
            try:
                os.link(tmp, path)  # fails with EEXIST: nothing replaced
            finally:
                os.unlink(tmp)
            fsync_dir(os.path.dirname(path))
            st = os.lstat(path)
        except FileExistsError as e:
            raise ObjectExistsError(f"{self.url(key)}: exists already (conditional create)", key=self.url(key)) from e
        except OSError as e:
            raise self._fail("conditional create", key, e) from e
        return PutReceipt(key, st.st_size, crc, _etag(st))

    def replace_if(self, key: str, data: bytes, etag: str) -> PutReceipt:
        info = self.head(key)
        if info is None:
            raise ObjectMissingError(f"{self.url(key)}: gone (conditional replace)", key=self.url(key))
        if info.etag != etag:
            raise ObjectExistsError(f"{self.url(key)}: changed (conditional replace)", key=self.url(key))
        return self._put(key, data)

    def get(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        path = self._path(key)
        try:
            fd = open_regular(path)
        except OSError as e:
            raise self._fail("get", key, e) from e
        try:
            size = os.fstat(fd).st_size if stop is None else stop
            out = bytearray(max(0, size - start))
            n = os.preadv(fd, [out], start) if out else 0
        finally:
            os.close(fd)
        if stop is not None and n != len(out):
            raise ObjectStorageError(f"{path}: asked for bytes [{start}, {stop}), got {n}", key=path)
        return bytes(out[:n])

    def get_into(self, key: str, start: int, out) -> int:
        path = self._path(key)
        try:
            fd = open_regular(path)
        except OSError as e:
            raise self._fail("ranged get", key, e) from e
        try:
            return os.preadv(fd, [memoryview(out).cast("B")], start)
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.lstat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, _etag(st)) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Regular files under the root whose key starts with ``prefix``; links are not followed."""
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            dirnames[:] = [d for d in dirnames if (base + d + "/").startswith(prefix) or prefix.startswith(base + d)]
            for name in filenames:
                key = base + name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append(ObjectInfo(key, st.st_size, _etag(st)))
        yield from sorted(found, key=lambda o: o.key)

    def list_dirs(self, prefix: str = "") -> list[str]:
        d = self.url(prefix.rstrip("/")) if prefix else self.root
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if stat.S_ISDIR(os.lstat(os.path.join(d, n)).st_mode))

    def delete(self, key: str, etag: str | None = None) -> None:
        path = self._path(key)
        info = self.head(key)
        if info is None:
            if etag:
                raise ObjectMissingError(f"{path}: gone (conditional delete)", key=path)
            return
        if etag and info.etag != etag:
            raise ObjectExistsError(f"{path}: changed (conditional delete)", key=path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._fail("delete", key, e) from e
