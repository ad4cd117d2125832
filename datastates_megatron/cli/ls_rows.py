"""The rows and the document of ``datastates-ckpt ls``, made once for a save directory (:mod:`.ls`)
and for a save location on object storage (:mod:`.objects`): each hands over its survey (what a
load would pick, :func:`..engine.tiers.tier.survey` or :func:`..engine.storage.survey.survey_objects`)
and what it measured of each ``iter_*`` entry; the states and the latest are decided here."""

from __future__ import annotations

from ..engine.errors import CheckpointAccessError, CheckpointError, FormatVersionError, NoCheckpointError
from ..engine.format.manifest import Manifest, parse_tracker
from .common import JSON_SCHEMA

__all__ = ["checkpoint_row", "ls_document"]


def checkpoint_row(
    iteration: int | None,
    path: str,
    *,
    size: int,
    files: int,
    created: float | None,
    now: float,
    manifest: Manifest | None = None,
    error: CheckpointError | None = None,
    foreign: str | None = None,
) -> dict:
    """One row: ``iteration``'s entry at ``path`` (``size`` bytes, ``files`` rank files, newest
    change ``created``), committed by ``manifest``, damaged with ``error``, or holding a checkpoint
    we did not write in format ``foreign``; otherwise uncommitted."""
    row = {
        "iteration": iteration,
        "path": path,
        "state": "uncommitted",
        "format": None,
        "tier": None,
        "world_size": None,
        "bytes": size,
        "data_bytes": None,
        "files": files,
        "commit_seq": None,
        "created": created,
        "age_s": None if created is None else now - created,
        "latest": False,
        "error": None,
    }
    if foreign is not None:
        row.update(state="foreign", format=foreign)
    elif isinstance(error, CheckpointAccessError):  # permission denied: not ours to read, not damaged
        row.update(state="unreadable", error=str(error))
    elif isinstance(error, FormatVersionError):  # a newer version's: not damaged, and never removed
        row.update(state="newer", error=str(error))
    elif error is not None:
        row.update(state="damaged", error=str(error))
    elif manifest is not None:
        row.update(
            state="committed",
            tier=manifest.tier,
            world_size=manifest.world_size,
            data_bytes=manifest.total_bytes,
            commit_seq=manifest.commit_seq,
            created=manifest.created,
            age_s=now - manifest.created,
        )
    return row


def ls_document(
    save_dir: str, rows: list[dict], found, tracker_text: str | None, tracker_readable: bool = True
) -> dict:
    """The ``ls --json`` document: ``rows``, the latest as ``found`` (the survey) decides it, and
    whether the tracker (``tracker_text``; ``None``: absent) agrees."""
    latest, latest_error = None, None
    try:
        latest = found.latest()
    except NoCheckpointError:
        pass
    except (CheckpointError, OSError) as e:
        latest_error = str(e)
    for row in rows:
        row["latest"] = latest is not None and row["iteration"] == latest and row["state"] == "committed"
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
