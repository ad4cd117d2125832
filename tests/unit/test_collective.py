"""Collective without a process group: a world of one, every operation this rank's own value."""

import pytest
import torch.distributed as dist

from datastates_megatron.engine.collective import Collective, RankFailure
from datastates_megatron.engine.errors import CheckpointError, CommitError, ForeignCheckpointError


@pytest.fixture
def world():
    assert not dist.is_initialized()
    return Collective()


def test_world_of_one(world):
    assert (world.rank, world.world_size, world.active, world.device.type) == (0, 1, False, "cpu")


def test_gather_returns_the_own_record_by_name(world):
    rec = {"ok": 1, "iteration": 7, "checksum": -(1 << 63), "big": (1 << 63) - 1}
    assert world.gather(rec) == [rec]


def test_gather_many_pads_nothing_and_keeps_order(world):
    recs = [{"iteration": i, "seq": 10 - i} for i in range(3)]
    assert world.gather_many(recs, fields=("iteration", "seq"), capacity=4) == [recs]
    assert world.gather_many([], fields=("iteration", "seq"), capacity=4) == [[]]


@pytest.mark.parametrize(
    "records,match",
    [
        ([{"a": 1 << 63}], "'a' = 9223372036854775808 is not an int64"),
        ([{"a": 1.5}], "'a' = 1.5 is not an int64"),
        ([{"b": 1}], r"record 0 has fields \['b'\], expected \['a'\]"),
        ([{"a": 1}, {"a": 2}], "2 records to gather, at most 1"),
    ],
)
def test_gather_many_refuses_bad_records(world, records, match):
    with pytest.raises(ValueError, match=match):
        world.gather_many(records, fields=("a",), capacity=1)


def test_broadcast_is_the_own_value(world):
    assert world.broadcast(123456789, src=0) == 123456789


def test_agree(world):
    assert world.agree(True) == []
    assert world.agree(False) == [0]


def test_agree_error(world):
    assert world.agree_error(None) is None
    failure = world.agree_error(ForeignCheckpointError("newer foreign checkpoint"))
    assert failure == RankFailure((0,), ((0, "ForeignCheckpointError", "newer foreign checkpoint"),))
    assert failure.error_class() is ForeignCheckpointError


@pytest.mark.parametrize(
    "name,cls", [("CommitError", CommitError), ("OSError", CheckpointError), ("x", CheckpointError)]
)
def test_failure_error_class_is_one_of_ours(name, cls):
    assert RankFailure((1,), ((1, name, "m"),)).error_class() is cls
