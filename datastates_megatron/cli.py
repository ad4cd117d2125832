"""``datastates-ckpt``: list, inspect and verify checkpoints, and export one to another format.  Its
``--help`` is the reference.

Layering: ``list``, ``inspect`` and ``verify`` read checkpoints through ``engine`` only (manifest,
rank-file reader, restore's ``open_rank``), import no megatron and never write.  ``export`` hands over
to :mod:`.megatron.export` (imported only then; ``--format torch_dist`` runs a Megatron-LM checkout), which
writes only under OUT_DIR.  Each read-only subcommand gathers a plain dict (the ``--json`` document,
stable keys) and renders it as text otherwise.  The gathering functions are public and raise
``NoCheckpointError`` (path missing / not a checkpoint), ``CorruptCheckpointError`` (damaged manifest)
or ``CliUsageError``; ``main`` turns those into one line on stderr and an exit status.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import stat
import sys
import time

from typing import TYPE_CHECKING

from ._deps import MissingDependencyError
from ._version import __version__
from .engine.errors import CheckpointError, CorruptCheckpointError, FormatVersionError, NoCheckpointError

if TYPE_CHECKING:
    from .engine.format.file_format import RankFile
    from .engine.format.manifest import Manifest

# ``--help`` and argument errors import nothing heavy (no torch, numpy or numba): the engine modules that
# read checkpoints are imported by the subcommand functions that use them.

__all__ = [
    "main",
    "list_checkpoints",
    "inspect_checkpoint",
    "verify_checkpoint",
    "package_data",
    "CliUsageError",
    "EXIT_OK",
    "EXIT_DAMAGED",
    "EXIT_USAGE",
    "EXIT_NEWER",
]

PROG = "datastates-ckpt"
JSON_SCHEMA = 1
EXIT_OK = 0  # success; for verify: every check passed
EXIT_DAMAGED = 1  # a checkpoint is damaged (verify found a problem, a manifest or rank file is unreadable)
EXIT_USAGE = 2  # bad arguments, or the path is not there / not a checkpoint
EXIT_NEWER = 3  # a checkpoint was written by a newer datastates-megatron (a newer format): upgrade to read it
_TRACKER_NAME = "latest_checkpointed_iteration.txt"  # engine.manifest.TRACKER_NAME (Megatron's), for the help text


class CliUsageError(CheckpointError, ValueError):
    """An argument does not fit the checkpoint (e.g. ``--rank`` beyond its world size)."""


# ---------------------------------------------------------------------------------------------- helpers
def _human(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _dir_usage(path: str) -> tuple[int, int, float | None]:
    """(bytes of regular files, number of ``.dsck`` files, newest mtime) of one directory; racing writers tolerated."""
    total, files, newest = 0, 0, None
    try:
        names = os.listdir(path)
    except OSError:
        return 0, 0, None
    for name in names:
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue  # removed while we looked
        total += st.st_size
        files += name.endswith(".dsck")
        newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    return total, files, newest


def _strip_path(message: str, path: str) -> str:
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _describe(value) -> str:
    """Short type summary of a stored object (for inspect's objects column)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} = {value!r}"
    if isinstance(value, str):
        return f"str = {value!r}" if len(value) <= 40 else f"str ({len(value)} chars)"
    if isinstance(value, bytes):
        return f"bytes ({len(value)})"
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {list(value.shape)}"
    if isinstance(value, argparse.Namespace):
        return f"Namespace ({len(vars(value))} fields)"
    if isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__} ({len(value)})"
    return type(value).__name__


def _objects_summary(objects) -> dict[str, str]:
    stored = objects.get("objects") if isinstance(objects, dict) else None
    if isinstance(stored, dict):
        return {str(k): _describe(v) for k, v in stored.items()}
    return {} if stored is None else {"<value>": _describe(stored)}


