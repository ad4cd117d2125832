#!/usr/bin/env python
"""Restore time of one checkpoint through the same-layout path and through the resharding path.

    python -m tests.integration.bench_reshard [--layers 4] [--hidden 512] [--bf16] [--with-dp4] [--out DIR] [--json]

Trains the demo GPT (CPU gloo ranks, ``tests/workers/reshard_worker.py``) for one iteration at
DP=2 and checkpoints it, then loads that same checkpoint into fresh processes:

  * ``same layout``     DP=2, same buckets: ``CheckpointManager.load`` (whole rank file: verify every
                        chunk, copy every tensor);
  * ``resharded``       DP=2 with another bucket size: the names no longer match, so ``load()``
                        restores by parameter identity (``megatron/checkpointing/reshard.py``) — the same bytes per
                        rank as above, so this isolates the cost of the resharding path itself;
  * ``resharded 2->1``  DP=1: one rank reads both old rank files;
  * ``resharded 2->4``  DP=4 (``--with-dp4``; 4 processes).

Per configuration it reports, as the maximum over ranks: the restore call itself (s), the bytes it
copied, its verify and copy seconds, and the whole ``LazyCheckpointer.load()`` (which adds creating
the Adam state, the DP all-gather of the param buffers and the non-tensor state).  The page cache is
warm (every file is read once before each configuration): this compares code paths, not storage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from tests.distributed.ranks import describe, run_ranks  # noqa: E402

WORKER = "tests.workers.reshard_worker"


def _run(world: int, args: list[str], timeout: float) -> list[dict]:
    res = run_ranks(WORKER, world, args, timeout=timeout)
    if any(r["returncode"] != 0 or r["result"] is None for r in res):
        raise SystemExit(f"worker failed:\n{describe(res)}")
    out = [r["result"] for r in res]
    if any("error" in r for r in out):
        raise SystemExit(f"load failed: {out[0].get('error')}")
    return out


def _warm(ckpt: str) -> None:
    """Read every file of the checkpoint once, so each configuration starts from a warm page cache
    (the writer may have used O_DIRECT, leaving nothing cached for whichever load came first)."""
    for dirpath, _, files in os.walk(ckpt):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(16 << 20):
                    pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--with-dp4", action="store_true", help="also restore at DP=4 (4 processes)")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    work = a.out or tempfile.mkdtemp(prefix="bench-reshard-")
    os.makedirs(work, exist_ok=True)
    model = ["--layers", str(a.layers), "--hidden", str(a.hidden), *(["--bf16"] if a.bf16 else [])]
    ckpt = os.path.join(work, "ckpt")
    try:
        _run(2, ["run", *model, "--total", "1", "--save", ckpt, "--save-at", "1"], a.timeout_s)
        ckpt_bytes = sum(
            os.path.getsize(os.path.join(ckpt, "iter_0000001", f))
            for f in os.listdir(os.path.join(ckpt, "iter_0000001"))
            if f.endswith(".dsck")
        )
        configs = [
            ("same layout 2->2", 2, []),
            ("resharded 2->2 (other buckets)", 2, ["--bucket-size", "1000000"]),
            ("resharded 2->1", 1, []),
        ]
        if a.with_dp4:
            configs.append(("resharded 2->4", 4, []))
        rows = []
        for label, world, extra in configs:
            _warm(ckpt)
            res = _run(
                world,
                [
                    "run",
                    *model,
                    *extra,
                    "--total",
                    "1",
                    "--load",
                    ckpt,
                    "--load-at",
                    "1",
                    "--save",
                    os.path.join(work, f"scratch-{world}-{len(rows)}"),
                ],
                a.timeout_s,
            )
            paths = {k for r in res for k in r["restore"]}
            path = "reshard" if "reshard" in paths else "same_layout"
            stats = [r["restore"][path] for r in res]
            rows.append(
                {
                    "config": label,
                    "path": path,
                    "ranks": world,
                    "restore_s": max(s["s"] for s in stats),
                    "mb_per_rank": max(s["bytes"] for s in stats) / 1e6,
                    "verify_s": max(s["verify_s"] for s in stats),
                    "copy_s": max(s["copy_s"] for s in stats),
                    "load_s": max(r["load_all_s"] for r in res),
                }
            )
    finally:
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps({"checkpoint_bytes": ckpt_bytes, "model": vars(a), "rows": rows}, indent=1))
        return 0
    print(
        f"checkpoint: demo GPT {a.layers} layers, hidden {a.hidden}, {'bf16' if a.bf16 else 'fp32'}, DP=2, "
        f"{ckpt_bytes / 1e6:.1f} MB in 2 rank files (warm page cache)"
    )
    head = f"{'configuration':32} {'path':12} {'MB/rank':>8} {'restore s':>10} {'verify s':>9} {'copy s':>7} {'load() s':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['config']:32} {r['path']:12} {r['mb_per_rank']:8.1f} {r['restore_s']:10.3f} {r['verify_s']:9.3f} "
            f"{r['copy_s']:7.3f} {r['load_s']:9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
