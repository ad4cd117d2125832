"""Format 2 of the global index (:mod:`.global_index`): sections that one resharding rank reads by
range, so that what it reads stays bounded as the world grows (issue #40, item 4: at 64k ranks a
rank read the whole 6.3 MB index and the whole 14.4 MB manifest to plan a few shards).

A rank of the new layout needs the pieces of its own model-parallel slices only, and of those only
the ones overlapping its element ranges; it opens a handful of old rank files, whose manifest
records it needs.  So the file is cut along those lines::

    MAGIC | u64 header length | header (JSON) | u64 XXH64 of the header | body | rank records | their sums

* the header (at most 4 KiB): the commit it belongs to, the body's length, and how rank records
  are stored (or ``null``: none);
* the body opens with its table of contents: ``u64`` length, ``u64`` XXH64, then JSON
  ``{"slices": [[slice, head offset, head length, head XXH64, rows offset, rows], ...]}``
  (offsets from the body's start; ``slice`` ``null`` for keys without one: identity 1);
* a slice's *head*: ``u64`` length of its tables, the tables (JSON: ``keys`` as ``[key, first
  row, rows, first fence]``, ``tensors``, ``params``), then its fences ``int64[f, 3]``: per block
  of :data:`BLOCK_ROWS` rows of one key, the block's first start, the largest end of the key's
  rows up to the block's end, and the block's XXH64;
* a slice's rows ``int64[n, 6]`` ``(key id, start, end, rank, tensor id, offset)``, sorted by key,
  start and rank (ids local to the slice);
* rank records ``uint64[world, 5]`` ``(file bytes, data bytes, tensors, index XXH64, header
  XXH64)`` -- the file name is ``rank_file_name(rank, token, seq)`` of the header -- with one
  XXH64 per :data:`RANK_BLOCK` records after them.

Every part a reader uses is checked against the checksum that names it before it is used (the
header against its own, the contents and heads against theirs, rows and records per block), and
every JSON text against the manifest's bounds before it is parsed.  A lookup is a binary search on
a key's fences and one ranged read of the blocks that can overlap.

Thread-safety: :func:`pack_body` is pure; a :class:`RangedIndex` is used by one thread.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from ..errors import CorruptCheckpointError
from ..names import rank_file_name
from .hashing import xxh64
from .json_budget import VALUE_BYTES, DecodeBudget
from .manifest import RankRecord

__all__ = [
    "VERSION",
    "BLOCK_ROWS",
    "RANK_BLOCK",
    "pack_body",
    "pack_ranks",
    "pack_columns",
    "RangedIndex",
    "slice_of",
    "check_bounds",
    "count_json",
]

VERSION = 2
BLOCK_ROWS = 32  # rows per checksummed block (1.5 KiB): a lookup reads a block or two per key
RANK_BLOCK = 128  # rank records per checksummed block (5 KiB)
_COLS = 6
_FENCE = 3
_RECORD = 5
_U64 = (1 << 64) - 1
# the manifest's bounds on a JSON text (see :mod:`.global_index`)
_BYTES_PER_VALUE = 16
_VALUE_ALLOWANCE = 1 << 16
_MAX_VALUES = 1 << 19
_MAX_OBJECTS = 64


def slice_of(key: str) -> str | None:
    """The model-parallel slice of a key ``json [slice, ...]`` (``None``: a key without one)."""
    try:
        parsed = json.loads(key)
    except (ValueError, RecursionError):
        return None
    return parsed[0] if isinstance(parsed, list) and parsed and isinstance(parsed[0], str) else None


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def pack_body(keys: list[str], tensors: list[str], params: dict, table: np.ndarray) -> bytes:
    """The body of a format-2 index of pieces ``table`` (``int64[n, 6]`` rows over ``keys`` and
    ``tensors`` ids) and ``params``, cut by slice."""
    key_slice = [slice_of(k) for k in keys]
    names = sorted({*key_slice, *(slice_of(k) for k in params)}, key=lambda s: (s is not None, s or ""))
    sid = {s: i for i, s in enumerate(names)}
    # a key's id within its slice: the slice's keys in text order
    order = sorted(range(len(keys)), key=lambda k: (sid[key_slice[k]], keys[k]))
    local = np.zeros(len(keys), dtype=np.int64)
    by_slice: dict = {s: [] for s in names}
    for k in order:
        local[k] = len(by_slice[key_slice[k]])
        by_slice[key_slice[k]].append(k)
    key_sid = np.array([sid[s] for s in key_slice], dtype=np.int64)
    table = table[np.lexsort((table[:, 3], table[:, 1], local[table[:, 0]], key_sid[table[:, 0]]))]
    bounds = np.searchsorted(key_sid[table[:, 0]], np.arange(len(names) + 1))
    params_by: dict = {s: {} for s in names}
    for k, v in params.items():
        params_by[slice_of(k)][k] = v
    parts, toc, at = [], [], 0
    for i, s in enumerate(names):
        head, rows = _slice(
            table[bounds[i] : bounds[i + 1]].copy(), [keys[k] for k in by_slice[s]], local, tensors, params_by[s]
        )
        parts += [head, rows]
        toc.append([s, at, len(head), xxh64(head), at + len(head), len(rows) // (8 * _COLS)])
        at += len(head) + len(rows)
    contents = json.dumps({"slices": toc}, separators=(",", ":")).encode()  # offsets from the sections' start
    return struct.pack("<QQ", len(contents), xxh64(contents)) + contents + b"".join(parts)


def _slice(rows: np.ndarray, keys: list[str], local: np.ndarray, tensors: list[str], params: dict):
    """One slice's head and rows (rows re-keyed to the slice's own key and tensor ids)."""
    kcol = local[rows[:, 0]] if len(rows) else rows[:, 0]
    used, tcol = np.unique(rows[:, 4], return_inverse=True)
    rows[:, 0], rows[:, 4] = kcol, tcol.reshape(-1)
    rows = np.ascontiguousarray(rows, dtype="<i8")
    starts = np.searchsorted(kcol, np.arange(len(keys) + 1))
    entries, fences = [], []
    for k, key in enumerate(keys):
        lo, hi = int(starts[k]), int(starts[k + 1])
        entries.append([key, lo, hi - lo, len(fences)])
        if hi == lo:
            continue
        most = np.maximum.accumulate(rows[lo:hi, 2])
        for b in range(lo, hi, BLOCK_ROWS):
            e = min(b + BLOCK_ROWS, hi)
            fences.append((int(rows[b, 1]), int(most[e - 1 - lo]), _signed(xxh64(rows[b:e].tobytes()))))
    tables = json.dumps(
        {"keys": entries, "tensors": [tensors[int(t)] for t in used], "params": params}, sort_keys=True
    ).encode()
    fence = np.array(fences, dtype="<i8").reshape(-1, _FENCE)
    return struct.pack("<Q", len(tables)) + tables + fence.tobytes(), rows.tobytes()


def pack_ranks(records, world_size: int) -> tuple[dict, bytes] | None:
    """``(header entry, bytes)`` of rank records ``records`` (every rank in order, their files
    named ``rank_file_name(rank, token, seq)`` of one save); ``None`` when they are not (a reader
    then reads the manifest for them)."""
    from ..names import parse_rank_file_name

    if len(records) != world_size or not records:
        return None
    first = parse_rank_file_name(records[0].file)
    if first is None:
        return None
    _, token, seq = first
    fmt = ("r%05d" + rank_file_name(0, token, seq)[len("r00000") :].replace("%", "%%")).__mod__
    if any(r.rank != i or r.file != fmt(i) for i, r in enumerate(records)):
        return None
    cols = np.array(
        [(r.file_bytes, r.data_bytes, r.n_tensors, r.index_xxh64, r.header_xxh64) for r in records], dtype="<u8"
    )
    return pack_columns(token, seq, cols)


def pack_columns(token: str, seq: int, cols: np.ndarray) -> tuple[dict, bytes]:
    """:func:`pack_ranks` of columns ``uint64[world, 5]`` (rank order) of files named
    ``rank_file_name(rank, token, seq)``: what the committer has at hand, no record by record."""
    raw = np.ascontiguousarray(cols, dtype="<u8").tobytes()
    step = RANK_BLOCK * _RECORD * 8
    sums = np.array([xxh64(raw[i : i + step]) for i in range(0, len(raw), step)], dtype="<u8").tobytes()
    return {"token": token, "seq": seq, "block": RANK_BLOCK, "sums_xxh64": xxh64(sums)}, raw + sums


def count_json(raw) -> tuple[int, int]:
    """Upper bounds on the JSON values (:func:`.json_budget.count_values`) and objects in ``raw``,
    over 16 MiB windows."""
    if isinstance(raw, (bytes, bytearray)):  # in place
        objects = raw.count(b"{")
        return 1 + raw.count(b",") + raw.count(b"[") + objects, objects
    values, objects = 1, 0
    for i in range(0, len(raw), 16 << 20):
        part = bytes(raw[i : i + (16 << 20)])
        objects += part.count(b"{")
        values += part.count(b",") + part.count(b"[")
    return values + objects, objects


def check_bounds(path: str, raw, what: str) -> None:
    """Refuse the index's JSON text ``raw`` (either format's) when it holds more values or objects
    than the manifest's bounds allow (one value per 16 bytes, at most 2^19 values and 64 objects),
    before it is decoded or parsed."""
    values, objects = count_json(raw)
    most = min(_MAX_VALUES, len(raw) // _BYTES_PER_VALUE + _VALUE_ALLOWANCE)
    if values > most or objects > _MAX_OBJECTS:
        raise CorruptCheckpointError(
            f"{path}: global index {what} hold up to {values} JSON values and {objects} objects in {len(raw)} "
            f"bytes, more than the {most} and {_MAX_OBJECTS} one we write could hold; refusing to parse them "
            f"(it would take ~{values * VALUE_BYTES >> 20} MiB)"
        )


def _text(budget: DecodeBudget, raw, what: str) -> str:
    """``raw`` as the text to parse, after :func:`check_bounds` and the file's decode budget (the
    caller drops ``raw`` before :func:`_parse`)."""
    check_bounds(budget.path, raw, what)
    return budget.text(raw, f"global index {what}")


def _parse(path: str, text: str, what: str):
    """``text`` (from :func:`_text`) parsed as JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: global index {what} are not JSON: {type(e).__name__}") from None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _Head:
    """One slice's tables and fences, checked."""

    def __init__(self, keys: dict, tensors: list, params: dict, fences: np.ndarray, rows_at: int, n_rows: int):
        self.keys, self.tensors, self.params, self.fences = keys, tensors, params, fences
        self.rows_at, self.n_rows = rows_at, n_rows


