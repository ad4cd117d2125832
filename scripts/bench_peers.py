#!/usr/bin/env python
"""Checkpointing peers on one Megatron workload, in one run: overhead, drain, bytes, restore.

    torchrun --nproc_per_node 2 scripts/bench_peers.py [--json OUT.json] [--plot OUT.png]

One workload -- megatron-core ``GPTModel`` + DDP(``use_distributed_optimizer=True``) +
``get_megatron_optimizer`` through the CPU/GPU demo harness (:mod:`datastates_megatron.demo.gpt`;
gloo on CPU, NCCL on GPU) -- trained with each engine in turn, in the same processes (model and
optimizer rebuilt from the same seed for every engine), checkpointing every ``--interval``
iterations (default every iteration):

  baseline     no checkpoint
  control      no checkpoint either, measured as an engine (not run unless asked for): an A/A
               control -- its ratios to the baseline are this machine's noise, in the same run
  torch_save   torch.save of the rank's state (param-buffer shard, main params, Adam state) + fsync
  dcp_async    torch.distributed.checkpoint.async_save + DefaultStager; staging awaited in an
               optimizer step pre-hook (TorchTitan)
  ours         datastates_megatron.LazyCheckpointer
  ours_local   the same with a node-local tier (--local-dir, a tmpfs by default): every checkpoint
               committed there, those at multiples of --persist-interval promoted to --dir in the background
  mcore_sync   megatron-core dist_checkpointing.save, torch_dist + FullyParallelSaveStrategyWrapper
  mcore_async  the same with async_sharded_save + AsyncCallsQueue, finalized every iteration
               (Megatron-LM's maybe_finalize_async_save)

(details in ``scripts/_bench_engines.py``).  Per engine: iteration time (median, p90), training
stall per checkpoint (time in the save call + time ``optimizer.step()`` waits in pre-hooks + the
per-iteration finalize call), drain time after the last iteration, end-to-end time including the
drain -- all also as ratios to the baseline of the same run -- bytes of one checkpoint directory,
and the time to restore the last checkpoint into the live model (page cache of its files evicted
first; the restored state is compared bit for bit with the state that was saved).  Then a sweep
of ``--intervals`` for ``--sweep-engines`` (overhead vs checkpoint interval).  The machine's
limits are measured first, in the same run: memcpy, sequential write+fsync and (cold) read GB/s
(GB = 1e9 bytes), every rank at once; from them the report's ``floor`` line: the least e2e ratio
the machine allows an engine that copies every checkpoint and leaves the last one durable.

Each engine phase runs under a watchdog: past ``--engine-timeout`` seconds the process reports the
phase as ``timeout`` (the JSON and table are written with what was measured so far), dumps every
thread's stack to stderr and exits with status 3 -- a hung collective cannot be cancelled.  The
megatron-core engines run last for that reason.

Checkpoints go under ``--dir`` (default ``./runs/bench``, on the real disk, not a tmpfs), one
sub-directory per engine, removed after each engine.  Progress bar on rank 0 (stderr); the table
on rank 0's stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

_HERE = Path(__file__).resolve().parent

import torch  # noqa: E402

import _bench_engines as be  # noqa: E402

log = logging.getLogger("bench_peers")

ALL_ENGINES = (
    "baseline",
    "torch_save",
    "dcp_async",
    "ours",
    "ours_local",
    "ours_replicated",
    "mcore_sync",
    "mcore_async",
    "control",
)
DEFAULT_ENGINES = [e for e in ALL_ENGINES if e != "control"]
RISKY = ("mcore_sync", "mcore_async")  # hung once on a small model: run them last
# run order of a round: the engine nearest the target sits next to the baseline (its ratio is the
# one a drift of this machine's speed between the two would bend most); megatron-core last; the
# A/A control one further from the baseline than ours_local (so its spread is at least that of
# ours_local's ratio)
RUN_ORDER = ("baseline", "ours_local", "control", "ours", "ours_replicated", "torch_save", "dcp_async", *RISKY)
if sorted(RUN_ORDER) != sorted(ALL_ENGINES):  # an engine missing here would silently never run
    raise RuntimeError(f"RUN_ORDER {RUN_ORDER} does not list the engines of ALL_ENGINES {ALL_ENGINES}")
ENGINE_KEYS = (
    "status",
    "error",
    "interval",
    "iterations",
    "checkpoints",
    "iter_times_s",
    "save_call_s",
    "gate_wait_s",
    "tick_s",
    "iter_median_s",
    "iter_p90_s",
    "stall_per_ckpt_s",
    "first_save_s",
    "drain_s",
    "e2e_s",
    "ratio_median",
    "ratio_p90",
    "ratio_stall",
    "ratio_e2e",
    "bytes_per_ckpt",
    "restore_s",
    "restore_runs_s",
    "restore_ok",
    "restore_iteration",
    "restore_mismatches",
    "replication_gbps",
    "replication_bytes_per_rank",
    "node_loss",
    "node_loss_ok",
    "foreign_cores",
    "steal_cores",
    "ratio_e2e_rounds",
    "rounds",
    "rss_base_bytes",
    "rss_peak_bytes",
    "rss_over_base_bytes",
    "cache_bytes",
    "cache_peak_bytes",
)
GB = 1e9
MB = 1 << 20


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    be.add_workload_args(p)
    g = p.add_argument_group("schedule")
    g.add_argument(
        "--engines",
        type=_csv,
        default=DEFAULT_ENGINES,
        help="comma-separated, from: " + ",".join(ALL_ENGINES) + " (baseline is always run)",
    )
    g.add_argument("--iters", type=int, default=8, help="measured iterations per engine and round")
    g.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of the main comparison, in alternating order (ABBA: drift of the "
        "machine's speed cancels); ratios are taken against the baseline of the same "
        "round, then averaged",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured iterations per engine (they checkpoint too; drained before measuring)",
    )
    g.add_argument("--interval", type=int, default=1, help="checkpoint interval of the main comparison")
    g.add_argument(
        "--intervals",
        type=lambda s: [int(x) for x in _csv(s)],
        default=[1, 2, 5],
        help="checkpoint intervals of the sweep",
    )
    g.add_argument(
        "--sweep-engines", type=_csv, default=["dcp_async", "ours"], help="engines of the interval sweep ('' for none)"
    )
    g.add_argument("--no-restore", action="store_true", help="skip the restore measurements")
    g.add_argument(
        "--restore-repeats",
        type=int,
        default=3,
        help="restores of the last checkpoint per engine (page cache evicted each time); the median is reported",
    )
    g.add_argument(
        "--engine-timeout",
        type=float,
        default=240.0,
        help="seconds one engine phase may take before it is reported as timeout",
    )
    g = p.add_argument_group("engines")
    g.add_argument("--host-cache-gb", type=float, default=1.0, help="ours: host cache per rank")
    g.add_argument("--flush-threads", type=int, default=2, help="ours: flush threads per rank")
    g.add_argument("--keep-last", type=int, default=2, help="ours: retention")
    g.add_argument(
        "--local-dir",
        default="/dev/shm/dsm-bench-local",
        help="ours_local: node-local tier (the engine adds {node}/ per host)",
    )
    g.add_argument(
        "--persist-interval",
        type=int,
        default=10,
        help="ours_local: promote the local checkpoints at multiples of N iterations to --dir",
    )
    g.add_argument(
        "--dcp-checkpointer",
        choices=("process", "thread"),
        default="process",
        help="DCP async_checkpointer_type (TorchTitan's async_with_pinned_mem: process)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--dir", default="./runs/bench", help="checkpoint root (on the disk under test)")
    g.add_argument(
        "--probe-mb", type=int, default=256, help="bytes per rank of the machine-limit probes (0 skips them)"
    )
    g.add_argument("--json", dest="json_out", default=None, help="write the results here")
    g.add_argument("--plot", default=None, help="write a PNG plot here")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    unknown = sorted(set(args.engines + args.sweep_engines) - set(ALL_ENGINES))
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {ALL_ENGINES}")
    if args.restore_repeats < 1 or args.rounds < 1:
        p.error("--restore-repeats and --rounds must be >= 1")
    if args.iters < 2 or args.warmup < 0 or args.interval < 1 or min(args.intervals or [1]) < 1:
        p.error("need --iters >= 2, --warmup >= 0 and intervals >= 1")
    if "baseline" not in args.engines:
        args.engines = ["baseline"] + args.engines
    return args


# --------------------------------------------------------------------------- #
# watchdog
# --------------------------------------------------------------------------- #
class Watchdog:
    """Aborts the process when a guarded phase overruns its deadline.

    One named thread, owned here and joined by :meth:`close`.  On expiry it logs which phase hung,
    calls ``on_timeout(label)`` (rank 0 writes the partial results there), dumps every thread's
    stack to stderr and ``os._exit(3)``: a rank stuck in a collective cannot be unstuck.
    :meth:`guard` is meant for the training thread; the rest is internal.
    """

    def __init__(self, rank: int, on_timeout: Callable[[str], None], grace_s: float = 0.0) -> None:
        self._rank = rank
        self._on_timeout = on_timeout
        self._grace_s = grace_s
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._label = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"bench-watchdog-r{rank}", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, label: str, timeout_s: float):
        with self._cond:
            self._label = label
            self._deadline = time.monotonic() + timeout_s + self._grace_s
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None
                self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(timeout=left)
                    continue
                label = self._label
                break
            else:
                return
        log.error(
            "rank %d: %r exceeded its time limit; reporting it as 'timeout' and aborting "
            "the run (a hung collective cannot be cancelled)",
            self._rank,
            label,
        )
        try:
            self._on_timeout(label)
        except Exception:  # the abort must happen regardless
            log.exception("rank %d: writing partial results failed", self._rank)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _barrier() -> None:
    torch.distributed.barrier()


def _gather(obj: Any) -> list:
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _max_across(values: list[list[float]]) -> list[float]:
    return [max(col) for col in zip(*values)] if values and values[0] else []


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


class ForeignLoad:
    """CPU used by processes outside this benchmark, and CPU the hypervisor took, in cores, over a
    window (needs psutil).

    *foreign*: busy time of the whole machine (steal excluded) minus the CPU time of the
    benchmark's rank processes and their children (writer threads and processes included);
    anything well above 0 means the timings were taken on a shared, contended machine.
    *steal*: time the vCPUs were runnable but the host ran something else.  On a virtual machine
    whose disk is emulated on the same physical cores, every byte written costs steal: training
    loses CPU to the writes of any engine that persists, however asynchronous it is.
    Rank 0 only; not thread-safe.
    """

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self._psutil = psutil
        self._procs = [psutil.Process(p) for p in pids]

    def _own(self) -> float:
        total = 0.0
        for proc in self._procs:
            try:
                ct = proc.cpu_times()
                total += ct.user + ct.system + ct.children_user + ct.children_system
                for child in proc.children(recursive=True):
                    ct = child.cpu_times()
                    total += ct.user + ct.system
            except self._psutil.Error:
                pass
        return total

    def _busy_steal(self) -> tuple[float, float]:
        t = self._psutil.cpu_times()
        steal = getattr(t, "steal", 0.0)
        busy = (
            sum(t)
            - t.idle
            - getattr(t, "iowait", 0.0)
            - getattr(t, "guest", 0.0)
            - getattr(t, "guest_nice", 0.0)
            - steal
        )
        return busy, steal

    def start(self) -> tuple[float, float, float, float]:
        busy, steal = self._busy_steal()
        return time.monotonic(), busy, steal, self._own()

    def stop(self, mark: tuple[float, float, float, float]) -> tuple[float, float]:
        """``(foreign cores, steal cores)`` since ``mark``."""
        wall = time.monotonic() - mark[0]
        busy, steal = self._busy_steal()
        if wall <= 0:
            return 0.0, 0.0
        foreign = (busy - mark[1]) - (self._own() - mark[3])
        return max(0.0, foreign / wall), max(0.0, (steal - mark[2]) / wall)


# --------------------------------------------------------------------------- #
# machine limits
# --------------------------------------------------------------------------- #
def probe_machine(directory: Path, nbytes: int) -> dict:
    """memcpy, sequential write+fsync and cold read GB/s; every rank at once (collective)."""
    rank = torch.distributed.get_rank()
    directory.mkdir(parents=True, exist_ok=True)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    res = {"memcpy_GBps": nbytes / best / GB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = src.to("cuda")
        pinned = torch.empty_like(src).pin_memory()
        pinned.copy_(dev)

        def d2h() -> None:
            pinned.copy_(dev)
            torch.cuda.synchronize()

        res["d2h_pinned_GBps"] = nbytes / min(_timed(d2h) for _ in range(3)) / GB
        del dev, pinned
    path = directory / f"probe-rank{rank}.bin"
    view = memoryview(src.numpy()).cast("B")
    chunk = 16 * MB
    _barrier()
    steal0 = _steal_s()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, nbytes, chunk):
            os.write(fd, view[off : off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t0
    _barrier()
    steal_s = _steal_s() - steal0  # machine-wide: read on rank 0 only
    be.evict_page_cache(directory)
    _barrier()
    out = memoryview(dst.numpy()).cast("B")
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        off = 0
        while off < nbytes:
            n = fh.readinto(out[off : off + chunk])
            if not n:
                break
            off += n
    read_s = time.perf_counter() - t0
    _barrier()
    path.unlink(missing_ok=True)
    res.update(write_fsync_s=write_s, read_s=read_s, bytes=nbytes)
    per_rank = _gather(res)
    total = nbytes * len(per_rank)
    summary = {
        "bytes_per_rank": nbytes,
        "memcpy_GBps_per_rank": statistics.mean(r["memcpy_GBps"] for r in per_rank),
        "write_fsync_GBps": total / max(r["write_fsync_s"] for r in per_rank) / GB,
        "read_cold_GBps": total / max(r["read_s"] for r in per_rank) / GB,
        "per_rank": per_rank,
    }
    if rank == 0 and steal_s == steal_s:
        summary["write_steal_core_s_per_GB"] = steal_s / (total / GB)
    if "d2h_pinned_GBps" in res:
        summary["d2h_pinned_GBps_per_rank"] = statistics.mean(r["d2h_pinned_GBps"] for r in per_rank)
    return summary


def _steal_s() -> float:
    """Machine-wide CPU seconds stolen by the hypervisor so far (NaN without psutil)."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- #
