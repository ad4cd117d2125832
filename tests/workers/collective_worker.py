"""Worker for tests/distributed/test_collective.py: every Collective operation on real gloo ranks.

Rank ``--fail-rank`` fails its step in the agreements; every rank prints what it saw."""

import argparse
import json

import torch.distributed as dist

from datastates_megatron._output import write_line
from datastates_megatron.engine.dist import collective
from datastates_megatron.engine.dist.collective import Collective
from datastates_megatron.engine.errors import CheckpointError, ForeignCheckpointError
from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fail-rank", type=int, required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    coll = Collective()
    out = {"rank": coll.rank, "world_size": coll.world_size, "active": coll.active}
    out["gather"] = coll.gather({"rank": rank, "neg": -rank - 1, "big": (1 << 63) - 1 - rank})
    mine = [{"i": rank, "k": k} for k in range(rank)]  # rank r brings r records
    out["gather_many"] = coll.gather_many(mine, fields=("i", "k"), capacity=world)
    out["broadcast"] = coll.broadcast(1000 + rank, src=world - 1)
    out["agree"] = coll.agree(rank != a.fail_rank)
    err = ForeignCheckpointError(f"rank {rank}: " + "x" * 10_000) if rank == a.fail_rank else None
    failure = coll.agree_error(err)
    out["failure"] = None if failure is None else [list(failure.ranks), failure.rank, failure.error, failure.message]
    out["failure_class"] = None if failure is None else failure.error_class().__name__
    out["no_failure"] = coll.agree_error(None) is None
    out["failures"] = coll.failures(rank == 0)  # every rank but 0 fails
    collective.NAMED = 1  # only the lowest failed rank is named; the count is still whole
    out["failures_named_1"] = coll.failures(rank == 0)
    collective.NAMED = 8
    out["min_max"] = coll.min_max(10 * rank - 5)
    try:  # an error class of the megatron/ layer, raised on one rank
        coll.raise_agreed(LazyCkptArgsError("bad flag") if rank == a.fail_rank else None, f"rank {rank}: step")
        out["raised"] = None
    except CheckpointError as e:
        out["raised"] = [type(e).__name__, str(e)]
    try:
        coll.gather({"b" if rank == a.fail_rank else "a": 1})
        out["schema"] = None
    except CheckpointError as e:
        out["schema"] = str(e)
    # a sub-group of the ranks after 0: its ranks and broadcast source are the group's
    sub = dist.new_group(ranks=list(range(1, world)), backend="gloo")
    if rank > 0:
        part = Collective(sub)
        out["sub"] = [part.rank, part.world_size, part.broadcast(2000 + rank, src=0), part.agree(rank != 1)]
    dist.barrier()
    dist.destroy_process_group()
    write_line("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
