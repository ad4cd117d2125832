"""The tests' one way to start processes: gloo ranks (:func:`run_ranks`) and whole commands such as
torchrun (:func:`run_command`).  One loop (:func:`_supervise`) bounds every wait, stops the rest when
one fails, kills on request (``kill_when``) or times out; a kill reaches each process's children.

A rank of :func:`run_ranks` prints one line ``RESULT <json>``.  When any rank dies, the survivors
(blocked in a collective) are killed, as torchrun would do.

A script rank is forked from a warm server process (``multiprocessing``'s forkserver with torch,
megatron-core and this package imported once) instead of a fresh interpreter: those imports cost
a fresh rank 3-8 CPU-seconds, several minutes over the suite on two cores.  Each rank is still its
own process in its own session with its own environment, ``sys.argv``, stdout/stderr and gloo
connections, runs the script as ``__main__``, joins its threads and runs its ``atexit`` hooks at the
end as the interpreter would, and dies for real on SIGKILL.  ``DSM_TEST_FRESH_INTERPRETERS=1``
launches fresh interpreters instead.  A function rank (``run_ranks(func, ...)``) is ``os.fork()``-ed
from the calling process itself (a fork costs ~0.1 CPU-second, a fresh interpreter ~3.5: what lets
tests/faults/sweep.py afford hundreds of crash/restart runs); the caller must not have initialised
``torch.distributed`` nor be running other threads (fork copies only the calling thread)."""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

from datastates_megatron._output import write_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what the workers import; a module missing here is skipped by the forkserver (ImportError)
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "datastates_megatron",
    "datastates_megatron.engine",
    "datastates_megatron.engine.manager",
    "datastates_megatron.engine.load.reader",
    "megatron.core",
    "megatron.core.dist_checkpointing",
    "datastates_megatron.demo.gpt",
    "datastates_megatron.demo.train",
    "datastates_megatron.megatron.checkpointing.shards",
]
_forkserver_context = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script,
    world: int,
    args: list[str],
    *,
    env: dict | None = None,
    timeout: float = 120.0,
    rank_env: dict[int, dict] | None = None,
    kill_when=None,
) -> list[dict]:
    """``script``: a ``.py`` path or a module name, or a function ``func(args) -> dict`` (its result
    is the rank's ``RESULT``) run in ranks forked from this process.  ``kill_when``: a callable polled
    while the ranks run; when it returns True every rank gets SIGKILL (a real ``kill -9``
    mid-training).  Returns one dict per rank: rank, returncode, result, stdout, stderr, timed_out."""
    port = free_port()
    fresh = os.environ.get("DSM_TEST_FRESH_INTERPRETERS") == "1"
    outputs = tempfile.mkdtemp(prefix="ranks-")
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": ROOT + os.pathsep + e.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1",
            }
        )
        e.update(env or {})
        e.update((rank_env or {}).get(rank, {}))
        prefix = os.path.join(outputs, str(rank))
        if callable(script):
            procs.append(_FunctionRank(script, args, e, prefix))
        elif fresh:
            procs.append(_FreshRank(script, args, e, prefix))
        else:
            procs.append(_ForkedRank(script, args, e, prefix))
    timed_out = _supervise(
        procs, timeout, kill_when=kill_when, stop_on_failure=True, poll_s=0.01 if callable(script) else 0.05
    )
    out = []
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=30)
        result = None
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        out.append(
            {
                "rank": rank,
                "returncode": p.returncode,
                "result": result,
                "stdout": stdout,
                "stderr": stderr,
                "timed_out": timed_out,
            }
        )
    for name in os.listdir(outputs):
        os.unlink(os.path.join(outputs, name))
    os.rmdir(outputs)
    return out


def describe(results: list[dict]) -> str:
    return "\n".join(
        f"--- rank {r['rank']} rc={r['returncode']}\n{r['stdout'][-2000:]}\n{r['stderr'][-3000:]}" for r in results
    )


