"""Restore: validate a committed checkpoint against the current world, verify, copy into tensors in place.

Nothing registered is modified until the manifest, the rank file and (when asked) every checksum have
been validated, so a bad checkpoint leaves the live model untouched.  Checksums are verified and
bytes copied by a thread pool (the XXH64 kernel and ``copy_`` release the GIL).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import stat

import torch

from .errors import CorruptCheckpointError, LayoutMismatchError, NoCheckpointError
from .file_format import RankFile, TensorEntry
from .manifest import Manifest, iter_dir, read_manifest
from .page_cache import warm_file
from .safe_io import describe
from .faults import crash_point

__all__ = ["open_checkpoint", "validate_world", "verify_file", "restore_into", "RestoreStats"]


@dataclasses.dataclass
class RestoreStats:
    bytes: int = 0
    verify_s: float = 0.0
    copy_s: float = 0.0
    read_ahead_s: float = 0.0  # 0 when the file was resident already


def open_checkpoint(root: str, iteration: int) -> tuple[str, Manifest]:
    ckpt = iter_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise NoCheckpointError(f"{ckpt}: no such checkpoint directory")
    return ckpt, read_manifest(ckpt)


def validate_world(manifest: Manifest, ckpt: str, world_size: int, layout: dict) -> None:
    """Raise :class:`LayoutMismatchError` naming every difference between the checkpoint and this world."""
    diffs = []
    if manifest.world_size != world_size:
        diffs.append(f"world size {manifest.world_size} in checkpoint, {world_size} now")
    for key in sorted(set(manifest.layout) | set(layout)):
        if manifest.layout.get(key) != layout.get(key):
            diffs.append(f"{key}={manifest.layout.get(key)!r} in checkpoint, {layout.get(key)!r} now")
    if diffs:
        raise LayoutMismatchError(f"{ckpt}: checkpoint layout differs from this run: " + "; ".join(diffs))


def open_rank(ckpt: str, manifest: Manifest, rank: int) -> RankFile:
    """Open ``rank``'s file and check it is the one the manifest committed (size and header checksum)."""
    rec = manifest.record(rank)
    if rec is None:
        raise CorruptCheckpointError(f"{ckpt}: the {manifest.tier} manifest has no file for rank {rank}")
    path = os.path.join(ckpt, rec.file)
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{ckpt}: rank {rank} file {rec.file} is missing") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: rank {rank} file cannot be read: {e}") from e
    if not stat.S_ISREG(st.st_mode):  # a link may point outside the checkpoint: never followed
        raise CorruptCheckpointError(
            f"{ckpt}: rank {rank} file {rec.file} is missing: {path} is "
            f"{describe(st.st_mode)}, not a regular file; refusing to follow or use it"
        )
    if st.st_size != rec.file_bytes:
        raise CorruptCheckpointError(f"{path}: rank {rank} file has {st.st_size} bytes, manifest says {rec.file_bytes}")
    try:
        rf = RankFile(path)  # O_NOFOLLOW + fstat again (:mod:`.safe_io`): a swap since lstat is refused too
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{ckpt}: rank {rank} file {rec.file} is missing") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: rank {rank} file cannot be read: {e}") from e
    from .hashing import xxh64

    if (
        xxh64(rf.header.pack()) != rec.header_xxh64
        or rf.header.index_xxh64 != rec.index_xxh64
        or rf.objects.get("tag") != rec.file
        or rf.objects.get("version") != manifest.iteration
    ):
        rf.close()
        raise CorruptCheckpointError(
            f"{path}: rank {rank} file is not the one committed by the manifest (from another iteration or run?)"
        )
    return rf


def _verify_chunk(rf: RankFile, entry: TensorEntry, c: int) -> str | None:
    try:
        rf.verify_chunk(entry, c)
    except CorruptCheckpointError as e:
        return str(e)
    return None


def verify_file(rf: RankFile, pool: cf.Executor, names=None) -> list[str]:
    """Check every chunk checksum in parallel; returns one message per bad tensor chunk."""
    entries = [rf.entries[n] for n in (names if names is not None else rf.entries)]
    futures = [pool.submit(_verify_chunk, rf, e, c) for e in entries for c in range(len(e.checksums))]
    return [msg for f in futures if (msg := f.result()) is not None]


def check_tensor_set(rf: RankFile, targets: dict[str, torch.Tensor], rank: int) -> None:
    missing = sorted(set(targets) - set(rf.entries))
    extra = sorted(set(rf.entries) - set(targets))
    problems = []
    if missing:
        problems.append(f"missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"not expected by this model: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name in sorted(set(targets) & set(rf.entries)):
        e, t = rf.entries[name], targets[name]
        if e.dtype != t.dtype or e.shape != tuple(t.shape):
            problems.append(
                f"tensor {name!r}: checkpoint has {e.dtype} {list(e.shape)}, model has {t.dtype} {list(t.shape)}"
            )
    if problems:
        raise LayoutMismatchError(f"{rf.path}: rank {rank}: " + "; ".join(problems[:8]))


def _copy_one(rf: RankFile, name: str, dst: torch.Tensor, rank: int) -> int:
    crash_point("restore", rank)
    with torch.no_grad():
        dst.copy_(rf.tensor(name))
    return rf.entries[name].nbytes


def restore_into(
    rf: RankFile, targets: dict[str, torch.Tensor], rank: int, *, verify: bool, threads: int = 4, agree=None
) -> RestoreStats:
    """Validate then copy ``rf``'s tensors into ``targets`` in place; nothing is written on any error.

    ``agree(ok: bool) -> failed ranks`` (a collective) is called once validation is over on this
    rank: the copy only happens when every rank validated its file, so no rank restores alone."""
    import time

    stats = RestoreStats()
    try:
        check_tensor_set(rf, targets, rank)
    except LayoutMismatchError:
        if agree is not None:
            agree(False)
        raise
    with cf.ThreadPoolExecutor(threads, thread_name_prefix=f"dsm-restore-r{rank}") as pool:
        t0 = time.perf_counter()
        if warm_file(rf.path, rf.fileno(), pool, threads):
            stats.read_ahead_s = time.perf_counter() - t0
        if verify:
            t0 = time.perf_counter()
            bad = verify_file(rf, pool)
            stats.verify_s = time.perf_counter() - t0
            if bad:
                if agree is not None:
                    agree(False)
                raise CorruptCheckpointError(f"rank {rank}: {len(bad)} corrupt chunk(s): " + "; ".join(bad[:5]))
        failed = agree(True) if agree is not None else []
        if failed:
            raise CorruptCheckpointError(
                f"rank {rank}: rank(s) {failed} could not validate their checkpoint files; nothing restored"
            )
        t0 = time.perf_counter()
        stats.bytes = sum(pool.map(lambda n: _copy_one(rf, n, targets[n], rank), list(targets)))
        stats.copy_s = time.perf_counter() - t0
    return stats
