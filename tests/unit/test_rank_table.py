"""The committer's rank records as columns (:mod:`datastates_megatron.engine.format.rank_table`): the
manifest it writes is byte for byte the one a tuple of records gives, and the table is a sequence
of those records."""

from __future__ import annotations

import numpy as np
import pytest

from datastates_megatron.engine.format.manifest import Manifest, RankRecord
from datastates_megatron.engine.format.rank_table import COLUMNS, RankTable
from datastates_megatron.engine.names import rank_file_name

TOKEN = "00000000000000cc"


def _columns(n: int, seed: int) -> np.ndarray:
    """Columns of every width: zeros, the largest uint64, and values of 1 to 20 digits."""
    rng = np.random.default_rng(seed)
    cols = rng.integers(0, 2**63, (n, len(COLUMNS)), dtype=np.uint64) // (
        np.uint64(10) ** rng.integers(0, 19, (n, len(COLUMNS)), dtype=np.uint64)
    )
    cols[:, COLUMNS.index("index_xxh64")] = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    cols[0] = 0
    cols[-1, COLUMNS.index("header_xxh64")] = 2**64 - 1
    return cols


def _manifest(ranks, world: int) -> Manifest:
    return Manifest(
        iteration=7,
        world_size=world,
        run_token=TOKEN,
        ranks=ranks,
        layout={"dp": world},
        metadata={"note": "é \u2028"},
        commit_seq=3,
        created=12.5,
        tier="local",
    )


@pytest.mark.parametrize("first, n", [(0, 1), (0, 300), (99_990, 20)])  # ranks of 5 and 6 digits
def test_a_table_writes_the_manifest_its_records_write(first, n):
    table = RankTable(first, TOKEN, 41, _columns(n, first + n))
    records = tuple(table)
    assert [r.rank for r in records] == list(range(first, first + n))
    assert [r.file for r in records] == [rank_file_name(r, TOKEN, 41) for r in range(first, first + n)]
    data = _manifest(table, first + n).to_json()
    assert data == _manifest(records, first + n).to_json()
    back = Manifest.from_json(data, "m.json")  # the checksum is the records' canonical text's
    assert back == _manifest(table, first + n) and _manifest(table, first + n) == back


def test_a_table_is_the_sequence_of_its_records():
    cols = _columns(5, 1)
    table = RankTable(10, TOKEN, 2, cols)
    want = tuple(RankRecord(10 + i, rank_file_name(10 + i, TOKEN, 2), *map(int, cols[i])) for i in range(5))
    assert len(table) == 5 and table[0] == want[0] and table[-1] == want[-1] and table[1:3] == want[1:3]
    assert tuple(table) == want and table == want and want == table and table == list(want)
    assert table == RankTable(10, TOKEN, 2, cols.copy()) and table != RankTable(10, TOKEN, 3, cols)
    assert table != want[:4] and table.record(12) == want[2] and table.record(15) is None
    assert table.file_names() == [r.file for r in want]
    assert int(table.column("data_bytes").sum()) == sum(r.data_bytes for r in want)
    with pytest.raises(IndexError):
        table[5]
    with pytest.raises(ValueError):  # a read-only view of what the commit wrote
        table.columns[0, 0] = 1


def test_a_manifest_of_a_table_answers_as_one_of_records():
    table = RankTable(0, TOKEN, 2, _columns(4, 2))
    m, t = _manifest(table, 4), _manifest(tuple(table), 4)
    assert m.total_bytes == t.total_bytes and m.file_names() == t.file_names()
    assert [m.record(r) for r in range(5)] == [t.record(r) for r in range(5)]
