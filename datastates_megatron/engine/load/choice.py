"""The restore decision as values: what each rank offers rank 0, rank 0's pure ``decide``, and the
:class:`RestoreChoice` that every rank receives and :meth:`.restorer.Restorer.load` consumes.

Nothing here does I/O or a collective: the restorer runs the one resolve round
(:func:`.resolve.resolve`) that carries these records, so the decision can be read, and tested, alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import CheckpointError, NoCheckpointError
from ..format.manifest import Manifest
from .resolve import Resolved

__all__ = ["DECIDE_FIELDS", "HOST_MEMORY", "SLOTS", "Restorable", "RestoreChoice", "decide", "newest_common", "offer"]

HOST_MEMORY = "host memory"  # RestoreChoice.root and LoadResult.root of a restore from a host copy
SLOTS = 8  # restore candidates each rank sends (its newest local saves)
DECIDE_FIELDS = ("n", *(f"{k}{i}" for i in range(SLOTS) for k in ("it", "tok", "seq", "ms")))


def offer(saves: dict) -> dict:
    """This rank's record for rank 0's restore decision: its ``SLOTS`` newest local saves (by
    commit time), ``saves`` being ``{iteration: (token, seq, commit ms)}`` -- one fixed-size record."""
    newest = sorted(saves, key=lambda it: saves[it][2])[-SLOTS:]
    record = {"n": len(newest)}
    for i in range(SLOTS):
        it = newest[i] if i < len(newest) else 0
        token, seq, ms = saves[it] if i < len(newest) else (0, 0, 0)
        record.update({f"it{i}": it, f"tok{i}": token, f"seq{i}": seq, f"ms{i}": ms})
    return record


def newest_common(cols: dict, iteration: int | None) -> dict:
    """Rank 0: ``{"local": [iteration, token, seq]}`` of the newest commit (by rank 0's commit time)
    every rank listed from the same save -- of ``iteration`` when one is asked for -- or ``None``.
    O(N * SLOTS)."""
    n = cols["n"]
    common = None
    for r in range(len(n)):
        mine = {(int(cols[f"it{i}"][r]), int(cols[f"tok{i}"][r]), int(cols[f"seq{i}"][r])) for i in range(int(n[r]))}
        common = mine if common is None else common & mine
        if not common:
            return {"local": None}
    order = {(int(cols[f"it{i}"][0]), int(cols[f"tok{i}"][0]), int(cols[f"seq{i}"][0])): int(cols[f"ms{i}"][0])
             for i in range(int(n[0]))}  # fmt: skip
    if iteration is not None:
        common = {c for c in common if c[0] == iteration}
    best = max(common, key=lambda c: (order[c], c[0]), default=None)
    return {"local": list(best) if best is not None else None}


def decide(cols: dict, found, *, root: str, iteration: int | None, tiered: bool, latest, held: str) -> tuple:
    """Rank 0, inside the resolve step: the tier and iteration every rank restores, from every
    rank's record (``cols``: the directory it asks for, its local saves; O(N * SLOTS)) and the
    survey of the shared tier ``found``.  The local tier wins when every rank holds the same save
    there (two nodes holding one iteration from different saves never restore together) and it is
    not older than the shared tier's newest (``latest(found)``).  ``tiered``: the ranks offered
    local saves; ``held``: what they hold, for the reason given ("node-local or host-memory").
    Returns the shared tier's iteration to read (``None``: it does not hold the chosen one) and the
    decision."""
    elsewhere = np.flatnonzero(cols["root"] != cols["root"][0])
    if elsewhere.size:  # a restore is collective: one directory for every rank
        raise CheckpointError(
            f"rank(s) {elsewhere[:8].tolist()}{f' and {elsewhere.size - 8} more' if elsewhere.size > 8 else ''} "
            f"asked to load another directory than rank 0 ({root}); give every rank the same one"
        )
    common = newest_common(cols, iteration)["local"] if tiered else None
    if iteration is not None:
        if common is not None:
            read = iteration if iteration in found.committed else None
            return read, {"tier": "local", "iteration": iteration, "why": f"iteration {iteration} is on every node"}
        why = f"iteration {iteration} is not on every node" if tiered else f"iteration {iteration} asked for"
        return iteration, {"tier": "persistent", "iteration": iteration, "why": why}
    try:
        newest = latest(found)
    except NoCheckpointError:
        if common is None:
            raise
        newest = None
    if common is not None and (newest is None or common[0] >= newest):
        read = common[0] if common[0] in found.committed else None
        return read, {"tier": "local", "iteration": common[0], "why": "the newest checkpoint every rank has"}
    why = "the newest checkpoint"
    if tiered:
        why = f"no {held} checkpoint every rank has"
        if common is not None:
            why = f"newer than the newest {held} checkpoint every rank has ({common[0]})"
    return newest, {"tier": "persistent", "iteration": newest, "why": why}


@dataclasses.dataclass(frozen=True)
class Restorable:
    """What one rank can restore without the shared tier, offered to rank 0's decision."""

    saves: dict  # iteration -> (run token as an int, save sequence, commit time in ms)
    how: dict  # iteration -> "host" (its host copy), "local" (this node's copy) or "replica" (a clique member's)
    table: dict  # the clique's replica table (:meth:`.replication.Replication.holdings`)


@dataclasses.dataclass(frozen=True)
class RestoreChoice:
    """The one restore decision (:meth:`.restorer.Restorer.choose`), as this rank needs it; what
    :meth:`.restorer.Restorer.load` consumes.  Made on rank 0; ``tier``, ``iteration``, ``view``'s
    header and ``reshard`` are the same on every rank, ``source``/``root``/``save`` are this rank's.

    ``tier``: where the job restores from, ``"local"`` (each rank's host copy, node copy or a
    replica) or ``"persistent"`` (``shared``).  ``source``: where this rank's state comes
    from -- ``"host"`` (its host copy, in memory: :mod:`..tiers.host_copy`), ``"local"`` (its node's
    copy), ``"replica"`` (fetched from the clique member holding it at load) or ``"persistent"``.
    ``root``: the tier directory this rank reads (:data:`HOST_MEMORY` for a host copy).  ``view``: the
    checkpoint ``iteration`` of the shared tier (``shared``: the load directory), its manifest's
    header and this rank's record, read by rank 0 alone; ``None`` when that tier does not hold it.
    ``reshard``: the caller's layout check of that manifest found another layout its planner
    reshards from (every rank then reads the shared tier).  Immutable."""

    tier: str
    iteration: int
    source: str
    root: str
    why: str
    shared: str
    view: Resolved | None = None
    reshard: bool = False
    asked: int | None = None  # the iteration asked for (None: the newest)
    save: tuple[int, int] | None = None  # the local save restored: (run token as an int, sequence)
    replicas: dict = dataclasses.field(default_factory=dict)  # the clique's table, for the fetch

    @property
    def manifest(self) -> Manifest | None:
        """The shared tier's manifest of ``iteration`` (header and this rank's record), or ``None``."""
        return self.view.manifest if self.view is not None else None

    @property
    def layout(self) -> dict | None:
        """The layout the checkpoint was saved with (from ``view``), or ``None``."""
        return dict(self.view.manifest.layout) if self.view is not None else None
