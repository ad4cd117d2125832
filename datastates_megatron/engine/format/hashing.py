"""XXH64 checksums (Numba kernels): every chunk of a rank file is hashed here, on write and on read.

The kernels are ``nogil`` so flush and restore threads hash in parallel, and ``cache=True`` so the
compiled code is reused across runs.  :func:`warmup` compiles them; the engine calls it in its
constructor, so no compilation lands on the training loop's critical path.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["xxh64", "xxh64_copy", "xxh64_kernel", "warmup"]

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
def xxh64_kernel(buf, seed):
    """XXH64 of the uint8 array ``buf`` with the uint64 ``seed``, for Numba callers (no conversion)."""
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
    return int(xxh64_kernel(_as_bytes(buf), np.uint64(seed)))


def xxh64_copy(src, dst: np.ndarray, seed: int = 0) -> int:
    """Copy ``src`` into ``dst`` (a writable uint8 array of the same length) and return its XXH64.

    One pass: each 32-byte stripe is hashed from the registers it was loaded into, so writing a
    region into a mapped file costs about one memcpy instead of a hash pass plus a copy."""
    src = _as_bytes(src)
    if dst.dtype != np.uint8 or dst.shape != src.shape:
        raise ValueError(f"xxh64_copy: destination is {dst.dtype}{dst.shape}, expected uint8{src.shape}")
    return int(_xxh64_copy_impl(src, dst, np.uint64(seed)))


def warmup() -> None:
    """Compile (or load from cache) the kernels with the argument types the engine uses."""
    xxh64(np.zeros(40, np.uint8))
    xxh64_copy(np.zeros(40, np.uint8), np.zeros(40, np.uint8))
