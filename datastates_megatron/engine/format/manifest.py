"""The global manifest (the commit point) and the Megatron-style tracker file (their names: :mod:`..names`).

``<root>/iter_0000100/manifest.json`` names every rank file of iteration 100 with its size and
checksums; it is written with temp file + fsync + ``os.replace`` + directory fsync
(:func:`..fs.durable.atomic_write`), so it either exists whole or not at all.  A directory without a
valid manifest is not a checkpoint (what a whole directory holds is :func:`..tiers.tier.survey`'s to say).
``<root>/latest_checkpointed_iteration.txt`` is replaced the same way right after the manifest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import time

from ..._version import VERSION_RE, __version__
from ..errors import CorruptCheckpointError, FormatVersionError, NoCheckpointError
from ..fs import safe_io
from ..fs.durable import atomic_write
from ..names import MANIFEST_NAME, TRACKER_NAME, iter_dir, iteration_of
from .json_budget import DecodeBudget, check_budget
from .rank_table import RankRecord, RankTable

__all__ = [
    "MANIFEST_VERSION",
    "RankRecord",
    "Manifest",
    "write_manifest",
    "read_manifest",
    "read_tracker",
    "read_tracker_text",
    "parse_tracker",
    "write_tracker",
]

MANIFEST_FORMAT = "datastates-megatron-manifest"
MANIFEST_VERSION = 1  # the newest format this code writes; it reads every format from 1 up to it
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+\Z")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_DIGITS = re.compile(rb"^[0-9]{1,18}\Z")  # ASCII only: ``str.isdigit`` accepts '\u00b2' and other scripts' digits
_U64 = 1 << 64
_MAX_WORLD = 1 << 31
_TIERS = ("persistent", "local")
# a manifest we write holds one JSON value per ~29 bytes (its rank records); its metadata may be
# denser, hence the allowance (a 1 MiB dense metadata dict)
_MANIFEST_BYTES_PER_VALUE = 16
_MANIFEST_VALUE_ALLOWANCE = 1 << 16
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Manifest:
    iteration: int
    world_size: int
    run_token: str
    ranks: tuple[RankRecord, ...] | RankTable  # a table: the committer's (a sequence of records)
    layout: dict
    metadata: dict
    commit_seq: int = 0  # orders commits across runs: the newest commit is the latest checkpoint
    created: float = dataclasses.field(default_factory=time.time)
    tier: str = "persistent"
    run_id: str = ""  # the run (:mod:`.run_id`) whose save directory this checkpoint belongs to; "" before it existed
    writer_version: str = (
        __version__  # the datastates-megatron that wrote it; "" in a manifest from before it was recorded
    )

    @property
    def total_bytes(self) -> int:
        if _is_table(self.ranks):
            return int(self.ranks.column("data_bytes").sum())
        return sum(r.data_bytes for r in self.ranks)

    def record(self, rank: int) -> RankRecord | None:
        """The entry of ``rank`` (a node-local manifest lists only that node's ranks), by position:
        a look-up, not a scan, so that reading every rank's entry stays O(N)."""
        if _is_table(self.ranks):
            return self.ranks.record(rank)
        return self._by_rank.get(rank)

    def file_names(self) -> list[str]:
        """Every rank's file name, in the records' order (no record made for a table)."""
        return self.ranks.file_names() if _is_table(self.ranks) else [r.file for r in self.ranks]

    @functools.cached_property
    def _by_rank(self) -> dict[int, RankRecord]:
        return {r.rank: r for r in self.ranks}

    def to_json(self) -> bytes:
        """The manifest as written: ``json.dumps(body, indent=1, sort_keys=True)``, byte for byte,
        whose ``checksum`` is :func:`_body_xxh64` of the rest.  The rank records -- all the bytes at
        N ranks -- are formatted from templates, in both the hashed (compact) and the written form:
        ``indent`` takes json's pure-Python encoder, and building a dict per record costs as much; a
        committer's :class:`.rank_table.RankTable` is formatted column-wise, with no object per rank."""
        from .hashing import xxh64

        body = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "iteration": self.iteration,
            "world_size": self.world_size,
            "run_token": self.run_token,
            "commit_seq": self.commit_seq,
            "created": self.created,
            "tier": self.tier,
            "layout": self.layout,
            "metadata": self.metadata,
            "ranks": [],
        }
        if self.run_id:
            body["run_id"] = self.run_id
        if self.writer_version:
            body["writer_version"] = self.writer_version
        compact = json.dumps(body, sort_keys=True, separators=(",", ":"))
        # the top-level "ranks" is the last one: only run_id, run_token, tier, world_size and writer_version
        # follow it, and inside a string a quote is escaped
        at = compact.rfind('"ranks":[]')
        head, tail = compact[:at].encode("utf-8"), compact[at + 10 :].encode("utf-8")
        body["checksum"] = xxh64(
            b"".join((head, b'"ranks":[', _records_text(self.ranks, _RECORD_COMPACT, b","), b"]", tail))
        )
        text = json.dumps(body, indent=1, sort_keys=True).encode("utf-8")
        if not self.ranks:
            return text
        # the one top-level "ranks" (keys nested deeper are indented further)
        at = text.index(b'\n "ranks": [],')
        records = _records_text(self.ranks, _RECORD_TEXT, b",\n")
        return b"".join((text[:at], b'\n "ranks": [\n', records, b"\n ],", text[at + len(b'\n "ranks": [],') :]))

    @classmethod
    def from_json(cls, data: bytes, path: str) -> "Manifest":
        """Parse and validate; every failure is a :class:`CorruptCheckpointError` naming ``path``.
        The checksum is verified before any field is used, and every field is type- and
        range-checked (so nothing read from the file sizes an allocation).  Before parsing, the JSON
        values are counted (:mod:`.json_budget`): a manifest denser than one we write (one value per
        ~29 bytes for its rank records) is refused unparsed.  No error raised here keeps the parsed
        body alive (``from None``; ``body`` is dropped before raising): a stored error must not pin
        a hostile file's objects."""
        check_budget(data, _MANIFEST_BYTES_PER_VALUE, _MANIFEST_VALUE_ALLOWANCE, path, "manifest")
        text = DecodeBudget(path, value_bytes=0).text(data, "manifest")  # ASCII, no string stored 4x wider
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{path}: manifest is not valid JSON: {type(e).__name__}: {e}") from None
        problem = cls._check_body(body, path)
        if problem is not None:
            del body
            raise problem
        try:
            return cls._validated(body)
        except _FieldError as e:
            message = f"{path}: {e}"
        del body
        raise CorruptCheckpointError(message) from None

    @staticmethod
    def _check_body(body, path: str) -> CorruptCheckpointError | None:
        """Format, version and checksum of a parsed body: the error to raise, or ``None``."""
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            return CorruptCheckpointError(f"{path}: not a datastates-megatron manifest")
        version = body.get("format_version")
        if type(version) is not int or version < 1:
            return CorruptCheckpointError(f"{path}: manifest format version {version!r:.40} is not a version")
        if version > MANIFEST_VERSION:  # checked before the checksum: a newer format may checksum otherwise
            writer = body.get("writer_version")
            return FormatVersionError.newer(
                path, "manifest", version, MANIFEST_VERSION, writer if isinstance(writer, str) else None
            )
        stored = body.pop("checksum", None)
        try:
            actual = _body_xxh64(body)
        except (TypeError, ValueError, RecursionError) as e:
            return CorruptCheckpointError(f"{path}: manifest cannot be checksummed: {type(e).__name__}: {e}")
        if type(stored) is not int or stored != actual:
            return CorruptCheckpointError(
                f"{path}: manifest checksum mismatch (stored {stored!r:.40}): the manifest was altered"
            )
        return None

    @classmethod
    def _validated(cls, body: dict) -> "Manifest":
        ranks_raw = _field(body, "ranks", list)
        world_size = _int(body, "world_size", 1, _MAX_WORLD)
        if len(ranks_raw) > world_size:
            raise _FieldError(f"manifest field 'ranks' lists {len(ranks_raw)} ranks for world size {world_size}")
        ranks = tuple(_rank_record(r, i) for i, r in enumerate(ranks_raw))
        created = _field(body, "created", (int, float))
        if not math.isfinite(created) or created < 0:
            raise _FieldError(f"manifest field 'created' is {created!r}, not a time")
        tier = body.get("tier", "persistent")
        if tier not in _TIERS:
            raise _FieldError(f"manifest field 'tier' is {tier!r:.40}, not one of {list(_TIERS)}")
        token = _field(body, "run_token", str)
        if not _TOKEN.match(token):
            raise _FieldError(f"manifest field 'run_token' {token!r:.80} is not a run token")
        run_id = body.get("run_id", "")
        if not isinstance(run_id, str) or (run_id and not _TOKEN.match(run_id)):
            raise _FieldError(f"manifest field 'run_id' {run_id!r:.80} is not a run id")
        writer = body.get("writer_version", "")
        if not isinstance(writer, str) or (writer and not VERSION_RE.match(writer)):
            raise _FieldError(f"manifest field 'writer_version' {writer!r:.80} is not a version")
        m = cls(
            writer_version=writer,
            run_id=run_id,
            iteration=_int(body, "iteration", 0, _U64 >> 1),
            world_size=world_size,
            run_token=token,
            ranks=ranks,
            layout=_field(body, "layout", dict),
            metadata=_field(body, "metadata", dict),
            commit_seq=_int(body, "commit_seq", 0, _U64 >> 1),
            created=float(created),
            tier=tier,
        )
        listed = [r.rank for r in m.ranks]
        if m.tier == "local":  # one node's manifest: a sorted subset of the ranks
            valid = bool(listed) and listed == sorted(set(listed))
        else:  # every rank, in order (compared without building range(world_size))
            valid = len(listed) == m.world_size and all(r == i for i, r in enumerate(listed))
        if not valid:
            shown = listed if len(listed) <= 8 else f"{listed[:8]} ..."
            raise _FieldError(f"{m.tier} manifest lists ranks {shown} for world size {m.world_size}")
        return m


