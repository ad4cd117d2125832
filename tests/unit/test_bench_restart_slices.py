"""``scripts/bench_restart.py``'s check of a tensor-parallel restore (issue 40, item 8): each rank's
parameter shard must equal its slice of the full tensor the 1-TP run saved, the slice given by
megatron-core's ``ShardedTensor`` coordinates (global shape, global offset, prepended axes)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script imports its sibling _bench_engines
    import bench_restart

    return bench_restart


def test_a_shard_is_the_slice_its_offset_names(bench):
    full = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(bench.saved_slice(full, (4, 6), (0, 3), (4, 3)), full[:, 3:])  # column-parallel half
    assert torch.equal(bench.saved_slice(full, (4, 6), (2, 0), (2, 6)), full[2:])  # row half
    # a prepended axis (e.g. the layer number) is in the coordinates, not in the tensor
    assert torch.equal(bench.saved_slice(full, (5, 4, 6), (2, 0, 3), (4, 3), prepend=1), full[:, 3:])


@pytest.mark.parametrize(
    "global_shape, offset, local, prepend, why",
    [
        ((4, 8), (0, 4), (4, 4), 0, "is not the global tensor"),  # the saved tensor is another one
        ((4, 6), (0, 4), (4, 3), 0, "is outside"),  # past the end
        ((4, 6), (0, -1), (4, 3), 0, "is outside"),
        ((4, 6), (0, 3), (4, 3), 1, "does not fit"),  # coordinates of another rank
        ((4, 6), (0,), (4, 3), 0, "does not fit"),
    ],
)
def test_coordinates_that_do_not_describe_the_saved_tensor_are_refused(
    bench, global_shape, offset, local, prepend, why
):
    with pytest.raises(ValueError, match=why):
        bench.saved_slice(torch.zeros(4, 6), global_shape, offset, local, prepend)


def _chunk(weight: torch.Tensor, bias: torch.Tensor):
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight.clone())
    module.bias = torch.nn.Parameter(bias.clone())
    return types.SimpleNamespace(module=module)


def test_tp_shards_are_compared_with_their_slice_and_the_rest_whole(bench):
    ref = {"c0.weight": torch.arange(24.0).reshape(4, 6), "c0.bias": torch.arange(4.0)}
    chunk = _chunk(ref["c0.weight"][:, 3:], ref["c0.bias"])  # TP rank 1 of a column split; bias replicated
    coords = {id(chunk.module.weight): ((4, 6), (0, 3), 0)}
    assert bench._tp_param_mismatches([chunk], ref, coords) == []
    # rank 0's coordinates for rank 1's data: the slice differs
    assert bench._tp_param_mismatches([chunk], ref, {id(chunk.module.weight): ((4, 6), (0, 0), 0)}) == ["c0.weight"]
    # one element off, in the shard or in the replicated bias
    with torch.no_grad():
        chunk.module.bias[2] += 1
    assert bench._tp_param_mismatches([chunk], ref, coords) == ["c0.bias"]
    with torch.no_grad():
        chunk.module.bias[2] -= 1
        chunk.module.weight[3, 2] = -1.0
    assert bench._tp_param_mismatches([chunk], ref, coords) == ["c0.weight"]


def test_a_shard_without_coordinates_or_a_missing_parameter_is_a_mismatch(bench):
    ref = {"c0.weight": torch.arange(24.0).reshape(4, 6), "c0.bias": torch.arange(4.0)}
    chunk = _chunk(ref["c0.weight"][:, 3:], ref["c0.bias"])
    assert bench._tp_param_mismatches([chunk], ref, {}) == ["c0.weight"]  # a half compared with the whole
    extra = dict(ref, **{"c0.other": torch.zeros(1)})
    assert bench._tp_param_mismatches([chunk], extra, {id(chunk.module.weight): ((4, 6), (0, 3), 0)}) == ["c0.other"]
    bad = bench._tp_param_mismatches([chunk], ref, {id(chunk.module.weight): ((4, 6), (0, 4), 0)})
    assert len(bad) == 1 and bad[0].startswith("c0.weight: ") and "is outside" in bad[0]
