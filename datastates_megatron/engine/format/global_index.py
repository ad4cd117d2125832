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
version, the commit it belongs to -- iteration, commit sequence, run token, world size -- ...).
Format 2 (written since issue #40, item 4; :mod:`.index_sections`) cuts the rest by model-parallel
slice, in checksummed blocks, with the manifest's rank records beside them, so that a resharding
rank reads only its slices' pieces near its element ranges and the records of the files it opens.
Format 1 (read whole, still read): the body's length and XXH64 in the header, then the body: a u64
length of its tables (JSON: ``keys``, ``tensors``, ``params``) and the pieces, ``int64[n, 6]`` rows
``(key id, start, end, rank, tensor id, offset)`` sorted by key, start and rank.  The manifest
stays the commit point: an index whose header names another commit (a re-save of the iteration
that was not committed) is ignored, and an index that is absent, damaged or stale makes the reader
fall back to reading every rank file's metadata.

Thread-safety: :class:`Summaries` is used by one commit thread; :class:`GlobalIndex` is read-only.
"""

from __future__ import annotations

import json
import logging
import os
import struct

import numpy as np

from ..errors import CheckpointAccessError, CorruptCheckpointError
from .hashing import xxh64
from .json_budget import DecodeBudget
from .index_sections import VERSION, RangedIndex, check_bounds, pack_body, pack_columns, pack_ranks, slice_of
from .manifest import Manifest
from ..fs.durable import atomic_write
from ..names import INDEX_NAME, iter_dir
from ..fs.safe_io import MANIFEST_MAX_BYTES, open_regular, read_capped

__all__ = ["GlobalIndex", "RangedIndex", "Summaries", "encode_summary", "summary_sum", "read_index", "write_index"]

log = logging.getLogger(__name__)

MAGIC = b"DSGIDX01"  # both formats (the header's ``format_version`` tells them apart)
# the manifest's bounds (:mod:`.json_budget`): a file of at most its size cap (64k ranks of two
# tensors each: ~5 MiB), tables of at most one JSON value per 16 bytes -- and, since a dict costs
# more than ``VALUE_BYTES``, at most a few objects (ours hold two: the top level and ``params``) and
# at most 2^19 values in all (:func:`.index_sections.check_bounds`), so that a parse costs a bounded constant beyond the
# text itself (docs/reliability.md: 64 MiB + 2x the file)
INDEX_MAX_BYTES = MANIFEST_MAX_BYTES
_HEADER_MAX = 4096
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
    return pack_body(list(keys), list(tensors), params, table)


def _binding(m: Manifest) -> dict:
    return {"iteration": m.iteration, "commit_seq": m.commit_seq, "run_token": m.run_token, "world_size": m.world_size}


def index_blob(manifest: Manifest, body: bytes, records: tuple | None = None) -> bytes:
    """The index file's bytes (format 2) for the commit ``manifest`` describes (a file, or an
    object): the header, ``body`` (:func:`.index_sections.pack_body`) and the manifest's rank records
    -- ``records`` ``(token, seq, uint64[world, 5])`` when the caller has them as columns (the
    committer: O(N) in numpy, not record by record)."""
    ranks = pack_columns(*records) if records is not None else pack_ranks(manifest.ranks, manifest.world_size)
    header = json.dumps(
        {"format_version": VERSION, **_binding(manifest), "body_bytes": len(body), "ranks": ranks and ranks[0]},
        sort_keys=True,
    ).encode()
    tail = ranks[1] if ranks else b""
    return MAGIC + struct.pack("<Q", len(header)) + header + struct.pack("<Q", xxh64(header)) + body + tail


def write_index(root: str, manifest: Manifest, body: bytes, records: tuple | None = None) -> str:
    """Write the index of the commit ``manifest`` describes (before that manifest is written)."""
    path = os.path.join(iter_dir(root, manifest.iteration), INDEX_NAME)
    atomic_write(path, index_blob(manifest, body, records))
    return path


class GlobalIndex:
    """A format-1 index, read whole: ``params`` and :meth:`pieces` of a key over an element range
    (the interface of :class:`.index_sections.RangedIndex`, without rank records)."""

    def __init__(self, path: str, keys: list[str], tensors: list[str], params: dict, table: np.ndarray) -> None:
        self.path = path
        self.keys = {k: i for i, k in enumerate(keys)}
        self.tensors = tensors
        self.params = params
        self.table = table
        self._key_col = np.ascontiguousarray(table[:, 0])
        self.bytes_read = 0  # read whole, before it was made (not counted here)

    @property
    def unsliced(self) -> bool:
        return any(slice_of(k) is None for k in self.params)

    def slices(self) -> list:
        return list({slice_of(k): None for k in self.params})

    def params_of(self, slices) -> dict:
        wanted = set(slices)
        return {k: v for k, v in self.params.items() if slice_of(k) in wanted}

    def record(self, rank: int) -> None:
        return None

    def close(self) -> None:
        pass

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


def read_index(ckpt: str, manifest: Manifest) -> "RangedIndex | GlobalIndex | None":
    """The index of ``ckpt``'s committed checkpoint (``manifest``), or ``None`` when it has none
    (written before the index, or by a rank whose summaries were missing) or the one there is of
    another commit; :class:`CorruptCheckpointError` naming the file when it is damaged.  Format 2
    comes back open for ranged reads (:class:`.index_sections.RangedIndex`: close it); format 1
    is read whole (:class:`GlobalIndex`).  ``ckpt`` is a directory: a checkpoint read from object
    storage into memory has no index file beside it (the callers ask for none)."""
    path = os.path.join(ckpt, INDEX_NAME)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        raise CheckpointAccessError(f"{path}: permission denied: cannot read the global index") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the global index: {e}") from e
    keep = False
    try:
        size = os.fstat(fd).st_size
        if size > INDEX_MAX_BYTES:
            raise CorruptCheckpointError(f"{path}: global index is larger than {INDEX_MAX_BYTES} bytes ({size})")
        head = os.pread(fd, 16 + _HEADER_MAX + 8, 0)
        if len(head) < 16 or head[:8] != MAGIC:
            raise CorruptCheckpointError(f"{path}: not a global index")
        (hlen,) = struct.unpack_from("<Q", head, 8)
        if hlen > min(_HEADER_MAX, len(head) - 16):
            raise CorruptCheckpointError(f"{path}: global index header of {hlen} bytes")
        try:
            header = json.loads(head[16 : 16 + hlen])
        except ValueError as e:
            raise CorruptCheckpointError(f"{path}: global index header is not JSON: {e}") from None
        version = header.get("format_version") if isinstance(header, dict) else None
        if version == 1:  # written before ranged reads: read whole, as then
            return _read_whole(path, manifest, header, hlen)
        if version != VERSION:
            raise CorruptCheckpointError(f"{path}: unknown global index format {str(header)[:60]!r}")
        if len(head) < 24 + hlen or struct.unpack_from("<Q", head, 16 + hlen)[0] != xxh64(head[16 : 16 + hlen]):
            raise CorruptCheckpointError(f"{path}: global index checksum mismatch (its header): the file was altered")
        if {k: header.get(k) for k in _binding(manifest)} != _binding(manifest):
            log.info("%s: of another commit than the manifest (a re-save that was not committed); not used", path)
            return None
        index = RangedIndex(path, fd, size, header, 24 + hlen, manifest.world_size)
        keep = True
        return index
    except PermissionError as e:
        raise CheckpointAccessError(f"{path}: permission denied: cannot read the global index") from e
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the global index: {e}") from e
    finally:
        if not keep:
            os.close(fd)


def _read_whole(path: str, manifest: Manifest, header: dict, hlen: int) -> GlobalIndex | None:
    """A format-1 index: its body read whole and checked against its one checksum."""
    if {k: header.get(k) for k in _binding(manifest)} != _binding(manifest):
        log.info("%s: of another commit than the manifest (a re-save that was not committed); not used", path)
        return None
    data = read_capped(path, INDEX_MAX_BYTES, "global index")
    view = memoryview(data)
    body = view[16 + hlen :]
    if header.get("body_bytes") != len(body) or header.get("body_xxh64") != xxh64(body):
        raise CorruptCheckpointError(f"{path}: global index checksum mismatch: the file was altered")
    text, table = _split(path, body)
    del view, body, data  # the file's bytes go before the parse: at most the text and its values at once
    keys, tensors, params = _parse_tables(path, text)
    del text
    return _checked(path, keys, tensors, params, table, manifest.world_size)


def _split(path: str, body: memoryview) -> tuple[str, np.ndarray]:
    """The tables' JSON text (checked against the bounds before it is decoded) and a copy of the
    pieces (so that the file's bytes can be freed)."""
    (tlen,) = struct.unpack_from("<Q", body, 0)
    if tlen > len(body) - 8 or (len(body) - 8 - tlen) % (8 * _COLS):
        raise CorruptCheckpointError(f"{path}: global index tables of {tlen} bytes in a body of {len(body)}")
    raw = body[8 : 8 + tlen]
    check_bounds(path, raw, "tables")  # one pass, before anything is decoded or parsed
    text = DecodeBudget(path).text(raw, "global index tables")
    raw.release()
    table = np.frombuffer(body, dtype="<i8", offset=8 + tlen).reshape(-1, _COLS).copy()
    return text, table


def _parse_tables(path: str, text: str) -> tuple[list, list, dict]:
    try:
        tables = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: global index tables are not JSON: {type(e).__name__}") from None
    keys, tensors, params = (tables.get(f) if isinstance(tables, dict) else None for f in ("keys", "tensors", "params"))
    if not (isinstance(keys, list) and isinstance(tensors, list) and isinstance(params, dict)):
        raise CorruptCheckpointError(f"{path}: global index tables lack keys, tensors or params")
    if not all(isinstance(x, str) for x in (*keys, *tensors)):
        raise CorruptCheckpointError(f"{path}: global index names are not all strings")
    return keys, tensors, params


def _checked(path: str, keys: list, tensors: list, params: dict, table: np.ndarray, world_size: int) -> GlobalIndex:
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
