"""Worker for tests/faults and tests/faults/sweep.py: CheckpointManager on a deterministic per-rank
state, with the faults a test asks for (slow copies, slow restores, timed SIGKILLs, a full disk).

Usable two ways: as a script (``python tests/workers/fault_worker.py MODE ...``, launched by
``tests/distributed/ranks.py``; prints one ``RESULT <json>`` line) and as a function
(:func:`run`, called in a forked rank by ``tests/distributed/ranks.py``).

Every rank appends to ``<progress>.rank<R>`` what the application has been *told*:
``snapshot <it>`` once the gate returned (the device->host copies of ``it`` are complete),
``ack <it>`` once ``wait()`` reported iteration ``it`` committed, ``load_start`` / ``load_done <it>``
around a load.  The lines are written with ``os.write`` (no fsync: a SIGKILL does not lose what the
kernel already has), so after a crash the test knows which commits were acknowledged."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


from datastates_megatron._output import write_line  # noqa: E402
from datastates_megatron.engine import EngineOptions, NoCheckpointError  # noqa: E402
from datastates_megatron.engine.manager import CheckpointManager  # noqa: E402


# ---------------------------------------------------------------------------------------- state
def make_state(rank: int, big: int) -> dict[str, torch.Tensor]:
    """Different sizes per rank; a big tensor (streamed through the cache in chunks), many small ones
    (coalesced), a bf16 one and a 0-d one."""
    ts = {f"small{i}": torch.zeros(10 + i + rank) for i in range(24)}
    ts["big"] = torch.zeros(big + 1000 * rank)
    ts["bf16"] = torch.zeros(33, 5, dtype=torch.bfloat16)
    ts["step"] = torch.zeros(())
    return ts


def fill(ts: dict[str, torch.Tensor], rank: int, it: int) -> None:
    """The 'training' state at iteration ``it``: every element depends on (rank, it, tensor, index)."""
    for k, t in enumerate(ts.values()):
        base = (rank * 1000 + it * 10 + k) % 251
        t.copy_(((torch.arange(t.numel(), dtype=torch.int64) + base) % 251).reshape(t.shape).to(t.dtype))


def is_state_of(ts: dict[str, torch.Tensor], rank: int, it: int) -> bool:
    expected = {n: t.clone() for n, t in ts.items()}
    fill(expected, rank, it)
    return all(torch.equal(ts[n], expected[n]) for n in ts)


# ---------------------------------------------------------------------------------------- faults
class Progress:
    """Append-only record of what this rank was told (survives SIGKILL: no user-space buffering)."""

    def __init__(self, prefix: str | None, rank: int) -> None:
        if prefix:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._fd = os.open(f"{prefix}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if prefix else None

    def note(self, line: str) -> None:
        if self._fd is not None:
            os.write(self._fd, (line + "\n").encode())


def read_progress(prefix: str, world: int) -> list[list[str]]:
    out = []
    for r in range(world):
        try:
            with open(f"{prefix}.rank{r}") as f:
                out.append(f.read().split("\n"))
        except FileNotFoundError:
            out.append([])
    return out


def acknowledged(prefix: str, world: int) -> int | None:
    """Newest iteration any rank was told is committed."""
    acks = [int(line.split()[1]) for lines in read_progress(prefix, world) for line in lines if line.startswith("ack ")]
    return max(acks) if acks else None


def arm_kill(after_ms: float) -> threading.Timer:
    """SIGKILL this process ``after_ms`` from now (an external ``kill -9``, not an engine crash point)."""
    timer = threading.Timer(after_ms / 1000.0, lambda: os.kill(os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
    return timer


def slow_copies(ms: float) -> None:
    from datastates_megatron.engine.save import device_copy

    real = device_copy.DeviceCopier.copy

    def copy(self, src, dst, ready):
        time.sleep(ms / 1000.0)
        return real(self, src, dst, ready)

    device_copy.DeviceCopier.copy = copy


def slow_restore(ms: float) -> None:
    from datastates_megatron.engine.load import reader

    real = reader._copy_one

    def copy_one(*args, **kwargs):
        time.sleep(ms / 1000.0)
        return real(*args, **kwargs)

    reader._copy_one = copy_one


def slow_writes(ms: float) -> None:
    from datastates_megatron.engine.format import writer

    real = writer.RankFileWriter.write

    def write(self, data, offset):
        time.sleep(ms / 1000.0)
        return real(self, data, offset)

    writer.RankFileWriter.write = write


def fill_disk(path: str, leave_bytes: int) -> int:
    """Create ``path`` so that only ``leave_bytes`` stay free on its file system; returns its size."""
    st = os.statvfs(os.path.dirname(path))
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes) // 4096 * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


# ---------------------------------------------------------------------------------------- main
def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "resume", "load", "fulldisk"])
    p.add_argument("--root", required=True)
    p.add_argument("--iters", type=int, default=3, help="save: iterations start..start+iters-1")
    p.add_argument("--until", type=int, default=None, help="resume: keep saving up to this iteration")
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--big", type=int, default=200_000, help="elements of the big fp32 tensor")
    p.add_argument("--cache-kb", type=int, default=256)
    p.add_argument("--flush-threads", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=0)
    p.add_argument("--recycle", default="local", help="CheckpointManager recycle_files")
    p.add_argument("--on-error", default="raise")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--progress", default=None, help="prefix of the per-rank progress files")
    p.add_argument("--slow-copy-ms", type=float, default=0.0)
    p.add_argument("--slow-restore-ms", type=float, default=0.0)
    p.add_argument("--slow-write-ms", type=float, default=0.0)
    p.add_argument("--kill-after-ms", type=float, default=None, help="SIGKILL this long after --kill-at starts")
    p.add_argument("--kill-at", default=None, help="'save:<iteration>' or 'load'")
    p.add_argument("--kill-rank", type=int, default=None, help="only this rank is killed (default: all)")
    p.add_argument(
        "--fill",
        choices=["data", "manifest"],
        default="data",
        help="fulldisk: leave too little space for the rank files, or just enough for them and not the manifest",
    )
    return p.parse_args(argv)


def run(argv) -> dict:
    a = parse(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = Progress(a.progress, rank)
    if a.slow_copy_ms:
        slow_copies(a.slow_copy_ms)
    if a.slow_restore_ms:
        slow_restore(a.slow_restore_ms)
    if a.slow_write_ms:
        slow_writes(a.slow_write_ms)
    kill_here = a.kill_after_ms is not None and (a.kill_rank is None or a.kill_rank == rank)

    ts = make_state(rank, a.big)
    opts = EngineOptions(cache_bytes=a.cache_kb << 10, flush_threads=a.flush_threads, timeout_s=a.timeout)
    mgr = CheckpointManager(a.root, opts, keep_last=a.keep_last, on_error=a.on_error, recycle_files=a.recycle)
    for n, t in ts.items():
        mgr.register(n, t)
    result: dict = {"rank": rank}

    if a.mode in ("resume", "load"):
        dist.barrier()  # start loading together, so a timed kill lands in every rank's load
        progress.note("load_start")
        if kill_here and a.kill_at == "load":
            arm_kill(a.kill_after_ms)
        try:
            r = mgr.load()
        except NoCheckpointError as e:
            if a.mode == "load":
                result["error"] = f"{type(e).__name__}: {e}"
                mgr.close()
                return result
            r = None  # resume: nothing committed yet, start from scratch
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"
            result["untouched"] = all(bool((t == 0).all()) for t in ts.values())
            mgr.close()
            return result
        progress.note(f"load_done {r.iteration if r else 0}")
        if r is None:
            result.update(iteration=None, exact=True, objects_ok=True)
        else:
            result.update(
                iteration=r.iteration,
                exact=is_state_of(ts, rank, r.iteration),
                objects_ok=r.objects == {"iteration": r.iteration, "rank": rank},
            )
        a.start = (r.iteration if r else 0) + 1
        if a.mode == "resume":
            a.iters = max(0, (a.until if a.until is not None else a.start + a.iters - 1) - a.start + 1)

    if a.mode in ("save", "resume"):
        errors, committed = [], []
        for it in range(a.start, a.start + a.iters):
            fill(ts, rank, it)
            if kill_here and a.kill_at == f"save:{it}":
                arm_kill(a.kill_after_ms)
            try:
                mgr.save(it, {"iteration": it, "rank": rank}, {"note": "fault"})
                mgr.wait_for_snapshot()
                progress.note(f"snapshot {it}")
                for t in ts.values():
                    t.fill_(-1)  # 'training' mutates the state right after the gate
                for rec in mgr.wait():
                    committed.append(rec.iteration)
                    progress.note(f"ack {rec.iteration}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        try:
            mgr.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
        result.update(committed=committed, errors=errors)
    elif a.mode == "fulldisk":
        result.update(fulldisk(a, mgr, ts, rank))
    else:
        mgr.close()
    return result


def fulldisk(a, mgr: CheckpointManager, ts, rank: int) -> dict:
    """Iteration 1 commits; the disk is filled; iteration 2 fails; space is freed; iteration 3 commits."""
    from datastates_megatron.engine.format.manifest import read_manifest, read_tracker
    from datastates_megatron.engine.names import iter_dir
    from datastates_megatron.engine.tiers.tier import latest_committed

    out: dict = {"errors": {}, "committed": []}

    def step(it: int) -> None:
        fill(ts, rank, it)
        try:
            started = mgr.save(it, {"iteration": it, "rank": rank})
            mgr.wait_for_snapshot()
            for t in ts.values():
                t.fill_(-1)
            out["committed"] += [r.iteration for r in mgr.wait()]
            out.setdefault("started", {})[it] = started
        except Exception as e:  # noqa: BLE001
            out["errors"].setdefault(it, []).append(f"{type(e).__name__}: {e}")
        dist.barrier()

    step(1)
    filler = os.path.join(os.path.dirname(os.path.abspath(a.root)), "filler.bin")
    if rank == 0:
        m = read_manifest(iter_dir(a.root, 1))
        if a.fill == "data":
            leave = sum(r.file_bytes for r in m.ranks) // 3  # rank files of iteration 2 cannot fit
        else:  # exactly the rank files fit (tmpfs counts 4 KiB pages); the manifest does not
            leave = sum(-(-r.file_bytes // 4096) * 4096 for r in m.ranks)
        out["filler_bytes"] = fill_disk(filler, leave)
    dist.barrier()
    step(2)  # fails: full disk
    if rank == 0:
        out["after_failure"] = {
            "latest": latest_committed(a.root),
            "tracker": read_tracker(a.root),
            "iter2_entries": sorted(os.listdir(iter_dir(a.root, 2))) if os.path.isdir(iter_dir(a.root, 2)) else None,
        }
    try:
        mgr.load(2)
        out["iter2_loadable"] = True
    except NoCheckpointError:
        out["iter2_loadable"] = False
    except Exception as e:  # noqa: BLE001
        out["iter2_loadable"] = f"{type(e).__name__}: {e}"
    out["untouched_by_failed_load"] = all(bool((t == -1).all()) for t in ts.values())
    dist.barrier()
    if rank == 0:
        os.unlink(filler)
    dist.barrier()
    step(3)  # space was freed: must commit
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001
        out["errors"].setdefault("close", []).append(f"{type(e).__name__}: {e}")
    return out


def main() -> int:
    result = run(sys.argv[1:])
    write_line("RESULT " + json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
