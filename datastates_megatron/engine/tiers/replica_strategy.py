"""Replication's strategy: who replicates to whom, and what a replica store keeps -- apart from how
the bytes move (:mod:`.replica_transport`) and from running it (:mod:`.replication`), as
nvidia-resiliency-ext keeps its strategies apart from its transport.

Cliques: ranks ``r, r+J, ..., r+(F-1)J`` within blocks of ``J*F`` ranks (``J`` = ranks per node puts
each member on a different node); every member keeps a copy of every other member's file.  A
replica store keeps the node-local ``keep_last`` newest, never fewer than two."""

from __future__ import annotations

import logging

from ..errors import OptionsError
from .retention import KeepPolicy

__all__ = ["replication_plan", "clique_of", "replica_policy"]

log = logging.getLogger(__name__)


def replication_plan(world_size: int, per_node: int, replicas: int | None, jump: int | None) -> tuple[int, int]:
    """``(jump, factor)`` for ``replicas`` partners per rank (None: 1 when there is more than one
    node and the node count is even, else 0) ``jump`` ranks apart (None: ranks per node); factor 1
    is off.  An explicit setting that does not tile the world raises :class:`OptionsError`."""
    nodes = max(1, world_size // max(1, per_node))
    jump = per_node if jump is None else jump
    if replicas is None:
        replicas = 1 if nodes > 1 and nodes % 2 == 0 else 0
        if nodes > 1 and nodes % 2:
            log.warning(
                "node-local checkpoints are not replicated: %d nodes do not pair up (set --lazy-ckpt-replicas "
                "K so that K+1 divides the node count)",
                nodes,
            )
    factor = replicas + 1
    if factor == 1:
        return jump, 1
    if jump < 1 or world_size % (jump * factor):
        raise OptionsError(
            "replication",
            [
                (
                    "replicas",
                    f"{replicas} partner(s) {jump} ranks apart do not tile {world_size} ranks "
                    f"(world size must be a multiple of jump*(replicas+1) = {jump * factor})",
                )
            ],
        )
    return jump, factor


def clique_of(rank: int, jump: int, factor: int) -> list[int]:
    """The ranks of ``rank``'s clique, ascending (O(factor): no list of every clique is built)."""
    block = rank // (jump * factor) * (jump * factor)
    return [block + rank % jump + k * jump for k in range(factor)]


def replica_policy(keep_last: int) -> KeepPolicy:
    """A replica store's retention: the node-local ``keep_last``, but never fewer than 2 -- the
    newest replica and the one before it, which a restart may still choose while the newest is being
    replaced (0: keep everything, as locally)."""
    return KeepPolicy(max(keep_last, 2) if keep_last else 0)
