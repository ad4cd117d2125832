"""One cell of the storage-error matrix (issue 41, item 2) through the fault filesystem, one process.

A manager on the mount (``on_error="warn"``) commits iteration 1; the fault is switched on; it saves
iteration 2; the fault is switched off; it saves iteration 3; then iteration 1 is loaded back.
:func:`run_cell` reports what happened (:class:`Outcome`); the tests compare it with what the issue
asks for, and ``python -m tests.faults.fault_table`` prints it as the table of docs/reliability.md.

Where each operation's fault is put: the calls of iteration 2's own files (``iter_0000002`` and
what is in it: the rank file's create, writes and fsync, the directory's mkdir, the manifest's
temp file and rename).  ``unlink`` has no call in a save of one's own files; it is retention's:
with ``keep_last=1`` committing 2 deletes 1, so its fault is put on ``iter_0000001``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.tiers.tier import committed_iterations

from tests.workers.fault_worker import fill, is_state_of, make_state

ERRNOS = ("EIO", "ENOSPC", "EROFS", "EDQUOT", "ETIMEDOUT")
OPS = ("open", "write", "fsync", "rename", "mkdir", "unlink")
# the path glob (relative to the mount's checkpoint directory "ckpt") each operation's fault is put on
TARGET = {op: "ckpt/iter_0000002/**" for op in OPS} | {
    "mkdir": "ckpt/iter_0000002",
    "unlink": "ckpt/iter_0000001/**",
}
BIG = 40_000  # elements of the big tensor: a few hundred KiB per checkpoint


@dataclasses.dataclass
class Outcome:
    saved: dict  # iteration -> what save() returned
    committed_after: list  # committed iterations on disk once the faulty save was waited for
    committed: list  # committed iterations on disk at the end
    hits: int  # calls the fault failed
    lines: list  # WARNING+ log lines of the package while the fault was on, and after
    tracebacks: int  # of those, how many carried a traceback
    leftover_2: list | None  # what iteration 2's directory holds at the end (None: no directory)
    loads: dict  # iteration -> restored bit-exact
    exc: str | None  # an exception that reached the test (on_error=warn: none should)

    def names(self, what: str) -> list[str]:
        return [ln for ln in self.lines if what in ln]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_cell(fs, err: str, op: str) -> Outcome:
    """Run one cell on the mounted fault filesystem ``fs``; the fault is always switched off again."""
    root = os.path.join(fs.root, "ckpt")
    keep_last = 1 if op == "unlink" else 0
    ts = make_state(0, BIG)
    handler = _Lines()
    pkg = logging.getLogger("datastates_megatron")
    saved, exc, hits, after = {}, None, 0, []
    loads = {}
    mgr = CheckpointManager(
        root, EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=keep_last, on_error="warn"
    )
    try:
        for n, t in ts.items():
            mgr.register(n, t)
        fill(ts, 0, 1)
        saved[1] = mgr.save(1, {"iteration": 1})
        mgr.wait()
        pkg.addHandler(handler)
        rule = fs.fault(op, TARGET[op], errno=getattr(errno, err))
        try:
            fill(ts, 0, 2)
            saved[2] = mgr.save(2, {"iteration": 2})
            mgr.wait()
            after = committed_iterations(root)
        finally:
            hits = fs.hits(rule)
            fs.clear(rule)
        fill(ts, 0, 3)
        saved[3] = mgr.save(3, {"iteration": 3})
        mgr.wait()
        for it in (1, 3):
            if it in committed_iterations(root):
                fill(ts, 0, 0)
                got = mgr.load(it)
                loads[it] = got.iteration == it and got.objects == {"iteration": it} and is_state_of(ts, 0, it)
    except Exception as e:  # noqa: BLE001 - reported as the outcome
        exc = f"{type(e).__name__}: {e}"
    finally:
        try:
            mgr.close()
        except Exception as e:  # noqa: BLE001
            exc = exc or f"close: {type(e).__name__}: {e}"
        pkg.removeHandler(handler)
    d2 = os.path.join(root, "iter_0000002")
    return Outcome(
        saved=saved,
        committed_after=after,
        committed=committed_iterations(root),
        hits=hits,
        lines=[r.getMessage() for r in handler.records],
        tracebacks=sum(1 for r in handler.records if r.exc_info or "Traceback" in r.getMessage()),
        leftover_2=sorted(os.listdir(d2)) if os.path.isdir(d2) else None,
        loads=loads,
        exc=exc,
    )


def named(o: Outcome, err: str, op: str) -> list[str]:
    """What the warning lines of the fault name: ``rank``, ``file`` (the path the fault hit),
    ``errno`` (its text), each once it is in one line with the others; one entry per line."""
    file = "iter_0000001" if op == "unlink" else "iter_0000002"
    out = []
    for ln in o.lines:
        got = [
            w
            for w, ok in (
                ("rank", "rank 0" in ln),
                ("file", file in ln),
                ("errno", os.strerror(getattr(errno, err)) in ln),
            )
            if ok
        ]
        if "file" in got:
            out.append(", ".join(got))
    return out


def summarize(o: Outcome, err: str, op: str) -> str:
    """The outcome of one cell in a few words (the table's cell)."""
    if o.exc:
        return f"raised {o.exc.split(':')[0]}"
    if o.hits == 0:
        return "fault never hit"
    parts = []
    if 2 in o.committed_after:
        parts.append("that checkpoint commits")
    elif o.leftover_2 is None:
        parts.append("abandoned, nothing left")
    else:
        parts.append(f"abandoned, left {o.leftover_2}")
    lines = named(o, err, op)
    parts.append(f"{len(lines)} line{'s' if len(lines) != 1 else ''}" + (f" ({'; '.join(lines)})" if lines else ""))
    if o.tracebacks:
        parts.append(f"{o.tracebacks} traceback(s)")
    if op == "unlink":
        parts.append("deletion retried, done" if 1 not in o.committed else "deletion never retried")
    if 3 in o.committed:
        parts.append("next commits")
    if o.loads and all(o.loads.values()):
        parts.append("older loads" if 1 in o.loads else "newest loads")
    return "; ".join(parts)


# what issue 41 item 2 asks of each operation's cell, in :func:`summarize`'s words
EXPECTED = {op: "abandoned, nothing left; 1 line (rank, file, errno); next commits; older loads" for op in OPS} | {
    # retention's unlink: the checkpoint commits; the deletion is left, said once, retried at the next commit
    "unlink": "that checkpoint commits; 1 line (rank, file, errno); deletion retried, done; next commits; newest loads",
}

# faults on the restore side: reading the newest checkpoint's rank file fails with an errno, or is held
READ_FAULTS = ("EIO", "ETIMEDOUT", "hold")
READ_TIMEOUT_S = 2.0  # timeout_s of the restoring manager: a held read is given up after at most twice that


@dataclasses.dataclass
class ReadOutcome:
    restored: int | None  # the iteration load() restored (None: it raised)
    exact: bool  # the state is that iteration's, bit for bit (or, when it raised, untouched)
    hits: int
    lines: list  # WARNING+ lines of the package naming iteration 2's rank file
    took_s: float  # load() alone
    exc: str | None


def run_read_cell(fs, fault: str, writer_mount: str) -> ReadOutcome:
    """Checkpoints 1 and 2 written through another mount of ``fs``'s directory (``writer_mount``:
    no page of theirs cached on ``fs``), then ``load()`` through ``fs`` while every read of
    checkpoint 2's rank file fails with ``fault`` (an errno name) or is held (``"hold"``)."""
    import time

    from datastates_megatron.engine import CheckpointError
    from tests.fusefs.control import FaultFS

    ts = make_state(0, BIG)
    with FaultFS(fs.source, writer_mount) as writer:
        opts = EngineOptions(cache_bytes=1 << 20, timeout_s=30)
        with CheckpointManager(os.path.join(writer.root, "ckpt"), opts, keep_last=0) as mgr:
            for n, t in ts.items():
                mgr.register(n, t)
            for it in (1, 2):
                fill(ts, 0, it)
                mgr.save(it, {"iteration": it})
                mgr.wait()
    fill(ts, 0, 7)
    spec = {"hold": True} if fault == "hold" else {"errno": getattr(errno, fault)}
    rule = fs.fault("read", "ckpt/iter_0000002/r*", **spec)
    handler = _Lines()
    pkg = logging.getLogger("datastates_megatron")
    pkg.addHandler(handler)
    restored, exc, hits, t0 = None, None, 0, 0.0
    try:
        opts = EngineOptions(cache_bytes=1 << 20, timeout_s=READ_TIMEOUT_S)
        with CheckpointManager(os.path.join(fs.root, "ckpt"), opts, keep_last=0) as mgr:
            for n, t in ts.items():
                mgr.register(n, t)
            t0 = time.perf_counter()
            try:
                restored = mgr.load().iteration
            except CheckpointError as e:
                exc = f"{type(e).__name__}: {e}"
            took = time.perf_counter() - t0
            hits = fs.hits(rule)
    finally:
        fs.clear(rule)
        pkg.removeHandler(handler)
    return ReadOutcome(
        restored=restored,
        exact=is_state_of(ts, 0, restored if restored is not None else 7),
        hits=hits,
        lines=[r.getMessage() for r in handler.records if "iter_0000002" in r.getMessage()],
        took_s=took,
        exc=exc,
    )


def summarize_read(o: ReadOutcome, fault: str) -> str:
    """The outcome of one restore-side cell in a few words (the table's cell)."""
    if o.exc:
        return f"raised {o.exc.split(':')[0]}"
    if o.hits == 0:
        return "fault never hit"
    parts = [f"iteration {o.restored} restored" + (", bit-exact" if o.exact else ", NOT bit-exact")]
    name = "ETIMEDOUT" if fault == "hold" else fault
    named = [ln for ln in o.lines if "rank 0" in ln and name in ln]
    parts.append(f"{len(o.lines)} line{'s' if len(o.lines) != 1 else ''}" + (" (rank, file, errno)" if named else ""))
    if fault == "hold":
        # given up after at most 2 x timeout_s, then the older one is restored (allowed 10 s here)
        bound = 2 * READ_TIMEOUT_S + 10
        parts.append("load() within 2 x timeout_s + 10 s" if o.took_s <= bound else f"load() took {o.took_s:.0f} s")
    return "; ".join(parts)


EXPECTED_READ = {f: "iteration 1 restored, bit-exact; 1 line (rank, file, errno)" for f in READ_FAULTS} | {
    "hold": "iteration 1 restored, bit-exact; 1 line (rank, file, errno); load() within 2 x timeout_s + 10 s",
}

# cells whose outcome differs from item 2's today: op -> (why, the outcome they show)
KNOWN: dict[str, tuple[str, str]] = {}
