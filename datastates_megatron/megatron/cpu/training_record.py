"""An exact record of a Megatron-LM run, for comparing a resumed run with an uninterrupted one.

Megatron's log prints the grad norm and params norm with three decimals; this records them (and
the lm loss) as Python floats, one JSON line per iteration per rank, plus, when ``train`` returns,
a digest of every tensor a resume needs (:func:`state_digest`), when each ``initialize_megatron``
and ``load_checkpoint`` began and ended, when an in-process restart's abort reached the checkpointer,
when a fault was injected (:func:`event`) and when the process started.
Lines are flushed one by one, so a run killed with ``kill -9`` keeps every iteration it logged.

:func:`install` wraps ``megatron.training.training.training_log`` (called once per iteration, on
every rank) and ``train`` in this process; arguments are taken by name, so core_v0.16 and core_v0.19
(whose signatures differ in trailing parameters) are both served. Used by
:mod:`~datastates_megatron.megatron.megatron_lm.run` (and so :mod:`.launch`) when ``DSM_TRAINING_RECORD`` names a
path prefix.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import os
import time
from typing import Any
from collections.abc import Callable

__all__ = ["ENV", "install", "read", "read_events", "read_runs"]

ENV = "DSM_TRAINING_RECORD"


def _float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item() if hasattr(x, "item") else x)


class _Record:
    """Appends JSON lines to ``PREFIX.rank<R>.jsonl`` (opened on first use: the rank is known only
    after Megatron has initialised torch.distributed).  Thread-safe: an in-process restart's abort
    runs on another thread than training."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._file = None
        self._lock = threading.Lock()
        self._early: list[dict] = []  # entries from before torch.distributed (a spare rank's abort)

    def write(self, entry: dict) -> None:
        with self._lock:
            if self._file is None:
                import psutil
                import torch.distributed as dist

                if not dist.is_initialized():  # the rank, and so the file, is not known yet
                    self._early.append(entry)
                    return
                self._file = open(f"{self.prefix}.rank{dist.get_rank()}.jsonl", "a", encoding="utf-8")
                # where a resumed run begins, and when its process started (a job restart's relaunch)
                start = {"start": os.getpid(), "t": psutil.Process().create_time()}
                self._file.write("".join(json.dumps(e) + "\n" for e in (start, *self._early)))
                self._early.clear()
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()


_active: _Record | None = None  # this process's record, once installed


def event(name: str) -> None:
    """A ``{name: time}`` line in this process's record, if one is installed: a fault injected, an
    attempt aborted (``scripts/bench_recovery.py`` splits a recovery into phases by them)."""
    if _active is not None:
        _active.write({name: time.time()})


def _timed(fn: Callable, key: str, record: _Record) -> Callable:
    """``fn``, writing ``{key: [start, end]}`` to ``record`` after each call."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.time()
        result = fn(*args, **kwargs)
        record.write({key: [t0, time.time()]})
        return result

    return timed


def _wrap(fn: Callable, after: Callable[[inspect.BoundArguments, Any], None]) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        after(sig.bind(*args, **kwargs), result)
        return result

    return wrapper


def install(prefix: str) -> None:
    """Record this process's training to ``PREFIX.rank<R>.jsonl`` (see the module docstring)."""
    global _active
    from megatron.training import training

    from ..megatron_lm import checkpointing as glue

    record = _active = _Record(prefix)

    def iteration_logged(bound: inspect.BoundArguments, _result: Any) -> None:
        a = bound.arguments
        loss = (a.get("loss_dict") or {}).get("lm loss")
        record.write(
            {
                "iteration": int(a["iteration"]),
                "grad_norm": _float(a.get("grad_norm")),
                "params_norm": _float(a.get("params_norm")),
                "lm_loss": _float(loss),
                "skipped": int(a.get("skipped_iter") or 0),
                "t": time.time(),  # when it was logged: a run's pace (tests/faults/test_pretrain_gpt_stall.py)
            }
        )

    def trained(bound: inspect.BoundArguments, result: Any) -> None:
        a = bound.arguments
        iteration = result[0] if isinstance(result, tuple) else None
        record.write({"final_iteration": iteration, "digest": state_digest(a["model"], a["optimizer"])})

    original_abort = glue.abort

    @functools.wraps(original_abort)
    def abort():  # an in-process restart's abort reached the checkpointer (Megatron's AbortCheckpoint)
        record.write({"abort": time.time()})
        return original_abort()

    training.training_log = _wrap(training.training_log, iteration_logged)
    training.train = _wrap(training.train, trained)
    # when each restore, and each attempt's re-initialisation, began and ended (scripts/bench_recovery.py)
    training.load_checkpoint = _timed(training.load_checkpoint, "load", record)
    if hasattr(training, "initialize_megatron"):  # pretrain's, in every tested Megatron-LM
        training.initialize_megatron = _timed(training.initialize_megatron, "init", record)
    glue.abort = abort


def read_runs(prefix: str, rank: int) -> list[tuple[dict[int, dict], dict | None]]:
    """One rank's record split by process (a requeued or resumed run appends to the file of the
    run before it): per run, ``({iteration: entry}, final entry or None)``."""
    path = f"{prefix}.rank{rank}.jsonl"
    runs: list[tuple[dict[int, dict], dict | None]] = []
    if not os.path.exists(path):
        return runs
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the last line of a killed run may be cut
            entry = json.loads(line)
            if "start" in entry or not runs:
                runs.append(({}, None))
            if "digest" in entry:
                runs[-1] = (runs[-1][0], entry)
            elif "iteration" in entry:
                runs[-1][0][entry["iteration"]] = entry
    return runs


def read_events(prefix: str, rank: int) -> list[dict]:
    """Every entry of one rank's record, in order (iterations, loads, starts, the final digest)."""
    path = f"{prefix}.rank{rank}.jsonl"
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def read(prefix: str, rank: int) -> tuple[dict[int, dict], dict | None]:
    """``({iteration: entry}, final entry or None)`` of one rank's whole record; an iteration logged
    by several runs keeps the last run's entry."""
    iterations: dict[int, dict] = {}
    final = None
    for its, fin in read_runs(prefix, rank):
        iterations.update(its)
        final = fin if fin is not None else final
    return iterations, final


def state_digest(model, optimizer) -> dict:
    """XXH64 of every tensor a resume needs on this rank, by shard name (model buffers and extra
    state under ``model_state.<key>``): two runs whose digests are equal hold the same model and
    optimizer state to the bit."""
    import torch  # here: the runner imports this module in every process, recording or not

    from ...engine.save.device_copy import as_bytes
    from ...engine.format.hashing import xxh64
    from ..checkpointing.model_state import capture
    from ..checkpointing.shards import collect_shards

    out = {r.name: xxh64(as_bytes(r.tensor).cpu().numpy()) for r in collect_shards(model, optimizer)}
    held = capture(model)
    for key, value in [*held["buffers"].items(), *held["extra_state"].items()]:
        if isinstance(value, torch.Tensor):
            out[f"model_state.{key}"] = xxh64(as_bytes(value.detach().contiguous()).cpu().numpy())
        else:
            out[f"model_state.{key}"] = repr(value)
    return out