def _load_manifest(ckpt: str) -> Manifest:
    from .engine.format.manifest import MANIFEST_NAME, read_manifest
    from .engine.tiers.tier import list_iterations

    try:
        is_dir = stat.S_ISDIR(os.stat(ckpt).st_mode)
    except FileNotFoundError:
        raise NoCheckpointError(f"{ckpt}: no such checkpoint directory{_retention_hint(ckpt)}") from None
    except PermissionError as e:
        raise NoCheckpointError(f"{ckpt}: permission denied ({e.strerror}): cannot look into it") from None
    except OSError as e:  # ENAMETOOLONG, ELOOP: not "no such checkpoint"
        from .engine.fs.safe_io import os_error_text

        raise NoCheckpointError(f"{ckpt}: cannot look into it: {os_error_text(e)}") from None
    if not is_dir:
        raise NoCheckpointError(f"{ckpt}: not a directory: not a checkpoint")
    try:
        return read_manifest(ckpt)
    except NoCheckpointError as e:
        hint = ""
        if list_iterations(ckpt):
            hint = f" (this looks like a save directory: try `{PROG} ls {ckpt}`)"
        raise NoCheckpointError(f"{e}{hint}") from e
    except FormatVersionError:
        raise  # not damage: "written by datastates-megatron X ...: upgrade"
    except CorruptCheckpointError as e:
        raise type(e)(f"damaged manifest: {e}") from e
    except CheckpointError:
        raise  # permission denied (CheckpointAccessError) is not damage
    except OSError as e:
        raise CorruptCheckpointError(f"{os.path.join(ckpt, MANIFEST_NAME)}: cannot read the manifest: {e}") from e


def _retention_hint(ckpt: str) -> str:
    """When ``ckpt`` is an ``iter_*`` older than the newest checkpoint committed beside it, it was most
    likely removed by the trainer's retention after it was listed (a reader racing a saving run)."""
    from .engine.format.manifest import iteration_of
    from .engine.tiers.tier import latest_committed

    iteration = iteration_of(ckpt)
    try:
        newest = latest_committed(os.path.dirname(os.path.normpath(ckpt)) or ".")
    except (CheckpointError, OSError):
        return ""
    if iteration is None or newest <= iteration:
        return ""
    return (
        f" (iteration {newest} is committed beside it: retention of a running trainer may have removed"
        " this one since it was listed; list again)"
    )


def _select_ranks(ckpt: str, m: Manifest, rank: int | None) -> list:
    """The manifest's records, or the one of ``rank`` (a node-local manifest lists only some ranks)."""
    if rank is None:
        return list(m.ranks)
    found = [r for r in m.ranks if r.rank == rank]
    if not found:
        listed = [r.rank for r in m.ranks]
        shown = listed if len(listed) <= 8 else f"{listed[:8]} ..."
        raise CliUsageError(
            f"{ckpt}: --rank {rank} is not in this checkpoint (world size {m.world_size}, {m.tier} "
            f"manifest lists ranks {shown})"
        )
    return found