@dataclass
class Finished:
    """What :func:`run_command` saw: the first non-zero exit status (or 0), and the output when it
    was captured (empty when it went to a log file)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    codes: tuple = ()  # each command's exit status, in order


def run_command(
    cmds: list[list[str]],
    *,
    env: dict | None = None,
    cwd=None,
    timeout: float = 300.0,
    log=None,
    kill_when=None,
    term_when=None,
) -> Finished:
    """Run each of ``cmds`` (one launcher each, e.g. one torchrun per "node"), each in a session of its
    own, until all end or ``timeout`` (then every process under them gets SIGKILL).  ``kill_when()``:
    SIGKILL to every launcher and every process under it (a real ``kill -9`` of the whole run);
    ``term_when()``: SIGTERM to every process under the launchers (as ``srun`` delivers a
    pre-emption), the run then left to finish; both polled every 50 ms.  ``log``: an open file
    taking stdout and stderr of all; without it they are captured (in files: a pipe nobody reads
    while we wait would stall a talkative command)."""
    procs = [_Command(cmd, env, cwd, log) for cmd in cmds]
    timed_out = _supervise(procs, timeout, kill_when=kill_when, term_when=term_when, poll_s=0.05)
    texts = [p.communicate(timeout=30) for p in procs]
    codes = [p.returncode for p in procs]
    return Finished(
        next((c for c in codes if c), codes[0]),
        "".join(t[0] for t in texts),
        "".join(t[1] for t in texts),
        timed_out,
        tuple(codes),
    )


def torchrun(script, nproc: int, args: list[str], *, cwd, timeout: float = 300.0, env: dict | None = None) -> Finished:
    """``python -m torch.distributed.run --standalone`` of ``script`` (a path) on ``nproc`` CPU ranks,
    this checkout first on ``PYTHONPATH``; output captured."""
    e = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
        **(env or {}),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    return run_command([[*cmd, *args]], env=e, cwd=cwd, timeout=timeout)


def _supervise(procs, timeout: float, *, kill_when=None, term_when=None, stop_on_failure=False, poll_s: float) -> bool:
    """Wait for ``procs`` (each with ``poll()``, ``kill()`` and ``terminate_ranks()``) at most
    ``timeout`` seconds; every one still running at the end is killed.  True when it timed out, not
    when it was stopped on purpose (``kill_when``, or a failed process with ``stop_on_failure``)."""

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if kill_when is not None and kill_when():
            kill_all()
            kill_when = None
        if term_when is not None and term_when():
            for p in procs:
                p.terminate_ranks()
            term_when = None
        if stop_on_failure and any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.5)  # let the others notice; then stop them like a launcher would
            kill_all()
            stop_on_failure = False
        time.sleep(poll_s)
    timed_out = any(p.poll() is None for p in procs)
    kill_all()
    return timed_out


class _Rank:
    """One launched rank: ``poll()`` (exit status or None), ``kill()`` (SIGKILL to its session),
    ``communicate()`` (waits, then its stdout and stderr, which it wrote to ``<prefix>.out/.err``:
    files, not pipes, which nobody reads while we wait and a talkative rank would fill)."""

    pid: int

    def __init__(self, prefix: str) -> None:
        self._out, self._err = prefix + ".out", prefix + ".err"

    def poll(self):
        raise NotImplementedError

    @property
    def returncode(self):
        return self.poll()

    def kill(self) -> None:
        _kill_session(self.pid)

    def communicate(self, timeout: float) -> tuple[str, str]:
        self._wait(timeout)
        texts = []
        for path in (self._out, self._err):
            try:
                with open(path, errors="replace") as f:
                    texts.append(f.read())
                os.unlink(path)
            except FileNotFoundError:  # killed before it opened its outputs
                texts.append("")
        return texts[0], texts[1]

    def _wait(self, timeout: float) -> None:
        raise NotImplementedError


class _FreshRank(_Rank):
    """A rank in a fresh interpreter (``python script.py`` / ``python -m module``)."""

    def __init__(self, script: str, args: list[str], env: dict, prefix: str) -> None:
        super().__init__(prefix)
        cmd = [sys.executable, script] if script.endswith(".py") else [sys.executable, "-m", script]
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self._proc = subprocess.Popen([*cmd, *args], env=env, stdout=out, stderr=err, start_new_session=True)
        self.pid = self._proc.pid

    def poll(self):
        return self._proc.poll()

    def _wait(self, timeout: float) -> None:
        self._proc.wait(timeout)


class _Command(_Rank):
    """A command such as torchrun, which starts its workers in sessions of their own: a kill reaches
    every process under it, found through ``psutil``.  Output to ``log``, else to temporary files."""

    def __init__(self, cmd: list[str], env, cwd, log) -> None:
        self._files = [] if log is not None else [tempfile.TemporaryFile("w+", errors="replace") for _ in range(2)]
        out, err = self._files or (log, subprocess.STDOUT)
        self._proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
        self.pid = self._proc.pid

    def poll(self):
        return self._proc.poll()

    def kill(self) -> None:
        import psutil

        under = self._signal_under(signal.SIGKILL)
        _kill_session(self.pid)
        psutil.wait_procs(under, timeout=30)

    def terminate_ranks(self) -> None:
        self._signal_under(signal.SIGTERM)

    def communicate(self, timeout: float) -> tuple[str, str]:
        self._proc.wait(timeout)
        texts = []
        for f in self._files:
            f.seek(0)
            texts.append(f.read())
            f.close()
        return (texts[0], texts[1]) if texts else ("", "")

    def _signal_under(self, sig: int) -> list:
        import psutil

        try:
            under = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in under:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        return under


class _ForkedRank(_Rank):
    """A rank forked from the warm forkserver; its stdout/stderr go to ``<prefix>.out/.err``."""

    def __init__(self, script: str, args: list[str], env: dict, prefix: str) -> None:
        super().__init__(prefix)
        self._proc = _forkserver().Process(target=_run_as_main, args=(script, list(args), env, self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self):
        return self._proc.exitcode

    def _wait(self, timeout: float) -> None:
        self._proc.join(timeout)


class _FunctionRank(_Rank):
    """A rank ``os.fork()``-ed from this process calling ``func(args)``; outputs as :class:`_ForkedRank`."""

    def __init__(self, func, args: list[str], env: dict, prefix: str) -> None:
        super().__init__(prefix)
        self._status = None
        self.pid = os.fork()
        if self.pid == 0:
            _run_function(func, list(args), env, self._out, self._err)

    def poll(self):
        if self._status is None:
            done, st = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self._status = os.waitstatus_to_exitcode(st)
        return self._status

    def _wait(self, timeout: float) -> None:  # only after _supervise: the rank has been killed if need be
        if self.poll() is None:
            self._status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def _run_function(func, args: list[str], env: dict, out_path: str, err_path: str) -> None:
    """In the forked rank: ``func(args)`` in ``env``, its result printed as ``RESULT``; never returns."""
    code = 1
    try:
        detach_with_outputs(out_path, err_path)
        # the caller's sys.stdout/stderr may not write to fds 1 and 2 (pytest's capture replaces them)
        sys.stdout, sys.stderr = (open(fd, "w", closefd=False) for fd in (1, 2))
        os.environ.clear()
        os.environ.update(env)
        import torch

        # the parent's intra-op thread pool (made by any parallel torch op before the fork) is
        # not in this process: a parallel op here would wait for its threads forever
        torch.set_num_threads(1)
        result = func(args)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        sys.stdout.flush()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def detach_with_outputs(out_path: str, err_path: str) -> None:
    """In a freshly forked rank: its own session (a kill of the rank's group reaches its children),
    stdout and stderr sent to these files."""
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _kill_session(pid: int) -> None:
    """SIGKILL the rank's session (its own children too); the rank itself if it has no session yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _forkserver():
    """The forkserver context, started once with the workers' imports done (``OMP_NUM_THREADS=1``
    in its environment: the OpenMP runtime reads it when torch loads it)."""
    global _forkserver_context
    if _forkserver_context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _forkserver_context = ctx
    return _forkserver_context


def _run_as_main(script: str, args: list[str], env: dict, out_path: str, err_path: str) -> None:
    """In the forked rank: become ``python script *args`` in ``env``, then end as the interpreter
    would (join non-daemon threads, run ``atexit`` hooks, flush) with the script's exit status."""
    detach_with_outputs(out_path, err_path)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    sys.argv = [script, *args]
    extra = [os.path.dirname(os.path.abspath(script))] if script.endswith(".py") else [os.getcwd()]
    sys.path[:0] = extra + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if script.endswith(".py"):
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - reported on stderr and by the exit status, as python does
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what the interpreter does first at exit: join non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    write_line(code, sys.stderr)
    return 1
