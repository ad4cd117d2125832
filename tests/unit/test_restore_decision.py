"""The restore decision on rank 0: the newest commit every rank holds from one save, from each
rank's few candidates (O(N) on rank 0; each other rank sends one fixed-size record)."""

import types

import numpy as np
import pytest

from datastates_megatron.engine import CheckpointError, NoCheckpointError
from datastates_megatron.engine.load.choice import DECIDE_FIELDS, SLOTS, decide, newest_common


def _cols(per_rank):
    """Columns of the gathered records: ``per_rank`` = one list of (iteration, token, seq, ms) per rank."""
    cols = {f: np.zeros(len(per_rank), dtype=np.int64) for f in DECIDE_FIELDS}
    for r, entries in enumerate(per_rank):
        cols["n"][r] = len(entries)
        for i, (it, tok, seq, ms) in enumerate(entries[:SLOTS]):
            cols[f"it{i}"][r], cols[f"tok{i}"][r], cols[f"seq{i}"][r], cols[f"ms{i}"][r] = it, tok, seq, ms
    return cols


def test_newest_common_save_by_commit_time_not_by_number():
    a5, a6, b4 = (5, 1, 5, 100), (6, 1, 6, 110), (4, 2, 1, 200)  # run 2 rolled back and committed 4 last
    assert newest_common(_cols([[a5, a6, b4], [a5, a6, b4]]), None) == {"local": [4, 2, 1]}
    # a rank lacking the newest: the newest they all share
    assert newest_common(_cols([[a5, a6, b4], [a5, a6]]), None) == {"local": [6, 1, 6]}


def test_the_same_iteration_from_two_saves_is_not_common():
    node0, node1 = [(6, 1, 6, 100)], [(6, 2, 1, 150)]  # one node's re-save manifest lost in a crash
    assert newest_common(_cols([node0, node1]), None) == {"local": None}
    assert newest_common(_cols([[], node1]), None) == {"local": None}


def test_an_asked_iteration_is_common_or_not():
    e = [(3, 1, 3, 10), (4, 1, 4, 20)]
    assert newest_common(_cols([e, e]), 3) == {"local": [3, 1, 3]}
    assert newest_common(_cols([e, e[1:]]), 3) == {"local": None}


def _decide(per_rank, committed, iteration=None, roots=None):
    """``decide`` as rank 0 runs it: every rank asks for the same directory unless ``roots`` says."""
    cols = _cols(per_rank)
    cols["root"] = np.array(roots or [7] * len(per_rank), dtype=np.int64)
    found = types.SimpleNamespace(committed=dict.fromkeys(committed))

    def latest(found):
        if not found.committed:
            raise NoCheckpointError("nothing committed")
        return max(found.committed)

    return decide(cols, found, root="/save", iteration=iteration, tiered=True, latest=latest, held="node-local")


def test_the_local_tier_wins_unless_the_shared_one_is_newer():
    e = [(4, 1, 4, 20), (6, 1, 6, 30)]
    assert _decide([e, e], committed=[4]) == (
        None,
        {"tier": "local", "iteration": 6, "why": "the newest checkpoint every rank has"},
    )
    assert _decide([e, e], committed=[4, 6])[0] == 6  # the shared tier's manifest of it is read too
    read, decision = _decide([e, e], committed=[4, 8])
    assert read == 8 and decision["tier"] == "persistent" and "newer than the newest node-local" in decision["why"]
    assert _decide([e, []], committed=[4])[1]["tier"] == "persistent"  # a rank holds nothing local


def test_nothing_anywhere_and_another_directory_are_errors():
    with pytest.raises(NoCheckpointError):
        _decide([[], []], committed=[])
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] asked to load another directory"):
        _decide([[], []], committed=[4], roots=[7, 8])


def test_an_asked_iteration_is_read_from_the_tier_that_has_it_on_every_rank():
    e = [(4, 1, 4, 20), (6, 1, 6, 30)]
    assert _decide([e, e], committed=[], iteration=4)[1]["tier"] == "local"
    assert _decide([e, e[1:]], committed=[4], iteration=4) == (
        4,
        {"tier": "persistent", "iteration": 4, "why": "iteration 4 is not on every node"},
    )