# one engine run
# --------------------------------------------------------------------------- #
def _proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """Reset this process's high-water RSS (``VmHWM``) to its RSS now (``5`` to
    /proc/self/clear_refs, Linux >= 4.0) and return that RSS: the base an engine's peak is measured
    from.  None where it cannot be reset (the peak would include earlier engines)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_bytes("VmRSS")


def _blank(name: str, interval: int) -> dict:
    res = {k: None for k in ENGINE_KEYS}
    res.update(status="pending", interval=interval, engine=name)
    return res


def run_engine(
    name: str,
    interval: int,
    args: argparse.Namespace,
    io_group: Any,
    root: Path,
    restore: bool,
    progress: Callable[[int], None],
    meter: ForeignLoad | None = None,
) -> dict:
    """Train ``--warmup`` + ``--iters`` iterations with engine ``name``; collective.  Returns the
    rank-0 view (per-iteration values are the maximum over ranks)."""
    from datastates_megatron.demo import gpt

    rank = torch.distributed.get_rank()
    if rank == 0:
        _rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    chunks, optimizer, scheduler = be.build_workload(args)
    # host memory: the high-water RSS from here (model and optimizer built) to the end of the drain
    # -- the engine's buffers, caches and staging copies, in this process (DCP's writer process
    # with --dcp-checkpointer process is not counted)
    rss_base = _reset_peak_rss()
    gate = be.GateTimer(optimizer)
    opts = be.BenchOptions(
        host_cache_gb=args.host_cache_gb,
        flush_threads=args.flush_threads,
        keep_last=args.keep_last,
        dcp_checkpointer=args.dcp_checkpointer,
        local_dir=args.local_dir,
        persist_interval=args.persist_interval,
    )
    engine = be.ENGINES[name](be.Workload(chunks, optimizer, scheduler, root, io_group), opts)
    local: dict[str, Any] = {"iter": [], "save": [], "gate": [], "tick": [], "ckpt": []}

    def one(it: int, do_save: bool, record: bool) -> None:
        data = be.workload_batch(args, it)
        gate.order()
        t0 = time.perf_counter()
        gpt.train_step(chunks, optimizer, data, scheduler=scheduler)  # noqa: F821 (bound above; `del`eted at the end to free memory)
        t1 = time.perf_counter()
        if do_save:
            engine.save(it)  # noqa: F821 (bound above; `del`eted at the end to free memory)
        t2 = time.perf_counter()
        engine.tick()  # noqa: F821 (bound above; `del`eted at the end to free memory)
        _sync_device()
        t3 = time.perf_counter()
        gate_s = gate.take()
        if do_save and engine.persists and "first_save" not in local:  # noqa: F821 (bound above; `del`eted at the end to free memory)
            local["first_save"] = t2 - t1
        if record:
            local["iter"].append(t3 - t0)
            local["save"].append(t2 - t1)
            local["gate"].append(gate_s)
            local["tick"].append(t3 - t2)
            local["ckpt"].append(do_save)
        progress(1)

    try:
        it = 0
        for _ in range(args.warmup):
            it += 1
            one(it, it % interval == 0 or it == args.warmup, record=False)
        engine.drain()
        _barrier()
        gate.take()
        local["params"] = sum(p.numel() for c in chunks for p in c.module.parameters())
        local["state_bytes"] = sum(t.numel() * t.element_size() for t in be.rank_state(chunks, optimizer).values())
        start = it
        mark = meter.start() if meter is not None else None
        for _ in range(args.iters):
            it += 1
            one(it, (it - start) % interval == 0, record=True)
        t0 = time.perf_counter()
        engine.drain()
        _sync_device()
        local["drain"] = time.perf_counter() - t0
        if rss_base is not None:
            local["rss_base"], local["rss_peak"] = rss_base, _proc_status_bytes("VmHWM")
        if mark is not None:
            local["foreign_cores"], local["steal_cores"] = meter.stop(mark)
        _barrier()
        if rank == 0 and engine.last_dir() is not None:
            local["bytes"] = be.dir_bytes(engine.last_dir())
        if restore and engine.persists and engine.last_iteration is not None:
            ref = be.snapshot_state(chunks, optimizer)
            local["restore"], local["mismatch"] = [], []
            for _ in range(args.restore_repeats):
                be.scramble_state(chunks, optimizer)
                be.evict_page_cache(root)
                _sync_device()
                _barrier()
                t0 = time.perf_counter()
                local["restore_iteration"] = engine.restore()
                _sync_device()
                local["restore"].append(time.perf_counter() - t0)
                _barrier()
                local["mismatch"] += be.compare_state(chunks, optimizer, ref)
            local["expected_iteration"] = engine.last_iteration
            if hasattr(engine, "recover"):  # a lost node: from the partner's replica vs from --dir
                be.scramble_state(chunks, optimizer)
                local["node_loss"] = engine.recover(check=functools.partial(be.compare_state, chunks, optimizer, ref))
                local["node_loss_mismatch"] = local["node_loss"]["partner"].pop("mismatch")
            del ref
        local["extras"] = engine.extras()
    finally:
        engine.close()
        gate.close()
        del engine, chunks, optimizer, scheduler
        gc.collect()
    ranks = _gather(local)
    if rank == 0:
        _rmtree(root)
    _barrier()
    return _summarise(name, interval, ranks)


def _summarise(name: str, interval: int, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    res = _blank(name, interval)
    iters = _max_across([r["iter"] for r in ranks])
    save = _max_across([r["save"] for r in ranks])
    gate = _max_across([r["gate"] for r in ranks])
    tick = _max_across([r["tick"] for r in ranks])
    n_ckpt = sum(r0["ckpt"])
    stall = sum(save) + sum(gate) + sum(tick)
    drain = max(r.get("drain", 0.0) for r in ranks)
    res.update(
        status="ok",
        iterations=len(iters),
        checkpoints=n_ckpt,
        iter_times_s=iters,
        save_call_s=save,
        gate_wait_s=gate,
        tick_s=tick,
        iter_median_s=statistics.median(iters),
        iter_p90_s=_pct(iters, 0.9),
        stall_per_ckpt_s=stall / n_ckpt if n_ckpt else 0.0,
        first_save_s=max((r["first_save"] for r in ranks if "first_save" in r), default=None),
        drain_s=drain,
        e2e_s=sum(iters) + drain,
        bytes_per_ckpt=r0.get("bytes"),
        params=r0.get("params"),
        foreign_cores=r0.get("foreign_cores"),
        steal_cores=r0.get("steal_cores"),
        rank_state_bytes=max(r.get("state_bytes", 0) for r in ranks),
    )
    if all(r.get("rss_peak") is not None for r in ranks):
        res.update(
            rss_base_bytes=max(r["rss_base"] for r in ranks),
            rss_peak_bytes=max(r["rss_peak"] for r in ranks),
            rss_over_base_bytes=max(r["rss_peak"] - r["rss_base"] for r in ranks),
        )
    extras = [r.get("extras") or {} for r in ranks]
    if any("cache_peak_bytes" in e for e in extras):
        res["cache_bytes"] = max(e.get("cache_bytes", 0) for e in extras)
        res["cache_peak_bytes"] = max(e.get("cache_peak_bytes", 0) for e in extras)
    if any("replication_bytes" in e for e in extras):
        res["replication_gbps"] = min(
            e["replication_bytes"] / e["replication_s"] / 1e9 for e in extras if e.get("replication_s")
        )
        res["replication_bytes_per_rank"] = max(e["replication_bytes"] for e in extras)
    if any("node_loss" in r for r in ranks):
        res["node_loss"] = {
            src: {
                "s": max(r["node_loss"][src]["s"] for r in ranks),
                "iteration": ranks[0]["node_loss"][src]["iteration"],
                "lost_iterations": ranks[0]["node_loss"][src]["lost_iterations"],
                "bytes": sum(r["node_loss"][src]["bytes"] for r in ranks),
                "fetched": sum(r["node_loss"][src]["fetched"] for r in ranks),
                "from": [r["node_loss"][src]["from"] for r in ranks],
            }
            for src in ranks[0]["node_loss"]
        }
        res["node_loss_ok"] = not any(r.get("node_loss_mismatch") for r in ranks)
    if any("restore" in r for r in ranks):
        mism = sorted({m for r in ranks for m in r.get("mismatch", [])})
        its = {r.get("restore_iteration") for r in ranks}
        runs = _max_across([r["restore"] for r in ranks])
        res.update(
            restore_s=statistics.median(runs),
            restore_runs_s=runs,
            restore_iteration=its.pop() if len(its) == 1 else sorted(its, key=str),
            restore_mismatches=mism[:20],
            restore_ok=not mism and all(r.get("restore_iteration") == r.get("expected_iteration") for r in ranks),
        )
    return res


def add_ratios(res: dict, base: dict | None) -> None:
    if not base or base.get("status") != "ok" or res.get("status") != "ok":
        return
    res["ratio_median"] = _ratio(res["iter_median_s"], base["iter_median_s"])
    res["ratio_p90"] = _ratio(res["iter_p90_s"], base["iter_p90_s"])
    res["ratio_stall"] = _ratio(res["stall_per_ckpt_s"], base["iter_median_s"])
    res["ratio_e2e"] = _ratio(res["e2e_s"], base["e2e_s"])


# --------------------------------------------------------------------------- #
# report
# --------------------------------------------------------------------------- #
def _f(x: Any, fmt: str = "{:.3f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return fmt.format(x)


def sweep_view(doc: dict) -> dict[str, dict[int, dict]]:
    """The interval sweep per engine, including the main run's interval."""
    view: dict[str, dict[int, dict]] = {}
    main_iv = doc["config"]["interval"]
    for name, per in (doc.get("sweep") or {}).items():
        row = {int(i): r for i, r in per.items()}
        if name in doc["engines"]:
            row.setdefault(main_iv, doc["engines"][name])
        view[name] = dict(sorted(row.items()))
    return view


