"""The storage under a persistent tier: the few operations a checkpoint needs, on a file system or
an object store, behind one interface.

A checkpoint on any storage is a set of objects under one prefix: ``iter_NNNNNNN/<rank file>`` for
every rank, then ``iter_NNNNNNN/manifest.json`` (the commit point), then the tracker.  Keys are
``/``-separated and relative to the storage's root (the ``--save`` directory, or an
``s3://bucket/prefix``); nothing outside the root is ever written, read or deleted.

The call order a writer goes through (as DCP's ``storage.py`` numbers its own):

1. :meth:`Storage.create` the lock object (``If-None-Match: *`` on S3, ``O_EXCL`` on POSIX): the
   one-writer check; refused with :class:`ObjectExistsError` when it exists.
2. :meth:`Storage.list` the root once (start-up survey: what is committed, what is ours).
3. For each checkpoint: :meth:`Storage.put_file` every rank object (streamed, checksummed end to
   end; a failed object raises and nothing is committed), then :meth:`Storage.create` (a new
   iteration) or :meth:`Storage.put_bytes` (a re-save) of the manifest -- one PUT, the commit -- then
   :meth:`Storage.put_bytes` of the tracker (informative, may lag).
4. Retention: :meth:`Storage.delete` the manifest first (the checkpoint is then not committed),
   then its rank objects; only keys we write (:mod:`..names`).

A reader: :meth:`Storage.read_capped` the manifest (refused from its listed or ``HEAD`` size over
its cap, before its body is fetched, as a file is refused from ``fstat``), then ranged
:meth:`Storage.get` of the rank objects,
verified against the rank file's own chunk checksums before anything is copied in place
(:mod:`.remote_file`).

Every failure of the store (after the bounded retries of :mod:`.retry`) is an
:class:`ObjectStorageError` naming the object by its URL; credentials never appear in a message.

Thread-safety: every method of a :class:`Storage` may be called from several threads at once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator

from ..errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "ObjectInfo",
    "Storage",
    "ObjectStorageError",
    "ObjectExistsError",
    "ObjectMissingError",
    "ObjectChecksumError",
    "PutReceipt",
]


class ObjectStorageError(CheckpointError, OSError):
    """An operation on the store failed after its retries: names the object (``key``, as a URL)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self):
        return type(self), (str(self), self.key)


class ObjectExistsError(ObjectStorageError, FileExistsError):
    """A conditional create found the object already there (``If-None-Match: *`` refused, 412)."""


class ObjectMissingError(ObjectStorageError, FileNotFoundError):
    """The object does not exist (404)."""


class ObjectChecksumError(CorruptCheckpointError):
    """The bytes the store holds are not the bytes sent (or read): a checksum disagrees."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing or a HEAD reports it."""

    key: str  # relative to the storage's root
    size: int
    etag: str = ""  # the store's version tag (an inode and mtime on POSIX), for conditional requests


@dataclasses.dataclass(frozen=True)
class PutReceipt:
    """What an upload stored: its size, the CRC32 of its bytes as sent, and the store's tag."""

    key: str
    size: int
    crc32: int
    etag: str


class Storage(abc.ABC):
    """The persistent tier's storage (module docstring: the call order).  A context manager;
    :meth:`close` is idempotent.  Thread-safe."""

    #: ``posix`` or ``s3``: decides which tier code path is taken
    scheme: str = ""

    @abc.abstractmethod
    def url(self, key: str = "") -> str:
        """The printable address of ``key`` (never with credentials): a path, or ``s3://bucket/k``."""

    @abc.abstractmethod
    def put_file(self, key: str, source, *, pace=None) -> PutReceipt:
        """Store ``source`` (a buffer: bytes, memoryview, a uint8 numpy array -- e.g. a mapped rank
        file) at ``key``, replacing what is there: streamed in parts (no second full copy),
        checksummed (CRC32) as sent, and the stored object's checksum compared with it before
        returning.  ``pace(n)`` is called after each ``n`` bytes sent.  The object appears whole or
        not at all."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> PutReceipt:
        """Store a small document at ``key`` in one request, replacing what is there."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> PutReceipt:
        """Store ``data`` at ``key`` only if nothing is there (one conditional request);
        :class:`ObjectExistsError` otherwise."""

    @abc.abstractmethod
    def replace_if(self, key: str, data: bytes, etag: str) -> PutReceipt:
        """Store ``data`` at ``key`` only if the object there still has ``etag`` (``If-Match``);
        :class:`ObjectExistsError` when it changed, :class:`ObjectMissingError` when it is gone."""

    @abc.abstractmethod
    def get(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``key`` (``stop=None``: to its end); :class:`ObjectMissingError`
        when absent.  The caller verifies them (rank file chunks, the manifest's own checksum)."""

    @abc.abstractmethod
    def get_into(self, key: str, start: int, out) -> int:
        """Read ``len(out)`` bytes of ``key`` from ``start`` into the writable buffer ``out``;
        returns the bytes read (fewer only at the object's end)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and tag, ``None`` when absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (under the root), in key order."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str = "") -> list[str]:
        """The names of the "directories" right under ``prefix`` (``prefix`` ends with ``/`` or is
        empty): the first segments of the keys below it that have more after them, sorted."""

    @abc.abstractmethod
    def delete(self, key: str, etag: str | None = None) -> None:
        """Delete ``key`` (only if it still has ``etag``, when given: :class:`ObjectExistsError`
        when it changed); deleting what is absent is not an error."""

    def read_capped(self, key: str, cap: int, what: str, size: int | None = None) -> bytearray:
        """The whole of the small document ``key`` (a manifest, the run id, the lock, an index, the
        tracker): refused with :class:`CorruptCheckpointError` naming it when its size -- ``size``
        from a listing, else one HEAD -- is over ``cap``, before its body is fetched (the object
        counterpart of :func:`..fs.safe_io.read_capped`).  At most ``size + 1`` bytes are read, so an
        object replaced by a larger one since it was listed is refused too.
        :class:`ObjectMissingError` when absent."""
        if size is None:
            info = self.head(key)
            if info is None:
                raise ObjectMissingError(f"{self.url(key)}: no such object", key=self.url(key))
            size = info.size
        if size > cap:
            raise CorruptCheckpointError(
                f"{self.url(key)}: {what} is larger than {cap} bytes ({size}); refusing to read it"
            )
        buf = bytearray(size + 1)
        n = self.get_into(key, 0, buf) if size else 0
        if n > size:
            raise CorruptCheckpointError(f"{self.url(key)}: {what} changed while it was read; refusing to read it")
        del buf[n:]
        return buf

    def close(self) -> None:
        """Release connections and threads (idempotent)."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
