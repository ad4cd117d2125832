"""``tests/distributed/ranks.run_ranks`` for a function instead of a script: each rank is
``os.fork()``-ed from the (already warm: torch imported, Numba kernels loaded) calling process and
calls ``func`` there.

Used by ``tests/faults/sweep.py`` to afford hundreds of crash/restart runs on two cores (a fresh
interpreter costs ~3.5 CPU-seconds, a fork ~0.1; ``run_ranks`` forks script ranks from a warm
forkserver for the same reason).  Same contract and result dicts as ``run_ranks``:
every rank is a real process with its own pid and gloo connections, a crash point is a real SIGKILL,
and when one rank dies the others are killed as a launcher would.  The caller must not have
initialised ``torch.distributed`` nor be running other threads (fork copies only the calling thread).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

from tests.distributed.ranks import detach_with_outputs, free_port


def fork_ranks(
    func,
    world: int,
    args: list[str],
    *,
    env: dict | None = None,
    timeout: float = 120.0,
    rank_env: dict[int, dict] | None = None,
    kill_when=None,
) -> list[dict]:
    """Run ``func(args) -> dict`` on ``world`` forked ranks; returns one dict per rank like ``run_ranks``."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="forkranks-")
    procs = []
    for rank in range(world):
        out_path, err_path = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
        pid = os.fork()
        if pid == 0:  # ------------------------------------------------------------- child
            code = 1
            try:
                detach_with_outputs(out_path, err_path)
                os.environ.update(
                    {
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world),
                        "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    }
                )
                os.environ.update(env or {})
                os.environ.update((rank_env or {}).get(rank, {}))
                result = func(list(args))
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
        procs.append(pid)  # --------------------------------------------------------- parent
    status: dict[int, int] = {}

    def reap() -> None:
        for pid in procs:
            if pid not in status:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(st)

    def kill_all() -> None:
        for pid in procs:
            if pid not in status:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(status) < world:
        reap()
        if kill_when is not None and kill_when():
            kill_all()
            break
        if any(code != 0 for code in status.values()) and len(status) < world:
            time.sleep(0.5)  # let the others notice; then stop them like a launcher would
            reap()
            kill_all()
            break
        time.sleep(0.01)
    timed_out = len(status) < world and time.monotonic() >= deadline
    kill_all()
    for pid in procs:
        if pid not in status:
            _, st = os.waitpid(pid, 0)
            status[pid] = os.waitstatus_to_exitcode(st)
    out = []
    for rank, pid in enumerate(procs):
        with open(os.path.join(tmp, f"{rank}.out")) as f:
            stdout = f.read()
        with open(os.path.join(tmp, f"{rank}.err")) as f:
            stderr = f.read()
        result = None
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        out.append(
            {
                "rank": rank,
                "returncode": status[pid],
                "result": result,
                "stdout": stdout,
                "stderr": stderr,
                "timed_out": timed_out,
            }
        )
    for name in os.listdir(tmp):
        os.unlink(os.path.join(tmp, name))
    os.rmdir(tmp)
    return out