def render(doc: dict) -> str:
    lines = []
    cfg, m = doc["config"], doc.get("machine") or {}
    lines.append(
        f"workload: GPT {cfg['layers']}L/{cfg['hidden']}h/seq{cfg['seq_len']}/mb{cfg['micro_batch']}"
        f" {'bf16' if cfg['bf16'] else 'fp32'}, {cfg['params'] or 0:,} params, {cfg['world_size']} ranks "
        f"({cfg['backend']}), {cfg.get('rounds', 1)} rounds x {cfg['iters']} measured iterations/engine "
        f"after {cfg['warmup']} warm-up, "
        f"checkpoint every {cfg['interval']}; rank state "
        f"{(cfg['rank_state_bytes'] or 0) / MB:.1f} MiB/rank"
    )
    if m:
        extra = f", D2H pinned {m['d2h_pinned_GBps_per_rank']:.2f} GB/s/rank" if "d2h_pinned_GBps_per_rank" in m else ""
        lines.append(
            f"machine: memcpy {m['memcpy_GBps_per_rank']:.2f} GB/s/rank, write+fsync "
            f"{m['write_fsync_GBps']:.2f} GB/s, cold read {m['read_cold_GBps']:.2f} GB/s "
            f"(all {len(m['per_rank'])} ranks at once, {m['bytes_per_rank'] / MB:.0f} MiB each){extra}"
        )
        if m.get("write_steal_core_s_per_GB") is not None:
            lines.append(
                f"machine: writing to disk costs {m['write_steal_core_s_per_GB']:.2f} core-s of "
                "hypervisor steal per GB written (CPU this VM loses to its own disk I/O)"
            )
    hdr = (
        "engine",
        "status",
        "iter med s",
        "x base",
        "p90 x",
        "stall/ckpt s",
        "stall/iter",
        "drain s",
        "e2e x",
        "e2e x by round",
        "MiB/ckpt",
        "first save s",
        "restore s",
        "restored",
        "other load",
        "steal",
    )
    rows = []
    for name, r in doc["engines"].items():
        rows.append(
            (
                name,
                r["status"],
                _f(r["iter_median_s"]),
                _f(r["ratio_median"], "{:.2f}"),
                _f(r["ratio_p90"], "{:.2f}"),
                _f(r["stall_per_ckpt_s"]),
                _f(r["ratio_stall"], "{:.1%}"),
                _f(r["drain_s"]),
                _f(r["ratio_e2e"], "{:.3f}"),
                "/".join(_f(x, "{:.2f}") for x in r.get("ratio_e2e_rounds") or []) or "-",
                _f(None if r["bytes_per_ckpt"] is None else r["bytes_per_ckpt"] / MB, "{:.1f}"),
                _f(r["first_save_s"]),
                _f(r["restore_s"]),
                _f(r["restore_ok"]),
                _f(r["foreign_cores"], "{:.2f}"),
                _f(r.get("steal_cores"), "{:.2f}"),
            )
        )
    lines += _table(hdr, rows)
    mem = [(n, r) for n, r in doc["engines"].items() if r.get("rss_peak_bytes") is not None]
    if mem:
        lines.append("")
        lines.append("host memory per rank (max over ranks and rounds), MiB:")
        lines += _table(
            ("engine", "RSS before engine", "peak RSS", "peak - before", "host cache peak", "host cache size"),
            [
                (
                    n,
                    _f(r["rss_base_bytes"] / MB, "{:.1f}"),
                    _f(r["rss_peak_bytes"] / MB, "{:.1f}"),
                    _f(r["rss_over_base_bytes"] / MB, "{:.1f}"),
                    _f(None if r.get("cache_peak_bytes") is None else r["cache_peak_bytes"] / MB, "{:.1f}"),
                    _f(None if r.get("cache_bytes") is None else r["cache_bytes"] / MB, "{:.1f}"),
                )
                for n, r in mem
            ],
        )
    floor = floor_view(doc)
    if floor:
        lines.append(
            f"floor: per checkpoint one copy of the rank state at the memcpy speed above "
            f"({floor['copy_s'] * 1e3:.0f} ms, {floor['copies']} in a round: +{floor['copy_ratio']:.3f}) and, "
            f"for the last one, its {floor['bytes'] / MB:.1f} MiB written at the write+fsync speed "
            f"({floor['write_s']:.3f} s: +{floor['write_ratio']:.3f}) -> {floor['ratio_e2e']:.3f}x the baseline's "
            f"e2e for an engine that copies every checkpoint and leaves the last one durable, on a "
            f"machine whose cores training fills"
        )
    loads = [r["foreign_cores"] for r in doc["engines"].values() if r.get("foreign_cores") is not None]
    if loads and max(loads) > 0.25:
        lines.append(
            f"WARNING: other processes used up to {max(loads):.2f} of {doc['config']['cpus']} "
            "cores during the measurements ('other load'); ratios are not trustworthy."
        )
    lines += _node_loss_lines(doc)
    sweep = sweep_view(doc)
    if sweep:
        lines.append("")
        lines.append("overhead vs checkpoint interval (end-to-end incl. drain, vs baseline):")
        ivs = sorted({i for per in sweep.values() for i in per})
        rows = []
        for name, per in sweep.items():
            row = [name]
            for i in ivs:
                r = per.get(i)
                if r is None:
                    row.append("-")
                elif r["status"] != "ok":
                    row.append(r["status"])
                else:
                    row.append(_f(None if r["ratio_e2e"] is None else r["ratio_e2e"] - 1, "{:+.1%}"))
            rows.append(tuple(row))
        lines += _table(("engine",) + tuple(f"every {i}" for i in ivs), rows)
    lines.append("")
    lines.append(
        "stall = save call + step pre-hook wait + per-iteration finalize/poll, max over ranks; "
        "x base = ratio to the baseline of the same round, averaged over the rounds (run in "
        "alternating order); e2e = measured iterations + drain; "
        "restore = median of --restore-repeats loads of the last checkpoint, page cache evicted, "
        "each verified bit for bit; "
        "other load = cores used by processes outside the benchmark while it measured; "
        "steal = cores the hypervisor took from this VM meanwhile (on this kind of VM it grows "
        "with the bytes written to disk)."
    )
    return "\n".join(lines)


