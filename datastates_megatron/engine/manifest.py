"""The global manifest (the commit point), the Megatron-style tracker file, and the directory layout.

``<root>/iter_0000100/manifest.json`` names every rank file of iteration 100 with its size and
checksums; it is written with temp file + fsync + ``os.replace`` + directory fsync, so it either
exists whole or not at all.  A directory without a valid manifest is not a checkpoint.
``<root>/latest_checkpointed_iteration.txt`` is replaced the same way right after the manifest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

from .errors import CorruptCheckpointError, FormatVersionError, NoCheckpointError
from .writer import fsync_dir

__all__ = [
    "MANIFEST_NAME",
    "TRACKER_NAME",
    "MANIFEST_VERSION",
    "RankRecord",
    "Manifest",
    "iter_dir",
    "rank_file_name",
    "parse_rank_file_name",
    "save_id",
    "atomic_write",
    "write_manifest",
    "read_manifest",
    "read_tracker",
    "write_tracker",
    "list_iterations",
    "committed_manifests",
    "committed_iterations",
    "latest_committed",
]

MANIFEST_NAME = "manifest.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
MANIFEST_FORMAT = "datastates-megatron-manifest"
MANIFEST_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file_name(rank: int, token: str, seq: int) -> str:
    return f"r{rank:05d}-{token}-{seq:06d}.dsck"


def save_id(name: str) -> tuple[int, int] | None:
    """``(run token as an integer, save sequence)`` of a rank file name whose token is one
    ``CheckpointManager`` agrees on (16 hex digits, below 2**63: it fits an int64 collective);
    None for any other name."""
    parsed = parse_rank_file_name(name)
    if parsed is None:
        return None
    token = parsed[1]
    if len(token) != 16 or any(c not in "0123456789abcdef" for c in token) or int(token, 16) >= 1 << 63:
        return None
    return int(token, 16), parsed[2]


def parse_rank_file_name(name: str) -> tuple[int, str, int] | None:
    """``(rank, run token, save sequence)`` of a :func:`rank_file_name`, or None for another name.
    Token and sequence identify the save: every rank's file of one save shares them."""
    parts = name.removesuffix(".dsck").split("-") if name.endswith(".dsck") else []
    if len(parts) != 3 or not parts[0].startswith("r") or not parts[0][1:].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[0][1:]), parts[1], int(parts[2])


