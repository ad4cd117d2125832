"""The per-rank file format (docs/format.md): header, aligned data, binary index, objects; and its reader.

Layout::

    [0, 4096)          header: magic, format version, section offsets/sizes/XXH64s, header XXH64
    [4096, ...)        data: regions at 4 KiB-aligned offsets (small tensors coalesced, 64 B-aligned)
    index_offset       index records (INDEX_WORDS x u64 per tensor), then u64 checksums, then names
    objects_offset     tagged-JSON objects (non-tensor state and per-tensor metadata)

The header is written last, so a file whose header is missing or does not verify was not finished.
"""

from __future__ import annotations

import dataclasses
import math
import errno as errno_module
import mmap
import os
import struct

import numba
import numpy as np
import torch

from ..errors import READ_ERRNOS, CorruptCheckpointError, FormatVersionError, StorageReadError
from .json_budget import DecodeBudget, check_budget
from .tagged_json import decode_objects
from ..fs.safe_io import open_regular
from .hashing import xxh64, xxh64_kernel

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "Header",
    "FileReceipt",
    "TensorEntry",
    "RankFile",
    "dtype_code",
    "code_dtype",
    "build_index",
    "encode_index",
    "decode_index",
    "load_file",
    "warmup",
    "INDEX_WORDS",
    "MAX_NDIM",
    "MIN_CHUNK_BYTES",
    "check_sections",
]

MAGIC = b"DSMCKPT\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sII" + "Q" * 11)  # magic, version, flags, 11 u64 fields

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}

MAX_NDIM = 8
# One index record = 16 little-endian uint64 words:
#   name_off, name_len, dtype_code, ndim, shape[8], data_offset, nbytes, checksum_first, n_checksums
INDEX_WORDS = 16


@numba.njit(nogil=True, cache=True)
def encode_index(name_off, name_len, dtype_code, ndim, shapes, data_offset, nbytes, cks_first, n_cks):
    """Pack the per-tensor columns into the fixed-width binary index records (see docs/format.md)."""
    n = name_off.shape[0]
    out = np.zeros((n, INDEX_WORDS), np.uint64)
    for i in range(n):
        out[i, 0] = name_off[i]
        out[i, 1] = name_len[i]
        out[i, 2] = dtype_code[i]
        out[i, 3] = ndim[i]
        for d in range(MAX_NDIM):
            out[i, 4 + d] = shapes[i, d]
        out[i, 12] = data_offset[i]
        out[i, 13] = nbytes[i]
        out[i, 14] = cks_first[i]
        out[i, 15] = n_cks[i]
    return out


