"""``datastates-ckpt verify CKPT_DIR``: every checksum of a checkpoint re-checked, each rank file
opened with the reader's own check against the manifest (``open_rank``), every bad tensor named."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time

from typing import TYPE_CHECKING

from ..engine.errors import CheckpointError, FormatVersionError
from ..engine.names import RANK_FILE_SUFFIX
from .common import JSON_SCHEMA, CliUsageError, emit, exit_for, human, strip_path
from .reading import load_manifest, select_ranks

if TYPE_CHECKING:
    from ..engine.format.file_format import RankFile
    from ..engine.format.manifest import Manifest

__all__ = ["verify_checkpoint", "run"]

_VERIFY_BATCH = 32  # rank files verify keeps open at once (two descriptors each)


def _check_chunk(rf: RankFile, entry, c: int) -> tuple[bool, int]:
    from ..engine.errors import CorruptCheckpointError

    cb = rf.header.chunk_bytes
    try:
        return True, rf.verify_chunk(entry, c)
    except CorruptCheckpointError:
        return False, len(rf.raw(entry)[c * cb : (c + 1) * cb])


class _ProgressLines:
    """Progress for a log file (Slurm output, CI): a line on stderr every ``every_s`` seconds with
    bytes done, GB/s and an ETA -- what a bar drawn with carriage returns cannot give there."""

    def __init__(self, total: int, every_s: float) -> None:
        self.total, self.every_s, self.done = total, every_s, 0
        self.t0 = self.last = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= self.every_s:  # a verify shorter than that prints nothing
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate else float("inf")
            print(
                f"verify: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB "
                f"({100 * self.done / max(self.total, 1):.0f}%), {rate / 1e9:.2f} GB/s, ETA {eta:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        pass


def _progress_bar(total: int, progress: bool | float):
    """``progress``: True draws a bar (a terminal), a number of seconds prints a line that often."""
    if progress is True:
        from tqdm import tqdm

        return tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr, leave=False
        )
    if progress is not False and progress is not None:
        return _ProgressLines(total, float(progress))
    return None


def _check_all(opened: list[tuple], fail, pool: cf.Executor, bar) -> tuple[int, int]:
    """Hash every chunk of the opened rank files in ``pool``; ``fail`` once per bad tensor.
    Returns ``(tensors, bytes)`` checked."""
    total = sum(e.nbytes for _, rf in opened for e in rf.entries.values())
    bad: dict[tuple, list[int]] = {}
    futures = {
        pool.submit(_check_chunk, rf, e, c): (i, e, c)
        for i, (_, rf) in enumerate(opened)
        for e in rf.entries.values()
        for c in range(len(e.checksums))
    }
    for f in cf.as_completed(futures):
        i, e, c = futures[f]
        ok, nbytes = f.result()
        if not ok:
            bad.setdefault((i, e.name), []).append(c)
        if bar is not None:
            bar.update(nbytes)
    for (i, name), chunks in sorted(bad.items()):
        rec, rf = opened[i]
        e, cb = rf.entries[name], rf.header.chunk_bytes
        chunks.sort()
        spans = ", ".join(
            f"{c} (file bytes {e.offset + c * cb}..{e.offset + min((c + 1) * cb, e.nbytes) - 1})" for c in chunks[:4]
        )
        more = f" and {len(chunks) - 4} more" if len(chunks) > 4 else ""
        fail(
            rec,
            "checksum",
            f"checksum mismatch in chunk(s) {spans}{more} of {len(e.checksums)}",
            tensor=name,
            chunks=chunks,
        )
    return sum(len(rf.entries) for _, rf in opened), total


def verify_checkpoint(
    ckpt: str, *, threads: int | None = None, rank: int | None = None, progress: bool | float = False
) -> dict:
    """Re-check every checksum and the manifest<->file agreement; the ``verify --json`` document.
    ``progress``: False, True (a bar) or seconds between progress lines (a log)."""
    import numpy as np

    from ..engine.format.hashing import xxh64

    ckpt = os.path.abspath(ckpt)
    m = load_manifest(ckpt)
    selected = select_ranks(ckpt, m, rank)
    workers = threads or min(8, os.cpu_count() or 1)
    xxh64(np.zeros(8, np.uint8))  # load the compiled kernel before the clock starts
    t0 = time.perf_counter()
    errors: list[dict] = []

    def fail(rec, kind, message, tensor=None, chunks=None):
        errors.append(
            {"rank": rec.rank, "file": rec.file, "tensor": tensor, "chunks": chunks, "kind": kind, "message": message}
        )

    n_tensors = total = 0
    bar = _progress_bar(sum(rec.data_bytes for rec in selected), progress)
    try:
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="dsm-verify") as pool:
            for at in range(0, len(selected), _VERIFY_BATCH):  # a bounded number of files open at once
                batch = _open_checked(ckpt, m, selected[at : at + _VERIFY_BATCH], fail)
                try:
                    n, nbytes = _check_all(batch, fail, pool, bar)
                finally:
                    for _, rf in batch:
                        rf.close()
                n_tensors, total = n_tensors + n, total + nbytes
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    present = {rec.file for rec in m.ranks}
    try:
        unreferenced = sorted(n for n in os.listdir(ckpt) if n.endswith(RANK_FILE_SUFFIX) and n not in present)
    except OSError:
        unreferenced = []
    return {
        "schema": JSON_SCHEMA,
        "command": "verify",
        "checkpoint": ckpt,
        "iteration": m.iteration,
        "world_size": m.world_size,
        "ok": not errors,
        "ranks_checked": [rec.rank for rec in selected],
        "tensors_checked": n_tensors,
        "bytes_checked": total,
        "seconds": seconds,
        "threads": workers,
        "errors": errors,
        "unreferenced_files": unreferenced,
    }


def _open_checked(ckpt: str, m: Manifest, records: list, fail) -> list[tuple]:
    """Open the files of ``records`` with the reader's check against the manifest (``open_rank``);
    ``fail`` for each unusable one, with the kind of its problem."""
    from ..engine.errors import RankFileError
    from ..engine.load.reader import open_rank

    opened: list[tuple] = []
    for rec in records:
        lost = f"its {rec.n_tensors} tensor(s) cannot be checked"
        try:
            rf = open_rank(ckpt, m, rec.rank)
        except RankFileError as e:  # missing, another size, not a regular file, not the committed one
            fail(rec, e.kind, f"{e.problem}; {lost}")
            continue
        except (CheckpointError, OSError) as e:  # the format refuses it
            kind = "newer" if isinstance(e, FormatVersionError) else "file"  # a newer version's: not damage
            fail(rec, kind, f"{strip_path(str(e), os.path.join(ckpt, rec.file))}; {lost}")
            continue
        tensor_bytes = sum(e.nbytes for e in rf.entries.values())
        if rf.header.n_tensors != rec.n_tensors or tensor_bytes != rec.data_bytes:
            fail(
                rec,
                "manifest",
                f"file holds {rf.header.n_tensors} tensors / {tensor_bytes} bytes, manifest says "
                f"{rec.n_tensors} / {rec.data_bytes}",
            )
        opened.append((rec, rf))
    return opened


def _error_line(err: dict) -> str:
    tensor = f"tensor {err['tensor']!r}: " if err["tensor"] is not None else ""
    return f"rank {err['rank']}: {err['file']}: {tensor}{err['message']}"


def _render_verify(doc: dict) -> None:
    for err in doc["errors"]:
        print(f"ERROR {_error_line(err)}")
    name = os.path.basename(doc["checkpoint"])
    rate = int(doc["bytes_checked"] / doc["seconds"]) if doc["seconds"] > 0 else 0
    checked = (
        f"{len(doc['ranks_checked'])} rank(s), {doc['tensors_checked']} tensors, {human(doc['bytes_checked'])} "
        f"in {doc['seconds']:.2f} s ({human(rate)}/s, {doc['threads']} threads)"
    )
    if doc["unreferenced_files"]:
        print(
            f"note: {len(doc['unreferenced_files'])} .dsck file(s) not named by the manifest (leftovers): "
            + ", ".join(doc["unreferenced_files"][:5])
        )
    if doc["ok"]:
        print(f"OK {name}: {checked}")
    else:
        bad_ranks = sorted({e["rank"] for e in doc["errors"]})
        print(f"FAILED {name}: {len(doc['errors'])} problem(s) in rank(s) {bad_ranks}; checked {checked}")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise CliUsageError(f"--threads must be >= 1, got {args.threads}")
    if args.progress_every <= 0:
        raise CliUsageError(f"--progress-every must be > 0, got {args.progress_every}")
    show = False if args.quiet else (True if sys.stderr.isatty() else args.progress_every)
    doc = verify_checkpoint(args.ckpt_dir, threads=args.threads, rank=args.rank, progress=show)
    emit(doc) if args.json else _render_verify(doc)
    return exit_for([e["kind"] == "newer" for e in doc["errors"]])