# ---------------------------------------------------------------------------------------------- ls
def list_checkpoints(save_dir: str) -> dict:
    """Every ``iter_*`` directory of ``save_dir`` with its state; the ``ls --json`` document."""
    from .engine.tiers.foreign import find_foreign
    from .engine.format.manifest import TRACKER_NAME, iter_dir, parse_tracker, read_manifest, read_tracker_text
    from .engine.tiers.tier import latest_committed, list_iterations

    try:
        is_dir = stat.S_ISDIR(os.stat(save_dir).st_mode)
    except FileNotFoundError:
        raise NoCheckpointError(f"{save_dir}: no such directory") from None
    except OSError as e:  # ENAMETOOLONG, EACCES, ELOOP: the directory may well exist
        from .engine.fs.safe_io import os_error_text

        raise NoCheckpointError(f"{save_dir}: cannot look into it: {os_error_text(e)}") from None
    if not is_dir:
        raise NoCheckpointError(f"{save_dir}: not a directory")
    save_dir = os.path.abspath(save_dir)
    now = time.time()
    rows = []
    foreign = {f.path: f.format for f in find_foreign(save_dir)}
    release = [p for p in foreign if os.path.basename(p) == "release"]
    for it, d in [(None, p) for p in release] + [(it, iter_dir(save_dir, it)) for it in list_iterations(save_dir)]:
        size, files, newest = _dir_usage(d)
        row = {
            "iteration": it,
            "path": d,
            "state": "uncommitted",
            "format": None,
            "tier": None,
            "world_size": None,
            "bytes": size,
            "data_bytes": None,
            "files": files,
            "commit_seq": None,
            "created": newest,
            "age_s": None if newest is None else now - newest,
            "latest": False,
            "error": None,
        }
        if d in foreign:
            row.update(state="foreign", format=foreign[d])
            rows.append(row)
            continue
        try:
            m = read_manifest(d)
        except NoCheckpointError:
            pass
        except PermissionError as e:  # CheckpointAccessError: not ours to read, not damaged
            row.update(state="unreadable", error=str(e))
        except FormatVersionError as e:  # a newer version's: not damaged, and never removed
            row.update(state="newer", error=str(e))
        except (CheckpointError, OSError) as e:
            row.update(state="damaged", error=str(e))
        else:
            row.update(
                state="committed",
                tier=m.tier,
                world_size=m.world_size,
                data_bytes=m.total_bytes,
                commit_seq=m.commit_seq,
                created=m.created,
                age_s=now - m.created,
            )
        rows.append(row)
    latest, latest_error = None, None
    try:
        latest = latest_committed(save_dir)
    except NoCheckpointError:
        pass
    except (CheckpointError, OSError) as e:
        latest_error = str(e)
    for row in rows:
        row["latest"] = latest is not None and row["iteration"] == latest and row["state"] == "committed"
    tracker_readable = True
    try:
        tracker_text = read_tracker_text(save_dir)  # not through a link, size-capped
    except CheckpointError as e:
        tracker_readable = False
        tracker_text = f"<unreadable: {_strip_path(str(e), os.path.join(save_dir, TRACKER_NAME))}>"
    tracker = parse_tracker(tracker_text)  # ASCII digits only
    return {
        "schema": JSON_SCHEMA,
        "command": "ls",
        "save_dir": save_dir,
        "checkpoints": rows,
        "latest": latest,
        "latest_error": latest_error,
        "tracker": tracker,
        "tracker_text": tracker_text,
        # an unreadable tracker agrees with nothing, not even with "no checkpoint"
        "tracker_agrees": None if tracker_text is None or latest_error or not tracker_readable else tracker == latest,
    }


def _render_ls(doc: dict) -> None:
    rows = doc["checkpoints"]
    print(f"save dir: {doc['save_dir']}")
    if not rows:
        print("no iter_* directories")
    else:
        table = [("ITERATION", "STATE", "TIER", "WORLD", "SIZE", "AGE", "")]
        for r in rows:
            state = {
                "damaged": "DAMAGED",
                "unreadable": "UNREADABLE",
                "newer": "NEWER FORMAT",
                "foreign": f"foreign ({r['format']})",
            }.get(r["state"], r["state"])
            table.append(
                (
                    "release" if r["iteration"] is None else str(r["iteration"]),
                    state,
                    r["tier"] or "-",
                    "-" if r["world_size"] is None else str(r["world_size"]),
                    _human(r["bytes"]),
                    _age(r["age_s"]),
                    "<- latest" if r["latest"] else "",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        right = {0, 3, 4, 5}
        for i, row in enumerate(table):
            cells = [c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))]
            print("  ".join(cells).rstrip())
            if i and rows[i - 1]["error"]:
                print(f"    {rows[i - 1]['error']}")
    if doc["latest"] is not None:
        print(f"latest: {doc['latest']}")
    elif doc["latest_error"]:
        print(f"latest: none: the loader refuses to choose: {doc['latest_error']}")
    else:
        print("latest: none (no committed checkpoint)")
    text = doc["tracker_text"]
    if text is None:
        print(f"tracker: absent ({_TRACKER_NAME})")
    else:
        verdict = {True: "agrees", False: "DIFFERS from latest", None: "latest undetermined"}[doc["tracker_agrees"]]
        if text.startswith("<unreadable") and doc["tracker_agrees"] is None:
            verdict = "cannot be compared"
        print(f"tracker: {text} ({verdict})")


