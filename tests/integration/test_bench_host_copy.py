"""Smoke test of ``python scripts/bench_host_copy.py`` (docs/BENCHMARKS.md) at 8 MiB: every measure
is reported, the host restores read memory (the script asserts where each restore came from and that
the values are the saved ones), and its temporary directory is removed."""

from __future__ import annotations

from tests.integration.bench_scripts import run_json


def test_bench_host_copy_prints_every_measure_and_restores_from_memory(tmp_path):
    args = ["--size-mb", "8", "--tensors", "2", "--saves", "1", "--out", str(tmp_path), "--json"]
    doc = run_json("bench_host_copy.py", args, tmp_path, timeout=120)
    assert doc["bytes"] == 8 << 20
    assert set(doc["save_s"]) == {"plain", "host_copy"} and all(v > 0 for v in doc["save_s"].values())
    assert set(doc["restore_s"]) == {"host_verify", "host_noverify", "file_verify_evicted", "memcpy"}
    assert all(v > 0 for v in doc["restore_ratio_vs_memcpy"].values()) and doc["restore_speedup_host_vs_file"] > 0
    assert list(tmp_path.iterdir()) == []
