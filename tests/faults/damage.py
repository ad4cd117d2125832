"""Ways to damage a checkpoint on disk, shared by the bad-input tests and the sweep."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from datastates_megatron.engine.format.file_format import HEADER_BYTES, INDEX_WORDS, RankFile
from datastates_megatron.engine.format.hashing import xxh64
from datastates_megatron.engine.format.manifest import Manifest, RankRecord
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir


def flip(path: str, offset: int, bit: int = 0) -> None:
    """Flip one bit of one byte of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def edit_manifest(ckpt_dir: str, edit, *, reseal: bool = True) -> None:
    """Hand-edit ``ckpt_dir``'s manifest: ``edit(body)`` changes the parsed JSON in place.

    ``reseal``: write it back through ``Manifest.to_json`` so that whatever integrity data the
    engine puts in a manifest is recomputed (a hand editor can do the same), and the reader's own
    validation is what has to refuse the edit.  Falls back to a plain JSON dump when the edited body
    no longer makes a ``Manifest`` (a field removed, say)."""
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    with open(path) as f:
        body = json.load(f)
    edit(body)
    data = None
    if reseal:
        try:
            ranks = tuple(
                RankRecord(**{f.name: r[f.name] for f in dataclasses.fields(RankRecord)}) for r in body["ranks"]
            )
            fields = {
                f.name: body[f.name] for f in dataclasses.fields(Manifest) if f.name in body and f.name != "ranks"
            }
            data = Manifest(ranks=ranks, **fields).to_json()
        except (KeyError, TypeError, ValueError):
            data = None
    if data is None:
        data = json.dumps(body, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(data)


def manifest_path(root: str, iteration: int) -> str:
    return os.path.join(iter_dir(root, iteration), MANIFEST_NAME)


def reseal_index_record(path: str, name: str, edit) -> None:
    """Rewrite the index record of tensor ``name`` (``edit(record words, checksums, file bytes)``
    changes them in place), then recompute every checksum a hand editor can: the index's, the
    header's and the manifest's record of both."""
    with RankFile(path) as rf:
        h, names = rf.header, list(rf.entries)
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
    n, words = h.n_tensors, INDEX_WORDS
    index = np.frombuffer(raw, "<u8", n * words, h.index_offset).reshape(n, words).copy()
    cks = np.frombuffer(raw, "<u8", int(index[:, 15].sum()), h.index_offset + n * words * 8).copy()
    edit(index[names.index(name)], cks, raw)
    raw[h.index_offset : h.index_offset + index.nbytes] = index.tobytes()
    raw[h.index_offset + index.nbytes : h.index_offset + index.nbytes + cks.nbytes] = cks.tobytes()
    index_xxh64 = xxh64(bytes(raw[h.index_offset : h.index_offset + h.index_bytes]))
    header = dataclasses.replace(h, index_xxh64=index_xxh64).pack()
    raw[:HEADER_BYTES] = header
    with open(path, "wb") as f:
        f.write(raw)
    edit_manifest(
        os.path.dirname(path),
        lambda b: b["ranks"][0].update(index_xxh64=index_xxh64, header_xxh64=xxh64(header)),
    )


def rebuild_rank_file(
    path: str,
    *,
    chunk_bytes: int | None = None,
    objects_json: bytes | None = None,
    file_bytes: int | None = None,
    rank: int = 0,
) -> None:
    """Rewrite rank file ``path`` as a hand editor with our format spec could: its tensors' bytes
    as they are, with ``chunk_bytes`` (a checksum per chunk, all recomputed), ``objects_json`` as
    the objects section, or a header declaring ``file_bytes`` with the file extended (sparse) to
    that size -- every checksum (index, objects, header, manifest record) resealed, so only the
    reader's own bounds can refuse it (``rank``: whose record of the manifest is resealed)."""
    from datastates_megatron.engine.format.file_format import build_index

    with RankFile(path) as rf:
        h = rf.header
        entries = list(rf.entries.values())
        data = bytes(rf.span(h.data_offset, h.data_offset + h.data_bytes))
        objects = bytes(rf.span(h.objects_offset, h.objects_offset + h.objects_bytes))
    chunk = chunk_bytes or h.chunk_bytes
    by_byte = np.array([xxh64(bytes([b])) for b in range(256)], np.uint64) if chunk == 1 else None
    sums = []
    for e in entries:
        raw = np.frombuffer(data, np.uint8, e.nbytes, e.offset - h.data_offset)
        if by_byte is not None:
            sums.append(by_byte[raw] if e.nbytes else np.array([xxh64(b"")], np.uint64))
        else:
            n = max(1, -(-e.nbytes // chunk))
            sums.append(np.array([xxh64(raw[i * chunk : (i + 1) * chunk].tobytes()) for i in range(n)], np.uint64))
    index = build_index(
        [e.name for e in entries],
        [e.dtype for e in entries],
        [e.shape for e in entries],
        [e.offset for e in entries],
        [e.nbytes for e in entries],
        sums,
    )
    objects = objects if objects_json is None else objects_json
    index_offset = -(-(h.data_offset + h.data_bytes) // 4096) * 4096
    header = dataclasses.replace(
        h,
        index_offset=index_offset,
        index_bytes=len(index),
        index_xxh64=xxh64(index),
        objects_offset=index_offset + len(index),
        objects_bytes=len(objects),
        objects_xxh64=xxh64(objects),
        chunk_bytes=chunk,
        file_bytes=file_bytes or index_offset + len(index) + len(objects),
    ).pack()
    with open(path, "wb") as f:
        f.write(header)
        f.write(data)
        f.write(bytes(index_offset - h.data_offset - h.data_bytes))
        f.write(index)
        f.write(objects)
        if file_bytes:
            f.truncate(file_bytes)
    size = os.path.getsize(path)
    edit_manifest(
        os.path.dirname(path),
        lambda b: b["ranks"][rank].update(file_bytes=size, index_xxh64=xxh64(index), header_xxh64=xxh64(header)),
    )
