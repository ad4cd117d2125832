"""CRC32s of a multipart object from the CRC32s of its parts, computed in parallel.

S3's additional checksums verify what it received: each part's CRC32 (``x-amz-checksum-crc32``) and
the object's ``COMPOSITE`` checksum, the CRC32 of the parts' CRC32s (:func:`composite_crc32`), which
the store reports and we compare.  The parts are hashed on the threads that send them; the whole
object's plain CRC32 (kept in the receipt) is combined from theirs: ``crc32_combine`` as zlib does
it (multiplication by ``x^(8n)`` modulo the CRC polynomial), about 1k integer operations per part.
"""

from __future__ import annotations

import base64
import zlib

__all__ = ["crc32_combine", "crc32_of_parts", "composite_crc32", "crc32_b64", "crc32_from_b64"]

_POLY = 0xEDB88320  # reflected CRC-32 polynomial
_TOP = 1 << 31  # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (reflected representation), as zlib's ``multmodp``."""
    m, p = _TOP, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, table = _TOP >> 1, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial


def _x2nmodp(n: int, k: int) -> int:
    """``x^(n * 2^k)`` modulo the polynomial."""
    p = _TOP
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


def crc32_of_parts(parts: list[tuple[int, int]]) -> int:
    """The CRC32 of the concatenation of parts given as ``(crc32, length)``, in order."""
    crc = 0
    for c, n in parts:
        crc = crc32_combine(crc, c, n)
    return crc


def composite_crc32(part_crcs: list[int]) -> int:
    """An S3 ``COMPOSITE`` CRC32 checksum: the CRC32 of the parts' CRC32s, 4 big-endian bytes each, in
    part order (reported as ``base64-N``, N the number of parts)."""
    return zlib.crc32(b"".join(c.to_bytes(4, "big") for c in part_crcs))


def crc32_b64(crc: int) -> str:
    """As S3 writes a CRC32: the 4 big-endian bytes in base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def crc32_from_b64(text: str) -> int | None:
    """The CRC32 S3 reported (a composite's ``-N`` suffix dropped), ``None`` when it is not one."""
    try:
        raw = base64.b64decode(text.rpartition("-")[0] if "-" in text else text, validate=True)
    except (ValueError, TypeError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None