# ---------------------------------------------------------------------------------------------- inspect
def _rank_summary(rf: RankFile, list_tensors: bool) -> dict:
    dtypes: dict[str, dict] = {}
    tensors = []
    for e in rf.entries.values():
        name = str(e.dtype).removeprefix("torch.")
        d = dtypes.setdefault(name, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += e.nbytes
        if list_tensors:
            tensors.append(
                {"name": e.name, "dtype": name, "shape": list(e.shape), "bytes": e.nbytes, "chunks": len(e.checksums)}
            )
    meta = rf.objects.get("tensor_meta") if isinstance(rf.objects, dict) else None
    return {
        "tensor_count": len(rf.entries),
        "tensor_bytes": sum(e.nbytes for e in rf.entries.values()),
        "chunk_bytes": rf.header.chunk_bytes,
        "dtypes": dtypes,
        "objects": _objects_summary(rf.objects),
        "tensor_meta_count": len(meta) if isinstance(meta, dict) else 0,
        "tensors": tensors if list_tensors else None,
    }


_VERIFY_BATCH = 32  # rank files verify keeps open at once (two descriptors each)
_SUMMARY_KEYS = ("tensor_count", "tensor_bytes", "chunk_bytes", "dtypes", "objects", "tensor_meta_count", "tensors")


def inspect_checkpoint(ckpt: str, rank: int | None = None, list_tensors: bool = False) -> dict:
    """Manifest and per-rank contents of one checkpoint directory; the ``inspect --json`` document."""
    from .engine.load.reader import open_rank

    ckpt = os.path.abspath(ckpt)
    m = _load_manifest(ckpt)
    ranks = []
    for rec in _select_ranks(ckpt, m, rank):
        row = {
            "rank": rec.rank,
            "file": rec.file,
            "file_bytes": rec.file_bytes,
            "data_bytes": rec.data_bytes,
            "n_tensors": rec.n_tensors,
            "error": None,
        }
        try:
            rf = open_rank(ckpt, m, rec.rank)
        except (CheckpointError, OSError) as e:
            row["error"] = _strip_path(str(e), os.path.join(ckpt, rec.file))
            row["newer"] = isinstance(e, FormatVersionError)  # a newer version's file: not damage
            row.update(dict.fromkeys(_SUMMARY_KEYS))
        else:
            try:
                row.update(_rank_summary(rf, list_tensors))
            finally:
                rf.close()
        ranks.append(row)
    return {
        "schema": JSON_SCHEMA,
        "command": "inspect",
        "checkpoint": ckpt,
        "manifest": {
            "iteration": m.iteration,
            "world_size": m.world_size,
            "run_token": m.run_token,
            "commit_seq": m.commit_seq,
            "created": m.created,
            "tier": m.tier,
            "total_bytes": m.total_bytes,
            "layout": m.layout,
            "metadata": m.metadata,
        },
        "ranks": ranks,
    }


def _render_inspect(doc: dict) -> None:
    m = doc["manifest"]
    print(f"checkpoint: {doc['checkpoint']}")
    print(
        f"iteration {m['iteration']}  world size {m['world_size']}  tier {m['tier']}  commit_seq {m['commit_seq']}  "
        f"run token {m['run_token']}"
    )
    print(
        f"created {_when(m['created'])} ({_age(time.time() - m['created'])} ago)  tensor bytes {_human(m['total_bytes'])}"
    )
    print(f"layout:   {json.dumps(m['layout'], sort_keys=True)}")
    print(f"metadata: {json.dumps(m['metadata'], sort_keys=True, default=str)}")
    for r in doc["ranks"]:
        print(f"\nrank {r['rank']}: {r['file']}  {_human(r['file_bytes'])} on disk, {r['n_tensors']} tensors")
        if r["error"]:
            print(f"  {'NEWER FORMAT' if r.get('newer') else 'DAMAGED'}: {r['error']}")
            continue
        print(
            f"  tensors: {r['tensor_count']}, {_human(r['tensor_bytes'])} ({r['tensor_bytes']} B), "
            f"checksum chunk {_human(r['chunk_bytes'])}"
        )
        for name, d in sorted(r["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"    {name:<14} {d['count']:>7}  {_human(d['bytes']):>10}")
        if r["objects"]:
            print(f"  objects ({len(r['objects'])} keys):")
            width = max(len(k) for k in r["objects"])
            for key, desc in r["objects"].items():
                print(f"    {key:<{width}}  {desc}")
        else:
            print("  objects: none")
        if r["tensor_meta_count"]:
            print(f"  tensor metadata: {r['tensor_meta_count']} entries")
        if r["tensors"] is not None:
            width = max((len(t["name"]) for t in r["tensors"]), default=4)
            print(f"  {'NAME':<{width}}  {'DTYPE':<14} {'SHAPE':<20} {'BYTES':>10}  CHUNKS")
            for t in r["tensors"]:
                shape = "[" + ", ".join(map(str, t["shape"])) + "]"
                print(f"  {t['name']:<{width}}  {t['dtype']:<14} {shape:<20} {t['bytes']:>10}  {t['chunks']}")


# ---------------------------------------------------------------------------------------------- verify
def _check_chunk(rf: RankFile, entry, c: int) -> tuple[bool, int]:
    from .engine.errors import CorruptCheckpointError

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

    from .engine.format.hashing import xxh64

    ckpt = os.path.abspath(ckpt)
    m = _load_manifest(ckpt)
    selected = _select_ranks(ckpt, m, rank)
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
        unreferenced = sorted(n for n in os.listdir(ckpt) if n.endswith(".dsck") and n not in present)
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
    """Open and check (against the manifest) the files of ``records``; ``fail`` for each unusable one."""
    from .engine.load.reader import open_rank
    from .engine.fs.safe_io import describe

    opened: list[tuple] = []
    for rec in records:
        path = os.path.join(ckpt, rec.file)
        lost = f"its {rec.n_tensors} tensor(s) cannot be checked"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            fail(rec, "missing", f"file is missing; {lost}")
            continue
        except OSError as e:
            fail(rec, "file", f"cannot stat the file: {e}; {lost}")
            continue
        if not stat.S_ISREG(st.st_mode):  # a symlink may point outside the checkpoint: never followed
            fail(rec, "file", f"is {describe(st.st_mode)} (not a regular file inside the checkpoint); {lost}")
            continue
        size = st.st_size
        if size != rec.file_bytes:
            what = "truncated" if size < rec.file_bytes else "longer than committed"
            fail(rec, "size", f"file is {what}: {size} bytes, manifest says {rec.file_bytes}; {lost}")
            continue
        try:
            rf = open_rank(ckpt, m, rec.rank)
        except (CheckpointError, OSError) as e:
            kind = "newer" if isinstance(e, FormatVersionError) else "file"  # a newer version's: not damage
            fail(rec, kind, f"{_strip_path(str(e), path)}; {lost}")
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


def _exit_for(problems: list[bool]) -> int:
    """The exit status of ``inspect``/``verify`` from their problems (True: a newer version's file):
    damage wins; only newer-format files is "upgrade" (3)."""
    if not problems:
        return EXIT_OK
    return EXIT_NEWER if all(problems) else EXIT_DAMAGED


def _error_line(err: dict) -> str:
    tensor = f"tensor {err['tensor']!r}: " if err["tensor"] is not None else ""
    return f"rank {err['rank']}: {err['file']}: {tensor}{err['message']}"


def _render_verify(doc: dict) -> None:
    for err in doc["errors"]:
        print(f"ERROR {_error_line(err)}")
    name = os.path.basename(doc["checkpoint"])
    rate = int(doc["bytes_checked"] / doc["seconds"]) if doc["seconds"] > 0 else 0
    checked = (
        f"{len(doc['ranks_checked'])} rank(s), {doc['tensors_checked']} tensors, {_human(doc['bytes_checked'])} "
        f"in {doc['seconds']:.2f} s ({_human(rate)}/s, {doc['threads']} threads)"
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


# ---------------------------------------------------------------------------------------------- where
def package_data() -> dict[str, str]:
    """The installed package and its data directories (launch scripts, presets, patches: every
    directory of the package that is not a Python package), by name; the ``where --json`` document."""
    package = os.path.dirname(os.path.abspath(__file__))
    found = {"package": package}
    for top, dirs, _ in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for d in dirs:
            path = os.path.join(top, d)
            if not os.path.exists(os.path.join(path, "__init__.py")):
                found.setdefault(d, path)
    return found


def _where(name: str | None, as_json: bool) -> int:
    found = package_data()
    if name is not None:
        if name not in found:
            raise CliUsageError(f"no package data named {name!r} (there is: {', '.join(sorted(found))})")
        print(found[name])
    elif as_json:
        _emit(found)
    else:
        width = max(map(len, found))
        for key, path in found.items():
            print(f"{key:<{width}}  {path}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- main
_EXAMPLES = """\
examples:
  datastates-ckpt ls /ckpt/gpt                       what is there, which one loads next
  datastates-ckpt inspect /ckpt/gpt/iter_0000100 --rank 0 --tensors
  datastates-ckpt verify /ckpt/gpt/iter_0000100 && echo clean
  datastates-ckpt ls /ckpt/gpt --json | jq '.latest'  every subcommand takes --json (stable keys)

"""
_EPILOG = f"""\
exit status: {EXIT_OK} success (verify: every check passed); {EXIT_DAMAGED} a checkpoint is damaged
(verify found a problem, or a manifest does not parse; ls: a row is DAMAGED); {EXIT_USAGE} bad arguments
or the path is not there / not a checkpoint, or a dependency the command needs is missing (a runtime
one: exit 1, before any command runs); {EXIT_NEWER} a checkpoint was written by a newer
datastates-megatron, in a format this version cannot read (ls: a row is NEWER FORMAT and none is
DAMAGED): upgrade.  Errors are one line on stderr.

layout: SAVE_DIR/iter_0000100/manifest.json (the commit point) + one rNNNNN-<token>-<seq>.dsck per
rank; SAVE_DIR/{_TRACKER_NAME} names the latest iteration for Megatron.
"""


def _build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=fmt,
        epilog=_EXAMPLES + _EPILOG,
        description=(
            "List, inspect and verify datastates-megatron checkpoints (read-only), export one to another\n"
            "format (writes only under OUT_DIR), patch a Megatron-LM checkout, and say where the installed\n"
            "launch scripts and presets are."
        ),
    )
    p.add_argument("--version", action="version", version=f"{PROG} (datastates-megatron) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ls = sub.add_parser(
        "ls",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="list the checkpoints of a save directory",
        description=(
            "List every iter_* directory of SAVE_DIR, committed or not.\n\n"
            "STATE: committed (its manifest.json parses: loadable), uncommitted (no manifest: an interrupted\n"
            "or in-progress save; never loaded, removed at the next start), DAMAGED (a manifest exists but\n"
            "does not parse; the reason is printed under the row, and the loader refuses to pick a latest\n"
            "checkpoint until it is repaired or removed), NEWER FORMAT (written by a newer datastates-megatron\n"
            "in a format this version cannot read; the row says which version: upgrade to load it; while it\n"
            "is newer than every committed checkpoint, the loader refuses to pick a latest one as for\n"
            "DAMAGED; never removed), foreign (FORMAT) (not written by datastates-megatron:\n"
            "Megatron-LM's own checkpoint, FORMAT torch_dist or torch, or other files, FORMAT unknown; never\n"
            "loaded, never removed; a run refuses to start over one newer than its latest checkpoint).\n"
            "TIER: the manifest's storage tier ('persistent' unless the checkpoint says otherwise).\n"
            "WORLD: ranks that wrote it.  SIZE: bytes of every file in the directory (including leftovers).\n"
            "AGE: since the manifest was written (uncommitted: since its newest file changed).\n"
            "'<- latest' marks the checkpoint CheckpointManager.load() picks by default (the newest commit,\n"
            f"not the highest iteration); the last lines show it and what {_TRACKER_NAME} says.\n"
            "Cheap: reads manifests and stats files, never rank-file contents."
        ),
    )
    ls.add_argument("save_dir", metavar="SAVE_DIR", help="the directory holding iter_* checkpoint directories")
    ls.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, save_dir, checkpoints[], latest, latest_error, "
        "tracker, tracker_text, tracker_agrees); a checkpoint's state is committed, uncommitted, "
        "damaged, unreadable (permission denied), newer (a newer format) or foreign, its format (foreign only; else null) torch_dist, torch or unknown, "
        "its iteration null for Megatron's release directory",
    )

    ins = sub.add_parser(
        "inspect",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="show what one checkpoint holds",
        description=(
            "Show one checkpoint: manifest (iteration, world size, tier, run token, commit sequence, creation\n"
            "time, layout, metadata) and per rank: file and bytes, tensor count and bytes by dtype, and the\n"
            "stored non-tensor objects (top-level keys with a short type summary).  A rank file that cannot\n"
            "be opened, or is not the one the manifest committed, is shown as DAMAGED (exit 1).\n"
            "Reads indexes only; use `verify` to check the tensor bytes."
        ),
    )
    ins.add_argument("ckpt_dir", metavar="CKPT_DIR", help="one checkpoint directory, e.g. SAVE_DIR/iter_0000100")
    ins.add_argument("--rank", type=int, metavar="N", help="only rank N (default: every rank)")
    ins.add_argument(
        "--tensors", action="store_true", help="list every tensor (name, dtype, shape, bytes, checksum chunks)"
    )
    ins.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, checkpoint, manifest{}, ranks[]; a rank's "
        "'tensors' is null without --tensors, its 'error' is null unless it is damaged)",
    )

    ver = sub.add_parser(
        "verify",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="re-check every checksum of a checkpoint",
        description=(
            "Re-check a checkpoint end to end: for each rank, that its file exists with the size, header\n"
            "checksum, index checksum, tag and iteration the manifest committed, that tensor count and bytes\n"
            "match, then every per-chunk XXH64 of every tensor (in parallel: the kernel releases the GIL).\n"
            "Prints one ERROR line per bad tensor (or per unusable file) naming rank, file and tensor, then a\n"
            "summary; exit 0 when clean, 1 otherwise.  Progress goes to stderr: a bar on a terminal, else\n"
            "a line every --progress-every seconds (bytes, GB/s, ETA: for Slurm logs).  Alignment padding\n"
            "between tensors is not covered by checksums (it holds no data)."
        ),
    )
    ver.add_argument("ckpt_dir", metavar="CKPT_DIR", help="one checkpoint directory, e.g. SAVE_DIR/iter_0000100")
    ver.add_argument("--rank", type=int, metavar="N", help="only rank N (default: every rank)")
    ver.add_argument("--threads", type=int, metavar="N", help="hashing threads (default: min(8, CPUs))")
    ver.add_argument("-q", "--quiet", action="store_true", help="no progress")
    ver.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between progress lines when stderr is not a terminal (default: 30)",
    )
    ver.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, checkpoint, iteration, world_size, ok, "
        "ranks_checked, tensors_checked, bytes_checked, seconds, threads, errors[{rank, file, "
        "tensor, chunks, kind, message}], unreferenced_files); kind is one of missing, size, file, "
        "manifest, checksum",
    )

    exp = sub.add_parser(
        "export",
        usage="%(prog)s [options] CKPT_DIR OUT_DIR [-- TRAINING_FLAGS...]",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="write a checkpoint in another format",
        description=(
            "Convert a committed checkpoint: --format torch writes one consolidated torch.save file (full\n"
            "parameters, per-parameter optimizer state, non-tensor state) for inspection or conversion,\n"
            "without Megatron-LM (TP=PP=1 checkpoints); --format torch_dist writes Megatron-LM's own\n"
            "dist_checkpointing checkpoint, which megatron-core loads at any TP/PP/DP (the path for a\n"
            "changed TP or PP size), by running Megatron-LM itself with --lazy-ckpt-convert-to on CPU\n"
            "ranks: any model and layout Megatron-LM saves.  Every byte read is checksum-verified unless\n"
            "--no-verify.  Prints the path written.\n\n"
            "  datastates-ckpt export SAVE_DIR OUT_DIR --megatron-lm ~/Megatron-LM -- \\\n"
            "      --num-layers 2 --hidden-size 64 ... --transformer-impl local --tensor-model-parallel-size 2"
        ),
    )
    from .megatron.export.export_args import add_export_arguments

    add_export_arguments(exp)

    where = sub.add_parser(
        "where",
        formatter_class=fmt,
        help="print where the launch scripts, presets and patches are installed",
        description=(
            "Print where the installed package keeps its data: the Slurm launch scripts (launch), their\n"
            "model presets (configs) and the Megatron-LM patches, one NAME PATH per line; with NAME, only\n"
            "that path (for scripts):\n\n"
            '  sbatch --nodes=1 "$(datastates-ckpt where launch)/gpu_multinode.sbatch"\n'
            '  cp -r "$(datastates-ckpt where configs)" my-presets'
        ),
    )
    where.add_argument("name", nargs="?", metavar="NAME", help="one of them (launch, configs, patches, package)")
    where.add_argument("--json", action="store_true", help="print one JSON object {NAME: PATH}")
    _add_patch_command(sub, fmt)
    return p


