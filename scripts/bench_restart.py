#!/usr/bin/env python
"""Restart time of one training state, side by side: our restore by phase, the peers' restores,
and a data-parallel and a tensor-parallel change (ours against megatron-core's own ``torch_dist``
resharding load).

    python scripts/bench_restart.py [--repeats 5] [--vocab 131072] [--no-reshard] [--no-tp] [--dir runs/bench-restart] [--json OUT]

One command, four launches of ``torchrun`` (this script under ``--phase``):

1. ``same`` (2 ranks): the workload of ``scripts/bench_peers.py`` (megatron-core GPT 6x512 +
   DistributedOptimizer, here with ``--vocab 131072``: about 518 MB of state per rank) trains
   ``--warmup`` iterations and is checkpointed once by each engine (ours, megatron-core
   ``torch_dist``, DCP, ``torch.save``; driven as ``scripts/_bench_engines.py`` drives them).  Then
   ``--repeats`` rounds, the order reversed every other round (ABBA): a plain sequential read of our
   rank files (the machine's cold-read bandwidth for the same bytes), and each engine's restore into
   the live model and optimizer, every time with the page cache of the files evicted
   (``posix_fadvise(DONTNEED)``) and the state scrambled first; every restore is compared bit for
   bit with the saved state.  Ours is broken down by phase (below).
2. ``reshard`` (1 rank, and 4 with ``--with-dp4``): the checkpoints of (1) loaded at another
   data-parallel size: ours (``LazyCheckpointer.load()``, resharded by parameter identity) and
   megatron-core's ``dist_checkpointing.load`` of its ``dp_reshardable`` checkpoint, alternating,
   page cache evicted; the restored parameters compared with the saved ones.
3. ``tp`` (2 ranks at TP 2, DP 1; not with ``--no-tp``): the checkpoints of (1) loaded at another
   tensor-parallel size: ours (``LazyCheckpointer.load()``, resharded through megatron-core's
   sharded keys and global offsets) and megatron-core's ``dist_checkpointing.load`` of a third
   checkpoint (1) writes for it, ``mcore_reshardable`` (``fully_reshardable``, Megatron-LM's
   ``--dist-ckpt-optim-fully-reshardable``: the optimizer state megatron-core reshards at another TP
   size), alternating, page cache evicted.  Each rank's
   parameters are compared with their slice of the saved full tensors (the offsets of megatron-core's
   ``sharded_state_dict``), and ours' whole state (parameters, Adam moments, step) with what
   megatron-core's load gave: both bit for bit.
4. The driver prints one table: medians over the rounds (max over ranks per round), ratios.

Our phases (seconds, max over ranks, median over rounds): ``decide`` -- rank 0 resolves the
checkpoint and its layout, each rank gets its record (``choose``); ``prepare`` -- Adam state and the
registered shards (``_ensure_optimizer_state``, ``_refresh``); ``open+plan`` -- the manager's tier
choice, opening the rank file, the plan and its validation; ``read`` -- reading the files into memory
(bytes and GB/s beside the plain read's); ``verify`` -- XXH64 of every chunk the plan touches, once;
``agree`` -- the one cross-rank agreement; ``copy`` -- into the live tensors;
``all-gather`` -- the param buffers across data-parallel ranks; ``other`` -- the rest of ``load()``
(non-tensor state, RNG, scheduler).  Each reshard also reports the plan's size (its (range,
destination) items, max over ranks) and the seconds making and checking it took (within
``open+plan``): a TP change reads each row of a block split on its last axis as an item of its own.

The machine's load matters: on a shared machine run it more than once and compare the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

import torch  # noqa: E402

import _bench_engines as be  # noqa: E402

log = logging.getLogger("bench_restart")
MB = 1e6
GB = 1e9
SAME_ENGINES = ("ours", "mcore_sync", "dcp_async", "torch_save")
READ_CHUNK = 16 << 20
PHASES = ("decide", "prepare", "open_plan", "read", "verify", "agree", "copy", "all_gather", "other")


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    be.add_workload_args(p)
    p.set_defaults(vocab=131072)
    p.add_argument("--phase", choices=("driver", "same", "reshard", "tp"), default="driver", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=5, help="rounds of every comparison (ABBA order)")
    p.add_argument("--warmup", type=int, default=2, help="training iterations before the checkpoint")
    p.add_argument(
        "--engines",
        default=",".join(SAME_ENGINES),
        help="same-layout engines, from: " + ",".join(SAME_ENGINES),
    )
    p.add_argument(
        "--before",
        default=None,
        metavar="TREE",
        help="also restore the same checkpoint with the package of this checkout (an older commit's "
        "files), imported under another name in the same processes and run in the same rounds: "
        "before/after from one command",
    )
    p.add_argument("--no-reshard", action="store_true", help="skip the data-parallel change")
    p.add_argument("--with-dp4", action="store_true", help="also load at 4 ranks (2 -> 4)")
    p.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel change (TP 1 -> 2)")
    p.add_argument("--dir", default="./runs/bench-restart", help="checkpoint root (on the disk under test)")
    p.add_argument("--host-cache-gb", type=float, default=1.5, help="ours: host cache per rank")
    p.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    p.add_argument("--timeout-s", type=float, default=1500, help="per launch")
    args = p.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.engines) - set(SAME_ENGINES))
    if unknown or "ours" not in args.engines:
        p.error(f"--engines: from {SAME_ENGINES}, with ours (got {args.engines})")
    if args.repeats < 1 or args.warmup < 1:
        p.error("--repeats and --warmup must be >= 1")
    return args


# --------------------------------------------------------------------------- #
# helpers (collective unless said)
# --------------------------------------------------------------------------- #
def _gather(obj: Any) -> list:
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    torch.distributed.barrier()


def _med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def plain_read(path: Path) -> tuple[int, float]:
    """Read ``path`` sequentially, 16 MiB at a time into one buffer (this rank alone); (bytes, s)."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [view])
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return total, time.perf_counter() - t0


