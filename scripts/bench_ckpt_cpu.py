#!/usr/bin/env python
"""CPU that checkpointing takes from training, per thread, side by side in one run.

    torchrun --nproc_per_node 2 scripts/bench_ckpt_cpu.py [--dirs /dev/shm/x,./runs/x] [--modes ours,ours-buffered]

On a machine whose cores the training already keeps busy (CPU-only training here), every CPU
millisecond of the background copier, flush and commit threads is a millisecond of training lost,
so this is the cost that decides the end-to-end overhead of an asynchronous checkpoint.  For each
directory (default: a tmpfs and the repository's disk) it trains the bench_peers workload (demo
GPT + DistributedOptimizer, 2 gloo ranks) without checkpoints, then with ``LazyCheckpointer``
checkpointing every iteration in each ``--modes`` variant (default: with and without rank-file
recycling -- ``ours`` is the default config, which recycles only on a node-local tier;
``ours-buffered``: no O_DIRECT; ``ours-copy``: no writes straight from the shards, every byte
through the host cache), and prints per rank: median iteration time (and its ratio
to the baseline), CPU milliseconds per iteration of the training thread and of each of our threads
(``/proc/self/task/<tid>/schedstat``, Linux only), and the machine's idle and hypervisor-steal cores
over the measured iterations (``psutil.cpu_times``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings


import torch  # noqa: E402

import _bench_engines as be  # noqa: E402  (scripts/, this script's directory)


def machine_ticks() -> tuple[float, float, float]:
    """(idle, steal, wall) seconds so far, machine-wide (``psutil.cpu_times``, as bench_peers reads
    them; steal: time the hypervisor ran something else on this VM's cores)."""
    import psutil

    t = psutil.cpu_times()
    return t.idle + getattr(t, "iowait", 0.0), getattr(t, "steal", 0.0), time.monotonic()


MODES = {  # mode -> LazyCkptConfig overrides
    "ours": {},  # defaults: no recycling on a tier without a local one; source writes on tmpfs
    "ours-recycle": {"recycle_files": "all"},
    "ours-buffered": {"direct_io": False},
    "ours-copy": {"source_writes": False},  # every shard through the host cache, even on tmpfs
    "ours-recycle-copy": {"recycle_files": "all", "source_writes": False},
    # tmpfs rank files written with pwrite after a hash pass, not through kept mappings
    "ours-recycle-pwrite": {"recycle_files": "all", "mapped_writes": False},
}


def run(mode: str, directory: str | None, args) -> dict:
    from datastates_megatron import LazyCheckpointer, LazyCkptConfig
    from datastates_megatron.demo import gpt

    rank = torch.distributed.get_rank()
    if directory and rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    torch.distributed.barrier()
    chunks, opt, _ = be.build_workload(args)
    ckpt = None
    if mode != "baseline":
        # every checkpoint taken (a skipped one would cost no CPU and flatter the figures)
        config = LazyCkptConfig(save_dir=directory, host_cache_gb=1.0, keep_last=2, when_behind="wait", **MODES[mode])
        ckpt = LazyCheckpointer(chunks, opt, config)
    times: list[float] = []
    for it in range(1, args.warmup + args.iters + 1):
        data = be.workload_batch(args, it)
        if it == args.warmup + 1:
            if ckpt:
                ckpt.wait()
            torch.distributed.barrier()
            cpu0, m0 = be.thread_cpu_s(), machine_ticks()
            times.clear()
        t0 = time.perf_counter()
        gpt.train_step(chunks, opt, data)
        if ckpt:
            ckpt.save(it)
            ckpt.poll()
        times.append(time.perf_counter() - t0)
    if ckpt:
        ckpt.wait()
    cpu1, m1 = be.thread_cpu_s(), machine_ticks()
    if ckpt:
        ckpt.close()
    if directory and rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    cpu = {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / args.iters for k in cpu1}
    wall = m1[2] - m0[2]
    return {
        "iter_s": statistics.median(times),
        "cpu": cpu,
        "idle": (m1[0] - m0[0]) / wall,
        "steal": (m1[1] - m0[1]) / wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dirs",
        default="/dev/shm/dsm-bench-cpu,./runs/bench-cpu",
        help="comma-separated checkpoint directories to compare (default: %(default)s)",
    )
    p.add_argument(
        "--modes", default="ours-recycle,ours", help=f"comma-separated, from {', '.join(MODES)} (default: %(default)s)"
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    be.add_workload_args(p)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if "RANK" not in os.environ:
        sys.exit("run me with torchrun, e.g.: torchrun --nproc_per_node 2 scripts/bench_ckpt_cpu.py")
    from datastates_megatron.demo import gpt

    unknown = [m for m in args.modes.split(",") if m and m not in MODES]
    if unknown:
        sys.exit(f"unknown --modes {unknown}; choose from {list(MODES)}")
    gpt.init_distributed(seed=args.seed)
    rank = torch.distributed.get_rank()
    rows = [("baseline", None, run("baseline", None, args))]
    for d in [x for x in args.dirs.split(",") if x]:
        d = os.path.abspath(d)
        for mode in [m for m in args.modes.split(",") if m]:
            rows.append((mode, d, run(mode, d, args)))
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if rank == 0:
        base = {r: g[0][2]["iter_s"] for r, g in enumerate(gathered)}
        threads = ["MainThread", "dsm-copier", "dsm-flush", "dsm-commit"]
        hdr = (
            f"{'rank':>4}  {'engine':<16} {'directory':<28} {'iter med s':>10} {'x base':>6}  "
            + "  ".join(f"{t + ' ms':>14}" for t in threads)
            + f"  {'ours total ms':>13}  {'idle':>5}  {'steal':>5}"
        )
        print(f"CPU per iteration, checkpoint every iteration ({args.iters} iterations after {args.warmup} warm-up)")
        print(hdr)
        print("-" * len(hdr))
        for r, g in enumerate(gathered):
            for mode, d, res in g:
                cpu = res["cpu"]
                ours = sum(v for k, v in cpu.items() if k.startswith("dsm-"))
                print(
                    f"{r:>4}  {mode:<16} {(d or '-')[-28:]:<28} {res['iter_s']:>10.3f} {res['iter_s'] / base[r]:>6.2f}  "
                    + "  ".join(f"{cpu.get(t, 0.0) * 1e3:>14.1f}" for t in threads)
                    + f"  {ours * 1e3:>13.1f}  {res['idle']:>5.2f}  {res['steal']:>5.2f}"
                )
    gpt.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
