"""Start-up of a run's tiers, agreed across ranks: the save directory's writer, the run id, this
node's tier of the run, and the clique's replication.

Each step is a collective: a failure on any rank raises on every rank (a rank failing alone would
leave the others waiting in the next collective), and the directory locks taken so far are released
before it is raised.  The :class:`..manager.CheckpointManager` calls these in order, then opens the
tiers' commit channels.
"""

from __future__ import annotations

import dataclasses
import os

from ..dist.collective import Collective
from ..errors import OptionsError, SaveDirBusyError
from ..fs.safe_io import check_path_fits, make_dir, make_root
from ..names import LONGEST_RANK_FILE_NAME, REPLICAS_DIR, RUN_SUBDIR_PREFIX
from ..options import ManagerOptions
from .reclaim import reclaim_finished_runs, unmark_ended
from .replica_strategy import clique_of
from .replication import Replication
from .run_id import run_subdir
from .tier import Tier, report_other_runs

__all__ = ["Started", "agree_start", "release", "start_replication", "start_tiers"]

# the longest path we create under a tier's root: a temp name beside a rank file in an iter_* directory
_LONGEST_NAME = os.path.join("iter_0000000000", LONGEST_RANK_FILE_NAME + ".tmp-4194304")
# ... and under a node-local root: in this run's directory, a replica held for another rank
_LONGEST_LOCAL = os.path.join(RUN_SUBDIR_PREFIX + "f" * 16, REPLICAS_DIR, "r99999", _LONGEST_NAME)


@dataclasses.dataclass(frozen=True)
class Started:
    """What :func:`start_tiers` agreed: the run id, this node's tier of the run (``None`` without a
    node-local root) and whether the save directory held no checkpoint (rank 0's survey)."""

    run_id: str
    local: Tier | None
    save_empty: bool

    @property
    def local_root(self) -> str | None:
        return self.local.root if self.local is not None else None


def release(tiers, timeout: float | None = None) -> None:
    """Release the directory locks of ``tiers`` (``None`` entries skipped); ``timeout``: at most this
    long on each tier (a bucket that does not answer)."""
    for tier in tiers:
        if tier is not None:
            tier.release(timeout)


def agree_start(world: Collective, rank: int, err: BaseException | None, tiers) -> None:
    """Make one rank's start-up error every rank's; the locks of ``tiers`` are released before raising."""
    try:
        world.raise_agreed(err, f"rank {rank}: start-up")
    except BaseException:
        release(tiers)
        raise


def start_tiers(
    persistent,
    world: Collective,
    *,
    rank: int,
    token: str,
    objects: bool,
    local_base: str | None,
    node_ranks: range,
    policy: ManagerOptions,
) -> Started:
    """The save directory's writer first refuses a checkpoint we did not write that a resume would
    skip, then takes the directory's one-writer lock, cleans our own leftovers and reads (or, at the
    run's first start, creates) the run id.  With it every rank knows its node-local tier
    ``<local_base>/run-<id>``, whose writer (the node's first rank) takes that directory's lock
    before cleaning it.  ``objects``: ``persistent`` is on object storage (no path to check)."""
    run_id, save_empty = 0, False
    try:
        for root, longest in ((None if objects else persistent.root, _LONGEST_NAME), (local_base, _LONGEST_LOCAL)):
            if root:  # ENAMETOOLONG now, not mid-save
                check_path_fits(root, longest)
        if persistent.is_writer:
            if not objects:
                make_root(persistent.root)
            found = persistent.survey()
            save_empty = not found.committed and not found.damaged
            persistent.refuse_foreign(found)  # read-only: before the lock
            persistent.acquire()
            persistent.clean(found)
            run_id = int(persistent.ensure_run_id(), 16)
    except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
        agree_start(world, rank, e, (persistent,))
        raise
    agree_start(world, rank, None, (persistent,))
    persistent.run_id = run = f"{world.broadcast(run_id, src=0):016x}"
    if not local_base:
        return Started(run, None, save_empty)
    local_root = run_subdir(local_base, run)
    local = Tier(
        "local",
        local_root,
        rank=rank,
        token=token,
        writes=list(node_ranks) if rank == node_ranks[0] else [],
        keep_last=policy.local_keep_last,
        recycle_files=policy.recycle_files,
        run_id=run,
        node_local=True,
    )
    try:
        if local.is_writer:
            make_root(local_base)  # the root given (a link there is the user's choice)
            make_dir(local_root)  # ours: never a link
            try:
                local.acquire()
            except SaveDirBusyError as e:
                raise SaveDirBusyError(
                    f"{local_root}: this run's node-local directory is in use by another writer ({e}). "
                    "On one machine running several nodes, give each its own directory with {node} in "
                    "--lazy-ckpt-local-dir"
                ) from None
            unmark_ended(local_root)  # this run is live here again
            reclaim_finished_runs(local_base, run)
            report_other_runs(local_base, run)
            local.clean()
    except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
        agree_start(world, rank, e, (local, persistent))
        raise
    agree_start(world, rank, None, (local, persistent))
    return Started(run, local, save_empty)


def start_replication(
    local: Tier,
    world: Collective,
    *,
    rank: int,
    per_node: int,
    node_ranks: range,
    jump: int,
    factor: int,
    keep_last: int,
    timeout_s: float,
    tiers,
) -> Replication:
    """The clique's group, then this rank's replica directories (agreed: a failure on any rank raises
    on every rank, the locks of ``tiers`` released).  The node's writer holds the replica directories
    of the union of its ranks' cliques."""
    clique = clique_of(rank, jump, factor)
    replication = Replication(local, clique, keep_last=keep_last, timeout_s=timeout_s)
    try:
        nodes = {m // per_node for m in clique}
        if len(nodes) < len(clique):  # a node lost would lose every copy of its ranks' files
            raise OptionsError(
                "replication",
                [
                    (
                        "replication_jump",
                        f"{jump} puts rank {rank}'s partners {clique} on the same node "
                        f"({per_node} ranks per node): use a multiple of the ranks per node",
                    )
                ],
            )
        writer = local.is_writer
        replication.open_stores({m for r in node_ranks for m in clique_of(r, jump, factor)} if writer else None)
    except Exception as e:  # noqa: BLE001 - every rank must hear it, not only this one
        agree_start(world, rank, e, tiers)
        raise
    agree_start(world, rank, None, tiers)
    replication.follow()
    return replication