class PhaseClock:
    """Times the phases of one ``LazyCheckpointer.load()`` by wrapping, on this instance only, the
    steps it calls (the library is not changed); the reader's own phases come from its
    ``RestoreStats``.  Not thread-safe: one load at a time."""

    def __init__(self, ckpt: Any) -> None:
        self.seconds: dict[str, float] = {}
        self.stats = None
        mgr = ckpt._mgr
        # the restore decision: ``choose`` today, ``view`` in the packages before it (``--before``)
        self._wrap(mgr, "choose" if hasattr(mgr, "choose") else "view", "decide")
        self._wrap(ckpt, "_ensure_optimizer_state", "prepare")
        self._wrap(ckpt, "_refresh", "prepare")
        self._wrap(ckpt, "_gather_params", "all_gather")
        self._wrap(mgr, "load", "manager_load", keep=True)
        self.plan_items = 0
        if hasattr(ckpt, "_planner"):  # the number of (range, destination) items of the plan
            make = ckpt._planner

            def counted(*a, **kw):
                planner = make(*a, **kw)
                plan = planner.plan

                def plan_counted(*pa, **pkw):
                    out = plan(*pa, **pkw)
                    self.plan_items = len(out.items)
                    return out

                planner.plan = plan_counted
                return planner

            ckpt._planner = counted

    def _wrap(self, obj: Any, attr: str, phase: str, keep: bool = False) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            if keep:
                self.stats = out.stats
            return out

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds, self.stats, self.plan_items = {}, None, 0

    def phases(self, total_s: float) -> dict[str, float]:
        """Seconds per phase of the last load (``PHASES``), and bytes read / verified."""
        s, st = self.seconds, self.stats
        reader = dict(
            read=st.read_ahead_s,
            verify=st.verify_s,
            agree=getattr(st, "agree_s", 0.0),
            copy=st.copy_s,
        )
        out = {
            "decide": s.get("decide", 0.0),
            "prepare": s.get("prepare", 0.0),
            "open_plan": max(0.0, s.get("manager_load", 0.0) - sum(reader.values())),
            **reader,
            "all_gather": s.get("all_gather", 0.0),
        }
        out["other"] = max(0.0, total_s - sum(out.values()))
        out["without_all_gather"] = total_s - out["all_gather"]  # the restore proper, per run
        # an older reader (--before) reads whole files ahead and does not count them
        out["bytes_read"] = getattr(st, "read_bytes", st.bytes if st.read_ahead_s else 0)
        out["bytes_copied"] = st.bytes
        out["bytes_verified"] = st.verified_bytes
        out["plan_s"] = getattr(st, "plan_s", 0.0)  # making and validating the plan, within open_plan
        out["plan_items"] = self.plan_items
        return out


