"""Rank-0-rooted agreement over the c10d key-value store: O(N) on rank 0, O(1) on every other rank.

The commit of a checkpoint needs one small status from every rank on rank 0 and one small outcome
from rank 0 on every rank -- not every rank's status on every rank.  :class:`StoreChannel` does
exactly that through the store the job already has (``torch.distributed``'s default store, a
``TCPStore`` served by rank 0), on a connection of its own (``Store.clone``) so that a wait here never
holds the lock of the client that process-group creation and NCCL's start-up use, and so that it
never interleaves with a training collective.  No process group of our own, hence no gloo full mesh.

One round of :meth:`gather`: every rank appends its packed record (``8 * (2 + fields)`` bytes) to one
key and adds 1 to a counter; the rank whose add completes the count sets a "ready" key; rank 0 waits
for it and reads the one value holding every record (then removes the round's keys).  One round of
:meth:`broadcast`: rank 0 sets a JSON document of at most :data:`MAX_OUTCOME_BYTES`; every other
rank waits for it and reads it.  A document is removed by rank 0 at its next gather, which no rank
can join before it has read every earlier document.

Every operation is a collective of the channel: every rank calls it, in the same order.  In a world
of one (no store) each returns this rank's own value.  Thread-safety: one thread uses a channel.
"""

from __future__ import annotations

import datetime
import json
import struct
import time
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import CheckpointError, CommitError

__all__ = ["StoreChannel", "MAX_OUTCOME_BYTES", "default_store"]