def _add_patch_command(sub, fmt) -> None:
    """``patch MEGATRON_DIR``: the source patch, applied from the installed package (not read-only)."""
    from .megatron.megatron_lm import patching, versions

    pat = sub.add_parser(
        "patch",
        formatter_class=fmt,
        help="apply the --lazy-ckpt patch to a Megatron-LM tree",
        description=(
            "Apply (or --check, or --revert) the --lazy-ckpt source patch to a Megatron-LM checkout or copy:\n"
            "the patch for the version in MEGATRON_DIR/megatron/core/package_info.py, shipped in this package.\n"
            f"Tested versions: {versions.tested_names()}.\n"
            "Idempotent: applying twice or reverting an unpatched tree says so and does nothing.  Only the\n"
            "work tree changes (git apply; nothing is staged).  Exit status: 0 done or nothing to do, 1 the\n"
            "patch does not apply (git's reasons are printed), 2 usage error, not a Megatron-LM tree, or an\n"
            "untested version."
        ),
    )
    patching.add_arguments(pat)


def _check_export(args: argparse.Namespace, flags: list[str]) -> None:
    """The export's usage errors, before anything heavy is imported."""
    from .megatron.export.export_args import locate_script

    args.training_flags = flags
    if args.format == "torch":
        if flags:
            raise CliUsageError("export --format torch runs no Megatron-LM: give no training flags after --")
        return
    try:
        locate_script(args.megatron_lm, args.script)
    except ValueError as e:
        raise CliUsageError(str(e)) from None
    if not flags:
        raise CliUsageError(
            "export --format torch_dist needs the training flags of the run that wrote the checkpoint after "
            "`--` (model shape, parallel layout, precision, tokenizer)"
        )


