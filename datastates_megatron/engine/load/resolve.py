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

The same round is also the restore decision (:meth:`.manager.CheckpointManager.choose`): every
rank's small fixed record (its restore candidates) is gathered to rank 0 first, which decides from
them and from its one survey of the tier which checkpoint to read, and every rank receives the
decision with its record -- one gather, one broadcast, one scatter.

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
from ..tiers.tier import Survey
from ..tiers.tier import survey as survey_dir

__all__ = ["Resolved", "resolve"]

_HEADER = ("iteration", "world_size", "run_token", "layout", "metadata", "commit_seq", "created", "tier", "run_id")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One rank's view of the resolved checkpoint: its directory and a manifest holding the
    header and this rank's record only (``manifest.record(rank)``) -- both ``None`` when rank 0's
    ``decide`` read nothing of this tier -- with what rank 0 decided (``decision``) and what the
    layout ``check`` returned (``checked``), the same on every rank."""

    ckpt: str | None
    manifest: Manifest | None
    decision: dict = dataclasses.field(default_factory=dict)
    checked: object = None

    def file_of(self, rank: int) -> RankRecord | None:
        return self.manifest.record(rank) if self.manifest is not None else None


def resolve(
    root: str,
    iteration: int | None,
    channel: StoreChannel,
    layout: dict,
    check: Callable[[Manifest, str], object] | None = None,
    latest: Callable[[Survey], int] | None = None,
    *,
    offer: dict | None = None,
    decide: Callable[[dict | None, Survey], tuple[int | None, dict]] | None = None,
    survey: Callable[[str], Survey] | None = None,
    read: Callable[[Survey, int], tuple[str, Manifest]] | None = None,
) -> Resolved:
    """Resolve checkpoint ``iteration`` (``None``: the newest committed, or what ``latest(survey)``
    says on rank 0) of the tier at ``root`` for this world (``channel.world_size`` ranks,
    ``layout``) and give this rank its record.  ``check(manifest, ckpt)`` replaces the same-layout
    check (e.g. a reshard's own); what it returns (JSON) is every rank's ``checked``.
    ``survey(root)``: what rank 0 finds there (default: the directory's, :func:`.tiers.tier.survey`);
    ``read(survey, iteration)``: ``(checkpoint, manifest)`` of a committed iteration in it (default:
    the directory's) -- object storage lists its objects and reads its manifest objects instead.

    With ``decide`` the same round is the restore decision: every rank's ``offer`` (int fields;
    ``None`` on every rank: nothing to gather) reaches rank 0 in one gather, where
    ``decide(columns, survey of root)`` returns the iteration of ``root`` to read (``None``: none)
    and a small JSON decision that every rank receives."""
    cols = channel.gather(offer, tuple(offer)) if offer is not None else None
    head, records, error = None, None, None
    if channel.is_root:
        try:
            found = (survey or survey_dir)(root)
            decision: dict = {}
            if decide is not None:
                iteration, decision = decide(cols, found)
            elif iteration is None:
                iteration = latest(found) if latest is not None else found.latest()
            head = {"decision": decision}
            if iteration is not None:
                ckpt, manifest = (read or _read)(found, iteration)
                checked = (check or (lambda m, c: validate_world(m, c, channel.world_size, layout)))(manifest, ckpt)
                head.update(ckpt=ckpt, head={k: getattr(manifest, k) for k in _HEADER}, checked=checked)
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
    if "ckpt" not in head:  # every rank alike: nothing read, nothing to send
        return Resolved(None, None, head["decision"])
    rec = channel.scatter(records, expect=True)
    ranks = (RankRecord(**rec),) if rec is not None else ()
    return Resolved(head["ckpt"], Manifest(ranks=ranks, **head["head"]), head["decision"], head.get("checked"))


def _read(found: Survey, iteration: int) -> tuple[str, Manifest]:
    """The directory and manifest of committed ``iteration`` in the surveyed tier ``found``."""
    root, it = found.root, iteration
    if it not in found.committed:
        if it in found.damaged:
            raise found.damaged[it]
        missing = (
            "no such checkpoint directory" if not os.path.lexists(iter_dir(root, it)) else "no committed checkpoint"
        )
        raise NoCheckpointError(f"{iter_dir(root, it)}: {missing}")
    return iter_dir(root, it), found.committed[it]


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RankRecord))


def _record_doc(rec: RankRecord | None) -> dict | None:
    """``dataclasses.asdict`` of a record, without its deep copy (flat ints and a str): at 64k
    ranks ``asdict`` was most of rank 0's resolve."""
    return {f: getattr(rec, f) for f in _RECORD_FIELDS} if rec is not None else None
