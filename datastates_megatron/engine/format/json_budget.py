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

Stateless; thread-safe.
"""

from __future__ import annotations

from ..errors import CorruptCheckpointError

__all__ = ["VALUE_BYTES", "count_values", "check_budget"]

VALUE_BYTES = 100  # the most memory one parsed JSON value (with its slot in its container) costs
_WINDOW = 16 << 20


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
