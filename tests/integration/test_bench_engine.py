"""Smoke test of ``python scripts/bench_engine.py`` (README.md, docs/BENCHMARKS.md) at 4 MiB and one
repeat: every measure is reported with a positive rate, and its temporary directory is removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_engine_prints_every_measure(tmp_path):
    args = ["--size-mb", "4", "--repeats", "1", "--out", str(tmp_path), "--json"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_engine.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["repeats"] == 1 and doc["flush"]["bytes"] == 4 << 20
    rates = {k: v for part in ("flush", "memcpy_hash") for k, v in doc[part].items() if k.endswith("_gbps")}
    assert set(rates) >= {"engine_auto_gbps", "engine_off_gbps", "plain_write_fsync_gbps", "xxh64_gbps", "crc32_gbps"}
    assert all(v > 0 for v in rates.values()), rates
    save = doc["save_call"]
    assert save["saves_per_repeat"] > 0 and 0 < save["save_call_median_ms"] <= save["save_call_max_ms"]
    assert list(tmp_path.iterdir()) == []  # its output directory is gone
