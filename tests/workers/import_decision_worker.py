"""Worker for tests/distributed/test_import_decision.py: :func:`torch_dist.importable_on_every_rank`
on real gloo ranks, each rank reading the directory given for it (a shared file system that shows
the ranks different things)."""

import argparse
import json

import torch.distributed as dist

from datastates_megatron._output import write_line
from datastates_megatron.engine.errors import CheckpointError
from datastates_megatron.megatron.megatron_lm import torch_dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--load-of-rank", required=True, help="comma-separated: rank r reads the r-th")
    a = p.parse_args()
    dist.init_process_group("gloo")
    load = a.load_of_rank.split(",")[dist.get_rank()]
    try:
        found = torch_dist.importable_on_every_rank(load)
        out = {"iteration": None if found is None else found.iteration}
    except CheckpointError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    dist.barrier()
    dist.destroy_process_group()
    write_line("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