class RangedIndex:
    """A format-2 index open for ranged reads (one descriptor, closed by :meth:`close`): the
    ``params`` of the slices asked for, the :meth:`pieces` of a key over an element range and the
    manifest :meth:`record` of a rank, each read on first use.  ``bytes_read``: what it read."""

    def __init__(self, path: str, fd: int, size: int, header: dict, body_at: int, world_size: int) -> None:
        self.path, self._fd, self.world_size = path, fd, world_size
        self.bytes_read = body_at
        self._body_at = body_at
        self._heads: dict = {}
        self._blocks: dict = {}
        self._rank_blocks: dict = {}
        self._sums: np.ndarray | None = None
        self._budget = DecodeBudget(path)  # every JSON text of this file, together
        body = header.get("body_bytes")
        ranks = header.get("ranks")
        extra = 0
        if ranks is not None:
            if not (
                isinstance(ranks, dict)
                and isinstance(ranks.get("token"), str)
                and _int(ranks.get("seq"))
                and ranks.get("block") == RANK_BLOCK
                and _int(ranks.get("sums_xxh64"))
            ):
                raise CorruptCheckpointError(f"{path}: global index rank records described as {str(ranks)[:80]!r}")
            extra = world_size * _RECORD * 8 + math.ceil(world_size / RANK_BLOCK) * 8
        if not _int(body) or body_at + body + extra != size or body < 16:
            raise CorruptCheckpointError(
                f"{path}: global index of {size} bytes, its header says {body_at} + {body} + {extra}"
            )
        self._ranks = ranks
        self._body = body
        clen, csum = struct.unpack("<QQ", self._read(0, 16))
        if clen > body - 16:
            raise CorruptCheckpointError(f"{path}: global index contents of {clen} bytes in a body of {body}")
        raw = self._read(16, clen)
        if xxh64(raw) != csum:
            raise CorruptCheckpointError(f"{path}: global index checksum mismatch (its contents): the file was altered")
        text = _text(self._budget, raw, "contents")
        del raw  # the bytes go before the parse
        toc = _parse(path, text, "contents")
        del text
        entries = toc.get("slices") if isinstance(toc, dict) else None
        if not isinstance(entries, list):
            raise CorruptCheckpointError(f"{path}: global index contents lack slices")
        self._slices: dict = {}
        self._sections_at = 16 + clen
        room = body - self._sections_at
        for e in entries:
            if not (
                isinstance(e, list)
                and len(e) == 6
                and (e[0] is None or isinstance(e[0], str))
                and all(_int(x) for x in e[1:])
                and e[1] + e[2] <= room
                and e[4] + e[5] * 8 * _COLS <= room
            ):
                raise CorruptCheckpointError(f"{path}: global index slice entry {str(e)[:80]!r} is out of range")
            at = self._sections_at
            self._slices[e[0]] = (e[1] + at, e[2], e[3], e[4] + at, e[5])

    # ------------------------------------------------------------------ reading
    def _read(self, at: int, n: int) -> bytearray:
        """``n`` bytes at body offset ``at`` (checked inside the file by the caller), read into one
        buffer (a crafted section costs its size once, not once per copy)."""
        out = bytearray(n)
        view, done, pos = memoryview(out), 0, self._body_at + at
        try:
            while done < n:
                got = os.preadv(self._fd, [view[done:]], pos + done)
                if not got:
                    raise CorruptCheckpointError(f"{self.path}: global index ended at {pos + done} while read")
                done += got
        finally:
            view.release()
        self.bytes_read += n
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def unsliced(self) -> bool:
        """Keys without a model-parallel slice (identity 1): not usable by slice."""
        return None in self._slices

    def slices(self) -> list:
        return list(self._slices)

    def _head(self, sl) -> _Head | None:
        if sl in self._heads:
            return self._heads[sl]
        entry = self._slices.get(sl)
        if entry is None:
            self._heads[sl] = None
            return None
        at, n, h, rows_at, n_rows = entry
        raw = self._read(at, n)
        if xxh64(raw) != h or n < 8:
            raise CorruptCheckpointError(
                f"{self.path}: global index checksum mismatch (slice {sl!r}): the file was altered"
            )
        (tlen,) = struct.unpack_from("<Q", raw, 0)
        if tlen > n - 8 or (n - 8 - tlen) % (8 * _FENCE):
            raise CorruptCheckpointError(f"{self.path}: global index slice {sl!r}: tables of {tlen} bytes in {n}")
        fences = np.frombuffer(raw, dtype="<i8", offset=8 + tlen).reshape(-1, _FENCE).copy()
        del raw[8 + tlen :], raw[:8]  # the tables, in place: a crafted head costs its size once
        text = _text(self._budget, raw, f"slice {sl!r} tables")
        del raw  # the bytes go before the parse
        tables = _parse(self.path, text, f"slice {sl!r} tables")
        del text
        keys, tensors, params = (
            tables.get(f) if isinstance(tables, dict) else None for f in ("keys", "tensors", "params")
        )
        if not (isinstance(keys, list) and isinstance(tensors, list) and isinstance(params, dict)):
            raise CorruptCheckpointError(f"{self.path}: global index slice {sl!r} lacks keys, tensors or params")
        if not all(isinstance(t, str) for t in tensors):
            raise CorruptCheckpointError(f"{self.path}: global index slice {sl!r}: tensor names are not all strings")
        by_key = {}
        for i, e in enumerate(keys):
            if not (
                isinstance(e, list)
                and len(e) == 4
                and isinstance(e[0], str)
                and all(_int(x) for x in e[1:])
                and e[1] + e[2] <= n_rows
                and e[3] + math.ceil(e[2] / BLOCK_ROWS) <= len(fences)
            ):
                raise CorruptCheckpointError(
                    f"{self.path}: global index slice {sl!r} key {str(e)[:80]!r} is out of range"
                )
            by_key[e[0]] = (i, e[1], e[2], e[3])
        head = self._heads[sl] = _Head(by_key, tensors, params, fences, rows_at, n_rows)
        return head

    def keys_of(self, sl) -> list[str]:
        """The keys of slice ``sl`` (none when the index has no such slice)."""
        head = self._head(sl)
        return list(head.keys) if head is not None else []

    def params_of(self, slices) -> dict:
        """``{key: [shape, dtype]}`` of the parameters of ``slices`` (those this index has)."""
        out = {}
        for sl in slices:
            head = self._head(sl)
            if head is not None:
                out.update(head.params)
        return out

    def pieces(self, key: str, start: int, end: int) -> list[tuple[int, str, int, int, int]]:
        """``(rank, tensor, offset, start, end)`` of every piece of ``key`` overlapping ``[start, end)``
        (lowest start, then lowest rank, first): the blocks its fences say can overlap, one read."""
        head = self._head(slice_of(key))
        got = head.keys.get(key) if head is not None else None
        if got is None or not got[2]:
            return []
        kid, lo, n, f0 = got
        fences = head.fences[f0 : f0 + math.ceil(n / BLOCK_ROWS)]
        b0 = int(np.searchsorted(fences[:, 1], start, side="right"))  # blocks before end at or before start
        b1 = int(np.searchsorted(fences[:, 0], end, side="left"))  # blocks from here start at or after end
        if b0 >= b1:
            return []
        rows = self._rows(head, kid, lo, n, fences, b0, b1)
        rows = rows[(rows[:, 2] > start) & (rows[:, 1] < end)]
        return [(int(r[3]), head.tensors[int(r[4])], int(r[5]), int(r[1]), int(r[2])) for r in rows]

    def _rows(self, head: _Head, kid: int, lo: int, n: int, fences: np.ndarray, b0: int, b1: int) -> np.ndarray:
        """Rows of blocks ``[b0, b1)`` of the key whose rows are ``lo .. lo + n``, checked."""
        first, last = lo + b0 * BLOCK_ROWS, lo + min(b1 * BLOCK_ROWS, n)
        cached = self._blocks.get((id(head), first, last))
        if cached is not None:
            return cached
        raw = self._read(head.rows_at + first * 8 * _COLS, (last - first) * 8 * _COLS)
        step = BLOCK_ROWS * 8 * _COLS
        for b, at in zip(range(b0, b1), range(0, len(raw), step)):
            if xxh64(raw[at : at + step]) != int(fences[b, 2]) & _U64:
                raise CorruptCheckpointError(
                    f"{self.path}: global index checksum mismatch (rows {first + at // (8 * _COLS)}..): the file was altered"
                )
        rows = np.frombuffer(raw, dtype="<i8").reshape(-1, _COLS)
        bad = (
            (rows[:, 0] != kid)
            | (rows[:, 1] < 0)
            | (rows[:, 2] < rows[:, 1])
            | (rows[:, 3] < 0)
            | (rows[:, 3] >= self.world_size)
            | (rows[:, 4] < 0)
            | (rows[:, 4] >= len(head.tensors))
            | (rows[:, 5] < 0)
        )
        if bad.any() or (np.diff(rows[:, 1]) < 0).any():
            raise CorruptCheckpointError(
                f"{self.path}: global index row {first + int(np.argmax(bad))} is out of range or unsorted"
            )
        self._blocks[(id(head), first, last)] = rows
        return rows

    def record(self, rank: int) -> RankRecord | None:
        """Rank ``rank``'s manifest record as the index holds it (``None``: it holds none)."""
        if self._ranks is None or not 0 <= rank < self.world_size:
            return None
        at = self._body
        n_blocks = math.ceil(self.world_size / RANK_BLOCK)
        if self._sums is None:
            raw = self._read(at + self.world_size * _RECORD * 8, n_blocks * 8)
            if xxh64(raw) != self._ranks["sums_xxh64"]:
                raise CorruptCheckpointError(
                    f"{self.path}: global index checksum mismatch (rank sums): the file was altered"
                )
            self._sums = np.frombuffer(raw, dtype="<u8")
        b = rank // RANK_BLOCK
        block = self._rank_blocks.get(b)
        if block is None:
            lo, hi = b * RANK_BLOCK, min((b + 1) * RANK_BLOCK, self.world_size)
            raw = self._read(at + lo * _RECORD * 8, (hi - lo) * _RECORD * 8)
            if xxh64(raw) != int(self._sums[b]):
                raise CorruptCheckpointError(
                    f"{self.path}: global index checksum mismatch (ranks {lo}..): the file was altered"
                )
            block = self._rank_blocks[b] = np.frombuffer(raw, dtype="<u8").reshape(-1, _RECORD)
        row = [int(x) for x in block[rank % RANK_BLOCK]]
        return RankRecord(rank, rank_file_name(rank, self._ranks["token"], self._ranks["seq"]), *row)
