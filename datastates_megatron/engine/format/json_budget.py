"""A cheap count before a costly parse: JSON whose parse would cost far more memory than its bytes.

``json.loads`` of 64 MiB of ``[{},{},...]`` builds 22 million dicts (~2 GB) before any check of
ours can run, and a checksum does not help against a file whose author recomputed it.  What a
parse costs is bounded by the number of values it creates -- at most ~100 bytes each (a one-key
dict in a list) -- and every value but the first of an array or object follows a ``,``, and
every container starts with ``[`` or ``{``.  So ``count(",") + count("[") + count("{")`` (a byte
scan, ~0.1 s per 64 MiB, in place for bytes; 16 MiB windows of a mapping) bounds the parse's memory before it
starts: a text above ``values_per_byte`` of its length (plus a fixed allowance for small texts)
is refused.  The counts also include commas and brackets inside strings, so they only
over-estimate: a refusal is never a parse that would have been cheap by far.

Values are not the only cost.  Python stores a string at 1, 2 or 4 bytes per character, by its
widest one: a 64 MiB string ending in one character past the BMP costs 256 MiB parsed, and as much
again when the whole text is decoded first.  Every JSON text we write escapes what is not ASCII
(``json.dumps``' default), so :class:`DecodeBudget` refuses one that is not ASCII, counts the
strings holding an escape of a character past Latin-1 at 4 bytes per character, and adds the costs
of every text of one file, so that many texts each under the count cannot add up to a multiple of
the file: what the parse of a file's texts makes beyond the bytes of its text and of its strings'
characters stays under :data:`DECODED_MAX` (docs/reliability.md: 64 MiB + 2x the file).

:func:`count_values` and :func:`check_budget` are stateless; a :class:`DecodeBudget` belongs to
the one reader of one file.
"""

from __future__ import annotations

import functools
import re

from ..errors import CorruptCheckpointError

__all__ = ["VALUE_BYTES", "DECODED_MAX", "count_values", "check_budget", "DecodeBudget", "wide_string_bytes"]

VALUE_BYTES = 100  # the most memory one parsed JSON value (with its slot in its container) costs
DECODED_MAX = 48 << 20  # what the parse of one file's texts may make beyond one byte per character
_WINDOW = 16 << 20
MiB = 1 << 20
# an escape of a character past Latin-1 (its string is then stored at 2 or 4 bytes per character);
# also matches an escaped backslash followed by "u....": an over-estimate, never an under-estimate
_WIDE_ESCAPE = re.compile(rb"\\u(?!00)[0-9a-fA-F]{4}")


def count_values(data) -> int:
    """An upper bound on the JSON values in ``data`` (bytes-like): counted in place for bytes and
    bytearray, over copied 16 MiB windows for any other buffer (a mapping)."""
    if isinstance(data, (bytes, bytearray)):
        return 1 + data.count(b",") + data.count(b"[") + data.count(b"{")
    view = memoryview(data).cast("B")
    total = 1
    for start in range(0, len(view), _WINDOW):
        part = bytes(view[start : start + _WINDOW])
        total += part.count(b",") + part.count(b"[") + part.count(b"{")
    return total


def check_budget(data, min_bytes_per_value: int, allowance: int, path: str, what: str) -> None:
    """Refuse (:class:`CorruptCheckpointError` naming ``path``) a JSON text ``data`` with more than
    ``len(data) // min_bytes_per_value + allowance`` values, before it is parsed: its parse then
    costs at most ``VALUE_BYTES`` per value."""
    values = count_values(data)
    limit = len(data) // min_bytes_per_value + allowance
    if values > limit:
        raise CorruptCheckpointError(
            f"{path}: {what} holds up to {values} JSON values in {len(data)} bytes, more than the {limit} "
            f"one we write could hold (one per {min_bytes_per_value} bytes); refusing to parse it "
            f"(it would take ~{values * VALUE_BYTES >> 20} MiB)"
        )


class DecodeBudget:
    """What parsing the JSON texts of one file (``path``) may cost, in all: :meth:`text` checks
    each text's bytes before it is decoded and charges its cost (:data:`VALUE_BYTES` per value, 3
    more bytes per character of a string stored wide); past ``limit`` the file is refused."""

    def __init__(self, path: str, limit: int = DECODED_MAX, value_bytes: int = VALUE_BYTES) -> None:
        # value_bytes 0: a file whose values :func:`check_budget` bounds by its own density (a manifest)
        self.path, self.limit, self.value_bytes, self.spent = path, limit, value_bytes, 0

    def text(self, raw, what: str) -> str:
        """``raw`` (bytes-like; a mapping's view is not copied) as the text to parse, refused
        (:class:`CorruptCheckpointError` naming the file and ``what``) when it is not ASCII or would
        take the file past the limit.  The caller drops ``raw`` before parsing: the bytes and the
        parse are never held at once."""
        if not _is_ascii(raw):
            raise CorruptCheckpointError(
                f"{self.path}: {what} is not ASCII (every JSON text we write escapes the rest); refusing to parse it"
            )
        cost = (count_values(raw) * self.value_bytes if self.value_bytes else 0) + 3 * wide_string_bytes(raw)
        if self.spent + cost > self.limit:
            raise CorruptCheckpointError(
                f"{self.path}: {what} would take ~{cost / MiB:.1f} MiB to parse (after {self.spent / MiB:.1f} MiB for "
                f"the file's other texts), more than the {self.limit / MiB:.0f} MiB one we write could; refusing to parse it"
            )
        self.spent += cost
        return str(raw, "ascii")


def _is_ascii(raw) -> bool:
    if isinstance(raw, (bytes, bytearray)):
        return raw.isascii()
    import numpy as np

    view = np.frombuffer(raw, dtype=np.uint8)  # in place
    return not view.size or int(view.max()) < 128


def wide_string_bytes(raw) -> int:
    """An upper bound on the characters of the strings of JSON text ``raw`` that hold an escape of
    a character past Latin-1 (their bytes): 0 at once when there is no such escape."""
    if _WIDE_ESCAPE.search(raw) is None:
        return 0
    import numpy as np

    return int(_wide_kernel()(np.frombuffer(raw, dtype=np.uint8)))


@functools.cache
def _wide_kernel():
    """:func:`_wide_strings` compiled (numba, cached) on first use: rare, and not on every import."""
    import numba

    return numba.njit(nogil=True, cache=True)(_wide_strings)


def _wide_strings(text):
    """The bytes of the strings of ``text`` holding a ``\\u`` escape not of ``00..``: one pass, as
    JSON reads strings (a backslash takes the next byte with it; outside a string none is valid)."""
    total = 0
    i = 0
    n = text.shape[0]
    while i < n:
        if text[i] != 34:  # '"': a string opens
            i += 1
            continue
        start = i
        wide = False
        i += 1
        while i < n and text[i] != 34:
            if text[i] == 92:  # '\\': an escape
                if i + 3 < n and text[i + 1] == 117 and (text[i + 2] != 48 or text[i + 3] != 48):
                    wide = True
                i += 2
            else:
                i += 1
        if wide:
            total += i - start
        i += 1
    return total
