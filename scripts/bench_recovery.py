#!/usr/bin/env python
"""Time from a fault to the first iteration completed after it, by recovery path, side by side.

    MEGATRON_LM_DIR=<patched core_v0.16.1> python scripts/bench_recovery.py [--layers 4] [--hidden 256]
        [--vocab 32000] [--fault-at 5] [--only MODE ...] [--dir DIR] [--json]

Megatron-LM's own ``pretrain_gpt.py`` on 2 gloo CPU ranks (the tests' tiny GPT, resized by
``--layers/--hidden/--vocab``), checkpointed every 2 iterations, an exception raised in the forward
pass of iteration ``--fault-at`` on every rank (``DSM_FAULT_AT``), then recovered:

* ``inprocess_host``: ``--inprocess-restart --lazy-ckpt``; each rank restores from its host copy;
* ``inprocess_file``: the same with ``--lazy-ckpt-host-copy off``: each rank reads ``--save``;
* ``megatron_inprocess``: ``--inprocess-restart`` with Megatron-LM's own ``torch_dist`` checkpoints
  (no ``--lazy-ckpt``);
* ``job_local``: no in-process restart: the job fails, and a new job (the same command) restores
  from the node-local tier (``--lazy-ckpt-local-dir`` under ``/dev/shm``);
* ``job_persistent``: the same without a node-local tier: the new job reads ``--save``, its page
  cache evicted first (``posix_fadvise``, best effort).

From the training record (rank 0; ``DSM_TRAINING_RECORD``: each logged iteration's time, the
fault's, the abort's, each ``initialize_megatron``'s and ``load_checkpoint``'s start and end, each
process's start), from the last iteration completed before the fault (:func:`phases`): ``partial``
(the faulting iteration's work until the fault), ``detect`` (until the in-process wrapper's abort
reached the checkpointer; a job restart: until the new job's process started), ``abort`` (the rest
of the abort and the wrapper's restart barrier), ``reinit`` (Megatron-LM's initialisation and the
model's build; a new process's imports too), ``restore``, ``first_iteration`` (from the restore's
end to the first iteration completed after it); their sum, and each path's total as a ratio to
``inprocess_host``'s.  A job restart's figure leaves out what a scheduler adds (the requeue,
the allocation).  Each run's final state is checked bit-exact against an uninterrupted run.

Then a goodput table (:func:`goodput`): for ``--gpus`` GPUs failing at ``--failures-per-gpu-hour``
each (default: 419 interruptions in 54 days on 16,384 GPUs, Llama 3's report), checkpointed every
``--interval-s`` seconds, the fraction of time spent on training that is kept, with each path's
measured recovery time:

    goodput = 1 - (interval / 2 + recovery) / MTBF,   MTBF = 1 / (gpus * failures per GPU-hour)

(a failure loses, on average, half an interval of work, plus the recovery; the checkpoints'
own cost to training is left out: the lazy engine's is near zero, and it is the same for each path).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datastates_megatron.megatron.cpu import training_record  # noqa: E402
from _bench_engines import evict_page_cache  # noqa: E402
from tests.integration.megatron_lm_runs import INPROCESS, LAZY, launch  # noqa: E402

ATTEMPTS = 3  # attempts (the faulting one included) a failing path is given before it is reported
MODES = ("inprocess_host", "inprocess_file", "megatron_inprocess", "job_local", "job_persistent")
APART = REPO / ".venv-resiliency"  # scripts/setup.sh installs nvidia-resiliency-ext 0.4.1 here


def _size_args(a: argparse.Namespace) -> list[str]:
    return [
        "--num-layers",
        str(a.layers),
        "--hidden-size",
        str(a.hidden),
        "--num-attention-heads",
        str(max(4, a.hidden // 64)),
        "--vocab-size",
        str(a.vocab),
        "--num-workers",
        "0",
    ]


def _env(fault: str) -> dict[str, str]:
    env = {"DSM_FAULT_AT": fault, "TORCH_CPP_LOG_LEVEL": "error"}
    if importlib.util.find_spec("nvidia_resiliency_ext") is None and APART.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(APART)) if p)
    return env


def _launch(tmp: Path, name: str, args: list[str], env: dict[str, str] | None = None, kill_when=None):
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return launch(tmp, name, args, timeout=900, kill_when=kill_when)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def phases(record: str, fault_at: int) -> dict:
    """Rank 0's recovery phases (seconds) from its training record: ``partial`` (the faulting
    iteration's work until the fault), ``detect`` (until the wrapper's abort reached the
    checkpointer; a job restart: until the new job's process started, the old one's exit
    included), ``abort`` (the rest of the abort, the wrapper's restart barrier; a job restart: 0),
    ``reinit`` (Megatron-LM's initialisation and the model's build, a new process's imports
    included), ``restore`` and ``first_iteration``.  A record without the fault's or the
    initialisation's times (an older one) gives their sum as ``partial``."""
    events = training_record.read_events(record, 0)
    before = [i for i, e in enumerate(events) if e.get("iteration") == fault_at - 1]
    loads = [i for i, e in enumerate(events) if "load" in e and before and i > before[0]]
    if not before or len(loads) != 1:  # one recovery: one restore after the last iteration before the fault
        raise RuntimeError(f"{record}: no fault-and-recovery in the record ({len(loads)} restores after the fault)")
    first = next((e for e in events[loads[0] :] if "iteration" in e), None)
    if first is None or first["iteration"] != fault_at:  # an older checkpoint restored: iterations replayed
        raise RuntimeError(f"{record}: the first iteration after the restore is {first and first['iteration']}")
    steps = sorted(
        b["t"] - a["t"]
        for a, b in zip(events, events[1:])
        if "iteration" in a and "iteration" in b and b["iteration"] == a["iteration"] + 1
    )
    t_last, (t0, t1), t_first = events[before[0]]["t"], events[loads[0]]["load"], first["t"]
    between = events[before[0] + 1 : loads[0]]

    t_fault = next((e["fault"] for e in between if "fault" in e), None)
    t_abort = next((e["abort"] for e in between if "abort" in e), None)
    t_start = next((e["t"] for e in between if "start" in e and "t" in e), None)  # a new process: a job restart
    t_init = next((e["init"][0] for e in between if "init" in e), None)
    out = {"partial": t0 - t_last, "detect": 0.0, "abort": 0.0, "reinit": 0.0}
    if t_fault is not None and t_init is not None:
        t_detected = t_start if t_start is not None else t_abort
        if t_detected is not None:
            out["partial"] = t_fault - t_last
            out["detect"] = t_detected - t_fault
            out["abort"] = t_init - t_abort if t_start is None else 0.0
            out["reinit"] = t0 - (t_init if t_start is None else t_start)
    out.update(restore=t1 - t0, first_iteration=t_first - t1)
    out["until_restore"] = t0 - t_last
    out["total"] = out["until_restore"] + out["restore"] + out["first_iteration"]
    out["iteration"] = statistics.median(steps) if steps else 0.0
    return out


def run_mode(mode: str, a: argparse.Namespace, tmp: Path, size: list[str]) -> dict:
    save = tmp / "ckpt"
    base = ["--train-iters", str(a.iters), *size, "--save", str(save), "--load", str(save), "--save-interval", "2"]
    fault = _env(f"raise:{a.fault_at}")
    if mode.startswith("inprocess"):
        extra = ["--lazy-ckpt-host-copy", "off"] if mode == "inprocess_file" else []
        run = _launch(tmp, mode, [*base, *LAZY, *INPROCESS, *extra], fault)
    elif mode == "megatron_inprocess":
        log = tmp / f"{mode}.log"

        def failing() -> bool:  # NVRx restarts a failing restore again and again: three tries are enough
            return log.is_file() and log.read_bytes().count(b"fn_ex:") >= 2 * ATTEMPTS

        run = _launch(tmp, mode, [*base, "--ckpt-format", "torch_dist", *INPROCESS], fault, failing)
        if failing():
            causes = sorted(set(re.findall(r"fn_ex: (\w+\([^)]*\))", run.log)))
            return {
                "error": f"{ATTEMPTS} attempts, the faulting one included, failed; then stopped: {', '.join(causes)}"
            }
    else:
        local = []
        if mode == "job_local":
            shm = Path(tempfile.mkdtemp(prefix="dsm-bench-recovery-", dir="/dev/shm"))
            local = ["--lazy-ckpt-local-dir", str(shm)]
        try:
            args = [*base, *LAZY, *local]
            first = _launch(tmp, mode, args, fault)
            if first.returncode == 0:
                return {"error": "the fault did not end the job"}
            if mode == "job_persistent":
                evict_page_cache(save)
            run = _launch(tmp, mode, args)  # the same record, appended to: both jobs' iterations and loads
            run = type(run)(run.returncode, first.log + run.log, run.record)
        finally:
            if local:
                shutil.rmtree(local[1], ignore_errors=True)
    if run.returncode != 0:
        errors = [ln for ln in run.log.splitlines() if "Error" in ln or "assert" in ln]
        return {"error": (errors[-1] if errors else run.log.splitlines()[-1:] or ["?"])[0][-300:]}
    out = phases(run.record, a.fault_at)
    out["final_digest"] = (run.final(0) or {}).get("digest")
    out["from_host_memory"] = "from host memory: 0 bytes read from storage" in run.log
    return out


def goodput(recovery_s: float, gpus: int, failures_per_gpu_hour: float, interval_s: float) -> float:
    """The fraction of time spent on training that is kept (see the module docstring)."""
    mtbf_s = 3600.0 / (gpus * failures_per_gpu_hour)
    return max(0.0, 1.0 - (interval_s / 2 + recovery_s) / mtbf_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--fault-at", type=int, default=5)
    p.add_argument("--only", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--dir", default=None, help="parent of the runs' directory (removed after)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--failures-per-gpu-hour", type=float, default=419 / (54 * 24 * 16384))
    p.add_argument("--interval-s", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not os.environ.get("MEGATRON_LM_DIR"):
        print("error: set MEGATRON_LM_DIR to a patched Megatron-LM core_v0.16.1 tree", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=a.dir))
    size = _size_args(a)
    doc: dict = {
        "size": size,
        "fault_at": a.fault_at,
        "modes": {},
        "goodput_inputs": {
            "gpus": a.gpus,
            "failures_per_gpu_hour": a.failures_per_gpu_hour,
            "interval_s": a.interval_s,
        },
    }
    try:
        (work / "reference").mkdir()
        ref = _launch(work / "reference", "reference", ["--train-iters", str(a.iters), *size])
        reference = (ref.final(0) or {}).get("digest") if ref.returncode == 0 else None
        for mode in a.only:
            tmp = work / mode
            tmp.mkdir()
            got = run_mode(mode, a, tmp, size)
            if "final_digest" in got:
                got["bit_exact"] = got.pop("final_digest") == reference and reference is not None
            doc["modes"][mode] = got
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["goodput"] = {
        mode: {str(g): goodput(m["total"], g, a.failures_per_gpu_hour, a.interval_s) for g in a.gpus}
        for mode, m in doc["modes"].items()
        if "total" in m
    }
    print(json.dumps(doc, indent=1) if a.json else render(doc))
    return 0


def render(doc: dict) -> str:
    modes = doc["modes"]
    base = modes.get("inprocess_host", {}).get("total")
    lines = [
        f"recovery from a fault in iteration {doc['fault_at']} (rank 0; seconds)",
        f"{'path':<20} {'partial':>7} {'detect':>6} {'abort':>6} {'reinit':>6} {'restore':>8} {'first_iter':>10} "
        f"{'total':>7} {'ratio':>6}  notes",
    ]
    for mode, m in modes.items():
        if "error" in m:
            lines.append(f"{mode:<20} failed: {m['error']}")
            continue
        ratio = f"{m['total'] / base:.2f}" if base else "-"
        notes = [f"iteration {m['iteration']:.2f} s", "bit-exact" if m.get("bit_exact") else "NOT bit-exact"]
        if m.get("from_host_memory"):
            notes.append("0 bytes from storage")
        lines.append(
            f"{mode:<20} {m['partial']:>7.2f} {m['detect']:>6.2f} {m['abort']:>6.2f} {m['reinit']:>6.2f} "
            f"{m['restore']:>8.3f} {m['first_iteration']:>10.2f} {m['total']:>7.2f} {ratio:>6}  {', '.join(notes)}"
        )
    g = doc["goodput_inputs"]
    lines += [
        "",
        f"goodput: a checkpoint every {g['interval_s']:.0f} s, {g['failures_per_gpu_hour']:.3g} failures per GPU-hour, "
        "the recovery above (no scheduler requeue)",
        f"{'path':<20} " + " ".join(f"{f'{n} GPUs':>12}" for n in g["gpus"]),
    ]
    for mode, by in doc["goodput"].items():
        lines.append(f"{mode:<20} " + " ".join(f"{by[str(n)]:>12.4%}" for n in g["gpus"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
