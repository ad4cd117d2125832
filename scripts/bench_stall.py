#!/usr/bin/env python
"""Training's pace while the checkpoint storage stalls: the demo trainer on 2 CPU ranks, a
checkpoint every iteration, every write stalled for ``--stall-s`` seconds from ``--stall-from``.

    python scripts/bench_stall.py [--stall-s 25] [--stall-from 30] [--rank 1] [--when-behind skip]

The stall is the engine's in-process stall point (``DSM_STALL_AT=write:<iteration>:<seconds>``,
:mod:`datastates_megatron.engine.runtime.faults`): from the first write of a checkpoint of iteration
``--stall-from`` on, every rank-file write waits until the stall ends, as a storage target that
stops answering and then recovers (``--rank``: only that rank's writes).  Prints the median
iteration time before the stall and of the iterations overlapping it (per rank, and their ratio;
how many ended within it, the longest; the target of
``--lazy-ckpt-when-behind skip`` is <= 1.2x), the checkpoints skipped, and whether the first
checkpoint after the stall committed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from datastates_megatron.demo.run_demo import fresh_workdir


def _run(workdir: str, a) -> list[dict]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        DSM_STALL_AT=f"write:{a.stall_from}:{a.stall_s}",
    )
    if a.rank is not None:
        env["DSM_STALL_RANK"] = str(a.rank)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "datastates_megatron.demo.train",
        *a.model.split(),
        "--train-iters",
        str(a.iters),
        "--save-interval",
        "1",
        "--lazy-ckpt",
        "--save",
        os.path.join(workdir, "ckpt"),
        "--lazy-ckpt-keep-last",
        "2",
        "--lazy-ckpt-when-behind",
        a.when_behind,
        "--log-json",
        os.path.join(workdir, "records"),
    ]
    log_path = os.path.join(workdir, "train.log")
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=a.timeout)
    if done.returncode != 0:
        raise SystemExit(f"the run failed (exit {done.returncode}); log: {log_path}")
    return [json.load(open(os.path.join(workdir, f"records.rank{r}.json"))) for r in range(2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stall-s", type=float, default=25.0)
    p.add_argument("--stall-from", type=int, default=30, help="the first iteration whose writes stall")
    p.add_argument("--rank", type=int, default=None, help="stall only this rank's writes (default: both)")
    p.add_argument("--when-behind", choices=("skip", "wait"), default="skip")
    p.add_argument("--iters", type=int, default=0, help="default: enough to outlast the stall, from a pace guess")
    p.add_argument("--model", default="--num-layers 2 --hidden-size 128 --seq-length 64 --vocab-size 512")
    p.add_argument("--workdir", default="runs/bench_stall")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    if not a.iters:
        a.iters = a.stall_from + int(a.stall_s / 0.05) + 60  # an iteration of the default model: ~50-100 ms
    fresh_workdir(a.workdir)  # a directory it did not make is refused, nothing removed
    t0 = time.time()
    ranks = _run(a.workdir, a)
    print(
        f"demo trainer, 2 CPU ranks, a checkpoint every iteration, {a.iters} iterations, writes of "
        f"{'rank ' + str(a.rank) if a.rank is not None else 'both ranks'} stalled {a.stall_s:.0f} s from "
        f"iteration {a.stall_from} (in-process stall point), --lazy-ckpt-when-behind {a.when_behind}; "
        f"run took {time.time() - t0:.0f} s"
    )
    ratios = []
    for rec in ranks:
        its = {x["iteration"]: x for x in rec["iterations"]}
        start = its[a.stall_from]["end"]  # the stall begins with the first write of this checkpoint
        before = [x["iter_s"] for i, x in its.items() if 3 <= i < a.stall_from]
        # every iteration that overlaps the stall, the one blocked through it included
        during = [x["iter_s"] for x in its.values() if x["end"] > start and x["end"] - x["iter_s"] < start + a.stall_s]
        done_in = sum(1 for x in its.values() if start < x["end"] <= start + a.stall_s)
        if not before or not during:
            raise SystemExit(f"rank {rec['rank']}: no iterations before or during the stall: raise --iters")
        b, d = statistics.median(before), statistics.median(during)
        ratios.append(d / b)
        stats = rec.get("stats", {})
        after = [
            c["iteration"] for c in rec["commits"] if its.get(c["iteration"], {}).get("end", 0) > start + a.stall_s
        ]
        print(
            f"rank {rec['rank']}: median iteration {1e3 * b:.1f} ms before the stall ({len(before)} iterations), "
            f"{1e3 * d:.1f} ms during it ({len(during)} iterations overlap it, {done_in} ended in it, longest "
            f"{max(during):.1f} s): ratio {d / b:.2f}x; "
            f"saves skipped here {stats.get('skipped', 0)}, checkpoints abandoned {stats.get('abandoned_skips', 0)}; "
            f"first commit after the stall: iteration {after[0] if after else None}; "
            f"last iteration {rec['last_iteration']}"
        )
    print(f"worst ratio during/before: {max(ratios):.2f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