def _node_loss_lines(doc: dict) -> list[str]:
    """Replication's cost (already in the main table as ours_replicated's stall and e2e) and what a
    lost node costs with and without the replica, side by side."""
    r = (doc.get("engines") or {}).get("ours_replicated") or {}
    if r.get("status") != "ok":
        return []
    base = (doc.get("engines") or {}).get("ours_local") or {}
    lines = [""]
    if r.get("replication_gbps") is not None:
        vs = ""
        if base.get("stall_per_ckpt_s") and base.get("e2e_s"):
            vs = (
                f"; vs ours_local: stall/ckpt x{_f(_ratio(r['stall_per_ckpt_s'], base['stall_per_ckpt_s']), '{:.2f}')}, "
                f"e2e x{_f(_ratio(r['e2e_s'], base['e2e_s']), '{:.3f}')}"
            )
        lines.append(
            f"replication (ours_replicated, 1 partner per rank): {r['replication_bytes_per_rank'] / MB:.1f} MiB "
            f"sent per rank, {r['replication_gbps']:.2f} GB/s per rank (slowest){vs}"
        )
    loss = r.get("node_loss")
    if loss:
        hdr = ("a node is lost, restore", "s", "x partner", "iteration", "iterations lost", "MiB read", "MiB fetched")
        rows = [
            (
                src,
                _f(v["s"]),
                _f(_ratio(v["s"], loss["partner"]["s"]), "{:.2f}"),
                str(v["iteration"]),
                str(v["lost_iterations"]),
                _f(v["bytes"] / MB, "{:.1f}"),
                _f(v["fetched"] / MB, "{:.1f}"),
            )
            for src, v in loss.items()
        ]
        lines += _table(hdr, rows)
        lines.append(
            f"(partner: the lost node's files fetched from the replica, restored state bit-exact: "
            f"{r.get('node_loss_ok')}; persistent: the newest checkpoint the promotion interval had written)"
        )
    return lines


