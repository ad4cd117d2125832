"""A manifest's rank records: one :class:`RankRecord`, or the committer's :class:`RankTable` of them.

Rank 0 of a 16k-rank job writes 16k records at every commit.  It has them as status columns
(numpy), and its file names follow one pattern (:func:`..names.rank_file_name`), so the table keeps
them so: no object per rank is made on the commit path, the manifest's text of the records is
formatted column-wise (:meth:`RankTable.json_text`, byte for byte what ``template % record``
gives), and the global index takes the same columns.  A record is made only when one is asked for.

Thread-safety: both types are immutable.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import numpy as np

from ..names import rank_file_name, rank_file_names, rank_file_parts

__all__ = ["RankRecord", "RankTable", "COLUMNS", "warmup"]

# a table's columns, in this order (the global index's rank records keep the same order)
COLUMNS = ("file_bytes", "data_bytes", "n_tensors", "index_xxh64", "header_xxh64")
_WIDE = 20  # decimal digits of the largest uint64


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """One rank's file in a manifest: its name, sizes and checksums."""

    rank: int
    file: str
    file_bytes: int
    data_bytes: int
    n_tensors: int
    index_xxh64: int
    header_xxh64: int


class RankTable(Sequence):
    """The records of ranks ``first .. first + len - 1`` of one save: ``columns`` ``uint64[n, 5]``
    (:data:`COLUMNS`), files named ``rank_file_name(rank, token, seq)``.  A sequence of
    :class:`RankRecord` (equal to the tuple of the same records), made one by one on demand."""

    __slots__ = ("first", "token", "seq", "columns")
    __hash__ = None  # as mutable-looking as the manifest that holds it (which holds dicts)

    def __init__(self, first: int, token: str, seq: int, columns: np.ndarray) -> None:
        columns = np.asarray(columns)
        if columns.ndim != 2 or columns.shape[1] != len(COLUMNS):
            raise ValueError(f"rank table columns of shape {columns.shape}, expected (n, {len(COLUMNS)})")
        self.first, self.token, self.seq = first, token, seq
        self.columns = np.ascontiguousarray(columns, dtype=np.uint64)
        self.columns.flags.writeable = False

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = range(len(self))[i]  # negative indices; IndexError past the end
        rank = self.first + i
        return RankRecord(rank, rank_file_name(rank, self.token, self.seq), *self.columns[i].tolist())

    def __iter__(self):
        names = self.file_names()
        for rank, name, row in zip(range(self.first, self.first + len(self)), names, self.columns.tolist()):
            yield RankRecord(rank, name, *row)

    def __eq__(self, other) -> bool:
        if isinstance(other, RankTable):
            return (self.first, self.token, self.seq) == (other.first, other.token, other.seq) and np.array_equal(
                self.columns, other.columns
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"RankTable(ranks {self.first}..{self.first + len(self) - 1}, token={self.token!r}, seq={self.seq})"

    def record(self, rank: int) -> RankRecord | None:
        """Rank ``rank``'s record (a position, not a search), or ``None`` when the table lacks it."""
        return self[rank - self.first] if self.first <= rank < self.first + len(self) else None

    def file_names(self) -> list[str]:
        """Every rank's file name, the pattern formatted once."""
        return rank_file_names(range(self.first, self.first + len(self)), self.token, self.seq)

    def column(self, name: str) -> np.ndarray:
        """One of :data:`COLUMNS`, read-only."""
        return self.columns[:, COLUMNS.index(name)]

    def json_text(self, template: str, order: tuple[str, ...], sep: bytes, quote) -> bytes:
        """``sep.join(template % record)`` over the records, each record's fields in ``order``
        (``%d`` of a column or ``rank``, ``%s`` of ``file`` as ``quote`` -- JSON's string encoder
        -- writes it), by one kernel pass over the columns."""
        pieces = re.split(r"%[ds]", template)
        if len(pieces) != len(order) + 1:
            raise ValueError(f"record template {template!r} has {len(pieces) - 1} fields, expected {len(order)}")
        # the quoted file name: its head, the rank's digits, its tail (a name's parts, each quoted)
        head, digits, tail = rank_file_parts(self.token, self.seq)
        head, tail = quote(head)[:-1], quote(tail)[1:]
        texts, fields, least = [pieces[0]], [], []
        for field, text in zip(order, pieces[1:]):
            if field == "file":
                texts[-1] += head
                fields.append(_RANK)
                least.append(digits)
                texts.append(tail + text)
            else:
                fields.append(_RANK if field == "rank" else COLUMNS.index(field))
                least.append(1)
                texts.append(text)
        texts[-1] += sep.decode("ascii")
        fields.append(-1)  # the last text (and the separator) is followed by no number
        least.append(0)
        raw = [t.encode("ascii") for t in texts]  # quoted: JSON's encoder leaves only ASCII
        starts = np.cumsum([0, *map(len, raw)], dtype=np.int64)
        out = np.empty(len(self) * (int(starts[-1]) + _WIDE * len(fields)), dtype=np.uint8)
        n = _kernel()(
            np.frombuffer(b"".join(raw), dtype=np.uint8),
            starts,
            np.array(fields, dtype=np.int64),
            np.array(least, dtype=np.int64),
            self.columns,
            self.first,
            out,
        )
        return out[: max(n - len(sep), 0)].tobytes()


_RANK = len(COLUMNS)  # a field number: the record's rank (not a column)


@functools.cache
def _kernel():
    """:func:`_format_records` compiled (or loaded from numba's cache) on first use: numba is not
    imported with the manifest."""
    import numba

    return numba.njit(nogil=True, cache=True)(_format_records)


def _format_records(text, starts, fields, least, columns, first, out):
    """Each row of ``columns`` (rank ``first``, ``first + 1``, ...) as ``text[starts[i]:starts[i + 1]]``
    then field ``fields[i]`` in decimal (a column; :data:`_RANK`: the rank; -1: none), zero-padded
    to ``least[i]`` digits, for each ``i``; into ``out``.  Returns the bytes written."""
    at = 0
    digits = np.empty(_WIDE, dtype=np.uint8)
    ten = np.uint64(10)
    for r in range(columns.shape[0]):
        for i in range(fields.shape[0]):
            for j in range(starts[i], starts[i + 1]):
                out[at] = text[j]
                at += 1
            f = fields[i]
            if f < 0:
                continue
            v = np.uint64(first + r) if f == _RANK else columns[r, f]
            k = 0
            while True:
                digits[k] = np.uint8(48 + v % ten)
                v = v // ten
                k += 1
                if v == 0 and k >= least[i]:
                    break
            for j in range(k - 1, -1, -1):
                out[at] = digits[j]
                at += 1
    return at


def warmup() -> None:
    """Compile (or load from cache) the formatting kernel, off the first commit."""
    RankTable(0, "0", 0, np.zeros((1, len(COLUMNS)), dtype=np.uint64)).json_text("%d %s", ("rank", "file"), b",", repr)
