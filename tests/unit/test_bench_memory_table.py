"""``scripts/bench_memory.py``'s summary (issue 49, item 7): per engine and size, the max over ranks
of the peak, the host cache, the Python heap (``--trace-heap``) and the index and manifest bytes,
over the baseline process of the same rank."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MB = 1 << 20


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script imports its sibling _bench_engines
    import bench_memory

    return bench_memory


def _rank(rank: int, peak: int, **extra) -> dict:
    return {"rank": rank, "peak": peak * MB, "base": 0, "growth": peak * MB // 2, "state_bytes": 10 * MB, **extra}


def test_the_table_holds_cache_heap_and_index_per_rank_over_the_baseline(bench):
    runs = {
        512: {
            "baseline": [_rank(0, 800), _rank(1, 810)],
            "ours": [
                _rank(
                    0,
                    990,
                    cache_bytes=64 * MB,
                    cache_peak_bytes=60 * MB,
                    heap_peak=30 * MB,
                    index_bytes=2048,
                    manifest_bytes=1024,
                ),
                _rank(
                    1,
                    960,
                    cache_bytes=64 * MB,
                    cache_peak_bytes=64 * MB,
                    heap_peak=20 * MB,
                    index_bytes=2048,
                    manifest_bytes=1024,
                ),
            ],
        }
    }
    rows = bench.summarise(runs)[512]
    assert rows["ours"]["over_base_bytes"] == 190 * MB  # rank 0: 990 - 800 (rank 1: 150)
    assert rows["ours"]["heap_peak_bytes"] == 30 * MB and rows["ours"]["cache_peak_bytes"] == 64 * MB
    assert rows["baseline"]["heap_peak_bytes"] == 0 and rows["baseline"]["index_bytes"] == 0
    table = bench.render({512: rows})
    assert "| 512 | ours | 10.0 | 990.0 | 190.0 | 95.0 | 64.0 (64.0) | 30.0 | 2.0 + 1.0 |" in table, table
    assert "| 512 | baseline | 10.0 | 810.0 | 0.0 | 0.0 | - | - | - |" in table, table
