"""Numba-compiled host-side kernels: XXH64 checksums, small-tensor coalescing plan, index encoding.

Every kernel is ``nogil`` so flush threads hash in parallel, and ``cache=True`` so the compiled code
is reused across runs.  :func:`warmup` compiles them all; the engine calls it in its constructor, so
no compilation ever lands on the training loop's critical path.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["xxh64", "xxh64_copy", "plan_layout", "encode_index", "decode_index", "warmup", "INDEX_WORDS", "MAX_NDIM"]

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)
_U0 = np.uint64(0)


@numba.njit(inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(inline="always")
def _round(acc, lane):
    acc = acc + lane * _P2
    acc = _rotl(acc, 31)
    return acc * _P1


@numba.njit(inline="always")
def _merge(acc, val):
    acc = acc ^ _round(_U0, val)
    return acc * _P1 + _P4


@numba.njit(inline="always")
def _lanes(seed):
    return seed + _P1 + _P2, seed + _P2, seed, seed - _P1


@numba.njit(inline="always")
def _converge(v1, v2, v3, v4):
    h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
    h = _merge(h, v1)
    h = _merge(h, v2)
    h = _merge(h, v3)
    return _merge(h, v4)


@numba.njit(inline="always")
def _finish(buf, words, h, i):
    """XXH64 of ``buf`` after its first ``i`` words went through the stripe loop (accumulated in ``h``)."""
    n = buf.shape[0]
    n_words = words.shape[0]
    h = h + np.uint64(n)
    while i < n_words:
        h = h ^ _round(_U0, words[i])
        h = _rotl(h, 27) * _P1 + _P4
        i += 1
    p = n_words * 8
    if p + 4 <= n:
        k = (
            np.uint64(buf[p])
            | (np.uint64(buf[p + 1]) << np.uint64(8))
            | (np.uint64(buf[p + 2]) << np.uint64(16))
            | (np.uint64(buf[p + 3]) << np.uint64(24))
        )
        h = h ^ (k * _P1)
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < n:
        h = h ^ (np.uint64(buf[p]) * _P5)
        h = _rotl(h, 11) * _P1
        p += 1
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    h = h ^ (h >> np.uint64(32))
    return h


@numba.njit(nogil=True, cache=True)
def _xxh64_impl(buf, seed):
    n = buf.shape[0]
    words = buf[: (n // 8) * 8].view(np.uint64)
    stripes = words.shape[0] // 4
    if n < 32:
        return _finish(buf, words, seed + _P5, 0)
    v1, v2, v3, v4 = _lanes(seed)
    for s in range(stripes):
        j = s * 4
        v1 = _round(v1, words[j])
        v2 = _round(v2, words[j + 1])
        v3 = _round(v3, words[j + 2])
        v4 = _round(v4, words[j + 3])
    return _finish(buf, words, _converge(v1, v2, v3, v4), stripes * 4)


@numba.njit(nogil=True, cache=True)
def _xxh64_copy_impl(src, dst, seed):
    """XXH64 of ``src`` while copying it to ``dst`` (same length): one pass over the source."""
    n = src.shape[0]
    words = src[: (n // 8) * 8].view(np.uint64)
    out = dst[: (n // 8) * 8].view(np.uint64)
    stripes = words.shape[0] // 4
    for p in range(stripes * 32, n):  # the bytes after the last whole stripe
        dst[p] = src[p]
    if n < 32:
        return _finish(src, words, seed + _P5, 0)
    v1, v2, v3, v4 = _lanes(seed)
    for s in range(stripes):
        j = s * 4
        a = words[j]
        b = words[j + 1]
        c = words[j + 2]
        d = words[j + 3]
        out[j] = a
        out[j + 1] = b
        out[j + 2] = c
        out[j + 3] = d
        v1 = _round(v1, a)
        v2 = _round(v2, b)
        v3 = _round(v3, c)
        v4 = _round(v4, d)
    return _finish(src, words, _converge(v1, v2, v3, v4), stripes * 4)


def _as_bytes(buf) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return arr.reshape(-1).view(np.uint8) if arr.dtype != np.uint8 else arr


def xxh64(buf, seed: int = 0) -> int:
    """XXH64 of a contiguous byte buffer (numpy uint8 array, bytes, memoryview or mmap slice)."""
    return int(_xxh64_impl(_as_bytes(buf), np.uint64(seed)))


def xxh64_copy(src, dst: np.ndarray, seed: int = 0) -> int:
    """Copy ``src`` into ``dst`` (a writable uint8 array of the same length) and return its XXH64.

    One pass: each 32-byte stripe is hashed from the registers it was loaded into, so writing a
    region into a mapped file costs about one memcpy instead of a hash pass plus a copy."""
    src = _as_bytes(src)
    if dst.dtype != np.uint8 or dst.shape != src.shape:
        raise ValueError(f"xxh64_copy: destination is {dst.dtype}{dst.shape}, expected uint8{src.shape}")
    return int(_xxh64_copy_impl(src, dst, np.uint64(seed)))


@numba.njit(nogil=True, cache=True)
def _align_up(x, a):
    return (x + a - 1) // a * a


@numba.njit(nogil=True, cache=True)
def plan_layout(nbytes, chunk_bytes, small_bytes, pack_bytes, align, small_align):
    """Place tensors in the data section and cut them into cache regions.

    Tensors of at most ``small_bytes`` are coalesced, ``small_align``-aligned, into packs of at most
    ``pack_bytes``; larger tensors start ``align``-aligned and are cut into ``chunk_bytes`` pieces.
    Every region starts ``align``-aligned and its length is padded to ``align`` (O_DIRECT-friendly).

    Returns ``(tensor_offset, regions, items)``: ``regions[r] = (offset, padded_len, first_item,
    n_items)``; ``items[k] = (tensor, chunk, offset_in_region, length)``.  Checksums are per item,
    so a tensor has ``ceil(nbytes / chunk_bytes)`` checksums (at least one).
    """
    n = nbytes.shape[0]
    tensor_offset = np.zeros(n, np.int64)
    max_items = 0
    for t in range(n):
        max_items += max(1, (nbytes[t] + chunk_bytes - 1) // chunk_bytes)
    regions = np.zeros((max_items, 4), np.int64)
    items = np.zeros((max_items, 4), np.int64)
    n_regions = 0
    n_items = 0
    cursor = 0  # next free byte in the data section
    pack_open = False
    pack_start = 0
    pack_fill = 0
    for t in range(n):
        size = nbytes[t]
        if size <= small_bytes:
            start = _align_up(pack_fill, small_align)
            if pack_open and start + size > pack_bytes:
                regions[n_regions - 1, 1] = _align_up(pack_fill, align)
                cursor = pack_start + regions[n_regions - 1, 1]
                pack_open = False
            if not pack_open:
                pack_open = True
                pack_start = cursor
                pack_fill = 0
                start = 0
                regions[n_regions, 0] = pack_start
                regions[n_regions, 2] = n_items
                regions[n_regions, 3] = 0
                n_regions += 1
            tensor_offset[t] = pack_start + start
            items[n_items, 0] = t
            items[n_items, 1] = 0
            items[n_items, 2] = start
            items[n_items, 3] = size
            n_items += 1
            regions[n_regions - 1, 3] += 1
            pack_fill = start + size
        else:
            if pack_open:
                regions[n_regions - 1, 1] = _align_up(max(pack_fill, 1), align)
                cursor = pack_start + regions[n_regions - 1, 1]
                pack_open = False
            tensor_offset[t] = cursor
            n_chunks = (size + chunk_bytes - 1) // chunk_bytes
            for c in range(n_chunks):
                length = min(chunk_bytes, size - c * chunk_bytes)
                regions[n_regions, 0] = cursor
                regions[n_regions, 1] = _align_up(length, align)
                regions[n_regions, 2] = n_items
                regions[n_regions, 3] = 1
                items[n_items, 0] = t
                items[n_items, 1] = c
                items[n_items, 2] = 0
                items[n_items, 3] = length
                n_items += 1
                n_regions += 1
                cursor += _align_up(length, align)
    if pack_open:
        regions[n_regions - 1, 1] = _align_up(max(pack_fill, 1), align)
        cursor = pack_start + regions[n_regions - 1, 1]
    return tensor_offset, regions[:n_regions].copy(), items[:n_items].copy()


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


def warmup() -> None:
    """Compile (or load from cache) every kernel with the argument types the engine uses."""
    xxh64(np.zeros(40, np.uint8))
    xxh64_copy(np.zeros(40, np.uint8), np.zeros(40, np.uint8))
    plan_layout(np.array([1, 1 << 20], np.int64), 1 << 16, 1 << 10, 1 << 16, 4096, 64)
    z = np.zeros(1, np.int64)
    encode_index(z, z, z, z, np.zeros((1, MAX_NDIM), np.int64), z, z, z, z)