def floor_view(doc: dict) -> dict | None:
    """The least end-to-end ratio this machine allows a checkpoint-every-``interval`` engine that
    keeps a copy of each checkpoint and makes the last one durable: the copies' time at the
    measured memcpy speed (counted whole: training keeps every core busy on the CPU workload) plus
    the last checkpoint at the measured write+fsync speed, over the baseline's e2e of a round.
    ``None`` without the machine probes, the baseline or a checkpoint size."""
    m, cfg, engines = doc.get("machine"), doc.get("config") or {}, doc.get("engines") or {}
    base = engines.get("baseline") or {}
    sizes = [r["bytes_per_ckpt"] for r in engines.values() if r.get("bytes_per_ckpt")]
    if not m or not sizes or not base.get("e2e_s") or not cfg.get("rank_state_bytes") or not cfg.get("iters"):
        return None
    copies = cfg["iters"] // cfg["interval"]
    copy_s = cfg["rank_state_bytes"] / (m["memcpy_GBps_per_rank"] * GB)
    write_s = min(sizes) / (m["write_fsync_GBps"] * GB)
    copy_ratio, write_ratio = copies * copy_s / base["e2e_s"], write_s / base["e2e_s"]
    return {
        "copies": copies,
        "copy_s": copy_s,
        "bytes": min(sizes),
        "write_s": write_s,
        "copy_ratio": copy_ratio,
        "write_ratio": write_ratio,
        "ratio_e2e": 1 + copy_ratio + write_ratio,
    }