def _emit(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=1, sort_keys=True, default=str)
    sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``datastates-ckpt`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = None
    if "--" in argv:  # export's training flags: split off before argparse, which mangles them
        at = argv.index("--")
        argv, flags = argv[:at], argv[at + 1 :]
    parser = _build_parser()
    args = parser.parse_args(argv)
    if flags is not None and args.command != "export":
        parser.error(f"{args.command} takes no arguments after --")
    try:
        if args.command == "ls":
            doc = list_checkpoints(args.save_dir)
            _emit(doc) if args.json else _render_ls(doc)
            states = {row["state"] for row in doc["checkpoints"]}
            return _exit_for([s == "newer" for s in states if s in ("damaged", "newer")])
        if args.command == "where":
            return _where(args.name, args.json)
        if args.command == "patch":
            from .megatron.megatron_lm.patching import main as patch

            return patch(args)
        if args.command == "export":
            _check_export(args, flags or [])
            from .megatron.export.exporter import run_export

            return run_export(args)
        if args.command == "inspect":
            doc = inspect_checkpoint(args.ckpt_dir, args.rank, args.tensors)
            _emit(doc) if args.json else _render_inspect(doc)
            return _exit_for([r.get("newer") for r in doc["ranks"] if r["error"]])
        if args.threads is not None and args.threads < 1:
            raise CliUsageError(f"--threads must be >= 1, got {args.threads}")
        if args.progress_every <= 0:
            raise CliUsageError(f"--progress-every must be > 0, got {args.progress_every}")
        show = False if args.quiet else (True if sys.stderr.isatty() else args.progress_every)
        doc = verify_checkpoint(args.ckpt_dir, threads=args.threads, rank=args.rank, progress=show)
        _emit(doc) if args.json else _render_verify(doc)
        return _exit_for([e["kind"] == "newer" for e in doc["errors"]])
    except BrokenPipeError:  # `| head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except MissingDependencyError as e:  # an optional one the command needs (export: megatron-core, psutil)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        if isinstance(e, FormatVersionError):
            return EXIT_NEWER
        usage = isinstance(e, (NoCheckpointError, CliUsageError)) or not isinstance(e, CheckpointError)
        return EXIT_USAGE if usage else EXIT_DAMAGED
    except Exception as e:  # a case no check foresaw: still one line, never a traceback (unless asked)
        if os.environ.get("DSM_DEBUG"):
            raise
        print(
            f"{PROG}: error: unexpected {type(e).__name__}: {e} (a damaged checkpoint or a bug in {PROG};"
            " DSM_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_DAMAGED


if __name__ == "__main__":
    sys.exit(main())
