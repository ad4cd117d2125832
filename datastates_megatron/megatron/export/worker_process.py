"""One worker process that never outlives its failure, its time limit or its parent's SIGTERM.

The torch_dist export runs megatron-core in a subprocess (:mod:`.exporter`).  megatron-core's checkpoint
writer forks writer processes and waits for them on a queue; one that dies before it answers (psutil
missing: issue 35) leaves the worker waiting for good, and a SIGTERM to the export left that worker
and its staging directory behind.  Here:

* parent side, :func:`run_worker`: the worker runs in its own session; whatever ends the wait (exit,
  time limit, an exception such as :class:`Terminated`), its whole process group is killed before it
  is reaped (so its id cannot have been reused), and its output is relayed line by line;
* worker side, :func:`watch_children`: a thread that ends the worker at once when one of its child
  processes exits with a failure (its traceback is already in the relayed output);
* :func:`sigterm_raises`: within it, SIGTERM raises :class:`Terminated`, so the callers' ``finally``
  blocks kill the worker and remove what they created; on the way out the signal acts as it would
  have (by default: the process ends by it).

Stdlib only.  Thread-safety: :func:`run_worker` blocks its caller and owns the relay thread it starts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import logging
import os
import select
import signal
import subprocess
import sys
import threading

from ..._output import write_line
from ...engine.errors import CheckpointError

__all__ = ["Terminated", "WorkerOutcome", "WorkerTerminatedError", "run_worker", "sigterm_raises", "watch_children"]

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM arrived inside :func:`sigterm_raises` (a ``BaseException``: no ``except Exception``
    on the way may swallow it before the cleanup)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class WorkerTerminatedError(CheckpointError, RuntimeError):
    """SIGTERM ended the work, and the signal's previous handler let the process go on."""


@dataclasses.dataclass(frozen=True)
class WorkerOutcome:
    returncode: int | None  # None: killed at the time limit
    done: bool  # the worker printed its success marker
    tail: str  # its last lines of output

    @property
    def how(self) -> str:
        """How it ended, in words."""
        if self.returncode is None:
            return "did not finish in time (killed)"
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return f"exit {self.returncode}"


def run_worker(argv: list[str], env: dict, timeout_s: float, *, marker: str, prefix: str) -> WorkerOutcome:
    """Run ``argv`` in a new session; its output goes to stderr line by line behind ``prefix``, except
    the line ``marker`` (its success).  Returns when it exits or after ``timeout_s``; every process of
    its group is killed first, also when an exception (SIGTERM's :class:`Terminated`) ends the wait."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=60)
    done = threading.Event()

    def relay() -> None:
        for line in proc.stdout:
            if line.strip() == marker:
                done.set()
                continue
            tail.append(line)
            sys.stderr.write(f"{prefix}{line}")
            sys.stderr.flush()

    relay_thread = threading.Thread(target=relay, name="dsm-worker-output", daemon=True)
    relay_thread.start()
    exited = False
    try:
        exited = _wait_exit(proc, timeout_s)
    finally:
        _kill_group(proc)
        proc.wait()
        relay_thread.join(timeout=10)  # the pipe closes with the last process of the group
        proc.stdout.close()
    return WorkerOutcome(proc.returncode if exited else None, done.is_set(), "".join(tail))


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether ``proc`` exited within ``timeout_s``; it is not reaped (a pidfd, where the kernel has them)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd: reaping is the only wait; the group kill is then best effort
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)  # a signal handler that raises ends it
        return bool(readable)
    finally:
        os.close(fd)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (its session: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty already


@contextlib.contextmanager
def sigterm_raises(what: str):
    """Within: SIGTERM raises :class:`Terminated` (only from the main thread; elsewhere nothing
    changes).  Leaving by it, the previous disposition is restored and the signal raised again:
    by default the process ends by SIGTERM; a handler that returns makes it a
    :class:`WorkerTerminatedError`.  ``what``: the work, for the log line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    if previous is None:  # installed outside Python: restore the default
        previous = signal.SIG_DFL
    try:
        yield
    except Terminated as e:
        signal.signal(signal.SIGTERM, previous)
        log.warning("%s: terminated by SIGTERM (its worker killed, what it staged removed)", what)
        signal.raise_signal(e.signum)
        raise WorkerTerminatedError(f"{what}: terminated by SIGTERM (its worker killed)") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def watch_children(interval_s: float = 0.2) -> threading.Thread:
    """In the worker: a daemon thread that ends this process (exit 1) as soon as one of its child
    processes has exited with a failure; the child is looked at, not reaped (``WNOWAIT``): its parent
    code still collects it.  Children are listed from ``/proc/self/task/*/children``."""

    def failed_child() -> tuple[int, str] | None:
        for pid in _children():
            try:
                got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue  # reaped meanwhile
            if got is None:
                continue
            if got.si_code == os.CLD_EXITED and got.si_status != 0:
                return pid, f"exit {got.si_status}"
            if got.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                return pid, f"killed by {signal.Signals(got.si_status).name}"
        return None

    def watch() -> None:
        stop = threading.Event()  # never set: the thread ends with the process
        while not stop.wait(interval_s):
            found = failed_child()
            if found is not None:
                pid, how = found
                write_line(f"a child process of the worker (pid {pid}) failed ({how}): ending the worker")
                os._exit(1)

    thread = threading.Thread(target=watch, name="dsm-child-watch", daemon=True)
    thread.start()
    return thread


def _children() -> list[int]:
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue  # the thread ended
    return pids