def _full_params(chunks: list) -> dict[str, torch.Tensor]:
    return {f"c{ci}.{n}": p.detach().clone() for ci, c in enumerate(chunks) for n, p in c.module.named_parameters()}


def _param_mismatches(chunks: list, ref: dict[str, torch.Tensor]) -> list[str]:
    live = _full_params(chunks)
    bad = sorted(set(ref) ^ set(live))
    return bad + [k for k, v in ref.items() if k in live and not torch.equal(live[k], v)]


def saved_slice(
    full: torch.Tensor, global_shape: tuple, global_offset: tuple, local_shape: tuple, prepend: int = 0
) -> torch.Tensor:
    """The part of ``full`` (a parameter as the 1-TP run held it) that a tensor-parallel shard of
    ``local_shape`` at ``global_offset`` holds, in megatron-core's coordinates (``ShardedTensor``:
    ``prepend`` leading axes that the tensor does not have, e.g. a layer number, and are the same at
    any TP size).  Raises ``ValueError`` where the two do not describe the same tensor."""
    global_shape, global_offset = tuple(global_shape), tuple(global_offset)
    if len(global_shape) != len(global_offset) or len(global_shape) != prepend + len(local_shape):
        raise ValueError(f"shard {tuple(local_shape)} +{prepend} axes does not fit global shape {global_shape}")
    if tuple(full.shape) != global_shape[prepend:]:
        raise ValueError(f"saved tensor {tuple(full.shape)} is not the global tensor {global_shape[prepend:]}")
    index = []
    for off, size, n in zip(global_offset[prepend:], local_shape, global_shape[prepend:]):
        if off < 0 or off + size > n:
            raise ValueError(f"shard {tuple(local_shape)} at {global_offset} is outside {global_shape}")
        index.append(slice(off, off + size))
    return full[tuple(index)]


