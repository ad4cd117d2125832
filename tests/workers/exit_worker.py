"""Saves with slow storage, then leaves the interpreter without ``close()``/``wait()`` (one process).

``python exit_worker.py ROOT [manager|lazy]``; prints ``SAVED`` once ``save()`` returned.  What the
engine does at interpreter exit is judged by tests/faults/test_concurrency.py from the files left
behind, the exit status and stderr."""

from __future__ import annotations

import sys

import torch


from datastates_megatron._output import write_line  # noqa: E402
from datastates_megatron.engine import EngineOptions  # noqa: E402
from datastates_megatron.engine.manager import CheckpointManager  # noqa: E402
from tests.workers.fault_worker import slow_writes  # noqa: E402


def main() -> None:
    root = sys.argv[1]
    slow_writes(20)  # 32 regions x 20 ms / 2 threads: the save is still flushing when main() returns
    mgr = CheckpointManager(root, EngineOptions(cache_bytes=1 << 20, chunk_bytes=256 << 10, timeout_s=30))
    for i in range(8):
        mgr.register(f"w{i}", torch.full((1 << 18,), float(i)))
    mgr.save(1, {"iteration": 1})
    write_line("SAVED")


if __name__ == "__main__":
    main()  # no close(): the interpreter exits with the save pending
