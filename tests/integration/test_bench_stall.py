"""Smoke test of ``python scripts/bench_stall.py`` (docs/BENCHMARKS.md): the demo trainer on 2 CPU
ranks with every write stalled 2 s from iteration 6 (the engine's in-process stall point); the run
ends, and each rank's line and the worst ratio are printed (the ratio itself is a timing: not
asserted here)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "--num-layers 2 --hidden-size 64 --seq-length 32 --vocab-size 256"


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_bench_stall_reports_each_rank_and_the_worst_ratio(tmp_path):
    args = ["--stall-s", "2", "--stall-from", "6", "--iters", "30", f"--model={TINY}", "--workdir", str(tmp_path / "w")]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_stall.py"), *args, "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "30 iterations, writes of both ranks stalled 2 s from iteration 6" in out, out
    for rank in (0, 1):
        line = next((x for x in out.splitlines() if x.startswith(f"rank {rank}: median iteration")), None)
        assert line is not None and "during it" in line and "last iteration 30" in line, out
    assert re.search(r"^worst ratio during/before: [0-9.]+x \(target <= 1\.2x\)$", out, re.M), out


def test_a_workdir_it_did_not_make_is_refused_and_left_alone(tmp_path):
    """It emptied any ``--workdir`` with ``rmtree``; now one line and nothing removed."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_stall.py"), "--workdir", str(mine)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and f"--workdir {mine}: not empty and not made by the demo" in done.stderr
    assert done.stderr.count("\n") == 1 and (mine / "notes.txt").read_text() == "keep"