def _shard_coordinates(chunks: list) -> dict[int, tuple]:
    """``{id(param): (global shape, global offset, prepend axes)}`` of every parameter that
    megatron-core's ``sharded_state_dict`` declares as a plain ``ShardedTensor`` of itself."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out: dict[int, tuple] = {}
    for c in chunks:
        params = {id(p) for p in c.module.parameters()}
        for sh in nested_values(c.module.sharded_state_dict()):
            if isinstance(sh, ShardedTensor) and id(sh.data) in params and sh.flattened_range is None:
                out.setdefault(id(sh.data), (tuple(sh.global_shape), tuple(sh.global_offset), sh.prepend_axis_num))
    return out


def _tp_param_mismatches(chunks: list, ref: dict[str, torch.Tensor], coords: dict[int, tuple]) -> list[str]:
    """Names of the live parameters (tensor-parallel shards) that differ from their slice of the saved
    full tensors ``ref``; a parameter without coordinates must equal its saved tensor whole."""
    live = {f"c{ci}.{n}": p for ci, c in enumerate(chunks) for n, p in c.module.named_parameters()}
    bad = sorted(set(ref) ^ set(live))
    for name, p in live.items():
        if name not in ref:
            continue
        at = coords.get(id(p))
        try:
            want = ref[name] if at is None else saved_slice(ref[name], at[0], at[1], tuple(p.shape), at[2])
        except ValueError as e:
            bad.append(f"{name}: {e}")
            continue
        if not (want.shape == p.shape and torch.equal(p.detach(), want)):
            bad.append(name)
    return bad


class OursFrom(be.Engine):
    """``LazyCheckpointer.load()`` of package ``pkg`` (this tree's, or ``--before``'s) restoring the
    checkpoint under ``load_dir`` into the live workload; its own saves (none) go to ``scratch``."""

    persists = True

    def __init__(self, w: be.Workload, pkg: Any, load_dir: Path, scratch: Path, host_cache_gb: float) -> None:
        super().__init__(w, be.BenchOptions())
        config = pkg.LazyCkptConfig(save_dir=str(scratch), load_dir=str(load_dir), host_cache_gb=host_cache_gb)
        self._ckpt = pkg.LazyCheckpointer(w.chunks, w.optimizer, config, opt_param_scheduler=w.scheduler)

    def restore(self) -> int | None:
        return self._ckpt.load()[0]

    def close(self) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()


def import_before(tree: str, root: Path) -> Any:
    """The package of checkout ``tree`` as ``dsm_before`` (its imports are relative), so that the old
    and the new restore run in the same processes and rounds (collective)."""
    dst = root / "before_pkg"
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(
            Path(tree) / "datastates_megatron", dst / "dsm_before", ignore=shutil.ignore_patterns("__pycache__")
        )
    _barrier()
    sys.path.insert(0, str(dst))
    return importlib.import_module("dsm_before")


# --------------------------------------------------------------------------- #
# phase 1: same layout
# --------------------------------------------------------------------------- #
def phase_same(args: argparse.Namespace) -> dict:
    from datastates_megatron.demo import gpt

    rank = torch.distributed.get_rank()
    root = Path(args.dir).resolve()
    io_group = torch.distributed.new_group(backend="gloo")
    chunks, optimizer, scheduler = be.build_workload(args)
    for it in range(1, args.warmup + 1):
        gpt.train_step(chunks, optimizer, be.workload_batch(args, it), scheduler=scheduler)
    opts = be.BenchOptions(host_cache_gb=args.host_cache_gb, keep_last=1, dcp_checkpointer="thread")
    engines: dict[str, be.Engine] = {}
    state_bytes = sum(t.numel() * t.element_size() for t in be.rank_state(chunks, optimizer).values())
    for name in args.engines:
        eroot = root / name
        if rank == 0:
            shutil.rmtree(eroot, ignore_errors=True)
            eroot.mkdir(parents=True)
        _barrier()
        eng = be.ENGINES[name](be.Workload(chunks, optimizer, scheduler, eroot, io_group), opts)
        eng.save(args.warmup)
        eng.drain()
        engines[name] = eng
        _barrier()
    if not args.no_tp:  # the optimizer state megatron-core reshards at another TP size, for the tp phase
        eroot = root / "mcore_reshardable"
        if rank == 0:
            shutil.rmtree(eroot, ignore_errors=True)
            eroot.mkdir(parents=True)
        _barrier()
        eng = be.ENGINES["mcore_reshardable"](be.Workload(chunks, optimizer, scheduler, eroot, io_group), opts)
        eng.save(args.warmup)
        eng.close()
        _barrier()
    # a restart restores with a checkpointer that did not write the checkpoint: so does ours here, as
    # the --before package does (the one that saved keeps its cache and threads)
    engines.pop("ours").close()
    import datastates_megatron

    w = be.Workload(chunks, optimizer, scheduler, root / "ours", io_group)
    engines["ours"] = OursFrom(w, datastates_megatron, root / "ours", root / "scratch-ours", args.host_cache_gb)
    if args.before:
        pkg = import_before(args.before, root)
        engines["ours_before"] = OursFrom(w, pkg, root / "ours", root / "scratch-before", args.host_cache_gb)
    ref = be.snapshot_state(chunks, optimizer)
    ref_params = _full_params(chunks)
    if rank == 0:  # the reshard phase compares its parameters with these
        torch.save(ref_params, root / "ref_params.pt")
    clocks = {n: PhaseClock(engines[n]._ckpt) for n in ("ours", "ours_before") if n in engines}
    own_file = _own_rank_file(root / "ours", args.warmup, rank)
    order = ["plain_read", *engines]
    rows: dict[str, list[dict]] = {k: [] for k in order}
    for name in order[1:]:  # one unmeasured restore each: compilation, first-use imports, allocations
        engines[name].restore()
        _barrier()
    for k in range(args.repeats):
        for name in order if k % 2 == 0 else order[::-1]:
            be.scramble_state(chunks, optimizer)
            be.evict_page_cache(root)
            _barrier()
            if name == "plain_read":
                nbytes, secs = plain_read(own_file)
                rows[name].append({"s": secs, "bytes": nbytes})
                _barrier()
                continue
            for clock in clocks.values():
                clock.reset()
            t0 = time.perf_counter()
            iteration = engines[name].restore()
            secs = time.perf_counter() - t0
            row: dict[str, Any] = {"s": secs, "iteration": iteration}
            if name in clocks:
                row["phases"] = clocks[name].phases(secs)
            _barrier()
            row["mismatch"] = be.compare_state(chunks, optimizer, ref)[:5]
            rows[name].append(row)
    for eng in engines.values():
        eng.close()
    per_rank = _gather(rows)
    out = {"world": torch.distributed.get_world_size(), "state_bytes_per_rank": state_bytes, "engines": {}}
    for name in order:
        runs = []
        for k in range(args.repeats):
            rs = [r[name][k] for r in per_rank]
            run = {"s": max(r["s"] for r in rs)}
            if name == "plain_read":
                run["bytes"] = sum(r["bytes"] for r in rs)
                run["GBps"] = run["bytes"] / run["s"] / GB
            else:
                run["ok"] = not any(r["mismatch"] for r in rs) and len({r["iteration"] for r in rs}) == 1
                run["mismatch"] = sorted({m for r in rs for m in r["mismatch"]})[:5]
                if "phases" in rs[0]:
                    run["phases"] = {p: max(r["phases"][p] for r in rs) for p in rs[0]["phases"]}
                    run["phases"]["bytes_read"] = sum(r["phases"]["bytes_read"] for r in rs)
            runs.append(run)
        out["engines"][name] = runs
    del chunks, optimizer, scheduler, ref, ref_params
    gc.collect()
    return out


def _own_rank_file(ckpt_root: Path, iteration: int, rank: int) -> Path:
    from datastates_megatron.engine.format.manifest import read_manifest

    d = be.iter_dir(ckpt_root, iteration)
    return d / read_manifest(str(d)).record(rank).file


# --------------------------------------------------------------------------- #
# phases 2 and 3: another data-parallel size, another tensor-parallel size
# --------------------------------------------------------------------------- #
def phase_reshard(args: argparse.Namespace) -> dict:
    """The checkpoints of ``same`` restored at this launch's layout (another DP size, or TP 2 with
    ``--phase tp``), ours against megatron-core's resharding load, alternating."""
    import datastates_megatron
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    root = Path(args.dir).resolve()
    io_group = torch.distributed.new_group(backend="gloo")
    chunks, optimizer, scheduler = be.build_workload(args)
    ref = torch.load(root / "ref_params.pt", weights_only=True)
    scratch = root / f"scratch-tp{tp}dp{dp}"
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    _barrier()
    w = be.Workload(chunks, optimizer, scheduler, root / "ours", io_group)
    ours = OursFrom(w, datastates_megatron, root / "ours", scratch, args.host_cache_gb)
    clock = PhaseClock(ours._ckpt)
    peer = "mcore_reshardable" if tp > 1 else "mcore_sync"  # dp_reshardable: a DP change only
    mcore = be.ENGINES[peer](be.Workload(chunks, optimizer, scheduler, root / peer, io_group), be.BenchOptions())
    mcore.last_iteration = args.warmup
    if tp > 1:
        coords = _shard_coordinates(chunks)

        def mismatches() -> list[str]:
            return _tp_param_mismatches(chunks, ref, coords)

    else:

        def mismatches() -> list[str]:
            return _param_mismatches(chunks, ref)

    order = ["ours", peer]
    rows: dict[str, list[dict]] = {k: [] for k in order}
    ours.restore()  # one unmeasured restore each: compilation, first-use imports, allocations
    be.scramble_state(chunks, optimizer)  # as before every measured one (what a restore leaves as it is)
    mcore.restore()
    # at another TP size the optimizer state has no saved full copy here: ours must equal, bit for
    # bit, what megatron-core's own resharding load gives (checked against the saved parameters below)
    mcore_state = be.snapshot_state(chunks, optimizer) if tp > 1 else None
    _barrier()
    for k in range(args.repeats):
        for name in order if k % 2 == 0 else order[::-1]:
            be.scramble_state(chunks, optimizer)
            be.evict_page_cache(root)
            _barrier()
            clock.reset()
            t0 = time.perf_counter()
            if name == "ours":
                iteration = ours.restore()
            else:
                iteration = mcore.restore()
            secs = time.perf_counter() - t0
            row: dict[str, Any] = {"s": secs, "iteration": iteration}
            if name == "ours":
                row["phases"] = clock.phases(secs)
            _barrier()
            row["mismatch"] = mismatches()[:5]
            if mcore_state is not None:
                row["mismatch"] += [
                    f"{n} (against {peer})" for n in be.compare_state(chunks, optimizer, mcore_state)[:5]
                ]
            rows[name].append(row)
    ours.close()
    mcore.close()
    del mcore_state
    per_rank = _gather(rows)
    label = f"TP 1 -> {tp}" if tp > 1 else f"DP 2 -> {world}"
    out = {"world": world, "tp": tp, "dp": dp, "label": label, "peer": peer, "engines": {}}
    for name in order:
        runs = []
        for k in range(args.repeats):
            rs = [r[name][k] for r in per_rank]
            run = {
                "s": max(r["s"] for r in rs),
                "ok": not any(r["mismatch"] for r in rs) and {r["iteration"] for r in rs} == {args.warmup},
                "mismatch": sorted({m for r in rs for m in r["mismatch"]})[:5],
            }
            if "phases" in rs[0]:
                run["phases"] = {p: max(r["phases"][p] for r in rs) for p in rs[0]["phases"]}
                run["phases"]["bytes_read"] = sum(r["phases"]["bytes_read"] for r in rs)
            runs.append(run)
        out["engines"][name] = runs
    if rank == 0 and not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _init_tensor_parallel(size: int, timeout_s: float) -> None:
    """torch.distributed and megatron's parallel state at TP ``size`` (before ``gpt.init_distributed``,
    which then only seeds), as the demo's TP tests start it."""
    from datetime import timedelta

    from datastates_megatron.megatron.cpu import cuda_on_cpu
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        cuda_on_cpu.install()
    torch.distributed.init_process_group(
        backend="gloo" if not torch.cuda.is_available() else "nccl",
        init_method="env://",
        timeout=timedelta(seconds=timeout_s),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=size, distributed_timeout_minutes=max(1, int(timeout_s // 60))
    )


# --------------------------------------------------------------------------- #
# ranks and driver
# --------------------------------------------------------------------------- #
def rank_main(args: argparse.Namespace) -> int:
    from datastates_megatron.demo import gpt

    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if args.phase == "tp":
        _init_tensor_parallel(2, max(600.0, args.timeout_s))
    gpt.init_distributed(seed=args.seed, timeout_s=max(600.0, args.timeout_s))
    try:
        out = phase_same(args) if args.phase == "same" else phase_reshard(args)
        if rank == 0:
            Path(args.json_out).write_text(json.dumps(out, indent=1))
        _barrier()
    finally:
        gpt.destroy_distributed()
    return 0


def _launch(args: argparse.Namespace, phase: str, nproc: int, out: Path, tree: str | None = None, engines=None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(29500 + os.getpid() % 1000 + nproc),
        str(Path(__file__).resolve()),
        "--phase",
        phase,
        "--json",
        str(out),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--engines",
        ",".join(engines or args.engines),
        "--dir",
        args.dir,
        "--host-cache-gb",
        str(args.host_cache_gb),
        *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "seq_len", "vocab")),
        *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("micro_batch", "seed", "lr")),
        *(["--bf16"] if args.bf16 else []),
        *(["--keep"] if args.keep else []),
        *(["--no-tp"] if args.no_tp else []),
        *(["--before", args.before] if args.before else []),
    ]
    tree = tree or str(_HERE.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tree, str(_HERE)]))
    log.info("%s", " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{phase} at {nproc} ranks failed (exit {proc.returncode})")
    doc = json.loads(out.read_text())
    doc["launch_s"] = time.perf_counter() - t0
    doc["tree"] = tree
    doc["commit"] = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return doc


