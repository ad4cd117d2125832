"""Smoke test of ``python scripts/bench_s3.py`` (docs/BENCHMARKS.md) at 4 MiB, one repeat: it starts
its own moto S3 server, and prints both rows (promotion and restore) with their rates and ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_s3_prints_the_promotion_and_the_restore_against_boto3(tmp_path):
    args = ["--mb", "4", "--part-mb", "5", "--concurrency", "2", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_s3.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        for label in ("promotion vs upload_file", "restore vs ranged GETs"):
            if line.startswith(label):
                rows[label] = [float(x) for x in line[len(label) :].split()]
    assert sorted(rows) == ["promotion vs upload_file", "restore vs ranged GETs"], done.stdout
    for label, (ours, plain, ratio) in rows.items():
        assert ours > 0 and plain > 0 and abs(ratio - ours / plain) < 0.01 + 0.01 * ratio, (label, ours, plain, ratio)
    assert list(tmp_path.iterdir()) == []  # its temporary directory is removed
