"""The one resolve step of a restart: rank 0 finds the checkpoint and reads its manifest, once; each
rank receives only its own record.

At N ranks, every rank reading the committed manifests (O(N) bytes each) is O(N^2) bytes at the
moment the whole job restarts.  :func:`resolve` instead has rank 0 survey the tier (the newest
commit, or the asked-for iteration), read that manifest and check it against this world (size and
layout), then broadcast the manifest's header (small: no rank records) and send each rank its own
record, all N in one store call (:meth:`.store_channel.StoreChannel.scatter`).  Every rank gets back a
:class:`Resolved` whose manifest lists only its own record -- enough for
:class:`.reader.CheckpointReader` and :class:`.load_plan.SameLayoutPlanner`, which look records up by
rank.  An error on rank 0 (no checkpoint, a damaged manifest, another layout) reaches every rank
as the same exception class and message.

Collective over its channel (every rank calls it once per resolve).  Thread-safety: the caller's
thread; the channel is this step's own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from ..errors import NoCheckpointError, error_class_named, make_error
from .load_plan import validate_world
from ..format.manifest import Manifest, RankRecord
from ..names import iter_dir
from ..dist.store_channel import StoreChannel
from ..tiers.tier import survey

__all__ = ["Resolved", "resolve"]

_HEADER = ("iteration", "world_size", "run_token", "layout", "metadata", "commit_seq", "created", "tier", "run_id")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One rank's view of the resolved checkpoint: its directory and a manifest holding the
    header and this rank's record only (``manifest.record(rank)``)."""

    ckpt: str
    manifest: Manifest

    def file_of(self, rank: int) -> RankRecord | None:
        return self.manifest.record(rank)


def resolve(
    root: str,
    iteration: int | None,
    channel: StoreChannel,
    layout: dict,
    check: Callable[[Manifest, str], None] | None = None,
    latest: Callable[[str], int] | None = None,
    read: Callable[[str, int | None], tuple[str, Manifest]] | None = None,
) -> Resolved:
    """Resolve checkpoint ``iteration`` (``None``: the newest committed, or what ``latest(root)``
    says on rank 0) of the tier at ``root`` for this world (``channel.world_size`` ranks,
    ``layout``) and give this rank its record.  ``check(manifest, ckpt)`` replaces the same-layout
    check (e.g. a reshard's own).  ``read(root, iteration)``: ``(checkpoint, manifest)`` on rank 0
    (default: the directory's; object storage reads its manifest object)."""
    head, records, error = None, None, None
    if channel.is_root:
        try:
            if iteration is None and latest is not None:
                iteration = latest(root)
            ckpt, manifest = (read or _read)(root, iteration)
            (check or (lambda m, c: validate_world(m, c, channel.world_size, layout)))(manifest, ckpt)
            head = {"ckpt": ckpt, "head": {k: getattr(manifest, k) for k in _HEADER}}
            records = {r: _record_doc(manifest.record(r)) for r in range(channel.world_size)}
        except Exception as e:  # noqa: BLE001 - every rank must hear it
            error = e
            head = {"error": type(e).__name__, "message": str(e)}
    head = channel.broadcast(head, limit=None)  # the header: its size is the metadata's, not N's
    if error is not None:
        raise error
    if "error" in head:
        raise make_error(
            error_class_named(head["error"]),
            f"rank {channel.rank}: resolving the checkpoint failed on rank 0: {head['message']}",
        )
    rec = channel.scatter(records, expect=True)
    ranks = (RankRecord(**rec),) if rec is not None else ()
    return Resolved(head["ckpt"], Manifest(ranks=ranks, **head["head"]))


def _read(root: str, iteration: int | None) -> tuple[str, Manifest]:
    """The directory and manifest of ``iteration`` (default: the newest committed) under ``root``."""
    found = survey(root)
    it = found.latest() if iteration is None else iteration
    if it not in found.committed:
        if it in found.damaged:
            raise found.damaged[it]
        missing = (
            "no such checkpoint directory" if not os.path.lexists(iter_dir(root, it)) else "no committed checkpoint"
        )
        raise NoCheckpointError(f"{iter_dir(root, it)}: {missing}")
    return iter_dir(root, it), found.committed[it]


def _record_doc(rec: RankRecord | None) -> dict | None:
    return dataclasses.asdict(rec) if rec is not None else None