MAX_OUTCOME_BYTES = 2048  # a broadcast document, as JSON
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def default_store():
    """A new client of ``torch.distributed``'s default store (``None`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store().clone()


class StoreChannel:
    """Gather to rank 0 and broadcast from rank 0 over ``store`` (keys under ``prefix``).

    ``store``: a ``torch.distributed.Store`` (or anything with ``append``, ``add``, ``set``,
    ``get``, ``wait``, ``delete_key``), ``None`` in a world of one.  ``sent``/``received``: the bytes
    this rank moved through the store (keys and values), for benchmarks."""

    def __init__(self, store, rank: int, world_size: int, prefix: str, timeout_s: float) -> None:
        if store is None and world_size != 1:
            raise ValueError(f"rank {rank}: a channel over {world_size} ranks needs a store")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.sent = 0
        self.received = 0
        self._round = 0
        self._stale: list[str] = []  # documents rank 0 removes at its next gather
        self._own: dict[str, bytes] = {}  # standing values in a world of one (no store)
        self._gone: frozenset[int] = frozenset()  # ranks that will never send again (:meth:`forget`)
        self.filled: frozenset[int] = frozenset()  # rank 0: the gone ranks its last gather filled in

    @property
    def gone(self) -> frozenset[int]:
        """The ranks :meth:`forget` was told of (each call adds to them)."""
        return self._gone

    def forget(self, ranks) -> None:
        """``ranks`` will never send again: their processes died, and an in-process restart went on
        without them.  From now on rank 0's gathers stop waiting for them and count each as a
        record of zeros (a failed status: the round's checkpoint is abandoned on every rank), and a
        gather rank 0 is blocked in is woken.  Safe from another thread than the one gathering.
        Not handled: rank 0 itself gone (the others' waits for its outcome run to the timeout)."""
        new = frozenset(r for r in ranks if r != self.rank and 0 <= r < self.world_size) - self._gone
        if not new:
            return
        self._gone |= new
        if self.active and self.is_root:
            # the round it may be blocked in re-checks; on a connection of its own (a client's
            # calls queue behind the wait blocked on it)
            waker = self.store.clone() if hasattr(self.store, "clone") else self.store
            waker.set(self._key("ready"), b"1")

    @property
    def active(self) -> bool:
        return self.store is not None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _key(self, what: str) -> str:
        return f"{self.prefix}/{self._round}/{what}"

    def _wait(self, key: str, what: str) -> None:
        try:
            self.store.wait([key], self.timeout)
        except Exception as e:  # noqa: BLE001 - the store's timeout is a RuntimeError/DistStoreError
            raise CommitError(
                f"rank {self.rank}: {what}: no answer through the store within "
                f"{self.timeout.total_seconds():.0f}s ({type(e).__name__}: {e}); a rank may have died"
            ) from e

    # ------------------------------------------------------------------ gather
    def gather(self, record: Mapping[str, int], fields: Sequence[str]) -> dict[str, np.ndarray] | None:
        """Rank 0: every rank's ``record`` (with these ``fields``) as one int64 array per field, in
        rank order (``columns[field][rank]``); others: ``None``."""
        fields = tuple(fields)
        if set(record) != set(fields):
            raise ValueError(f"rank {self.rank}: record has fields {sorted(record)}, expected {list(fields)}")
        values = [record[f] for f in fields]
        for name, v in zip(fields, values):
            if not isinstance(v, int) or not _I64_MIN <= v <= _I64_MAX:
                raise ValueError(f"rank {self.rank}: field {name!r} = {v!r} is not an int64")
        schema = zlib.crc32(",".join(fields).encode("utf-8"))
        if not self.active:
            self._round += 1
            return {f: np.array([record[f]], dtype=np.int64) for f in fields}
        row = struct.pack(f"<2q{len(fields)}q", self.rank, schema, *values)
        rows_key, count_key, ready_key = self._key("rows"), self._key("count"), self._key("ready")
        self.store.append(rows_key, row)
        self.sent += len(rows_key) + len(row) + len(count_key) + 8
        arrived = self.store.add(count_key, 1)
        self.received += 8
        if arrived == self.world_size:
            self.store.set(ready_key, b"1")
            self.sent += len(ready_key) + 1
        if not self.is_root:
            self._round += 1
            return None
        self.filled = frozenset()
        deadline = time.monotonic() + self.timeout.total_seconds()
        if not self._gone:
            self._wait(ready_key, f"gathering round {self._round} of {self.prefix}")
        # woken by forget(), or ranks gone before: which rows came is checked
        raw = self._without_the_gone(rows_key, fields, schema, deadline) if self._gone else self.store.get(rows_key)
        self.sent += len(ready_key) + len(rows_key)
        self.received += len(raw)
        for key in (rows_key, count_key, ready_key, *self._stale):
            self.store.delete_key(key)
        self._stale.clear()
        self._round += 1
        return _unpack(raw, fields, schema, self.world_size, self.prefix)

    def _without_the_gone(self, rows_key: str, fields: tuple, schema: int, deadline: float) -> bytes:
        """Rank 0, once ranks are gone: the round's rows when every other rank has sent its own,
        with a row of zeros for each gone rank that did not (:attr:`filled`; polled: a wait would
        need every key)."""
        width = 8 * (2 + len(fields))
        while True:
            raw = self.store.get(rows_key)
            sent = {int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), width)}
            missing = set(range(self.world_size)) - sent
            if missing <= self._gone:
                zeros = b"".join(struct.pack(f"<2q{len(fields)}q", r, schema, *[0] * len(fields)) for r in missing)
                self.filled = frozenset(missing)
                return raw + zeros
            if time.monotonic() > deadline:
                raise CommitError(
                    f"rank 0: gathering round {self._round} of {self.prefix}: no answer from rank(s) "
                    f"{sorted(missing - self._gone)[:8]} within {self.timeout.total_seconds():.0f}s; a rank may have died"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ standing values
    def publish(self, name: str, value: bytes) -> None:
        """Set this rank's standing value ``name`` (kept in the store until replaced: for data a
        rank sends once and rank 0 re-reads only when told it changed).  Not a collective."""
        if not self.active:
            self._own[name] = bytes(value)
            return
        key = f"{self.prefix}/{name}/{self.rank}"
        self.store.set(key, value)
        self.sent += len(key) + len(value)

    def fetch(self, name: str, ranks: Sequence[int]) -> list[bytes]:
        """Rank 0: the standing values ``name`` of ``ranks`` (one store call)."""
        if not self.active:
            return [self._own.get(name, b"") for _ in ranks]
        keys = [f"{self.prefix}/{name}/{r}" for r in ranks]
        values = self.store.multi_get(keys) if keys else []
        self.sent += sum(map(len, keys))
        self.received += sum(map(len, values))
        return values

    # ------------------------------------------------------------------ scatter
    def scatter(self, docs: dict[int, dict] | None, expect: bool) -> dict | None:
        """Rank 0 sends ``docs[r]`` (JSON-able) to each rank ``r`` it names, in one store call;
        a rank that ``expect``s a document (rank 0 included, when it names itself) gets its own,
        the others ``None``.  Each receiver removes its key once read."""
        key_of = f"{self.prefix}/{self._round}/to/{{}}".format
        self._round += 1
        if not self.active:
            return docs.get(0) if expect else None
        if self.is_root:
            others = {r: json.dumps(d, sort_keys=True).encode("utf-8") for r, d in docs.items() if r != 0}
            if others:
                keys = [key_of(r) for r in others]
                self.store.multi_set(keys, list(others.values()))
                self.sent += sum(map(len, keys)) + sum(map(len, others.values()))
            return docs.get(0) if expect else None
        if not expect:
            return None
        key = key_of(self.rank)
        self._wait(key, f"waiting for rank 0's document ({self.prefix})")
        raw = self.store.get(key)
        self.store.delete_key(key)
        self.sent += 3 * len(key)
        self.received += len(raw)
        return json.loads(raw.decode("utf-8"))

    # ------------------------------------------------------------------ broadcast
    def broadcast(self, doc: dict | None, limit: int | None = MAX_OUTCOME_BYTES) -> dict:
        """Rank 0's ``doc`` (JSON-able, at most ``limit`` bytes as JSON; ``None``: any size) on
        every rank."""
        key = self._key("outcome")
        self._round += 1
        if not self.active:
            return doc
        if self.is_root:
            raw = json.dumps(doc, sort_keys=True).encode("utf-8")
            if limit is not None and len(raw) > limit:
                raise ValueError(f"rank 0: outcome of {len(raw)} bytes, at most {limit}")
            self.store.set(key, raw)
            self.sent += len(key) + len(raw)
            self._stale.append(key)
            return doc
        self._wait(key, f"waiting for rank 0's outcome ({self.prefix})")
        raw = self.store.get(key)
        self.sent += 2 * len(key)  # the wait and the get name the key
        self.received += len(raw)
        return json.loads(raw.decode("utf-8"))


def _unpack(raw: bytes, fields: tuple[str, ...], schema: int, world_size: int, where: str) -> dict[str, np.ndarray]:
    """The gathered records, one column per field in rank order (numpy: O(N) without a Python loop)."""
    width = 2 + len(fields)
    if len(raw) != 8 * width * world_size:
        raise CheckpointError(
            f"rank 0: {where}: gathered {len(raw)} bytes, expected {world_size} records of {8 * width} "
            "(a rank of another version, or a rank that joined twice?)"
        )
    table = np.frombuffer(raw, dtype="<i8").reshape(world_size, width)
    bad = np.flatnonzero(table[:, 1] != schema)
    if bad.size:
        raise CheckpointError(
            f"rank 0: {where}: rank(s) {table[bad[:8], 0].tolist()} sent other fields than {list(fields)} "
            "(a version mismatch?)"
        )
    table = table[np.argsort(table[:, 0], kind="stable")]
    if not np.array_equal(table[:, 0], np.arange(world_size)):
        raise CheckpointError(f"rank 0: {where}: the records are not one per rank 0..{world_size - 1}")
    return {f: np.ascontiguousarray(table[:, 2 + k]) for k, f in enumerate(fields)}
