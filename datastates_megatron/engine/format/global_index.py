"""The global index of a checkpoint: which element ranges of which rank file hold each global key,
in one file beside the manifest, so that a load by global identity (a reshard) opens only the rank
files it needs instead of reading the metadata of every one.

Each rank describes its own file in a *summary* (made by the integration layer from its tensors'
metadata, opaque to the engine): ``{"pieces": [[key, start, end, tensor, offset], ...],
"params": {key: value}}`` -- elements ``[start, end)`` of global key ``key`` are elements
``offset...`` of ``tensor`` in this rank's file.  A rank sends its summary through the commit's
store only when it changed (its status carries the summary's checksum); the writer (rank 0 of the
persistent tier) keeps every rank's, builds the index body once per change (O(total pieces)) and
writes it before the manifest at each commit.

File ``global_index.dsgi``: ``MAGIC``, a little-endian u64 header length, the header (JSON: format
version, the commit it belongs to -- iteration, commit sequence, run token, world size -- and the
body's length and XXH64), then the body: a u64 length of its tables (JSON: ``keys``, ``tensors``,
``params``) and the pieces, ``int64[n, 6]`` rows ``(key id, start, end, rank, tensor id, offset)``
sorted by key, start and rank.  The manifest stays the commit point: an index whose header names
another commit (a re-save of the iteration that was not committed) is ignored, and an index that
is absent, damaged or stale makes the reader fall back to reading every rank file's metadata.

Thread-safety: :class:`Summaries` is used by one commit thread; :class:`GlobalIndex` is read-only.
"""

from __future__ import annotations

import json
import logging
import os
import struct

import numpy as np

from ..errors import CorruptCheckpointError
from .hashing import xxh64
from .json_budget import check_budget
from .manifest import Manifest
from ..fs.durable import atomic_write
from ..names import INDEX_NAME, iter_dir
from ..fs.safe_io import read_capped

__all__ = ["GlobalIndex", "Summaries", "encode_summary", "summary_sum", "read_index", "write_index"]

log = logging.getLogger(__name__)

MAGIC = b"DSGIDX01"
VERSION = 1
INDEX_MAX_BYTES = 1 << 30  # 64k ranks of two tensors each: ~5 MiB
_HEADER_MAX = 4096
_TABLE_BYTES_PER_VALUE = 4  # names and params as we write them: a value per 4+ bytes
_COLS = 6  # key id, start, end, rank, tensor id, offset


