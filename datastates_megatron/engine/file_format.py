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
import mmap
import os
import struct

import numpy as np
import torch

from .errors import CorruptCheckpointError, FormatVersionError
from .objects import decode_objects
from .safe_io import open_regular
from .serializer import INDEX_WORDS, MAX_NDIM, decode_index, encode_index, xxh64

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "Header",
    "TensorEntry",
    "RankFile",
    "dtype_code",
    "code_dtype",
    "build_index",
    "read_header",
    "open_rank_file",
    "load_file",
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
        if fields[1] != FORMAT_VERSION:
            raise FormatVersionError(f"{path}: unknown format version {fields[1]} (this reader knows {FORMAT_VERSION})")
        (stored,) = struct.unpack_from("<Q", raw, _HEADER.size)
        if stored != xxh64(raw[: _HEADER.size]):
            raise CorruptCheckpointError(f"{path}: header checksum mismatch")
        return cls(fields[1], *fields[3:])


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


def _parse_index(raw: memoryview, n: int, path: str, file_bytes: int | None = None) -> list[TensorEntry]:
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
        if (
            not 0 <= r[3] <= MAX_NDIM
            or r[12] < 0
            or r[13] < 0
            or (file_bytes is not None and r[12] + r[13] > file_bytes)
        ):
            raise CorruptCheckpointError(
                f"{path}: index record {len(out)} is out of range (ndim {r[3]}, bytes "
                f"{r[12]}..+{r[13]} of a {file_bytes}-byte file)"
            )
        name = names[r[0] : r[0] + r[1]].decode("utf-8")
        shape = tuple(int(x) for x in r[4 : 4 + r[3]])
        out.append(TensorEntry(name, code_dtype(int(r[2])), shape, int(r[12]), int(r[13]), cks[r[14] : r[14] + r[15]]))
    return out


def read_header(path: str) -> Header:
    with os.fdopen(open_regular(path), "rb") as f:
        return Header.unpack(f.read(HEADER_BYTES), path)


class RankFile:
    """A rank file opened read-only via ``mmap``; tensors are zero-copy views.  Not thread-safe to close
    while views are used; reading entries from several threads is safe."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        # never through a symlink, only a regular file (a FIFO does not block): CorruptCheckpointError
        self._file = os.fdopen(open_regular(self.path), "rb")
        size = os.fstat(self._file.fileno()).st_size
        if size < HEADER_BYTES:
            self._file.close()
            raise CorruptCheckpointError(f"{self.path}: truncated ({size} bytes, header needs {HEADER_BYTES})")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self.header = Header.unpack(self._mm[:HEADER_BYTES], self.path)
        except CorruptCheckpointError:
            self.close()
            raise
        h = self.header
        if size != h.file_bytes:
            self.close()
            raise CorruptCheckpointError(f"{self.path}: size is {size} bytes, header says {h.file_bytes} (truncated?)")
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
            self.entries = {e.name: e for e in _parse_index(index_raw, h.n_tensors, self.path, size)}
            self.objects = decode_objects(objects_raw)
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

    def chunks(self, entry: TensorEntry):
        """Yield ``(chunk_index, uint8 view)`` pairs matching ``entry.checksums``."""
        cb = self.header.chunk_bytes
        raw = self.raw(entry)
        for c in range(len(entry.checksums)):
            yield c, raw[c * cb : (c + 1) * cb]

    def verify_entry(self, entry: TensorEntry) -> None:
        for c, chunk in self.chunks(entry):
            if xxh64(chunk) != int(entry.checksums[c]):
                raise CorruptCheckpointError(
                    f"{self.path}: checksum mismatch in tensor {entry.name!r} (chunk {c}, bytes "
                    f"{entry.offset + c * self.header.chunk_bytes}..+{len(chunk)})"
                )

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


def open_rank_file(path: str) -> RankFile:
    return RankFile(path)


def load_file(path: str, verify: bool = True) -> tuple[dict[str, torch.Tensor], object]:
    """Read a whole rank file: ``(tensors, objects)``.  Tensors are zero-copy views of the mapping."""
    rf = RankFile(path)
    if verify:
        for e in rf.entries.values():
            rf.verify_entry(e)
    return {name: rf.tensor(name) for name in rf.entries}, rf.objects
