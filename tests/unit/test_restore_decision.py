"""The restore decision on rank 0: the newest commit every rank holds from one save, from each
rank's few candidates (O(N) on rank 0; each other rank sends one fixed-size record)."""

import numpy as np

from datastates_megatron.engine.manager import _DECIDE_FIELDS, _SLOTS, _newest_common


def _cols(per_rank):
    """Columns of the gathered records: ``per_rank`` = one list of (iteration, token, seq, ms) per rank."""
    cols = {f: np.zeros(len(per_rank), dtype=np.int64) for f in _DECIDE_FIELDS}
    for r, entries in enumerate(per_rank):
        cols["n"][r] = len(entries)
        for i, (it, tok, seq, ms) in enumerate(entries[:_SLOTS]):
            cols[f"it{i}"][r], cols[f"tok{i}"][r], cols[f"seq{i}"][r], cols[f"ms{i}"][r] = it, tok, seq, ms
    return cols


def test_newest_common_save_by_commit_time_not_by_number():
    a5, a6, b4 = (5, 1, 5, 100), (6, 1, 6, 110), (4, 2, 1, 200)  # run 2 rolled back and committed 4 last
    assert _newest_common(_cols([[a5, a6, b4], [a5, a6, b4]]), None) == {"local": [4, 2, 1]}
    # a rank lacking the newest: the newest they all share
    assert _newest_common(_cols([[a5, a6, b4], [a5, a6]]), None) == {"local": [6, 1, 6]}


def test_the_same_iteration_from_two_saves_is_not_common():
    node0, node1 = [(6, 1, 6, 100)], [(6, 2, 1, 150)]  # one node's re-save manifest lost in a crash
    assert _newest_common(_cols([node0, node1]), None) == {"local": None}
    assert _newest_common(_cols([[], node1]), None) == {"local": None}


def test_an_asked_iteration_is_common_or_not():
    e = [(3, 1, 3, 10), (4, 1, 4, 20)]
    assert _newest_common(_cols([e, e]), 3) == {"local": [3, 1, 3]}
    assert _newest_common(_cols([e, e[1:]]), 3) == {"local": None}
