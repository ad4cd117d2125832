"""Launch N real processes (gloo over loopback) running a worker script; collect their results.

Each worker prints one line ``RESULT <json>``.  When any rank dies, the survivors (blocked in a
collective) are killed, as torchrun would do.  Every wait is bounded.

A rank is forked from a warm server process (``multiprocessing``'s forkserver with torch,
megatron-core and this package imported once) instead of a fresh interpreter: those imports cost
a fresh rank 3-8 CPU-seconds, several minutes over the suite on two cores.  Each rank is still its
own process in its own session with its own environment, ``sys.argv``, stdout/stderr and gloo
connections, runs the script as ``__main__``, joins its threads and runs its ``atexit`` hooks at the
end as the interpreter would, and dies for real on SIGKILL.  ``DSM_TEST_FRESH_INTERPRETERS=1``
launches fresh interpreters instead."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what the workers import; a module missing here is skipped by the forkserver (ImportError)
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "datastates_megatron",
    "datastates_megatron.engine",
    "datastates_megatron.engine.manager",
    "datastates_megatron.engine.reader",
    "megatron.core",
    "megatron.core.dist_checkpointing",
    "datastates_megatron.demo.gpt",
    "datastates_megatron.demo.train",
    "datastates_megatron.megatron.shards",
]
_forkserver_context = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str,
    world: int,
    args: list[str],
    *,
    env: dict | None = None,
    timeout: float = 120.0,
    rank_env: dict[int, dict] | None = None,
    kill_when=None,
) -> list[dict]:
    """``script``: a ``.py`` path or a module name.  ``kill_when``: a callable polled while the ranks
    run; when it returns True every rank gets SIGKILL (a real ``kill -9`` mid-training)."""
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
        if fresh:
            procs.append(_FreshRank(script, args, e))
        else:
            procs.append(_ForkedRank(script, args, e, os.path.join(outputs, str(rank))))
    deadline = time.monotonic() + timeout
    stopped = False  # killed on purpose (kill_when, or a rank failed), not for running out of time
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if kill_when is not None and kill_when():
            for p in procs:
                if p.poll() is None:
                    p.kill()
            stopped = True
            break
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.5)  # let the others notice; then stop them like a launcher would
            for p in procs:
                if p.poll() is None:
                    p.kill()
            stopped = True
            break
        time.sleep(0.05)
    timed_out = not stopped and any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
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


class _Rank:
    """One launched rank: ``poll()`` (exit status or None), ``kill()``, ``communicate()``."""

    pid: int

    def poll(self):
        raise NotImplementedError

    @property
    def returncode(self):
        return self.poll()

    def kill(self) -> None:
        _kill_session(self.pid)


class _FreshRank(_Rank):
    """A rank in a fresh interpreter (``python script.py`` / ``python -m module``)."""

    def __init__(self, script: str, args: list[str], env: dict) -> None:
        cmd = [sys.executable, script] if script.endswith(".py") else [sys.executable, "-m", script]
        self._proc = subprocess.Popen(
            [*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.pid = self._proc.pid

    def poll(self):
        return self._proc.poll()

    def communicate(self, timeout: float) -> tuple[str, str]:
        return self._proc.communicate(timeout=timeout)


class _ForkedRank(_Rank):
    """A rank forked from the warm forkserver; its stdout/stderr go to ``<prefix>.out/.err``."""

    def __init__(self, script: str, args: list[str], env: dict, prefix: str) -> None:
        self._out, self._err = prefix + ".out", prefix + ".err"
        self._proc = _forkserver().Process(target=_run_as_main, args=(script, list(args), env, self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self):
        return self._proc.exitcode

    def communicate(self, timeout: float) -> tuple[str, str]:
        self._proc.join(timeout)
        texts = []
        for path in (self._out, self._err):
            try:
                with open(path, errors="replace") as f:
                    texts.append(f.read())
                os.unlink(path)
            except FileNotFoundError:  # killed before it opened its outputs
                texts.append("")
        return texts[0], texts[1]


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
    print(code, file=sys.stderr)
    return 1