class _FieldError(Exception):
    """A manifest field of the wrong type or out of range (turned into CorruptCheckpointError)."""


def _field(body, key: str, types, where: str = ""):
    if not isinstance(body, dict) or key not in body:
        raise _FieldError(f"manifest is missing field {where}{key!r}")
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise _FieldError(f"manifest field {where}{key!r} is {type(value).__name__} {value!r:.40}, expected {names}")
    return value


def _int(body, key: str, lo: int, hi: int, where: str = "") -> int:
    """An int (not a bool, not a float) in ``[lo, hi)``."""
    value = _field(body, key, int, where)
    if not lo <= value < hi:
        raise _FieldError(f"manifest field {where}{key!r} is {value}, outside [{lo}, {hi})")
    return value


def _rank_record(raw, i: int) -> RankRecord:
    where = f"ranks[{i}]."
    if not isinstance(raw, dict):
        raise _FieldError(f"field {where[:-1]} is {type(raw).__name__}, expected an object")
    rank = _int(raw, "rank", 0, _MAX_WORLD, where)
    name = _field(raw, "file", str, where)
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise _FieldError(f"rank {rank} file {name!r:.80} is not a plain file name inside the checkpoint directory")
    return RankRecord(
        rank=rank,
        file=name,
        file_bytes=_int(raw, "file_bytes", 0, _U64 >> 1, where),
        data_bytes=_int(raw, "data_bytes", 0, _U64 >> 1, where),
        n_tensors=_int(raw, "n_tensors", 0, _U64 >> 1, where),
        index_xxh64=_int(raw, "index_xxh64", 0, _U64, where),
        header_xxh64=_int(raw, "header_xxh64", 0, _U64, where),
    )