def encode_summary(summary: dict) -> tuple[bytes, int]:
    """A rank's summary as sent (canonical JSON) and its checksum (:func:`summary_sum`)."""
    raw = json.dumps(summary, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return raw, summary_sum(raw)


def summary_sum(raw: bytes) -> int:
    """The checksum a status carries for summary ``raw``: a positive int64 (0 means "none")."""
    return (xxh64(raw) & ((1 << 63) - 1)) or 1


class Summaries:
    """Rank 0's copy of every rank's summary, refreshed from the store when a rank's checksum
    changes, and the index body built from them (rebuilt only after a change)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sums = np.zeros(world_size, dtype=np.int64)
        self._docs: list[dict | None] = [None] * world_size
        self._body: bytes | None = None

    def update(self, sums: np.ndarray, fetch) -> bytes | None:
        """The index body for ranks whose summaries have checksums ``sums`` (``None`` when a rank
        has none, or they do not make one index); ``fetch(ranks) -> [bytes]`` gets the changed ones."""
        if (sums == 0).any():
            return None
        changed = np.flatnonzero(sums != self._sums).tolist()
        if changed:
            self._body = None
            raws = fetch(changed)
            good = [bool(raw) and summary_sum(raw) == int(sums[r]) for r, raw in zip(changed, raws)]
            docs = _docs([raw for raw, ok in zip(raws, good) if ok])
            for r, ok in zip(changed, good):
                self._docs[r] = next(docs) if ok else None
            self._sums[changed] = sums[changed]
            self._sums[[r for r in changed if self._docs[r] is None]] = 0  # fetched again next time
        if self._body is None and all(d is not None for d in self._docs):
            self._body = _build(self._docs)
        return self._body


def _docs(raws: list[bytes]):
    """The summaries as rank 0 received them, in order (``None`` for one that is not a summary:
    no index then): one parse of them all (at 64k ranks 65k parses cost 3x more), else one each."""
    try:
        docs = json.loads(b"[" + b",".join(raws) + b"]")
    except (ValueError, RecursionError):
        docs = [_doc(raw) for raw in raws]
    if not isinstance(docs, list) or len(docs) != len(raws):  # a raw with a "," at its top level
        docs = [_doc(raw) for raw in raws]
    return iter(d if isinstance(d, dict) else None for d in docs)


def _doc(raw: bytes) -> dict | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _build(docs: list[dict]) -> bytes | None:
    """The index body from every rank's summary (``None``, logged, when two ranks disagree on a
    key's ``params``)."""
    keys: dict[str, int] = {}
    tensors: dict[str, int] = {}
    params: dict[str, object] = {}
    rows = []
    for rank, doc in enumerate(docs):
        for key, value in doc.get("params", {}).items():
            if params.setdefault(key, value) != value:
                log.warning("rank 0: no global index: ranks disagree on %s (%r, %r)", key, params[key], value)
                return None
        for key, start, end, tensor, offset in doc.get("pieces", ()):
            k = keys.setdefault(key, len(keys))
            t = tensors.setdefault(tensor, len(tensors))
            rows.append((k, start, end, rank, t, offset))
    table = np.array(rows, dtype=np.int64).reshape(-1, _COLS)
    table = table[np.lexsort((table[:, 3], table[:, 1], table[:, 0]))]
    tables = json.dumps({"keys": list(keys), "tensors": list(tensors), "params": params}, sort_keys=True).encode()
    return struct.pack("<Q", len(tables)) + tables + np.ascontiguousarray(table, dtype="<i8").tobytes()


def _binding(m: Manifest) -> dict:
    return {"iteration": m.iteration, "commit_seq": m.commit_seq, "run_token": m.run_token, "world_size": m.world_size}


def write_index(root: str, manifest: Manifest, body: bytes) -> str:
    """Write the index of the commit ``manifest`` describes (before that manifest is written)."""
    header = json.dumps(
        {"format_version": VERSION, **_binding(manifest), "body_bytes": len(body), "body_xxh64": xxh64(body)},
        sort_keys=True,
    ).encode()
    path = os.path.join(iter_dir(root, manifest.iteration), INDEX_NAME)
    atomic_write(path, MAGIC + struct.pack("<Q", len(header)) + header + body)
    return path


class GlobalIndex:
    """One checkpoint's global index: ``params`` and :meth:`pieces` of a key over an element range."""

    def __init__(self, path: str, keys: list[str], tensors: list[str], params: dict, table: np.ndarray) -> None:
        self.path = path
        self.keys = {k: i for i, k in enumerate(keys)}
        self.tensors = tensors
        self.params = params
        self.table = table
        self._key_col = np.ascontiguousarray(table[:, 0])

    def pieces(self, key: str, start: int, end: int) -> list[tuple[int, str, int, int, int]]:
        """``(rank, tensor, offset, start, end)`` of every piece of ``key`` overlapping ``[start, end)``
        (lowest start, then lowest rank, first): a binary search, not a scan."""
        k = self.keys.get(key)
        if k is None:
            return []
        lo, hi = np.searchsorted(self._key_col, [k, k + 1])
        rows = self.table[lo:hi]
        rows = rows[(rows[:, 2] > start) & (rows[:, 1] < end)]
        return [(int(r[3]), self.tensors[int(r[4])], int(r[5]), int(r[1]), int(r[2])) for r in rows]


def read_index(ckpt: str, manifest: Manifest) -> GlobalIndex | None:
    """The index of ``ckpt``'s committed checkpoint (``manifest``), or ``None`` when it has none
    (written before the index, or by a rank whose summaries were missing) or the one there is of
    another commit; :class:`CorruptCheckpointError` naming the file when it is damaged."""
    path = os.path.join(ckpt, INDEX_NAME)
    try:
        data = read_capped(path, INDEX_MAX_BYTES, "global index")
    except FileNotFoundError:
        return None
    view = memoryview(data)
    if len(data) < 16 or bytes(view[:8]) != MAGIC:
        raise CorruptCheckpointError(f"{path}: not a global index")
    (hlen,) = struct.unpack_from("<Q", data, 8)
    if hlen > min(_HEADER_MAX, len(data) - 16):
        raise CorruptCheckpointError(f"{path}: global index header of {hlen} bytes")
    try:
        header = json.loads(bytes(view[16 : 16 + hlen]))
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: global index header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format_version") != VERSION:
        raise CorruptCheckpointError(f"{path}: unknown global index format {str(header)[:60]!r}")
    if {k: header.get(k) for k in _binding(manifest)} != _binding(manifest):
        log.info("%s: of another commit than the manifest (a re-save that was not committed); not used", path)
        return None
    body = view[16 + hlen :]
    if header.get("body_bytes") != len(body) or header.get("body_xxh64") != xxh64(body):
        raise CorruptCheckpointError(f"{path}: global index checksum mismatch: the file was altered")
    return _parse(path, body, manifest.world_size)


def _parse(path: str, body, world_size: int) -> GlobalIndex:
    (tlen,) = struct.unpack_from("<Q", body, 0)
    if tlen > len(body) - 8 or (len(body) - 8 - tlen) % (8 * _COLS):
        raise CorruptCheckpointError(f"{path}: global index tables of {tlen} bytes in a body of {len(body)}")
    raw = bytes(body[8 : 8 + tlen])
    check_budget(raw, _TABLE_BYTES_PER_VALUE, 1024, path, "global index")
    try:
        tables = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: global index tables are not JSON: {type(e).__name__}") from None
    keys, tensors, params = (tables.get(f) if isinstance(tables, dict) else None for f in ("keys", "tensors", "params"))
    if not (isinstance(keys, list) and isinstance(tensors, list) and isinstance(params, dict)):
        raise CorruptCheckpointError(f"{path}: global index tables lack keys, tensors or params")
    if not all(isinstance(x, str) for x in (*keys, *tensors)):
        raise CorruptCheckpointError(f"{path}: global index names are not all strings")
    table = np.frombuffer(body, dtype="<i8", offset=8 + tlen).reshape(-1, _COLS)
    bad = (
        (table[:, 0] < 0)
        | (table[:, 0] >= len(keys))
        | (table[:, 1] < 0)
        | (table[:, 2] < table[:, 1])
        | (table[:, 3] < 0)
        | (table[:, 3] >= world_size)
        | (table[:, 4] < 0)
        | (table[:, 4] >= len(tensors))
        | (table[:, 5] < 0)
    )
    if bad.any() or (np.diff(table[:, 0]) < 0).any():
        raise CorruptCheckpointError(f"{path}: global index row {int(np.argmax(bad))} is out of range or unsorted")
    return GlobalIndex(path, keys, tensors, params, table)
