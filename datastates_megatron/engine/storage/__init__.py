"""Storage under the persistent tier: a directory (:mod:`.posix`) or S3 (:mod:`.s3`), one interface
(:mod:`.base`, whose docstring numbers the call order), chosen once from the ``--save`` location
(:func:`open_storage`)."""

from __future__ import annotations

from .base import (
    ObjectChecksumError,
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    ObjectStorageError,
    PutReceipt,
    Storage,
)
from .retry import Retry
from .url import StorageURL, is_object_url, parse_url

__all__ = [
    "Storage",
    "ObjectInfo",
    "PutReceipt",
    "ObjectStorageError",
    "ObjectExistsError",
    "ObjectMissingError",
    "ObjectChecksumError",
    "Retry",
    "StorageURL",
    "is_object_url",
    "parse_url",
    "open_storage",
]


def open_storage(location: str, **options) -> Storage:
    """The storage at ``location``: ``s3://bucket/prefix`` (:class:`.s3.S3Storage`, ``options`` its
    keyword arguments), ``msc://profile/path`` (an S3 profile of multi-storage-client's config,
    :mod:`.msc`), else a directory (:class:`.posix.PosixStorage`)."""
    if not is_object_url(location):
        from .posix import PosixStorage

        return PosixStorage(location)
    url = parse_url(location)
    if url.scheme == "msc":
        from .msc import open_msc

        return open_msc(url, **options)
    from .s3 import S3Storage

    return S3Storage(url, **options)
