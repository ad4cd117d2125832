"""Launch N real processes (gloo over loopback) running a worker script; collect their results.

Each worker prints one line ``RESULT <json>``.  When any rank dies, the survivors (blocked in a
collective) are killed, as torchrun would do.  Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, args: list[str], *, env: dict | None = None, timeout: float = 120.0,
              rank_env: dict[int, dict] | None = None, kill_when=None) -> list[dict]:
    """``script``: a ``.py`` path or a module name.  ``kill_when``: a callable polled while the ranks
    run; when it returns True every rank gets SIGKILL (a real ``kill -9`` mid-training)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "PYTHONPATH": ROOT + os.pathsep + e.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"})
        e.update(env or {})
        e.update((rank_env or {}).get(rank, {}))
        cmd = [sys.executable, script] if script.endswith(".py") else [sys.executable, "-m", script]
        procs.append(subprocess.Popen([*cmd, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if kill_when is not None and kill_when():
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.5)  # let the others notice; then stop them like a launcher would
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    timed_out = any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = []
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=30)
        result = None
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        out.append({"rank": rank, "returncode": p.returncode, "result": result, "stdout": stdout, "stderr": stderr,
                    "timed_out": timed_out})
    return out


def describe(results: list[dict]) -> str:
    return "\n".join(f"--- rank {r['rank']} rc={r['returncode']}\n{r['stdout'][-2000:]}\n{r['stderr'][-3000:]}" for r in results)
