"""Collective without a process group: a world of one, every operation this rank's own value."""

import pytest
import torch.distributed as dist

from datastates_megatron.engine.dist.collective import Collective, RankFailure
from datastates_megatron.engine.errors import CheckpointError, CommitError, ForeignCheckpointError, OptionsError


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
    assert failure == RankFailure((0,), ((0, "ForeignCheckpointError", "newer foreign checkpoint"),), count=1)
    assert failure.error_class() is ForeignCheckpointError


@pytest.mark.parametrize(
    "name,cls", [("CommitError", CommitError), ("OSError", CheckpointError), ("x", CheckpointError)]
)
def test_failure_error_class_is_one_of_ours(name, cls):
    assert RankFailure((1,), ((1, name, "m"),)).error_class() is cls


class _ElsewhereError(CheckpointError):
    """An error class defined outside engine/errors.py (as the megatron/ layer's are)."""


def test_error_classes_defined_anywhere_cross_ranks_by_name():
    from datastates_megatron.megatron.megatron_lm.torch_dist import ConversionError

    assert RankFailure((1,), ((1, "ConversionError", "m"),)).error_class() is ConversionError
    assert RankFailure((1,), ((1, "_ElsewhereError", "m"),)).error_class() is _ElsewhereError
    err = RankFailure((1, 2, 7), ((1, "_ElsewhereError", "a"), (2, "_ElsewhereError", "b"))).to_error("load")
    assert type(err) is _ElsewhereError
    assert str(err) == "load failed on rank(s) [1, 2, 7]: [rank 1] a; [rank 2] b"  # rank 7: named once


def test_an_error_whose_constructor_takes_other_arguments_still_arrives_in_its_class():
    err = RankFailure((3,), ((3, "OptionsError", "invalid options: x must be >= 1"),)).to_error("start-up")
    assert type(err) is OptionsError and "x must be >= 1" in str(err)


def test_two_error_classes_of_one_name_are_refused():
    with pytest.raises(TypeError, match="already exists"):
        type("CommitError", (CheckpointError,), {"__module__": "somewhere.else"})


def test_raise_agreed_in_a_world_of_one_raises_the_own_error(world):
    world.raise_agreed(None, "start-up")
    own = CommitError("mine")
    with pytest.raises(CommitError) as got:
        world.raise_agreed(own, "load", own=False)
    assert got.value is own


def test_a_failure_of_many_ranks_names_the_lowest_and_counts_the_rest():
    named = tuple(range(8))
    failure = RankFailure(named, ((0, "CommitError", "a"),), count=5000)
    assert failure.failed == 5000
    assert str(failure.to_error("load")) == (
        "load failed on rank(s) [0, 1, 2, 3, 4, 5, 6, 7] and 4992 more (5000 in all): [rank 0] a"
    )  # the ranks without a message reported are counted once, in the list


def test_min_max_in_a_world_of_one(world):
    assert world.min_max(-7) == (-7, -7)
    with pytest.raises(ValueError):
        world.min_max(-(1 << 63))
