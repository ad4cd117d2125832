"""Smoke test of ``python scripts/bench_host_copy.py`` (docs/BENCHMARKS.md) at 8 MiB: every measure
is reported, the host restores read memory (the script asserts where each restore came from and that
the values are the saved ones), and its temporary directory is removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_host_copy_prints_every_measure_and_restores_from_memory(tmp_path):
    args = ["--size-mb", "8", "--tensors", "2", "--saves", "1", "--out", str(tmp_path), "--json"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_host_copy.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["bytes"] == 8 << 20
    assert set(doc["save_s"]) == {"plain", "host_copy"} and all(v > 0 for v in doc["save_s"].values())
    assert set(doc["restore_s"]) == {"host_verify", "host_noverify", "file_verify_evicted", "memcpy"}
    assert all(v > 0 for v in doc["restore_ratio_vs_memcpy"].values()) and doc["restore_speedup_host_vs_file"] > 0
    assert list(tmp_path.iterdir()) == []
