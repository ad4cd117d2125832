"""``datastates-ckpt ls SAVE_DIR``: every ``iter_*`` directory of a save directory with its state,
which one a load picks, and what the tracker says.  Reads manifests and stats files only."""

from __future__ import annotations

import argparse
import os
import stat
import time

from ..engine.errors import CheckpointError, NoCheckpointError
from ..engine.names import RANK_FILE_SUFFIX, TRACKER_NAME
from ..engine.storage.url import is_object_url
from .common import age, emit, exit_for, human, strip_path
from .ls_rows import checkpoint_row, ls_document

__all__ = ["list_checkpoints", "run"]


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
        files += name.endswith(RANK_FILE_SUFFIX)
        newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    return total, files, newest


def list_checkpoints(save_dir: str) -> dict:
    """Every ``iter_*`` directory of ``save_dir`` with its state, as the tier's own survey
    (:func:`.engine.tiers.tier.survey`: what a load would pick) classifies it; the ``ls --json`` document."""
    from ..engine.format.manifest import read_tracker_text
    from ..engine.names import iter_dir
    from ..engine.tiers.foreign import find_foreign
    from ..engine.tiers.tier import survey

    try:
        is_dir = stat.S_ISDIR(os.stat(save_dir).st_mode)
    except FileNotFoundError:
        raise NoCheckpointError(f"{save_dir}: no such directory") from None
    except OSError as e:  # ENAMETOOLONG, EACCES, ELOOP: the directory may well exist
        from ..engine.fs.safe_io import os_error_text

        raise NoCheckpointError(f"{save_dir}: cannot look into it: {os_error_text(e)}") from None
    if not is_dir:
        raise NoCheckpointError(f"{save_dir}: not a directory")
    save_dir = os.path.abspath(save_dir)
    now = time.time()
    foreign = {f.path: f.format for f in find_foreign(save_dir)}
    release = [p for p in foreign if os.path.basename(p) == "release"]
    found = survey(save_dir)
    rows = []
    for it, d in [(None, p) for p in release] + [(it, iter_dir(save_dir, it)) for it in found.iterations]:
        size, files, newest = _dir_usage(d)
        rows.append(
            checkpoint_row(
                it,
                d,
                size=size,
                files=files,
                created=newest,
                now=now,
                manifest=found.committed.get(it),
                error=found.damaged.get(it),
                foreign=foreign.get(d),
            )
        )
    tracker_readable = True
    try:
        tracker_text = read_tracker_text(save_dir)  # not through a link, size-capped
    except CheckpointError as e:
        tracker_readable = False
        tracker_text = f"<unreadable: {strip_path(str(e), os.path.join(save_dir, TRACKER_NAME))}>"
    return ls_document(save_dir, rows, found, tracker_text, tracker_readable)


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
                    human(r["bytes"]),
                    age(r["age_s"]),
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
        print(f"tracker: absent ({TRACKER_NAME})")
    else:
        verdict = {True: "agrees", False: "DIFFERS from latest", None: "latest undetermined"}[doc["tracker_agrees"]]
        if text.startswith("<unreadable") and doc["tracker_agrees"] is None:
            verdict = "cannot be compared"
        print(f"tracker: {text} ({verdict})")


def run(args: argparse.Namespace) -> int:
    if is_object_url(args.save_dir):  # s3://, msc://
        from .objects import list_object_checkpoints

        doc = list_object_checkpoints(args.save_dir)
    else:
        doc = list_checkpoints(args.save_dir)
    emit(doc) if args.json else _render_ls(doc)
    states = {row["state"] for row in doc["checkpoints"]}
    return exit_for([s == "newer" for s in states if s in ("damaged", "newer")])
