"""Megatron-LM's ``torch_dist`` checkpoint of a lazy checkpoint, written on a few processes.

``datastates-ckpt export --format torch_dist --nproc N`` without training flags: N gloo processes
(:mod:`.export_ranks`, any N, whatever the old world size) each take a share of the checkpoint's
distinct global blocks (:func:`.global_tensors.global_blocks`: one per sharded key and offset,
shared out largest first to the process with the fewest bytes so far, the same on every process),
read them through the engine's verifying reader from whichever old ranks hold them, and hand them to
megatron-core's own ``dist_checkpointing.save`` as ``ShardedTensor`` s with the recorded sharded key,
global shape and global offset -- what the model's ``sharded_state_dict`` declared when it was saved.
megatron-core checks that the blocks tile every global tensor and writes its ``torch_dist`` format
(``metadata.json``, ``common.pt``, ``*.distcp``), which megatron-core loads at any layout.

The model weights only, with ``iteration`` and ``checkpoint_version`` as common state: the
optimizer's and the RNG's sharded form depends on the run's flags (``--no-load-optim
--no-load-rng`` or ``--finetune`` load it in Megatron-LM).  Parameters without global coordinates
(identity 2, or declared by megatron-core as a ``ShardedTensorFactory``) are refused: Megatron-LM's
own export (training flags after ``--``) is the fallback for them.

Thread-safety: :func:`main` is a process entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from ..._output import write_line
from ...engine.format.manifest import read_manifest
from ...engine.load.reader import CheckpointReader
from .global_tensors import GlobalBlock, close_index, global_blocks, megatron_key, open_index, read_blocks

__all__ = ["CHECKPOINT_VERSION", "main", "share", "sharded_tensor"]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0  # Megatron-LM's, for a checkpoint of this format


def share(blocks: list[GlobalBlock], nproc: int) -> list[int]:
    """The process each block goes to: largest first, to the one with the fewest bytes so far (ties:
    the lowest); deterministic, so that every process computes the same."""
    owner = [0] * len(blocks)
    load = [0] * nproc
    order = sorted(range(len(blocks)), key=lambda i: (-blocks[i].numel, blocks[i].block.key, blocks[i].block.offset))
    for i in order:
        p = min(range(nproc), key=lambda q: (load[q], q))
        owner[i] = p
        load[p] += blocks[i].numel
    return owner


def sharded_tensor(gb: GlobalBlock, data: torch.Tensor):
    """megatron-core's ``ShardedTensor`` of one block (the recorded key, global shape and offset)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    b = gb.block
    return ShardedTensor(
        key=megatron_key(b.key),
        data=data,
        dtype=data.dtype,
        local_shape=tuple(b.shape),
        global_shape=tuple(b.global_shape),
        global_offset=tuple(b.offset),
        axis_fragmentations=tuple(g // n for g, n in zip(b.global_shape, b.shape)),
        replica_id=0,
        prepend_axis_num=0,
        allow_shape_mismatch=b.mismatch,
    )


def write(path: str, iteration: int, out: str, *, verify: bool = True) -> int:
    """This process's share of checkpoint ``path`` into megatron-core's ``torch_dist`` checkpoint
    ``out`` (with the other processes of the default process group); returns the blocks written."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    rank, nproc = dist.get_rank(), dist.get_world_size()
    with CheckpointReader(path, read_manifest(path), verify=verify, threads=2) as reader:
        index = open_index(reader)
        try:
            blocks = [gb for bl in global_blocks(index, path).values() for gb in bl]
            owner = share(blocks, nproc)
            mine = [gb for gb, p in zip(blocks, owner) if p == rank]
            values = read_blocks(reader, index, mine) if mine else []
        finally:
            close_index(index)
    model = {
        f"{gb.block.key}@{','.join(map(str, gb.block.offset))}": sharded_tensor(gb, v) for gb, v in zip(mine, values)
    }
    state = {"model": model, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    dist_checkpointing.save(state, out, sharded_strategy=("torch_dist", 1))
    log.info(
        "export process %d of %d: %d of %d blocks of iteration %d written",
        rank,
        nproc,
        len(mine),
        len(blocks),
        iteration,
    )
    return len(mine)


def main(argv: list[str] | None = None) -> int:
    """One export process: ``CKPT_ITER_DIR ITERATION OUT [--no-verify]`` (rank and world from the
    environment :mod:`.export_ranks` sets)."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog=f"python -m {__name__}")
    p.add_argument("path")
    p.add_argument("iteration", type=int)
    p.add_argument("out")
    p.add_argument("--no-verify", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ..cpu import cuda_on_cpu

    cuda_on_cpu.install()  # without a GPU: megatron-core's writer synchronizes CUDA (a no-op then)
    dist.init_process_group("gloo")
    try:
        n = write(args.path, args.iteration, args.out, verify=not args.no_verify)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    write_line(f"rank {os.environ.get('RANK')}: {n} blocks written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
