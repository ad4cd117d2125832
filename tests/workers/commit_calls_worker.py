"""Worker for tests/faults/test_commit_metadata.py: commits between two marker calls that the test
finds in ``strace``'s log, so that it counts the system calls of those commits alone.

``python -m tests.workers.commit_calls_worker DIR KEPT COMMITS``: under ``DIR``, a save directory
(``save``) holding ``KEPT`` committed checkpoints (one saved for real, the others its manifest and
rank file cloned under other iterations: what retention and the survey see is the same) and a
node-local root (``local``); then a manager over both (start-up and one warm-up commit, not
counted), then ``COMMITS`` commits, each promoted (``persist_interval=1``), between a ``stat`` of
``MARK_BEGIN`` and one of ``MARK_END``.  Megatron's default: ``--save`` keeps every checkpoint.
Prints one ``RESULT <json>`` line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import torch

from datastates_megatron._output import write_line
from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.format.manifest import iter_dir, read_manifest, write_manifest, write_tracker
from datastates_megatron.engine.manager import CheckpointManager

MARK_BEGIN = "/dsm-count-begin"
MARK_END = "/dsm-count-end"


def _manager(directory: str) -> CheckpointManager:
    mgr = CheckpointManager(
        os.path.join(directory, "save"),
        EngineOptions(cache_bytes=1 << 20, timeout_s=120),
        keep_last=0,
        local_root=os.path.join(directory, "local"),
        persist_interval=1,
        local_keep_last=2,
    )
    mgr.register("w", torch.zeros(1024))
    return mgr


def _mark(path: str) -> None:
    try:
        os.stat(path)
    except FileNotFoundError:
        pass


def prepare(directory: str, kept: int) -> None:
    """``kept`` committed checkpoints in ``directory/save`` (iterations 1..kept, committed in order)."""
    with _manager(directory) as mgr:
        mgr.save(1)
        mgr.wait()
    save = os.path.join(directory, "save")
    first = read_manifest(iter_dir(save, 1))
    for it in range(2, kept + 1):
        shutil.copytree(iter_dir(save, 1), iter_dir(save, it))
        write_manifest(save, dataclasses.replace(first, iteration=it, commit_seq=first.commit_seq + it - 1))
    write_tracker(save, kept)


def run(directory: str, kept: int, commits: int) -> dict:
    if kept:
        prepare(directory, kept)
    with _manager(directory) as mgr:
        base = kept + 1
        mgr.save(base)  # warm-up: every lazy start (threads, pools, JIT) before the count
        mgr.wait()
        _mark(MARK_BEGIN)
        for it in range(base + 1, base + 1 + commits):
            mgr.save(it)
            mgr.wait()
        _mark(MARK_END)
        committed = mgr.committed()
    return {"committed": len(committed), "newest": committed[-1]}


if __name__ == "__main__":
    directory, kept, commits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    write_line("RESULT " + json.dumps(run(directory, kept, commits)))