_RECORD_TEXT = (
    '  {\n   "data_bytes": %d,\n   "file": %s,\n   "file_bytes": %d,\n   "header_xxh64": %d,\n'
    '   "index_xxh64": %d,\n   "n_tensors": %d,\n   "rank": %d\n  }'
)  # one RankRecord as json.dumps(indent=1, sort_keys=True) writes it inside the manifest
_RECORD_COMPACT = '{"data_bytes":%d,"file":%s,"file_bytes":%d,"header_xxh64":%d,"index_xxh64":%d,"n_tensors":%d,"rank":%d}'  # ... and as _body_xxh64 hashes it
_RECORD_ORDER = ("data_bytes", "file", "file_bytes", "header_xxh64", "index_xxh64", "n_tensors", "rank")  # their fields


def _is_table(ranks) -> bool:
    """Whether ``ranks`` is a committer's :class:`.rank_table.RankTable` (not a tuple of records)."""
    return isinstance(ranks, RankTable)


def _records_text(ranks, template: str, sep: bytes) -> bytes:
    """The records' JSON text, ``sep``-separated: a committer's table column-wise (no object per rank)."""
    from json.encoder import encode_basestring_ascii as quoted

    if _is_table(ranks):
        return ranks.json_text(template, _RECORD_ORDER, sep, quoted)
    return (
        sep.decode()
        .join(
            template % (r.data_bytes, quoted(r.file), r.file_bytes, r.header_xxh64, r.index_xxh64, r.n_tensors, r.rank)
            for r in ranks
        )
        .encode("utf-8")
    )


