"""Integration smoke test of ``scripts/bench_memory.py`` (issue 41 item 8): a fresh 2-rank torchrun
per engine on a tiny GPT; the JSON holds every engine's high-water RSS over the baseline process,
and ours reports its host cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_memory.py"
TINY = ["--layers", "2", "--heads", "4", "--seq-len", "32", "--vocab", "256", "--iters", "2", "--warmup", "1"]


@pytest.mark.slow
def test_each_engine_reported_over_its_baseline_process(tmp_path):
    out = tmp_path / "mem.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--hiddens", "64", "--engines", "ours,torch_save"]
        + ["--host-cache-gb", "0.008", "--dir", str(tmp_path / "ck"), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]["64"]
    assert sorted(rows) == ["baseline", "ours", "torch_save"]
    assert rows["baseline"]["over_base_bytes"] == 0 and rows["baseline"]["growth_over_base_bytes"] == 0
    for name, row in rows.items():
        assert row["peak_bytes"] > row["state_bytes"] > 0, (name, row)
    assert abs(rows["ours"]["cache_bytes"] - 0.008 * (1 << 30)) < 1 << 20  # --host-cache-gb is GiB
    assert 0 < rows["ours"]["cache_peak_bytes"] <= rows["ours"]["cache_bytes"]
    assert "| 64 | ours |" in done.stdout
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # runs removed


def test_ours_over_its_baseline_process(tmp_path):
    """The fast one (the default set): ``--engines ours`` alone, beside the baseline process it is
    measured against."""
    out = tmp_path / "mem.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--hiddens", "64", "--engines", "ours"]
        + ["--host-cache-gb", "0.008", "--dir", str(tmp_path / "ck"), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]["64"]
    assert sorted(rows) == ["baseline", "ours"]
    assert rows["ours"]["peak_bytes"] > rows["ours"]["state_bytes"] > 0
    assert abs(rows["ours"]["cache_bytes"] - 0.008 * (1 << 30)) < 1 << 20  # --host-cache-gb is GiB
    assert 0 < rows["ours"]["cache_peak_bytes"] <= rows["ours"]["cache_bytes"]
    assert "| 64 | ours |" in done.stdout
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # runs removed