@dataclasses.dataclass(frozen=True)
class RankRecord:
    rank: int
    file: str
    file_bytes: int
    data_bytes: int
    n_tensors: int
    index_xxh64: int
    header_xxh64: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    iteration: int
    world_size: int
    run_token: str
    ranks: tuple[RankRecord, ...]
    layout: dict
    metadata: dict
    commit_seq: int = 0  # orders commits across runs: the newest commit is the latest checkpoint
    created: float = dataclasses.field(default_factory=time.time)
    tier: str = "persistent"

    @property
    def total_bytes(self) -> int:
        return sum(r.data_bytes for r in self.ranks)

    def record(self, rank: int) -> RankRecord | None:
        """The entry of ``rank`` (a node-local manifest lists only that node's ranks)."""
        for r in self.ranks:
            if r.rank == rank:
                return r
        return None

    def to_json(self) -> bytes:
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
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }
        body["checksum"] = _body_xxh64(body)
        return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, path: str) -> "Manifest":
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptCheckpointError(f"{path}: manifest is not valid JSON: {e}") from e
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(f"{path}: not a datastates-megatron manifest")
        if body.get("format_version") != MANIFEST_VERSION:
            raise FormatVersionError(
                f"{path}: unknown manifest format version {body.get('format_version')!r} (this reader knows {MANIFEST_VERSION})"
            )
        try:
            ranks = tuple(RankRecord(**r) for r in body["ranks"])
            m = cls(
                iteration=int(body["iteration"]),
                world_size=int(body["world_size"]),
                run_token=str(body["run_token"]),
                ranks=ranks,
                layout=dict(body["layout"]),
                metadata=dict(body["metadata"]),
                commit_seq=int(body["commit_seq"]),
                created=float(body["created"]),
                tier=str(body.get("tier", "persistent")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{path}: manifest is missing or has a malformed field: {e}") from e
        listed = [r.rank for r in m.ranks]
        if m.tier == "local":  # one node's manifest: a sorted subset of the ranks
            valid = listed == sorted(set(listed)) and all(0 <= r < m.world_size for r in listed) and listed
        else:
            valid = listed == list(range(m.world_size))
        if not valid:
            raise CorruptCheckpointError(f"{path}: {m.tier} manifest lists ranks {listed} for world size {m.world_size}")
        for r in m.ranks:
            if not _SAFE_NAME.match(r.file) or r.file in (".", ".."):
                raise CorruptCheckpointError(f"{path}: rank {r.rank} file {r.file!r} is not a plain file name inside the checkpoint directory")
        stored = body.pop("checksum", None)
        if stored != _body_xxh64(body):
            raise CorruptCheckpointError(f"{path}: manifest checksum mismatch (stored {stored!r}): the manifest was altered")
        return m


def _body_xxh64(body: dict) -> int:
    """XXH64 of the manifest's canonical JSON (sorted keys, compact), without its checksum field."""
    from .serializer import xxh64

    return xxh64(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably: temp file, fsync, rename, directory fsync."""
    directory = os.path.dirname(path) or "."
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)  # a full disk must not leave temp files behind
        except OSError:
            pass
        raise
    fsync_dir(directory)


def write_manifest(root: str, manifest: Manifest) -> str:
    path = os.path.join(iter_dir(root, manifest.iteration), MANIFEST_NAME)
    atomic_write(path, manifest.to_json())
    return path


def read_manifest(ckpt_dir: str) -> Manifest:
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise NoCheckpointError(f"{ckpt_dir}: no {MANIFEST_NAME}: not a committed checkpoint") from e
    m = Manifest.from_json(data, path)
    match = _ITER_RE.match(os.path.basename(os.path.normpath(ckpt_dir)))
    if match and int(match.group(1)) != m.iteration:
        raise CorruptCheckpointError(f"{path}: manifest is for iteration {m.iteration}, directory says {int(match.group(1))}")
    return m


def read_tracker(root: str) -> int | None:
    """The iteration named by Megatron's tracker file, or ``None`` (absent, or 'release')."""
    try:
        with open(os.path.join(root, TRACKER_NAME)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(root: str, iteration: int) -> None:
    atomic_write(os.path.join(root, TRACKER_NAME), f"{iteration}".encode())


def list_iterations(root: str) -> list[int]:
    """Every ``iter_*`` directory under ``root``, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ITER_RE.match(n)) and os.path.isdir(os.path.join(root, n)))


def committed_manifests(root: str, damaged: list | None = None) -> dict[int, Manifest]:
    """Iteration -> manifest, for every directory whose manifest exists and parses.  Manifests that
    exist but do not parse are appended to ``damaged`` as errors."""
    out = {}
    for it in list_iterations(root):
        try:
            out[it] = read_manifest(iter_dir(root, it))
        except NoCheckpointError:
            continue
        except CorruptCheckpointError as e:
            if damaged is not None:
                damaged.append(e)
    return out


def committed_iterations(root: str) -> list[int]:
    """Committed iterations in commit order (oldest commit first)."""
    found = committed_manifests(root)
    return sorted(found, key=lambda it: (found[it].commit_seq, it))


def latest_committed(root: str) -> int:
    """The most recently committed iteration (by commit sequence, so a run that resumed from an older
    checkpoint and committed again supersedes higher iteration numbers left by an earlier run)."""
    damaged: list = []
    found = committed_manifests(root, damaged)
    if damaged:
        # manifests are written atomically, so a damaged one means corruption, not a crash: say so
        # rather than silently falling back to an older checkpoint
        first = damaged[0]  # keep its class: FormatVersionError says "upgrade", not "damaged"
        raise type(first)(f"{first} (pass an explicit iteration to load another checkpoint)") from first
    if not found:
        raise NoCheckpointError(f"{root}: no committed checkpoint (no iter_*/{MANIFEST_NAME})")
    return max(found, key=lambda it: (found[it].commit_seq, it))
