"""Smoke test of ``scripts/bench_ckpt_cpu.py``: a tiny GPT on 2 gloo ranks, every mode, and the
table it prints has one row per rank and mode with the per-thread CPU and machine columns filled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed.ranks import Finished, torchrun

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_ckpt_cpu.py"
MODES = ("ours", "ours-recycle", "ours-buffered")


def _launch(tmp_path: Path, *args: str) -> Finished:
    tiny = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "256"]
    return torchrun(SCRIPT, 2, [*tiny, "--iters", "3", "--warmup", "1", *args], cwd=tmp_path)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads per-thread CPU from /proc (Linux)")
def test_every_mode_prints_a_row_per_rank_with_our_threads_busy(tmp_path):
    pytest.importorskip("megatron.core")
    proc = _launch(tmp_path, "--dirs", str(tmp_path / "ckpt"), "--modes", ",".join(MODES))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    header = next(line.split() for line in proc.stdout.splitlines() if line.lstrip().startswith("rank"))
    assert header[-2:] == ["idle", "steal"]
    by_rank_mode = {(r[0], r[1]): r for r in rows}
    assert set(by_rank_mode) == {(rank, mode) for rank in ("0", "1") for mode in ("baseline", *MODES)}
    for (rank, mode), row in by_rank_mode.items():
        ours_total_ms = float(row[-3])
        if mode == "baseline":
            assert ours_total_ms == 0.0
        else:  # per-thread CPU is counted in 10 ms ticks: a tiny model may show 0 ms, so no lower bound
            cores = 1.5 * (os.cpu_count() or 1)  # idle and steal are in cores (10 ms ticks: some slack)
            assert ours_total_ms >= 0 and float(row[3]) > 0 and 0 <= float(row[-2]) <= cores, row
            assert 0 <= float(row[-1]) <= cores, row


def test_an_unknown_mode_is_refused_with_the_choices(tmp_path):
    proc = _launch(tmp_path, "--modes", "ours,turbo")
    assert proc.returncode != 0 and "turbo" in proc.stderr and "ours-buffered" in proc.stderr