def _table(hdr: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*hdr), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in doc["engines"].items():
        if r["status"] == "ok" and r["iter_times_s"]:
            ax1.plot(
                range(1, len(r["iter_times_s"]) + 1),
                r["iter_times_s"],
                marker="o",
                ms=3,
                label=name,
                lw=2.2 if name in ("ours", "baseline") else 1.2,
            )
    ax1.set_xlabel("measured iteration")
    ax1.set_ylabel("iteration time (s)")
    ax1.set_title(f"per-iteration time, checkpoint every {doc['config']['interval']}")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ticks: set[int] = set()
    for name, per in sweep_view(doc).items():
        pts = sorted(
            (i, 100 * (r["ratio_e2e"] - 1))
            for i, r in per.items()
            if r["status"] == "ok" and r["ratio_e2e"] is not None
        )
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ticks.update(p[0] for p in pts)
    if ticks:
        ax2.set_xticks(sorted(ticks))
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xlabel("checkpoint interval (iterations)")
    ax2.set_ylabel("end-to-end overhead vs baseline (%)")
    ax2.set_title("overhead vs checkpoint interval")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(
        f"{doc['config']['layers']}L/{doc['config']['hidden']}h GPT, "
        f"{doc['config']['world_size']} ranks ({doc['config']['backend']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def emit(doc: dict, args: argparse.Namespace, final: bool) -> None:
    """Rank 0: write the JSON (and, when final, the plot); print the table when final."""
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(args.json_out) + ".tmp")
        tmp.write_text(json.dumps({**doc, "floor": floor_view(doc)}, indent=1, default=str))
        os.replace(tmp, args.json_out)
    if final:
        if args.plot:
            try:
                plot(doc, args.plot)
            except Exception as e:  # a plot failure must not lose the table
                log.warning("plot failed: %s", e)
        print(render(doc), flush=True)


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #
def _plan(args: argparse.Namespace) -> list[tuple[str, int, bool, int]]:
    """(engine, interval, main?, round) in run order.  The main comparison runs ``--rounds`` times,
    every other round in reverse order (ABBA), so a slow drift of the machine's speed hits the
    baseline and the engines alike, and ``ours_local`` runs right next to the baseline in every
    round (``RUN_ORDER``); the interval sweep runs once, after it."""
    main = [e for e in RUN_ORDER if e in args.engines]
    sweep_iv = [i for i in dict.fromkeys(args.intervals) if i != args.interval]
    plan = []
    for k in range(args.rounds):
        plan += [(e, args.interval, True, k) for e in (main if k % 2 == 0 else main[::-1])]
    plan += [(e, i, False, 0) for e in main if e in args.sweep_engines and e != "baseline" for i in sweep_iv]
    return plan


