"""``python scripts/bench_recovery.py`` (docs/BENCHMARKS.md) end to end, on the tests' tiny GPT: every
path is reported, each recovered run is bit-exact, and the host-memory path read nothing from
storage.  Slow (five recoveries of Megatron-LM); its arithmetic is ``unit/test_bench_recovery_phases.py``
and its measurement of an in-process restart runs in ``test_inprocess_restart.py`` (default set)."""

from __future__ import annotations

import pytest

from tests.integration.bench_scripts import run_json
from tests.integration.megatron_lm_runs import MEGATRON_LM_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="MEGATRON_LM_DIR is not set"),
]


def test_every_path_recovers_bit_exact_or_says_why_not(tmp_path):
    args = ["--layers", "2", "--hidden", "64", "--vocab", "512", "--dir", str(tmp_path), "--json"]
    doc = run_json("bench_recovery.py", args, tmp_path, timeout=1500)
    modes = doc["modes"]
    assert set(modes) == {"inprocess_host", "inprocess_file", "megatron_inprocess", "job_local", "job_persistent"}
    for name, m in modes.items():
        if name == "megatron_inprocess" and "error" in m:  # its own restore fails on CPU ranks (the issue)
            continue
        assert m["bit_exact"] and m["total"] > 0, (name, m)
    assert modes["inprocess_host"]["from_host_memory"] and not modes["inprocess_file"]["from_host_memory"]
    assert set(doc["goodput"]["inprocess_host"]) == {"1024", "16384"}
    assert list(tmp_path.iterdir()) == []
