"""Cleanup after a commit of an iteration saved more than once: the files of older saves of that
iteration go, a later save of this run (another rank may have started it already) stays."""

from __future__ import annotations

import os

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir, rank_file_name

from tests.workers.fault_worker import fill, make_state


def test_commit_removes_older_saves_of_its_iteration_and_keeps_a_newer_one(tmp_path):
    root = tmp_path / "ckpt"
    ts = make_state(0, 20_000)
    with CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        d = iter_dir(str(root), 5)
        os.makedirs(d)
        planted = {
            "older save of this run": (rank_file_name(0, mgr.token, 0), False),
            "another run's save": (rank_file_name(0, "0" * 16, 3), False),
            "newer save of this run": (rank_file_name(1, mgr.token, 99), True),
        }
        for name, _ in planted.values():
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"x" * 4096)
        fill(ts, 0, 5)
        assert mgr.save(5, {"iteration": 5})
        mgr.wait()
        committed = read_manifest(d).ranks[0].file
        left = set(os.listdir(d))
    assert committed in left
    for what, (name, kept) in planted.items():
        assert (name in left) == kept, what
