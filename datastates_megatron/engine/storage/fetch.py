"""Reading a checkpoint from object storage: its manifest, then each rank object by parallel ranged
GETs into a local file, verified whole before it takes its name.

Why a local file: the one load path (:mod:`..load.reader`: plan, validate, agree, copy) reads mapped
rank files; fetching into the node-local directory keeps that path the only one, and the copy there
is what a later restore of the same checkpoint reads again.  Why verified before it takes its
name: the object is written to ``<name>.fetching`` (created ``O_EXCL``, never through a link), every
checksum of the file format is checked there -- header against the manifest's record, index,
objects section, every data chunk (XXH64) -- and only then is it renamed into place; a damaged
object raises :class:`.base.ObjectChecksumError` naming its URL, rank and tensor, and leaves
nothing behind.  Nothing is copied into a live tensor before that.

Memory: ``threads`` ranges of ``range_bytes`` in flight, each written at its offset as it arrives:
no buffer of the object's size.

Thread-safety: each call owns its files; calls for different ranks may run at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

from ..errors import CorruptCheckpointError
from ..format.file_format import RankFile
from ..format.hashing import xxh64
from ..format.manifest import Manifest
from ..fs.durable import atomic_write, unlinked_on_error
from ..names import MANIFEST_NAME, iter_dir
from ..fs.safe_io import MANIFEST_MAX_BYTES, create_temp, make_dir, make_root
from .base import ObjectChecksumError, Storage
from .survey import iter_prefix, manifest_key

__all__ = ["fetch_manifest", "read_manifest", "fetch_rank", "fetch_checkpoint", "FETCHING_SUFFIX"]

FETCHING_SUFFIX = ".fetching"
_RANGE = 16 << 20


def fetch_manifest(storage: Storage, iteration: int) -> Manifest:
    """The validated manifest of ``iteration`` (``ObjectMissingError`` when it is not committed)."""
    return read_manifest(storage, iteration)[0]


def read_manifest(storage: Storage, iteration: int) -> tuple[Manifest, bytearray]:
    """The validated manifest of ``iteration`` and its bytes as committed (size-capped before they
    are fetched: :meth:`.base.Storage.read_capped`)."""
    key = manifest_key(iteration)
    raw = storage.read_capped(key, MANIFEST_MAX_BYTES, "manifest")
    m = Manifest.from_json(raw, storage.url(key))
    if m.iteration != iteration:
        raise CorruptCheckpointError(f"{storage.url(key)}: manifest is for iteration {m.iteration}")
    return m, raw


def _download(storage: Storage, key: str, path: str, size: int, threads: int, range_bytes: int) -> None:
    fd = create_temp(path)
    try:
        os.ftruncate(fd, size)
        spans = [(lo, min(size, lo + range_bytes)) for lo in range(0, size, range_bytes)]

        def one(span) -> None:
            lo, hi = span
            view, at = memoryview(storage.get(key, lo, hi)), lo  # one range per thread in flight
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n

        with cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="dsm-fetch") as pool:
            list(pool.map(one, spans))
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch_rank(
    storage: Storage,
    manifest: Manifest,
    rank: int,
    dest_dir: str,
    *,
    threads: int = 4,
    range_bytes: int = _RANGE,
    verify: bool = True,
) -> str:
    """Fetch ``rank``'s object of ``manifest``'s checkpoint into ``dest_dir`` (verified whole unless
    ``verify`` is false: ``datastates-ckpt verify`` reports the damage itself); its path."""
    rec = manifest.record(rank)
    if rec is None:
        raise CorruptCheckpointError(f"{storage.url(iter_prefix(manifest.iteration))}: no object for rank {rank}")
    key = iter_prefix(manifest.iteration) + rec.file
    info = storage.head(key)
    if info is None:
        raise CorruptCheckpointError(f"{storage.url(key)}: rank {rank} object is missing")
    if info.size != rec.file_bytes and verify:
        raise ObjectChecksumError(
            f"{storage.url(key)}: rank {rank} object has {info.size} bytes, manifest says {rec.file_bytes}"
        )
    final = os.path.join(dest_dir, rec.file)
    tmp = final + FETCHING_SUFFIX
    _download(storage, key, tmp, info.size, threads, range_bytes)  # unverified: as the store holds it
    with unlinked_on_error(tmp):
        if verify:
            _verify(storage.url(key), tmp, manifest, rank)
        os.replace(tmp, final)
    return final


def _verify(url: str, path: str, manifest: Manifest, rank: int) -> None:
    rec = manifest.record(rank)
    try:
        with RankFile(path) as rf:
            if xxh64(rf.header.pack()) != rec.header_xxh64 or rf.header.index_xxh64 != rec.index_xxh64:
                raise CorruptCheckpointError(f"{path}: header or index is not the one the manifest committed")
            rf.verify_all()
    except CorruptCheckpointError as e:
        raise ObjectChecksumError(f"{url}: rank {rank}: {str(e).replace(path, 'object')}") from None


def fetch_checkpoint(
    storage: Storage, iteration: int, dest_root: str, ranks=None, *, threads: int = 4, verify: bool = True
) -> tuple[str, Manifest]:
    """Fetch committed ``iteration`` -- its manifest and the objects of ``ranks`` (default: every
    rank) -- into ``dest_root/iter_N/``, a checkpoint directory the one load path reads
    (:class:`..load.reader.CheckpointReader`).  Returns ``(directory, manifest)``."""
    m, raw = read_manifest(storage, iteration)
    make_root(dest_root)
    d = iter_dir(dest_root, iteration)
    make_dir(d)
    for r in range(m.world_size) if ranks is None else ranks:
        fetch_rank(storage, m, r, d, threads=threads, verify=verify)
    atomic_write(os.path.join(d, MANIFEST_NAME), raw)  # the bytes committed, last: the local copy is then complete
    return d, m
