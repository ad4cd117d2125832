"""The CPU demo, end to end: train, kill -9 mid-training, resume, prove the trajectory is bit-exact.

1. reference: a small GPT trains on 2 CPU ranks (torchrun, gloo) without checkpointing;
2. the same run with ``--lazy-ckpt`` checkpointing every iteration is killed with SIGKILL (every
   rank, a real ``kill -9``) once a few checkpoints are committed;
3. a restart resumes from the latest committed checkpoint and trains to the end;
4. the losses after resume and a digest of every parameter / optimizer-state shard are compared
   with the reference to the bit, and a table of costs is printed.

Usage: ``python -m datastates_megatron.demo.run_demo [--iters 30 --kill-after 8 --workdir runs/demo]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

from .._output import write_line

__all__ = ["MARK", "fresh_workdir", "main"]


def _signal_ranks(proc: subprocess.Popen, sig: int) -> list:
    """Send ``sig`` to every process under the launcher ``proc`` (torchrun starts its workers in
    sessions of their own); returns them as ``psutil`` processes."""
    import psutil

    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return procs


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker: a real ``kill -9`` of the whole run."""
    import psutil

    procs = _signal_ranks(proc, signal.SIGKILL)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)


def _launch(
    workdir: str, name: str, nproc: int, train_args: list[str], kill_after: int | None = None, timeout: float = 900
) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "datastates_megatron.demo.train",
        *train_args,
    ]
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        tracker = os.path.join(workdir, "ckpt", "latest_checkpointed_iteration.txt")
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_after is not None and os.path.exists(tracker):
                with open(tracker) as f:
                    text = f.read().strip()
                if text.isdigit() and int(text) >= kill_after:
                    _kill_tree(proc)  # kill -9 of torchrun and every rank
                    proc.wait()
                    write_line(f"  killed every rank with SIGKILL after checkpoint {text} was committed")
                    return -9
            time.sleep(0.05)
        if proc.poll() is None:
            _kill_tree(proc)
            raise SystemExit(f"{name} run timed out after {timeout:.0f}s; log: {log_path}")
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed (exit {proc.returncode}); log: {log_path}")
    return 0


def _load(prefix: str, nproc: int) -> list[dict]:
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(nproc)]


def _median_iteration_s(iterations: list[dict], warmup: int = 2) -> float:
    """The median iteration time, leaving out the first ``warmup`` iterations after start-up when
    more than that ran (a short ``--iters`` run keeps them); NaN when none ran."""
    times = [x["iter_s"] for x in iterations]
    times = times[warmup:] if len(times) > warmup else times
    return statistics.median(times) if times else float("nan")


MARK = ".datastates-demo"  # in a --workdir the demo made: what it may remove at the next run


def fresh_workdir(path: str) -> None:
    """An empty ``path`` for this run (the demo's, and ``scripts/bench_stall.py``'s): a new or empty directory is used as it is; one an earlier
    demo run made (it holds :data:`MARK`) is emptied; anything else is someone else's and is
    refused, nothing removed (``rmtree`` never follows a link inside it)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise SystemExit(f"--workdir {path}: not a directory the demo made; give a new or empty directory")
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.isfile(os.path.join(path, MARK)):
            raise SystemExit(
                f"--workdir {path}: not empty and not made by the demo (no {MARK}): nothing removed; "
                "give a new or empty directory"
            )
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MARK), "w") as f:
        f.write("made by datastates_megatron.demo.run_demo: removed by its next run\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--kill-after", type=int, default=10, help="kill once this checkpoint is committed")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--model", default="--num-layers 4 --hidden-size 256 --seq-length 128 --vocab-size 1024")
    a = p.parse_args(argv)
    fresh_workdir(a.workdir)
    w = a.workdir
    common = [*a.model.split(), "--train-iters", str(a.iters), *(["--bf16"] if a.bf16 else [])]
    lazy = [
        "--lazy-ckpt",
        "--save",
        os.path.join(w, "ckpt"),
        "--save-interval",
        "1",
        "--lazy-ckpt-host-cache-gb",
        "0.25",
        "--lazy-ckpt-flush-threads",
        "2",
        "--lazy-ckpt-keep-last",
        "2",
    ]

    write_line(f"[1/3] reference run: {a.iters} iterations on {a.nproc} CPU ranks, no checkpointing")
    _launch(w, "reference", a.nproc, [*common, "--log-json", os.path.join(w, "reference")])
    write_line(f"[2/3] lazy-checkpointed run (every iteration), killed with kill -9 after checkpoint {a.kill_after}")
    if _launch(w, "killed", a.nproc, [*common, *lazy], kill_after=a.kill_after) != -9:
        raise SystemExit("the run finished before it could be killed: raise --iters or lower --kill-after")
    write_line("[3/3] restart: resume from the latest committed checkpoint and train to the end")
    _launch(w, "resumed", a.nproc, [*common, *lazy, "--log-json", os.path.join(w, "resumed")])

    ref, res = _load(os.path.join(w, "reference"), a.nproc), _load(os.path.join(w, "resumed"), a.nproc)
    start = res[0]["resumed_from"]
    ref_loss = {x["iteration"]: x["loss"] for x in ref[0]["iterations"]}
    res_loss = {x["iteration"]: x["loss"] for x in res[0]["iterations"]}
    same_loss = bool(res_loss) and all(res_loss[i] == ref_loss[i] for i in res_loss)
    same_state = all(r["digest"] == q["digest"] for r, q in zip(ref, res))
    n_tensors = len(res[0]["digest"])
    write_line(f"\nresumed from iteration {start} (latest committed when killed: >= {a.kill_after})")
    last = max(res_loss, default=None)
    example = f", e.g. it {last}: {res_loss[last]!r} vs {ref_loss[last]!r}" if last is not None else ""
    write_line(
        f"losses after resume equal the uninterrupted run to the bit: {same_loss} ({len(res_loss)} iterations{example})"
    )
    write_line(
        f"final parameters + optimizer state equal to the bit on every rank: {same_state} ({n_tensors} tensors on rank 0)"
    )

    t_ref = _median_iteration_s(ref[0]["iterations"])
    t_ckpt = _median_iteration_s(res[0]["iterations"])
    commits = [c for r in res for c in r["commits"]]
    stall = statistics.median(c["stall_s"] for c in commits) if commits else float("nan")
    per_rank = res[0]["commits"][-1]["bytes_per_rank"] if res[0]["commits"] else []
    flush = statistics.median(c["flush_gbps"] for c in res[0]["commits"]) if res[0]["commits"] else float("nan")
    rows = [
        ("iteration time, no checkpointing (median)", f"{t_ref * 1e3:.1f} ms"),
        ("iteration time, checkpoint every iteration", f"{t_ckpt * 1e3:.1f} ms ({t_ckpt / t_ref:.3f}x)"),
        (
            "training stall per checkpoint (median)",
            f"{stall * 1e3:.2f} ms ({stall / t_ckpt * 100:.1f}% of an iteration)",
        ),
        ("bytes per rank per checkpoint", ", ".join(f"{b / 1e6:.1f} MB" for b in per_rank)),
        ("flush throughput (median, save -> fsynced)", f"{flush:.2f} GB/s"),
        ("checkpoints committed after resume", f"{len(res[0]['commits'])}"),
    ]
    width = max(len(k) for k, _ in rows)
    write_line()
    for k, v in rows:
        write_line(f"  {k:<{width}}  {v}")
    ok = same_loss and same_state
    write_line("\nDEMO " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