def _body_xxh64(body: dict) -> int:
    """XXH64 of the manifest's canonical JSON (sorted keys, compact), without its checksum field."""
    from .hashing import xxh64

    return xxh64(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def write_manifest(root: str, manifest: Manifest) -> str:
    path = os.path.join(iter_dir(root, manifest.iteration), MANIFEST_NAME)
    atomic_write(path, manifest.to_json())
    return path


def read_manifest(ckpt_dir: str) -> Manifest:
    """The manifest of ``ckpt_dir``.  :class:`NoCheckpointError` when there is none; anything else
    wrong (not a regular file, a symlink, larger than :data:`.safe_io.MANIFEST_MAX_BYTES`,
    unreadable, unparsable, invalid) is a :class:`CorruptCheckpointError` naming it, and so is an
    ``iter_*`` directory that is a symlink: we never write one, so it is not ours to read through."""
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    named = iteration_of(ckpt_dir)
    if named is not None and os.path.islink(os.path.normpath(ckpt_dir)):
        raise CorruptCheckpointError(
            f"{ckpt_dir}: is a symlink to {os.readlink(os.path.normpath(ckpt_dir))!r}; checkpoint directories are"
            " never read through a link (not written by this engine)"
        )
    try:
        data = safe_io.read_capped(path, safe_io.MANIFEST_MAX_BYTES, "manifest")
    except FileNotFoundError as e:
        raise NoCheckpointError(f"{ckpt_dir}: no {MANIFEST_NAME}: not a committed checkpoint") from e
    except NotADirectoryError as e:
        raise NoCheckpointError(f"{ckpt_dir}: not a directory: not a checkpoint") from e
    m = Manifest.from_json(data, path)
    if named is not None and named != m.iteration:
        raise CorruptCheckpointError(f"{path}: manifest is for iteration {m.iteration}, directory says {named}")
    return m


def read_tracker_text(root: str) -> str | None:
    """The tracker's text (stripped), ``None`` when absent; :class:`CorruptCheckpointError` when it
    is a symlink, not a regular file, longer than :data:`.safe_io.TRACKER_MAX_BYTES`, or not text."""
    path = os.path.join(root, TRACKER_NAME)
    try:
        raw = safe_io.read_capped(path, safe_io.TRACKER_MAX_BYTES, "tracker")
    except FileNotFoundError:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{path}: tracker is not text: {e}") from e


def parse_tracker(text: str | None) -> int | None:
    """The iteration a tracker text names: ASCII digits only, else ``None`` ('release', damage)."""
    if text is None or not _DIGITS.match(text.encode("utf-8", "replace")):
        return None
    return int(text)


def read_tracker(root: str) -> int | None:
    """The iteration named by Megatron's tracker file, or ``None`` (absent, 'release', or not a
    plain iteration number; a tracker that cannot be read safely is logged).  Informative only."""
    try:
        return parse_tracker(read_tracker_text(root))
    except CorruptCheckpointError as e:
        log.warning("%s", e)
        return None


def write_tracker(root: str, iteration: int) -> None:
    atomic_write(os.path.join(root, TRACKER_NAME), f"{iteration}".encode())
