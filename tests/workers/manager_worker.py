"""Worker for tests/distributed: save or load a deterministic per-rank state with CheckpointManager."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from datastates_megatron._output import write_line
from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager


def make_state(rank: int):
    # different sizes per rank; one tensor bigger than the cache (streamed), many small ones (coalesced)
    ts = {f"small{i}": torch.zeros(10 + i + rank) for i in range(30)}
    ts["big"] = torch.zeros(200_000 + 1000 * rank)
    ts["bf16"] = torch.zeros(33, 5, dtype=torch.bfloat16)
    ts["step"] = torch.zeros(())
    return ts


def fill(ts, rank: int, it: int):
    for k, (name, t) in enumerate(ts.items()):
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype) * 0 + (rank * 1000 + it * 10 + k) % 251)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load", "resume"])
    p.add_argument("--root", required=True)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--keep-last", type=int, default=0)
    p.add_argument("--keep-every", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-iter", type=int, default=-1)
    p.add_argument("--on-error", default="raise")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--world-layout", default="{}")
    p.add_argument("--local-root", default=None, help="node-local tier; '{node}' is replaced by the node id")
    p.add_argument("--persist-interval", type=int, default=1)
    p.add_argument("--local-keep-last", type=int, default=2)
    p.add_argument("--local-fallback", default="all")
    p.add_argument("--replicas", type=int, default=None, help="partner replicas (default: the manager's)")
    p.add_argument("--replication-jump", type=int, default=None)
    p.add_argument("--abandon", action="store_true", help="save: exit without close() (as a kill -9 would)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ts = make_state(rank)
    opts = EngineOptions(cache_bytes=256 << 10, flush_threads=2, timeout_s=60)
    mgr = CheckpointManager(
        a.root,
        opts,
        keep_last=a.keep_last,
        keep_every=a.keep_every,
        on_error=a.on_error,
        layout=json.loads(a.world_layout),
        local_root=a.local_root,
        persist_interval=a.persist_interval,
        local_keep_last=a.local_keep_last,
        local_fallback=a.local_fallback,
        replicas=a.replicas,
        replication_jump=a.replication_jump,
    )
    for n, t in ts.items():
        mgr.register(n, t)
    result = {"rank": rank}
    if a.mode == "resume":  # load the latest, check it, then keep saving on top of it
        r = mgr.load()
        expected = {n: t.clone() for n, t in ts.items()}
        fill(expected, rank, r.iteration)
        result.update(iteration=r.iteration, exact=all(torch.equal(ts[n], expected[n]) for n in ts), root=r.root)
        a.start = r.iteration + 1
    if a.mode in ("save", "resume"):
        if rank == a.fail_rank:
            from datastates_megatron.engine.format import writer

            real = writer.RankFileWriter.write

            def write(self, data, offset):
                if f"iter_{a.fail_iter:07d}" in self.path:
                    raise OSError(28, "No space left on device (injected)")
                return real(self, data, offset)

            writer.RankFileWriter.write = write
        errors, committed = [], []
        for it in range(a.start, a.start + a.iters):
            fill(ts, rank, it)
            try:
                mgr.save(it, {"iteration": it, "rank": rank}, {"note": "test"})
                mgr.wait_for_snapshot()
                for t in ts.values():
                    t.fill_(-1)  # mutate right after the gate
                committed += [r.iteration for r in mgr.wait()]
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        if a.abandon:  # every local commit (and its replicas) is done; no end-of-run promotion
            result.update(committed=committed, errors=errors)
            write_line("RESULT " + json.dumps(result))
            os._exit(0)
        try:
            mgr.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
        result.update(committed=committed, errors=errors)
    else:
        try:
            r = mgr.load(a.iteration, root=os.environ.get("DSM_TEST_LOAD_ROOT"))  # per-rank override
            expected = {n: t.clone() for n, t in ts.items()}
            fill(expected, rank, r.iteration)
            result["iteration"] = r.iteration
            result["objects"] = r.objects
            result["root"] = r.root
            result["exact"] = all(torch.equal(ts[n], expected[n]) for n in ts)
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"
            result["untouched"] = all(bool((t == 0).all()) for t in ts.values())
        mgr.close()
    write_line("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
