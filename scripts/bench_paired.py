#!/usr/bin/env python
"""Overhead of checkpointing every iteration, measured in paired blocks that cancel machine drift.

    torchrun --nproc_per_node 2 scripts/bench_paired.py [--tier local|disk] [--block 4] [--quads 3]

``bench_peers.py`` runs each engine in turn for ~15-20 s; on a VM whose speed drifts by 10-30 %
within a minute, the ratio of two such runs moves by as much as the overhead being measured.  Here
one process trains one model (the bench_peers workload) in short blocks that alternate, ABBA, between
no checkpoint (A) and ``LazyCheckpointer`` checkpointing every iteration (B), so each pair of blocks
sees the same machine state within seconds.

A B block ends with ``wait(persist=True)``: everything it started, local commits and scheduled
promotions to the persistent tier, is committed inside the block, so no background work spills
into the next A block (this charges B more than a continuous run would, where that work overlaps
the next iterations).  The run ends with the end-of-run promotion of the newest checkpoint
(``wait(persist=True, promote_newest=True)``), charged to B as well.

Prints per quad (A B B A) the B/A ratio of iteration time, and over the run: median iteration
time of A and B and their ratio, the end-to-end ratio (all B time incl. block-end waits and the
final promotion / all A time), and (Linux) the CPU each kind of thread used per iteration in A and
in B blocks, mean over ranks: where a checkpoint's cost goes on a machine whose cores training
already fills.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import time
import warnings


import torch  # noqa: E402

import _bench_engines as be  # noqa: E402  (scripts/, this script's directory)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tier",
        choices=("local", "disk"),
        default="local",
        help="local: every checkpoint to --local-dir, those at multiples of --persist-interval promoted to "
        "--dir (bench_peers' ours_local); disk: every checkpoint to --dir (its ours)",
    )
    p.add_argument("--dir", default="./runs/bench-paired", help="persistent checkpoint root")
    p.add_argument("--local-dir", default="/dev/shm/dsm-bench-paired", help="node-local tier (--tier local)")
    p.add_argument("--persist-interval", type=int, default=10)
    p.add_argument("--block", type=int, default=4, help="iterations per block")
    p.add_argument("--quads", type=int, default=3, help="A B B A groups")
    p.add_argument("--warmup", type=int, default=3, help="iterations with checkpoints before the first block")
    be.add_workload_args(p)
    args = p.parse_args()
    if args.block < 1 or args.quads < 1 or args.warmup < 1:
        p.error("--block, --quads and --warmup must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    warnings.filterwarnings("ignore")
    if "RANK" not in os.environ:
        sys.exit("run me with torchrun, e.g.: torchrun --nproc_per_node 2 scripts/bench_paired.py")
    from datastates_megatron import LazyCheckpointer, LazyCkptConfig
    from datastates_megatron.demo import gpt

    gpt.init_distributed(seed=args.seed)
    rank = torch.distributed.get_rank()
    root, local = os.path.abspath(args.dir), os.path.abspath(args.local_dir)
    if rank == 0:
        for d in (root, local):
            shutil.rmtree(d, ignore_errors=True)
    torch.distributed.barrier()
    chunks, opt, sched = be.build_workload(args)
    tier = (
        {"local_dir": os.path.join(local, "{node}"), "persist_interval": args.persist_interval, "local_keep_last": 2}
        if args.tier == "local"
        else {}
    )
    ckpt = LazyCheckpointer(
        chunks,
        opt,
        LazyCkptConfig(save_dir=root, host_cache_gb=1.0, keep_last=2, when_behind="wait", **tier),
        opt_param_scheduler=sched,
    )
    it = 0

    def step(save: bool) -> tuple[float, float]:
        """(wall, training-thread CPU) seconds of one iteration."""
        nonlocal it
        it += 1
        data = be.workload_batch(args, it)
        t0, c0 = time.perf_counter(), time.thread_time()
        gpt.train_step(chunks, opt, data, scheduler=sched)
        if save:
            ckpt.save(it)
            ckpt.poll()
        return time.perf_counter() - t0, time.thread_time() - c0

    try:
        for _ in range(args.warmup):
            step(True)
        ckpt.wait(persist=True)
        blocks: list[
            tuple[str, list[tuple[float, float]], float]
        ] = []  # (kind, (wall, cpu) per iteration, block-end wait)
        threads_cpu = {"A": collections.Counter(), "B": collections.Counter()}  # seconds by thread kind
        for _ in range(args.quads):
            for kind in "ABBA":
                torch.distributed.barrier()
                before = be.thread_cpu_s()
                times = [step(kind == "B") for _ in range(args.block)]
                t0 = time.perf_counter()
                if kind == "B":
                    ckpt.wait(persist=True)
                blocks.append((kind, times, time.perf_counter() - t0))
                after = be.thread_cpu_s()
                threads_cpu[kind].update({k: after[k] - before.get(k, 0.0) for k in after})
        t0 = time.perf_counter()
        ckpt.wait(persist=True, promote_newest=True)
        final = time.perf_counter() - t0
    finally:
        ckpt.close()
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (blocks, final, threads_cpu))
    if rank == 0:
        # a step takes as long as its slowest rank: per-iteration maximum over ranks
        merged = [
            (
                kind,
                [max(g[0][b][1][i][0] for g in gathered) for i in range(len(times))],
                max(g[0][b][2] for g in gathered),
            )
            for b, (kind, times, _) in enumerate(gathered[0][0])
        ]
        # the training thread's CPU per iteration, mean over ranks: inflated in B when our threads
        # slow it through shared caches and memory bandwidth rather than by taking its core
        cpu = [
            (kind, statistics.mean(c for g in gathered for _, c in g[0][b][1]))
            for b, (kind, _, _) in enumerate(gathered[0][0])
        ]
        final = max(g[1] for g in gathered)
        print(
            f"paired blocks: tier {args.tier}, {args.quads} x (A B B A) blocks of {args.block} iterations, "
            f"A = no checkpoint, B = checkpoint every iteration (block-end waits charged to B)"
        )
        print(
            f"{'quad':>4}  {'A s/it':>7}  {'B s/it':>7}  {'B/A':>5}  {'B block-end wait s':>18}  "
            f"{'A train cpu s/it':>16}  {'B train cpu s/it':>16}"
        )
        for q in range(args.quads):
            quad = merged[4 * q : 4 * q + 4]
            a = [t for kind, ts, _ in quad if kind == "A" for t in ts]
            b = [t for kind, ts, _ in quad if kind == "B" for t in ts]
            waits = sum(w for kind, _, w in quad if kind == "B")
            ca = statistics.mean(c for kind, c in cpu[4 * q : 4 * q + 4] if kind == "A")
            cb = statistics.mean(c for kind, c in cpu[4 * q : 4 * q + 4] if kind == "B")
            print(
                f"{q:>4}  {statistics.mean(a):>7.5f}  {statistics.mean(b):>7.5f}  "
                f"{statistics.mean(b) / statistics.mean(a):>5.3f}  {waits:>18.3f}  {ca:>16.3f}  {cb:>16.3f}"
            )
        a_all = [t for kind, ts, _ in merged if kind == "A" for t in ts]
        b_all = [t for kind, ts, _ in merged if kind == "B" for t in ts]
        b_waits = sum(w for kind, _, w in merged if kind == "B")
        med = statistics.median(b_all) / statistics.median(a_all)
        e2e = (sum(b_all) + b_waits + final) / sum(a_all)
        print(
            f"median iteration: A {statistics.median(a_all):.5f} s, B {statistics.median(b_all):.5f} s, ratio {med:.3f}"
        )
        print(
            f"end to end: A {sum(a_all):.2f} s; B {sum(b_all):.2f} s + block-end waits {b_waits:.2f} s "
            f"+ end-of-run promotion {final:.2f} s = {sum(b_all) + b_waits + final:.2f} s; ratio {e2e:.3f}"
        )
        n_iter = 2 * args.quads * args.block  # iterations of each kind
        kinds = sorted(
            {k for g in gathered for c in g[2].values() for k in c},
            key=lambda k: -statistics.mean(g[2]["B"][k] for g in gathered),
        )
        if kinds:
            print("CPU by thread, ms per iteration (mean over ranks; B includes its block-end waits):")
            print(f"{'thread':<22}  {'A':>7}  {'B':>7}  {'B - A':>7}")
            for k in kinds:
                a, b = (1e3 * statistics.mean(g[2][x][k] for g in gathered) / n_iter for x in "AB")
                print(f"{k:<22}  {a:>7.1f}  {b:>7.1f}  {b - a:>+7.1f}")
            a, b = (1e3 * statistics.mean(sum(g[2][x].values()) for g in gathered) / n_iter for x in "AB")
            print(f"{'all':<22}  {a:>7.1f}  {b:>7.1f}  {b - a:>+7.1f}")
        for d in (root, local):
            shutil.rmtree(d, ignore_errors=True)
    gpt.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
