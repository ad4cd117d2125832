"""training_record's reader: runs split at each process's start line, a cut last line ignored."""

from __future__ import annotations

import json

from datastates_megatron.megatron.cpu import training_record


def test_runs_are_split_and_a_cut_last_line_is_ignored(tmp_path):
    prefix = str(tmp_path / "rec")
    lines = [
        {"start": 11},
        {"iteration": 1, "grad_norm": 0.5},
        {"iteration": 2, "grad_norm": 0.25},
        {"start": 12},
        {"iteration": 2, "grad_norm": 0.75},
        {"iteration": 3, "grad_norm": 1.0},
        {"final_iteration": 3, "digest": {"model0": 7}},
    ]
    with open(f"{prefix}.rank1.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
        f.write('{"iteration": 4, "grad')  # a run killed mid-write
    runs = training_record.read_runs(prefix, 1)
    assert [sorted(its) for its, _ in runs] == [[1, 2], [2, 3]]
    assert runs[0][1] is None and runs[1][1]["digest"] == {"model0": 7}
    iterations, final = training_record.read(prefix, 1)
    assert sorted(iterations) == [1, 2, 3] and iterations[2]["grad_norm"] == 0.75  # the later run's
    assert final["final_iteration"] == 3
    assert training_record.read_runs(str(tmp_path / "none"), 0) == []


def test_load_entries_are_events_not_iterations_and_a_cut_line_is_ignored(tmp_path):
    prefix = str(tmp_path / "rec")
    lines = [{"start": 11}, {"load": [1.0, 1.5]}, {"iteration": 1, "t": 2.0}, {"load": [3.0, 3.25]}]
    with open(f"{prefix}.rank0.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
        f.write('{"load": [4.0')  # cut
    assert training_record.read_events(prefix, 0) == lines
    assert sorted(training_record.read(prefix, 0)[0]) == [1]  # a load is not an iteration
    assert training_record.read_events(str(tmp_path / "none"), 0) == []


def test_an_entry_before_torch_distributed_waits_for_the_ranks_file(tmp_path):
    """A spare rank's abort is written before it has a rank: it must not open rank 0's file (the
    spare's later iterations would land there), but the file of the rank it is given."""
    import torch.distributed as dist

    prefix = str(tmp_path / "rec")
    record = training_record._Record(prefix)
    record.write({"abort": 1.0})
    assert list(tmp_path.iterdir()) == []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        record.write({"iteration": 1, "t": 2.0})
    finally:
        dist.destroy_process_group()
    start, *rest = training_record.read_events(prefix, 0)
    assert start["t"] > 0 and rest == [{"abort": 1.0}, {"iteration": 1, "t": 2.0}]