def summarise(doc: dict) -> dict:
    """Medians over the rounds; ours' phases too."""
    out: dict[str, Any] = {}
    for label, phase in doc["phases"].items():
        rows = {}
        for name, runs in phase["engines"].items():
            r = {"s": _med([x["s"] for x in runs]), "runs_s": [x["s"] for x in runs]}
            if "GBps" in runs[0]:
                r["GBps"] = _med([x["GBps"] for x in runs])
                r["bytes"] = runs[0]["bytes"]
            if "ok" in runs[0]:
                r["ok"] = all(x["ok"] for x in runs)
            if "phases" in runs[0]:
                r["phases"] = {p: _med([x["phases"][p] for x in runs]) for p in runs[0]["phases"]}
                plain = phase["engines"].get("plain_read")
                if plain:  # read speed against the plain read of the same round, round by round
                    r["read_x_plain_runs"] = [
                        x["phases"]["bytes_read"] / x["phases"]["read"] / GB / p["GBps"]
                        if x["phases"]["read"]
                        else None
                        for x, p in zip(runs, plain)
                    ]
                    r["read_x_plain"] = _med(r["read_x_plain_runs"])
            rows[name] = r
        out[label] = rows
    return out


def render(doc: dict, summary: dict) -> str:
    cfg = doc["config"]
    same = summary["same"]
    lines = [
        f"workload: GPT {cfg['layers']}L/{cfg['hidden']}h vocab {cfg['vocab']} "
        f"{'bf16' if cfg['bf16'] else 'fp32'}, 2 ranks (gloo), "
        f"{doc['phases']['same']['state_bytes_per_rank'] / MB:.1f} MB of state per rank; "
        f"{cfg['repeats']} rounds (ABBA), page cache evicted before each; medians, max over ranks",
    ]
    plain = same.get("plain_read")
    if plain:
        lines.append(
            f"machine: plain sequential read of our rank files, both ranks at once: {plain['GBps']:.2f} GB/s "
            f"({plain['bytes'] / MB:.0f} MB in {plain['s']:.3f} s)"
        )
    ours = same["ours"]["s"]
    peers = {n: r for n, r in same.items() if n not in ("ours", "plain_read")}
    lines.append("")
    lines.append(f"{'restore, same layout (2 ranks)':34} {'s':>7} {'x ours':>7}  restored bit-exact  runs")
    for name, r in same.items():
        if name == "plain_read":
            continue
        runs = " ".join(f"{x:.3f}" for x in r["runs_s"])
        lines.append(f"{name:34} {r['s']:7.3f} {r['s'] / ours:7.2f}  {'yes' if r['ok'] else 'NO':>18}  {runs}")
    dist = {n: r for n, r in peers.items() if n in ("mcore_sync", "dcp_async")}
    if dist:
        best = min(dist, key=lambda n: dist[n]["s"])
        lines.append(f"ours / fastest distributed peer ({best}): {ours / dist[best]['s']:.2f} (<= 1.00: no slower)")
    ph = same["ours"]["phases"]
    lines.append("")
    lines.append("ours, by phase (s, median of rounds, max over ranks):")
    lines.append("  " + "  ".join(f"{p} {ph[p]:.3f}" for p in PHASES))
    if plain and ph["read"]:
        gbps = ph["bytes_read"] / ph["read"] / GB
        lines.append(
            f"  read {ph['bytes_read'] / MB:.0f} MB (both ranks) in {ph['read']:.3f} s: {gbps:.2f} GB/s, "
            f"{gbps / plain['GBps']:.0%} of the median plain read ({same['ours']['read_x_plain']:.0%}: the median "
            f"of each round's ratio); verified {ph['bytes_verified'] / MB:.0f} MB/rank, "
            f"copied {ph['bytes_copied'] / MB:.0f} MB/rank"
        )
    if "ours_before" in same:
        lines.append("")
        lines.append(
            f"before/after, ours same layout, same rounds (before: the package of {cfg['before']}; "
            f"after: this tree at {doc['phases']['same']['commit']}):"
        )
        lines.append(
            f"{'':8} {'load s':>7} {'w/o a-g':>7} {'read s':>7} {'read GB/s':>9} {'x plain':>7} "
            + " ".join(f"{p:>10}" for p in PHASES if p != "read")
        )
        for label in ("ours_before", "ours"):
            r = same[label]
            ph = r["phases"]
            gbps = ph["bytes_read"] / ph["read"] / GB if ph["read"] and ph["bytes_read"] else None
            lines.append(
                f"{'before' if label == 'ours_before' else 'after':8} {r['s']:7.3f} "
                f"{ph['without_all_gather']:7.3f} {ph['read']:7.3f} "
                f"{gbps or 0:9.2f} {r.get('read_x_plain') or 0:7.2f} "
                + " ".join(f"{ph[p]:10.3f}" for p in PHASES if p != "read")
            )
    for label, rows in summary.items():
        if label == "same":
            continue
        phase = doc["phases"][label]
        world = phase["world"]
        what = phase.get("label", f"DP 2 -> {world}")
        o, m = rows["ours"], rows[phase.get("peer", "mcore_sync")]
        lines.append("")
        lines.append(f"{'restore, ' + what:34} {'s':>7} {'x mcore':>7}  restored bit-exact  runs")
        for name, r in rows.items():
            runs = " ".join(f"{x:.3f}" for x in r["runs_s"])
            lines.append(f"{name:34} {r['s']:7.3f} {r['s'] / m['s']:7.2f}  {'yes' if r['ok'] else 'NO':>18}  {runs}")
        lines.append(
            f"ours {what} / ours same layout: {o['s'] / ours:.2f}; "
            f"phases: " + "  ".join(f"{p} {o['phases'][p]:.3f}" for p in PHASES)
        )
        lines.append(
            f"  ours' plan: {o['phases']['plan_items']:.0f} items (max over ranks), made and checked in "
            f"{o['phases']['plan_s']:.3f} s; same layout: {same['ours']['phases']['plan_items']:.0f} items, "
            f"{same['ours']['phases']['plan_s']:.3f} s"
        )
        if phase.get("tp", 1) > 1:
            lines.append(
                f"  ({world} ranks, TP {phase['tp']} x DP {phase['dp']}; bit-exact: each rank's parameters against "
                f"their slice of the saved full tensors, and ours' whole state against {phase['peer']}'s restore)"
            )
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "phase"}, "phases": {}}
    try:
        doc["phases"]["same"] = _launch(args, "same", 2, root / "same.json")
        if not args.no_reshard:
            doc["phases"]["dp1"] = _launch(args, "reshard", 1, root / "dp1.json")
            if args.with_dp4:
                doc["phases"]["dp4"] = _launch(args, "reshard", 4, root / "dp4.json")
        if not args.no_tp:
            doc["phases"]["tp2"] = _launch(args, "tp", 2, root / "tp2.json")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarise(doc)
    doc["summary"] = summary
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    print(render(doc, summary), flush=True)
    ok = all(r.get("ok", True) for rows in summary.values() for r in rows.values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase == "driver":
        return driver(args)
    if "RANK" not in os.environ:
        sys.exit("--phase runs under torchrun; run the script without it")
    return rank_main(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
