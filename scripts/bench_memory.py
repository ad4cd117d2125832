#!/usr/bin/env python
"""Peak host memory per rank during save, one fresh process group per engine and model size.

    python scripts/bench_memory.py [--hiddens 512,1024] [--engines ...] [--json OUT.json]

For every model size (``--hiddens``) and engine, a fresh ``torchrun --nproc_per_node N`` of this
script (``--worker``) builds the bench_peers workload (megatron-core GPT + distributed optimizer,
:mod:`_bench_engines`), trains ``--warmup`` iterations without checkpointing (gradients, Adam state
and activations allocated), then starts the engine and trains ``--iters`` iterations with a
checkpoint each, and drains.  Per rank it reads the process's high-water RSS (``VmHWM``):

  peak          VmHWM at the end of the drain, since the process started;
  over_base     peak minus the peak of the no-checkpoint ``baseline`` process of the same size --
                what the engine costs on top of training, the figure the bound is about;
  growth        VmHWM growth from the end of the warm-up (reset through /proc/self/clear_refs)
                to the end of the drain, minus the baseline process's growth over the same span.

Fresh processes matter: in one process the allocator keeps what an earlier engine freed and a
later engine's peak understates (bench_peers.py runs every engine in one process).  Engines run in
this process only are counted: ``dcp_async`` runs with its thread checkpointer here (the process
one's writer process would not be counted), megatron-core's async save forks a writer whose pages
are not counted either.  Ours reports its host cache's size and high-water use (``cache``).

Our bound: peak growth <= host cache + a constant, whatever the model size (the constant each run
needs is ``over_base`` minus the cache size; docs/BENCHMARKS.md states it for two sizes).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

MB = 1 << 20
ENGINES = ("baseline", "ours", "torch_save", "dcp_async", "mcore_async")
log = logging.getLogger("bench_memory")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _reset_hwm() -> int:
    """Reset VmHWM to the RSS now (Linux >= 4.0) and return it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import _bench_engines as be

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    be.add_workload_args(p)
    p.add_argument("--hiddens", type=lambda s: [int(x) for x in _csv(s)], default=[512, 1024])
    p.add_argument("--engines", type=_csv, default=list(ENGINES), help="from " + ",".join(ENGINES))
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--warmup", type=int, default=2, help="iterations without checkpoint before the measure")
    p.add_argument("--iters", type=int, default=3, help="iterations with a checkpoint each")
    p.add_argument("--host-cache-gb", type=float, default=0.064, help="ours: host cache per rank")
    p.add_argument("--flush-threads", type=int, default=2)
    p.add_argument("--dir", default="./runs/bench-memory", help="checkpoint root (one sub-directory per run)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument(
        "--trace-heap",
        action="store_true",
        help="also trace the Python heap (tracemalloc: Python objects and numpy buffers, not torch "
        "tensors) from the warm-up's end to the drain's; its own cost inflates the RSS figures of that run",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {ENGINES}")
    return args


# --------------------------------------------------------------------------- #
# worker: one engine, one size, in a fresh process per rank
# --------------------------------------------------------------------------- #
def worker(args: argparse.Namespace) -> None:
    import torch

    import _bench_engines as be
    from datastates_megatron.demo import gpt

    warnings.filterwarnings("ignore")
    gpt.init_distributed(seed=args.seed, timeout_s=args.timeout)
    rank = torch.distributed.get_rank()
    io_group = torch.distributed.new_group(backend="gloo")
    root = Path(args.dir).resolve()
    chunks, optimizer, scheduler = be.build_workload(args)
    for it in range(1, args.warmup + 1):
        gpt.train_step(chunks, optimizer, be.workload_batch(args, it), scheduler=scheduler)
    torch.distributed.barrier()
    warm_peak = _status_bytes("VmHWM")
    base = _reset_hwm()
    if args.trace_heap:  # a run of its own: tracing costs time and memory of its own
        import tracemalloc

        tracemalloc.start()
    opts = be.BenchOptions(
        host_cache_gb=args.host_cache_gb, flush_threads=args.flush_threads, keep_last=2, dcp_checkpointer="thread"
    )
    engine = be.ENGINES[args.engine](be.Workload(chunks, optimizer, scheduler, root, io_group), opts)
    try:
        for it in range(args.warmup + 1, args.warmup + args.iters + 1):
            gpt.train_step(chunks, optimizer, be.workload_batch(args, it), scheduler=scheduler)
            engine.save(it)
            engine.tick()
        engine.drain()
        peak = _status_bytes("VmHWM")
        extras = engine.extras()
        if args.trace_heap:
            extras["heap_peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        engine.close()
    # the commit metadata rank 0 writes per checkpoint (ours): global index and manifest, the largest
    for name, key in (("global_index.dsgi", "index_bytes"), ("manifest.json", "manifest_bytes")):
        extras[key] = max((f.stat().st_size for f in root.rglob(name)), default=0)
    state = sum(t.numel() * t.element_size() for t in be.rank_state(chunks, optimizer).values())
    mine = {
        "rank": rank,
        "peak": max(peak, warm_peak),
        "base": base,
        "growth": peak - base,
        "state_bytes": state,
        **extras,
    }
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- #
# driver
# --------------------------------------------------------------------------- #
def _run_one(args: argparse.Namespace, argv: list[str], hidden: int, engine: str, scratch: Path) -> list[dict]:
    result = scratch / f"h{hidden}-{engine}.json"
    run_dir = Path(args.dir).resolve() / f"h{hidden}-{engine}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(Path(__file__).resolve()),
        *argv,
        "--worker",
        "--engine",
        engine,
        "--hidden",
        str(hidden),
        "--dir",
        str(run_dir),
        "--result",
        str(result),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"hidden {hidden}, engine {engine}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def summarise(runs: dict[int, dict[str, list[dict]]]) -> dict:
    """Max over ranks per (size, engine), with the baseline process's figures subtracted."""
    out: dict = {}
    for hidden, engines in runs.items():
        base = engines.get("baseline")
        rows = {}
        for name, ranks in engines.items():
            row = {
                "state_bytes": max(r["state_bytes"] for r in ranks),
                "peak_bytes": max(r["peak"] for r in ranks),
                "growth_bytes": max(r["growth"] for r in ranks),
                "cache_bytes": max((r.get("cache_bytes", 0) for r in ranks), default=0),
                "cache_peak_bytes": max((r.get("cache_peak_bytes", 0) for r in ranks), default=0),
                "heap_peak_bytes": max((r.get("heap_peak", 0) for r in ranks), default=0),
                "index_bytes": max((r.get("index_bytes", 0) for r in ranks), default=0),
                "manifest_bytes": max((r.get("manifest_bytes", 0) for r in ranks), default=0),
            }
            if base is not None:
                by_rank = {r["rank"]: r for r in base}
                row["over_base_bytes"] = max(r["peak"] - by_rank[r["rank"]]["peak"] for r in ranks)
                row["growth_over_base_bytes"] = max(r["growth"] - by_rank[r["rank"]]["growth"] for r in ranks)
            rows[name] = row
        out[hidden] = rows
    return out


def render(summary: dict) -> str:
    lines = [
        "| hidden | engine | state/rank MiB | peak MiB | peak over baseline MiB | growth over baseline MiB "
        "| cache MiB (peak use) | Python heap peak MiB | index + manifest KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for hidden, rows in summary.items():
        for name, r in rows.items():
            cache = f"{r['cache_bytes'] / MB:.1f} ({r['cache_peak_bytes'] / MB:.1f})" if r["cache_bytes"] else "-"
            heap = f"{r['heap_peak_bytes'] / MB:.1f}" if r["heap_peak_bytes"] else "-"
            meta = f"{r['index_bytes'] / 1024:.1f} + {r['manifest_bytes'] / 1024:.1f}" if r["manifest_bytes"] else "-"
            lines.append(
                f"| {hidden} | {name} | {r['state_bytes'] / MB:.1f} | {r['peak_bytes'] / MB:.1f} | "
                f"{r.get('over_base_bytes', float('nan')) / MB:.1f} | "
                f"{r.get('growth_over_base_bytes', float('nan')) / MB:.1f} | {cache} | {heap} | {meta} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the driver's own flags are not the worker's: drop them with their values
    drop = {"--hiddens", "--engines", "--json", "--dir", "--nproc", "--timeout"}
    worker_argv: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop:
            skip = "=" not in a
            continue
        worker_argv.append(a)
    engines = ["baseline"] + [e for e in args.engines if e != "baseline"]
    runs: dict[int, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as scratch:
        for hidden in args.hiddens:
            runs[hidden] = {}
            for engine in engines:
                log.info("hidden %d, %s ...", hidden, engine)
                runs[hidden][engine] = _run_one(args, worker_argv, hidden, engine, Path(scratch))
    summary = summarise(runs)
    table = render(summary)
    sys.stdout.write(table + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": vars(args), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
