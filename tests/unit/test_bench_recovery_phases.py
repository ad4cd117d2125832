"""``scripts/bench_recovery.py``'s arithmetic: the recovery phases read from a training record, and
the goodput formula.  The script's own runs are ``tests/integration/test_bench_recovery.py`` (slow);
its measurement of a real in-process restart runs in ``test_inprocess_restart.py``."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_bench_restart_slices import SCRIPTS


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_recovery

    return bench_recovery


def _record(tmp_path, entries) -> str:
    prefix = str(tmp_path / "run-record")
    with open(f"{prefix}.rank0.jsonl", "w") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")
    return prefix


def test_phases_run_from_the_last_iteration_before_the_fault_to_the_first_after(bench, tmp_path):
    record = _record(
        tmp_path,
        [
            {"start": 1},
            {"load": [0.0, 0.5]},  # the first attempt's load: nothing to restore
            *({"iteration": i, "t": 10.0 + i} for i in range(1, 5)),  # one iteration a second
            {"load": [20.0, 20.25]},  # the restart's restore
            {"iteration": 5, "t": 21.25},
        ],
    )
    got = bench.phases(record, 5)
    assert got == pytest.approx(
        {
            **{"partial": 6.0, "detect": 0.0, "abort": 0.0, "reinit": 0.0},  # no fault or init times recorded
            **{"until_restore": 6.0, "restore": 0.25, "first_iteration": 1.0, "total": 7.25, "iteration": 1.0},
        }
    )


def _phases_after_a_fault(bench, tmp_path, *recovery) -> dict:
    """``phases`` of a record: iterations 1..4 one a second, a fault half-way through iteration 5
    (t = 14.5), then the ``recovery`` entries (the last one iteration 5's)."""
    entries = [{"start": 1, "t": 0.0}, *({"iteration": i, "t": 10.0 + i} for i in range(1, 5)), {"fault": 14.5}]
    return bench.phases(_record(tmp_path, [*entries, *recovery]), 5)


def test_an_in_process_restart_splits_into_detection_abort_and_reinitialisation(bench, tmp_path):
    got = _phases_after_a_fault(
        bench,
        tmp_path,
        {"abort": 15.0},
        {"init": [16.0, 17.0]},
        {"load": [18.0, 18.25]},
        {"iteration": 5, "t": 19.25},
    )
    want = {"partial": 0.5, "detect": 0.5, "abort": 1.0, "reinit": 2.0, "restore": 0.25, "first_iteration": 1.0}
    assert {k: got[k] for k in want} == pytest.approx(want)
    assert got["until_restore"] == pytest.approx(4.0) and got["total"] == pytest.approx(5.25)


def test_a_job_restart_detects_until_the_new_process_starts(bench, tmp_path):
    got = _phases_after_a_fault(
        bench,
        tmp_path,
        {"start": 2, "t": 20.0},  # the new job's process
        {"init": [30.0, 31.0]},
        {"load": [32.0, 32.5]},
        {"iteration": 5, "t": 33.0},
    )
    want = {"partial": 0.5, "detect": 5.5, "abort": 0.0, "reinit": 12.0, "restore": 0.5, "first_iteration": 0.5}
    assert {k: got[k] for k in want} == pytest.approx(want)


def test_a_record_without_a_recovery_is_refused(bench, tmp_path):
    record = _record(tmp_path, [{"start": 1}, {"load": [0.0, 0.1]}, {"iteration": 4, "t": 1.0}])
    with pytest.raises(RuntimeError, match="no fault-and-recovery"):
        bench.phases(record, 5)


def test_two_restores_after_the_fault_are_not_one_recovery(bench, tmp_path):
    entries = [{"iteration": 4, "t": 1.0}, {"load": [2.0, 2.1]}, {"load": [5.0, 5.1]}, {"iteration": 5, "t": 6.0}]
    with pytest.raises(RuntimeError, match="2 restores"):
        bench.phases(_record(tmp_path, entries), 5)


def test_a_restore_of_an_older_checkpoint_is_refused(bench, tmp_path):
    entries = [{"iteration": 4, "t": 1.0}, {"load": [2.0, 2.1]}, {"iteration": 3, "t": 3.0}, {"iteration": 5, "t": 5.0}]
    with pytest.raises(RuntimeError, match="first iteration after the restore is 3"):
        bench.phases(_record(tmp_path, entries), 5)


def test_goodput_loses_half_an_interval_and_the_recovery_per_failure(bench):
    # 1 failure per hour: MTBF 3600 s; each costs 300 s of lost work and 60 s of recovery
    assert bench.goodput(60.0, 1, 1.0, 600.0) == pytest.approx(1 - 360 / 3600)
    assert bench.goodput(60.0, 1000, 1.0, 600.0) == 0.0  # never below zero
