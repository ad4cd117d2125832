"""Smoke test of ``python scripts/bench_restore.py`` (README.md, docs/BENCHMARKS.md) at 4 MiB and
one repeat: every measure warm and (where the page cache can be dropped) cold, the restored values checked equal to the saved ones, and
its temporary directory removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_restore_prints_every_measure_and_checks_values(tmp_path):
    args = ["--size-mb", "4", "--tensors", "2", "--repeats", "1", "--out", str(tmp_path), "--json"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_restore.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["restored_ok"] is True and doc["bytes"] == 4 << 20
    caches = ["warm"] + (["cold"] if not doc["cold_unavailable_reason"] else [])  # drop_caches needs root
    assert sorted(doc["results"]) == sorted(caches)
    for cache in caches:
        measures = doc["results"][cache]
        assert set(measures) == {"raw_read", "restore_verify", "restore_noverify"}, measures
        assert all(m["gbps"] > 0 and len(m["seconds"]) == 1 for m in measures.values()), measures
    assert list(tmp_path.iterdir()) == []
