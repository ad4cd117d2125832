"""The ranks of the offline ``torch_dist`` export: one command on N local gloo ranks, as one process
group that ends at its first failure.

``datastates-ckpt export --format torch_dist`` (:mod:`.exporter`) runs Megatron-LM's own training script
with ``--lazy-ckpt-convert-to`` on as many CPU ranks as the checkpoint has, through
:func:`.worker_process.run_worker`, which kills its worker's whole process group at its time limit or
on SIGTERM.  torchrun puts each rank in a session of its own (out of that group's reach), so the ranks
are started here instead, in the caller's group:

* ``start --nproc N -- COMMAND...``: COMMAND once per rank, with the environment torchrun gives
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...); the first rank
  that fails ends the others (SIGKILL) and this process with its status; ``EXPORT-RANKS-OK`` is
  printed when every rank exited 0;
* ``rank SCRIPT ARGS...``: one rank: :func:`.worker_process.watch_children` (megatron-core's
  checkpoint writer processes: one that dies must not leave the rank waiting for it), then
  :mod:`..cpu.launch` (the CUDA->CPU shim and the runtime hook).

Thread-safety: process entry points only.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from ..._output import write_line

__all__ = ["DONE", "rank_env", "start", "main"]

DONE = "EXPORT-RANKS-OK"  # printed by ``start`` when every rank succeeded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's ``--standalone --nproc-per-node nproc`` sets for ``rank``."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "GROUP_RANK": 0,
        "ROLE_RANK": rank,
        "WORLD_SIZE": nproc,
        "LOCAL_WORLD_SIZE": nproc,
        "ROLE_WORLD_SIZE": nproc,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    return {k: str(v) for k, v in env.items()}


def start(nproc: int, command: list[str]) -> int:
    """Run ``command`` on ``nproc`` ranks; returns 0 when every rank exited 0, else the status of the
    first that failed (1 when a signal ended it), after killing the others."""
    port = _free_port()
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several ranks per node
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the child: replaced by the command (same process group as this one)
            try:
                os.execvpe(command[0], command, {**base, **rank_env(rank, nproc, port)})
            except OSError as e:
                write_line(f"rank {rank}: cannot run {command[0]}: {e}")
            os._exit(127)
        pids[pid] = rank
    write_line(f"started {nproc} ranks (pids {' '.join(map(str, pids))})")
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            write_line(f"rank {rank} failed ({how}): ending the other ranks")
            for other in pids:
                try:
                    os.kill(other, signal.SIGKILL)  # ours: forked above, not yet reaped
                except ProcessLookupError:
                    pass
            for other in list(pids):
                os.waitpid(other, 0)
            return code if code > 0 else 1
    write_line(DONE)
    return 0


def _rank(argv: list[str]) -> None:
    from ...engine.runtime.faults import hold_point
    from ..cpu import launch as cpu_launch
    from .worker_process import watch_children

    write_line(f"rank {os.environ.get('RANK')} started (pid {os.getpid()})")
    hold_point("export_worker")  # the fault tests' stalled export
    watch_children()
    cpu_launch.main(argv)


def main(argv: list[str] | None = None) -> int:
    """``start --nproc N -- COMMAND...`` or ``rank SCRIPT ARGS...`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m {__name__} start --nproc N -- COMMAND... | rank SCRIPT ARGS..."
    if argv[:1] == ["rank"]:
        _rank(argv[1:])
        return 0
    if argv[:2] == ["start", "--nproc"] and len(argv) > 4 and argv[2].isdigit() and argv[3] == "--":
        return start(int(argv[2]), argv[4:])
    write_line(usage, sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
