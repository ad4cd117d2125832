"""The quick fault sweep end to end (slow: ~1-2 minutes of two cores; the full sweep is a script),
and its hostile-storage section (a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_sweep_loses_nothing(tmp_path):
    out = tmp_path / "summary.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.faults.sweep",
            "--quick",
            "--no-demo",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["data_lost"] == 0, done.stdout[-3000:]
    assert summary["total"]["killed"] >= 15 and summary["total"]["resumed"] == summary["total"]["killed"], summary[
        "total"
    ]
    assert summary["silent_corruptions"] == 0, done.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:]


def test_hostile_storage_section_every_attack_as_specified_nothing_outside_changed(tmp_path):
    out = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.faults.sweep", "--only", "hostile", "--dir", str(tmp_path), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    hostile = json.loads(out.read_text())["hostile"]
    assert len(hostile) >= 20
    for h in hostile:
        assert h["as_specified"] and h["outside_unchanged"], h
        assert "TRACEBACK" not in h["outcome"] and h["wall_s"] < 30, h
        # the stated bound: 64 MiB + 2x the crafted bytes, 2 s per 64 MiB (attacks.bound)
        assert h["within_bound"], h
    assert done.returncode == 0, done.stdout[-3000:]