def decode_index(raw: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_index`: ``(n, INDEX_WORDS)`` int64 view over the raw index bytes."""
    if raw.size % (INDEX_WORDS * 8):
        raise ValueError(f"index of {raw.size} bytes is not a whole number of {INDEX_WORDS * 8}-byte records")
    return raw.view("<u8").reshape(-1, INDEX_WORDS).astype(np.int64)


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _CODE:
        raise ValueError(f"dtype {dtype} is not supported by the checkpoint format")
    return _CODE[dtype]


def code_dtype(code: int) -> torch.dtype:
    if not 0 <= code < len(_DTYPES):
        raise CorruptCheckpointError(f"unknown dtype code {code}")
    return _DTYPES[code]


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    data_offset: int
    data_bytes: int
    index_offset: int
    index_bytes: int
    index_xxh64: int
    objects_offset: int
    objects_bytes: int
    objects_xxh64: int
    chunk_bytes: int
    n_tensors: int
    file_bytes: int

    def pack(self) -> bytes:
        body = _HEADER.pack(
            MAGIC,
            self.version,
            0,
            self.data_offset,
            self.data_bytes,
            self.index_offset,
            self.index_bytes,
            self.index_xxh64,
            self.objects_offset,
            self.objects_bytes,
            self.objects_xxh64,
            self.chunk_bytes,
            self.n_tensors,
            self.file_bytes,
        )
        body += struct.pack("<Q", xxh64(body))
        return body + b"\x00" * (HEADER_BYTES - len(body))

    @classmethod
    def unpack(cls, raw: bytes, path: str) -> "Header":
        if len(raw) < _HEADER.size + 8:
            raise CorruptCheckpointError(f"{path}: truncated header ({len(raw)} bytes)")
        fields = _HEADER.unpack_from(raw)
        if fields[0] != MAGIC:
            raise CorruptCheckpointError(f"{path}: not a datastates checkpoint file (magic {fields[0]!r})")
        if fields[1] > FORMAT_VERSION:  # the header does not say who wrote it (its manifest does)
            raise FormatVersionError.newer(path, "rank file", fields[1], FORMAT_VERSION)
        if fields[1] < 1:
            raise CorruptCheckpointError(f"{path}: rank file format version {fields[1]} is not a version")
        (stored,) = struct.unpack_from("<Q", raw, _HEADER.size)
        if stored != xxh64(raw[: _HEADER.size]):
            raise CorruptCheckpointError(f"{path}: header checksum mismatch")
        return cls(fields[1], *fields[3:])


@dataclasses.dataclass(frozen=True)
class FileReceipt:
    """A durable (fsynced) rank file as its manifest entry describes it -- the committer's input --
    with the seconds its making took: ``copy_s`` until its bytes were copied from their source (the
    device for a save, the local file for a promotion), ``flush_s`` until it was durable."""

    version: int
    path: str
    file_bytes: int
    data_bytes: int
    n_tensors: int
    index_xxh64: int
    header_xxh64: int
    save_call_s: float = 0.0
    copy_s: float = 0.0
    flush_s: float = 0.0

    @classmethod
    def of(cls, header: Header, data_bytes: int, version: int, path: str, **seconds: float) -> "FileReceipt":
        """The receipt of the file whose (written, verified) header is ``header``."""
        h = header
        return cls(version, path, h.file_bytes, data_bytes, h.n_tensors, h.index_xxh64, xxh64(h.pack()), **seconds)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int
    checksums: np.ndarray  # uint64, one per chunk


def build_index(names, dtypes, shapes, offsets, nbytes, checksums_per_tensor) -> bytes:
    """Encode the index section: records, then all checksums, then UTF-8 names."""
    encoded = [n.encode("utf-8") for n in names]
    name_len = np.array([len(b) for b in encoded], np.int64)
    name_off = np.concatenate([[0], np.cumsum(name_len)[:-1]]).astype(np.int64) if len(names) else name_len
    n_cks = np.array([len(c) for c in checksums_per_tensor], np.int64)
    cks_first = np.concatenate([[0], np.cumsum(n_cks)[:-1]]).astype(np.int64) if len(names) else n_cks
    shape_arr = np.zeros((len(names), MAX_NDIM), np.int64)
    for i, s in enumerate(shapes):
        if len(s) > MAX_NDIM:
            raise ValueError(f"tensor {names[i]!r} has {len(s)} dims; the format stores at most {MAX_NDIM}")
        shape_arr[i, : len(s)] = s
    records = encode_index(
        name_off,
        name_len,
        np.array([dtype_code(d) for d in dtypes], np.int64),
        np.array([len(s) for s in shapes], np.int64),
        shape_arr,
        np.asarray(offsets, np.int64),
        np.asarray(nbytes, np.int64),
        cks_first,
        n_cks,
    )
    all_cks = np.concatenate(checksums_per_tensor).astype(np.uint64) if len(names) else np.zeros(0, np.uint64)
    return records.astype("<u8").tobytes() + all_cks.astype("<u8").tobytes() + b"".join(encoded)


def _parse_index(raw: memoryview, n: int, path: str, data: tuple[int, int, int]) -> list[TensorEntry]:
    """The index section's entries; ``data`` is ``(data_offset, data_offset + data_bytes, chunk_bytes)``."""
    rec_bytes = n * INDEX_WORDS * 8
    buf = np.frombuffer(raw, dtype=np.uint8)
    if buf.size < rec_bytes:
        raise CorruptCheckpointError(f"{path}: index holds {buf.size} bytes, {n} records need {rec_bytes}")
    rec = decode_index(buf[:rec_bytes])
    total_cks = int(rec[:, 15].sum()) if n else 0
    cks = buf[rec_bytes : rec_bytes + 8 * total_cks].view("<u8").copy()  # no view may pin the mapping
    names = bytes(buf[rec_bytes + 8 * total_cks :])
    out = []
    for r in rec:
        out.append(_entry(r, len(out), names, cks, path, data))
    return out


def _entry(r: np.ndarray, i: int, names: bytes, cks: np.ndarray, path: str, data: tuple[int, int, int]) -> TensorEntry:
    """One index record as a :class:`TensorEntry`, refused (``CorruptCheckpointError`` naming the file,
    record and tensor) unless it is self-consistent: its bytes lie inside the data section, its size
    is its shape times its dtype's, and it has one checksum per ``chunk_bytes`` of data."""
    data_start, data_stop, chunk_bytes = data
    if not (0 <= r[3] <= MAX_NDIM and 0 <= r[0] and 0 <= r[1] and r[0] + r[1] <= len(names)):
        raise CorruptCheckpointError(f"{path}: index record {i} is out of range (ndim {r[3]}, name {r[0]}..+{r[1]})")
    name = names[r[0] : r[0] + r[1]].decode("utf-8")
    dtype = code_dtype(int(r[2]))
    shape = tuple(int(x) for x in r[4 : 4 + r[3]])
    offset, nbytes = int(r[12]), int(r[13])
    what = f"{path}: index record {i} (tensor {name!r})"
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
        raise CorruptCheckpointError(f"{what} declares {nbytes} bytes for {dtype} {list(shape)}")
    if not data_start <= offset <= offset + nbytes <= data_stop:
        raise CorruptCheckpointError(
            f"{what}: bytes {offset}..+{nbytes} lie outside the data section [{data_start}, {data_stop})"
        )
    n_cks = -(-nbytes // chunk_bytes) if chunk_bytes > 0 else -1
    if not (r[15] == n_cks or (nbytes == 0 and r[15] <= 1)) or r[14] < 0 or r[14] + r[15] > len(cks):
        raise CorruptCheckpointError(f"{what}: {r[15]} checksums for {nbytes} bytes in {chunk_bytes}-byte chunks")
    return TensorEntry(name, dtype, shape, offset, nbytes, cks[r[14] : r[14] + r[15]])


MIN_CHUNK_BYTES = 4096  # the writer's smallest chunk (EngineOptions.effective_chunk_bytes)
MAX_NAME_BYTES = 1 << 16  # a tensor name in the index: far beyond any model's parameter names
_INDEX_RECORD_BYTES = INDEX_WORDS * 8
# the objects section we write: tensor metadata (a value per ~10 bytes at worst) and user state
_OBJECTS_BYTES_PER_VALUE = 8
_OBJECTS_VALUE_ALLOWANCE = 1 << 18


def check_sections(h: Header, path: str) -> None:
    """Refuse (:class:`CorruptCheckpointError` naming ``path``) a header whose sections are not
    laid out as the writer lays them, before anything they describe is read: data at 4 KiB, the
    index after the data (with at most the padding a recycled file leaves:
    :func:`.writer.reuse_limit`), the objects right after the index and the file's end right after
    them; ``chunk_bytes`` at least the writer's minimum; an index no larger than the records,
    checksums and names of ``n_tensors`` tensors over ``data_bytes`` need.  So what a crafted
    header costs is bounded by the bytes it really has."""
    data_end = h.data_offset + h.data_bytes
    aligned = -(-data_end // 4096) * 4096
    problems = []
    if h.chunk_bytes < MIN_CHUNK_BYTES:
        problems.append(f"chunk_bytes {h.chunk_bytes} is below the writer's minimum {MIN_CHUNK_BYTES}")
    if h.data_offset != HEADER_BYTES:
        problems.append(f"data starts at {h.data_offset}, not {HEADER_BYTES}")
    if not aligned <= h.index_offset <= aligned + data_end // 8 + (4 << 20):
        problems.append(f"index starts at {h.index_offset}, not after the data ({aligned}) as written")
    if h.objects_offset != h.index_offset + h.index_bytes or h.file_bytes != h.objects_offset + h.objects_bytes:
        problems.append(
            f"sections end at {h.objects_offset + h.objects_bytes} (objects at {h.objects_offset}), "
            f"file_bytes says {h.file_bytes}"
        )
    if h.chunk_bytes >= MIN_CHUNK_BYTES:
        most_checksums = h.n_tensors + h.data_bytes // h.chunk_bytes
        most_index = h.n_tensors * (_INDEX_RECORD_BYTES + MAX_NAME_BYTES) + 8 * most_checksums
        if not h.n_tensors * _INDEX_RECORD_BYTES <= h.index_bytes <= most_index:
            problems.append(f"an index of {h.index_bytes} bytes for {h.n_tensors} tensors over {h.data_bytes} bytes")
    if problems:
        raise CorruptCheckpointError(f"{path}: header describes a file the writer never makes: {'; '.join(problems)}")


def _errno_text(e: OSError) -> str:
    """``EIO (Input/output error)``: an errno as a log line names it."""
    name = errno_module.errorcode.get(e.errno, str(e.errno))
    return f"{name} ({e.strerror or os.strerror(e.errno)})"


class RankFile:
    """A rank file opened read-only via ``mmap``; tensors are zero-copy views.  Not thread-safe to close
    while views are used; reading entries from several threads is safe."""

    def __init__(self, path: str, memory_fd: int | None = None) -> None:
        """``memory_fd``: read this open memory file (a memfd, duplicated) that ``path`` only names."""
        self.path = os.fspath(path)
        # never through a symlink, only a regular file (a FIFO does not block): CorruptCheckpointError
        self._file = os.fdopen(open_regular(self.path) if memory_fd is None else os.dup(memory_fd), "rb")
        self._mm = None
        size = os.fstat(self._file.fileno()).st_size
        if size < HEADER_BYTES:
            self._file.close()
            raise CorruptCheckpointError(f"{self.path}: truncated ({size} bytes, header needs {HEADER_BYTES})")
        try:  # the header and the sections' bounds before anything is mapped or parsed
            self.header = h = Header.unpack(os.pread(self._file.fileno(), HEADER_BYTES, 0), self.path)
            if size != h.file_bytes:
                raise CorruptCheckpointError(
                    f"{self.path}: size is {size} bytes, header says {h.file_bytes} (truncated?)"
                )
            check_sections(h, self.path)
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            self.close()
            if e.errno in READ_ERRNOS:  # the storage failed the read: the file may be intact
                raise StorageReadError(f"{self.path}: reading its header failed: {_errno_text(e)}", e.errno) from e
            raise CorruptCheckpointError(f"{self.path}: cannot read or map its {size} bytes: {e.strerror or e}") from e
        except CorruptCheckpointError:
            self.close()
            raise
        view = memoryview(self._mm)
        index_raw = view[h.index_offset : h.index_offset + h.index_bytes]
        if xxh64(index_raw) != h.index_xxh64:
            self.close()
            raise CorruptCheckpointError(f"{self.path}: index checksum mismatch")
        objects_raw = view[h.objects_offset : h.objects_offset + h.objects_bytes]
        if xxh64(objects_raw) != h.objects_xxh64:
            self.close()
            raise CorruptCheckpointError(f"{self.path}: objects checksum mismatch")
        try:  # checksummed, but a hand-made file can still hold anything: only our error escapes
            self.entries = {
                e.name: e
                for e in _parse_index(
                    index_raw, h.n_tensors, self.path, (h.data_offset, h.data_offset + h.data_bytes, h.chunk_bytes)
                )
            }
            check_budget(objects_raw, _OBJECTS_BYTES_PER_VALUE, _OBJECTS_VALUE_ALLOWANCE, self.path, "objects section")
            # ASCII, no string stored 4x wider than its bytes (decoded from the mapping, not a copy)
            self.objects = decode_objects(DecodeBudget(self.path, value_bytes=0).text(objects_raw, "objects section"))
        except CorruptCheckpointError:
            self.close()
            raise
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
            self.close()
            raise CorruptCheckpointError(
                f"{self.path}: index or objects section does not parse: {type(e).__name__}: {e}"
            ) from e
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)

    def fileno(self) -> int:
        """The descriptor of the open file (the mapped inode, even if the path was replaced since)."""
        return self._file.fileno()

    def span(self, start: int, stop: int) -> np.ndarray:
        """Zero-copy uint8 view of the file's bytes ``[start, stop)`` (page-aligned at offset 0)."""
        return self._bytes[start:stop]

    def raw(self, entry: TensorEntry) -> np.ndarray:
        return self._bytes[entry.offset : entry.offset + entry.nbytes]

    def verify_chunk(self, entry: TensorEntry, c: int, raw: np.ndarray | None = None) -> int:
        """Check checksum ``c`` of ``entry`` (its bytes ``raw``, default: the mapped ones); returns the
        bytes hashed or raises :class:`CorruptCheckpointError` naming the file, tensor, chunk and bytes.
        The one chunk check of the package: restore, promotion and ``datastates-ckpt verify`` use it."""
        cb = self.header.chunk_bytes
        if raw is None:
            raw = self.raw(entry)[c * cb : (c + 1) * cb]
        if not 0 <= c < len(entry.checksums) or int(xxh64_kernel(raw, np.uint64(0))) != int(entry.checksums[c]):
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch in tensor {entry.name!r} (chunk {c}, bytes "
                f"{entry.offset + c * cb}..+{len(raw)})"
            )
        return len(raw)

    def verify_entry(self, entry: TensorEntry) -> None:
        for c in range(len(entry.checksums)):
            self.verify_chunk(entry, c)

    def verify_all(self) -> int:
        """Check every chunk of every tensor (:meth:`verify_chunk`); returns the tensor bytes checked
        or raises :class:`CorruptCheckpointError` at the first bad chunk.  The one whole-file check:
        promotion verifies a file before copying it, replication before sending one and after
        receiving one.  (``datastates-ckpt verify`` checks chunk by chunk to report every bad one.)"""
        total = 0
        for entry in self.entries.values():
            self.verify_entry(entry)
            total += entry.nbytes
        return total

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy tensor over the mapped bytes (copy-on-write: writing it never touches the file)."""
        e = self.entries[name]
        flat = torch.from_numpy(self.raw(e)) if e.nbytes else torch.empty(0, dtype=torch.uint8)
        return flat.view(e.dtype).reshape(e.shape)

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self._bytes = None
            try:
                self._mm.close()
            except BufferError:
                pass  # live zero-copy views keep the mapping; it goes with them
            self._mm = None
        self._file.close()

    def __enter__(self) -> "RankFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_file(path: str, verify: bool = True) -> tuple[dict[str, torch.Tensor], object]:
    """Read a whole rank file: ``(tensors, objects)``.  Tensors are zero-copy views of the mapping."""
    rf = RankFile(path)
    if verify:
        rf.verify_all()
    return {name: rf.tensor(name) for name in rf.entries}, rf.objects


def warmup() -> None:
    """Compile (or load from cache) the index encoder with the argument types the engine uses."""
    z = np.zeros(1, np.int64)
    encode_index(z, z, z, z, np.zeros((1, MAX_NDIM), np.int64), z, z, z, z)
