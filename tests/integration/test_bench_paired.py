"""Smoke test of ``scripts/bench_paired.py``: a tiny GPT on 2 gloo ranks, one A B B A group per tier,
and what it prints: one row per group, the median and end-to-end ratios, the CPU by thread."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.ranks import Finished, torchrun

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_paired.py"


def _launch(tmp_path: Path, *args: str) -> Finished:
    tiny = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "256"]
    groups = ["--block", "2", "--quads", "2", "--warmup", "1", "--persist-interval", "3"]
    dirs = ["--dir", str(tmp_path / "ckpt"), "--local-dir", str(tmp_path / "local")]
    return torchrun(SCRIPT, 2, [*tiny, *groups, *dirs, *args], cwd=tmp_path)


@pytest.mark.parametrize("tier", ["local", "disk"])
def test_prints_each_group_and_the_ratios_and_leaves_no_checkpoint_behind(tmp_path, tier):
    pytest.importorskip("megatron.core")
    proc = _launch(tmp_path, "--tier", tier)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [r[0] for r in rows] == ["0", "1"]
    for row in rows:
        a, b, ratio, wait, cpu_a, cpu_b = map(float, row[1:])
        assert a > 0 and b > 0 and ratio == pytest.approx(b / a, rel=0.05) and wait >= 0, row
        assert 0 < cpu_a and 0 < cpu_b, row
    med = re.search(r"median iteration: A ([\d.]+) s, B ([\d.]+) s, ratio ([\d.]+)", proc.stdout)
    e2e = re.search(r"end-of-run promotion ([\d.]+) s = ([\d.]+) s; ratio ([\d.]+)", proc.stdout)
    assert med and e2e, proc.stdout
    assert float(med.group(3)) == pytest.approx(float(med.group(2)) / float(med.group(1)), rel=0.05)
    assert float(e2e.group(3)) > 0
    if tier == "disk":  # nothing to promote without a local tier
        assert float(e2e.group(1)) < 0.05
    cpu = {
        m.group(1): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+[-+][\d.]+$", proc.stdout, re.M)
    }
    assert cpu["MainThread"][0] > 0 and cpu["all"][1] >= cpu["MainThread"][1], proc.stdout
    assert cpu["dsm-flush"][1] > 0 and cpu["dsm-flush"][0] < cpu["dsm-flush"][1], proc.stdout  # B writes
    assert ("dsm-promote" in cpu) == (tier == "local"), proc.stdout
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "local").exists()