def merge_rounds(name: str, interval: int, rounds: list[dict]) -> dict:
    """One engine's figures over its rounds: times pooled, ratios averaged over the rounds (each
    against the baseline of its own round), restore from the round that measured it."""
    done = [r for r in rounds if r.get("status") == "ok"]
    res = _blank(name, interval)
    res["rounds"] = rounds
    if not done:
        if rounds:  # the round that failed (timeout, error) rather than the ones skipped after it
            bad = next((r for r in rounds if r["status"] not in ("pending", "skipped")), rounds[-1])
            res.update(status=bad["status"], error=bad.get("error"))
        return res
    iters = [t for r in done for t in r["iter_times_s"]]
    n_ckpt = sum(r["checkpoints"] or 0 for r in done)
    stall = sum(r["stall_per_ckpt_s"] * (r["checkpoints"] or 0) for r in done)

    def mean(key: str) -> float | None:
        vals = [r[key] for r in done if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    res.update(
        status="ok" if len(done) == len(rounds) else "partial",
        iterations=len(iters),
        checkpoints=n_ckpt,
        iter_times_s=iters,
        save_call_s=[t for r in done for t in r["save_call_s"]],
        gate_wait_s=[t for r in done for t in r["gate_wait_s"]],
        tick_s=[t for r in done for t in r["tick_s"]],
        iter_median_s=statistics.median(iters),
        iter_p90_s=_pct(iters, 0.9),
        stall_per_ckpt_s=stall / n_ckpt if n_ckpt else 0.0,
        first_save_s=done[0]["first_save_s"],
        drain_s=mean("drain_s"),
        e2e_s=mean("e2e_s"),
        ratio_median=mean("ratio_median"),
        ratio_p90=mean("ratio_p90"),
        ratio_stall=mean("ratio_stall"),
        ratio_e2e=mean("ratio_e2e"),
        ratio_e2e_rounds=[r["ratio_e2e"] for r in done],
        bytes_per_ckpt=next((r["bytes_per_ckpt"] for r in done if r.get("bytes_per_ckpt")), None),
        foreign_cores=mean("foreign_cores"),
        steal_cores=mean("steal_cores"),
    )
    for r in done:
        if r.get("restore_s") is not None:
            res.update(
                {
                    k: r[k]
                    for k in ("restore_s", "restore_runs_s", "restore_ok", "restore_iteration", "restore_mismatches")
                }
            )
    for key in ("params", "rank_state_bytes"):
        res[key] = done[0].get(key)
    for key in ("rss_peak_bytes", "rss_over_base_bytes", "cache_peak_bytes", "cache_bytes"):  # the worst round
        vals = [r[key] for r in done if r.get(key) is not None]
        res[key] = max(vals) if vals else None
    res["rss_base_bytes"] = next((r["rss_base_bytes"] for r in done if r.get("rss_base_bytes") is not None), None)
    for key in ("replication_gbps", "replication_bytes_per_rank", "node_loss", "node_loss_ok"):
        res[key] = next((r[key] for r in reversed(done) if r.get(key) is not None), None)  # the last measured
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if "RANK" not in os.environ:
        sys.exit("run me with torchrun, e.g.: torchrun --nproc_per_node 2 scripts/bench_peers.py")
    from datastates_megatron.demo import gpt

    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.WARNING if rank else logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("megatron", "torch", "datastates_megatron", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gpt.init_distributed(seed=args.seed, timeout_s=max(600.0, args.engine_timeout * 2))
    world = torch.distributed.get_world_size()
    if world < 2 and "ours_replicated" in args.engines:  # a partner is another rank (another "node")
        log.warning("ours_replicated needs at least 2 ranks; not run on %d", world)
        args.engines = [e for e in args.engines if e != "ours_replicated"]
        args.sweep_engines = [e for e in args.sweep_engines if e != "ours_replicated"]
    io_group = torch.distributed.new_group(backend="gloo")
    root = Path(args.dir).resolve()

    import megatron.core

    doc: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("json_out", "plot")},
            "world_size": world,
            "backend": torch.distributed.get_backend(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "params": None,  # filled from the baseline run
            "rank_state_bytes": None,
            "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", "?"),
            "python": platform.python_version(),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "dir": str(root),
        },
        "machine": None,
        "engines": {},
        "sweep": {},
    }
    plan = _plan(args)
    rounds: dict[str, list[dict]] = {}  # engine -> its per-round results (main comparison)
    for name, interval, is_main, k in plan:
        if is_main:
            rounds.setdefault(name, []).append(_blank(name, interval))
        else:
            doc["sweep"].setdefault(name, {})[str(interval)] = _blank(name, interval)
    doc["engines"] = {n: _blank(n, args.interval) for n in ALL_ENGINES if n in rounds}  # report order

    current: dict[str, Any] = {}

    def on_timeout(label: str) -> None:
        if rank != 0:
            return
        slot = current.get("slot")
        if slot is not None:
            slot.update(status="timeout", error=f"{label} exceeded --engine-timeout {args.engine_timeout:.0f}s")
        for r in [x for per in rounds.values() for x in per] + [
            x for per in doc["sweep"].values() for x in per.values()
        ]:
            if r["status"] == "pending":
                r["status"] = "skipped"
        for n in rounds:
            doc["engines"][n] = merge_rounds(n, args.interval, rounds[n])
        emit(doc, args, final=True)

    pids = _gather(os.getpid())
    meter = None
    if rank == 0:
        try:
            meter = ForeignLoad(pids)
        except ImportError:
            log.warning("psutil missing: 'other load' is not measured")
    watchdog = Watchdog(rank, on_timeout, grace_s=0.0 if rank == 0 else 15.0)
    total = len(plan) * (args.warmup + args.iters)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="it", dynamic_ncols=True, file=sys.stderr)

    def progress(n: int) -> None:
        if bar is not None:
            bar.update(n)

    try:
        if args.probe_mb > 0:
            with watchdog.guard("machine probes", args.engine_timeout):
                doc["machine"] = probe_machine(root / "probe", args.probe_mb * MB)
            if rank == 0:
                _rmtree(root / "probe")
        for name, interval, is_main, k in plan:
            slot = rounds[name][k] if is_main else doc["sweep"][name][str(interval)]
            current["slot"] = slot
            if bar is not None:
                bar.set_description(f"{name}@{interval}" + (f" r{k + 1}" if is_main else ""))
            last_round = is_main and k == args.rounds - 1
            try:
                with watchdog.guard(f"{name} (interval {interval})", args.engine_timeout):
                    res = run_engine(
                        name,
                        interval,
                        args,
                        io_group,
                        root / f"{name}-every{interval}",
                        restore=last_round and not args.no_restore,
                        progress=progress,
                        meter=meter,
                    )
            except Exception as e:  # recorded; the next engine starts from a fresh model
                log.exception("rank %d: engine %s (interval %d) failed", rank, name, interval)
                res = dict(slot, status="error", error=f"{type(e).__name__}: {e}")
            slot.update(res)
            if is_main:
                base_k = rounds.get("baseline", [None] * (k + 1))[k]
                if name == "baseline":  # the engines of this round measured before it (ABBA)
                    for other in rounds.values():
                        add_ratios(other[k], base_k)
                else:
                    add_ratios(slot, base_k)
                for n in rounds:
                    doc["engines"][n] = merge_rounds(n, args.interval, rounds[n])
                base = doc["engines"].get("baseline")
                if base and base["status"] == "ok":
                    doc["config"]["params"] = base.get("params")
                    doc["config"]["rank_state_bytes"] = base.get("rank_state_bytes")
            else:
                add_ratios(slot, doc["engines"].get("baseline"))
            if rank == 0:
                emit(doc, args, final=False)
    finally:
        current["slot"] = None
        watchdog.close()
        if bar is not None:
            bar.close()
    if rank == 0:
        emit(doc, args, final=True)
    _barrier()
    gpt.destroy_distributed()
    failed = [n for n, r in doc["engines"].items() if r["status"] not in ("ok",)]
    return 1 if failed and rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
