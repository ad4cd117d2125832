"""One helper for every cross-rank step: named int64 records gathered, one rank's error every rank's.

In the spirit of DCP's ``_DistWrapper``: the device is chosen once (CUDA when the group's backend is
nccl, else CPU), every operation is the identity in a world of one (no process group initialised,
or a group of one rank), and callers speak in field names, never in positions of a packed vector.
Records hold Python ints that fit an int64; callers convert unsigned 64-bit values themselves.

Agreements cost O(1) bytes per rank at any world size: one all-reduce of a count when every rank
succeeded, a few more (one per failed rank named, at most ``NAMED``) when some did not; nothing gathers
a row per rank of the world.  ``gather``/``gather_many`` move a row per rank and are meant for small
groups (a replication clique), never the world of a large job.

Every operation is a collective: every rank of the group calls it, in the same order, exactly once
per step.  Thread-safety: a ``Collective`` holds no mutable state; the calls on one group must come
from one thread at a time (as for any ``torch.distributed`` group).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping, Sequence

import torch

from ..errors import CheckpointError, error_class_named, make_error

__all__ = ["Collective", "RankFailure", "NAMED"]

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
NAMED = 8  # failed ranks an agreement names (the lowest); the rest are counted
_MESSAGE_BYTES = 4096  # the error broadcast by agree_error: one JSON line, shortened to fit


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What every rank learns when some rank failed: the lowest failed ranks (at most ``NAMED``), the
    errors of the first of them (as many as the caller asked for), and how many ranks failed."""

    ranks: tuple[int, ...]  # the lowest failed ranks, ascending
    errors: tuple[tuple[int, str, str], ...]  # (rank, exception class name, message) of the first ones
    count: int = 0  # every failed rank (0: as many as ``ranks``)

    @property
    def failed(self) -> int:
        """How many ranks failed."""
        return max(self.count, len(self.ranks))

    @property
    def rank(self) -> int:
        return self.errors[0][0]

    @property
    def error(self) -> str:
        return self.errors[0][1]

    @property
    def message(self) -> str:
        return self.errors[0][2]

    def error_class(self) -> type[CheckpointError]:
        """The package's exception class the reported errors share, whichever module defines it
        (``CheckpointError`` when they differ or are not ours)."""
        names = {e[1] for e in self.errors}
        return error_class_named(names.pop()) if len(names) == 1 else CheckpointError

    def to_error(self, what: str) -> CheckpointError:
        """One error for every rank: ``what`` failed on these ranks, with each reported rank's
        message (each names its file, rank and tensor), under the errors' common class.  Every
        failed rank is counted once: named in the list, or in its "and N more"."""
        ranks = f"{list(self.ranks)}"
        if self.failed > len(self.ranks):
            ranks += f" and {self.failed - len(self.ranks)} more ({self.failed} in all)"
        detail = "; ".join(f"[rank {src}] {text}" for src, _, text in self.errors)
        return make_error(self.error_class(), f"{what} failed on rank(s) {ranks}: {detail}")


class Collective:
    """Collectives over ``group`` (``None``: the default group) of ``torch.distributed``.

    Without an initialised process group, or in a group of one rank, ``rank`` is 0 (the group's
    rank otherwise), ``world_size`` is 1 and every operation returns this rank's own value."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self.group = group
        self._active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self._active else 0
        self.world_size = dist.get_world_size(group) if self._active else 1
        self.device = torch.device("cpu")
        if self._active and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def active(self) -> bool:
        """Whether the operations talk to other ranks (False: a world of one)."""
        return self._active

    # ------------------------------------------------------------------ records
    def gather(self, record: Mapping[str, int]) -> list[dict[str, int]]:
        """Every rank's ``record`` (same field names on every rank, checked), in rank order."""
        return [rows[0] for rows in self.gather_many([record], fields=tuple(record), capacity=1)]

    def gather_many(
        self, records: Sequence[Mapping[str, int]], *, fields: Sequence[str], capacity: int
    ) -> list[list[dict[str, int]]]:
        """Every rank's list of at most ``capacity`` records with these ``fields``, in rank order."""
        fields = tuple(fields)
        if len(records) > capacity:
            raise ValueError(f"rank {self.rank}: {len(records)} records to gather, at most {capacity}")
        width = len(fields)
        schema = zlib.crc32(",".join(fields).encode("utf-8"))
        values = [schema, len(records)]
        for i, rec in enumerate(records):
            if set(rec) != set(fields):
                raise ValueError(f"rank {self.rank}: record {i} has fields {sorted(rec)}, expected {list(fields)}")
            for name in fields:
                v = rec[name]
                if not isinstance(v, int) or not _I64_MIN <= v <= _I64_MAX:
                    raise ValueError(f"rank {self.rank}: field {name!r} = {v!r} is not an int64")
                values.append(v)
        values += [0] * (width * (capacity - len(records)))
        mine = torch.tensor(values, dtype=torch.int64)
        rows = [v.tolist() for v in self._all_gather(mine)]
        bad = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]  # the same list on every rank
        if bad:
            raise CheckpointError(
                f"rank {self.rank}: rank(s) {bad} gathered other fields than rank 0 "
                f"(this rank's: {list(fields)}; a version mismatch?)"
            )
        return [[dict(zip(fields, row[2 + k * width : 2 + (k + 1) * width])) for k in range(row[1])] for row in rows]

    def broadcast(self, value: int, src: int = 0) -> int:
        """Rank ``src``'s int64 ``value`` on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        return int(self._broadcast(t, src)[0])

    # ------------------------------------------------------------------ agreement
    def min_max(self, value: int) -> tuple[int, int]:
        """The least and the greatest int64 ``value`` of the group's ranks (one all-reduce)."""
        if value == _I64_MIN:
            raise ValueError(f"rank {self.rank}: {value} has no negation in an int64")
        got = self._all_reduce("MIN", torch.tensor([value, -value], dtype=torch.int64))
        return int(got[0]), -int(got[1])

    def agree(self, ok: bool) -> list[int]:
        """Every rank says whether its step succeeded; returns the lowest failed ranks, at most
        ``NAMED`` (on every rank).  :meth:`failures` also says how many failed."""
        return self.failures(ok)[0]

    def failures(self, ok: bool) -> tuple[list[int], int]:
        """``(the lowest failed ranks, at most NAMED; how many ranks failed)``: one all-reduce of the
        count, then one all-reduce (a minimum) per failed rank named."""
        failed = not ok
        count = int(self._all_reduce("SUM", torch.tensor([int(failed)], dtype=torch.int64))[0])
        named: list[int] = []
        for _ in range(min(count, NAMED)):
            mine = self.rank if failed and self.rank not in named else _I64_MAX
            named.append(int(self._all_reduce("MIN", torch.tensor([mine], dtype=torch.int64))[0]))
        return named, count

    def agree_error(self, err: BaseException | None, report: int = 1) -> RankFailure | None:
        """Make one rank's error every rank's: ``None`` when no rank failed; else the failed ranks
        and the error class and message of the first ``report`` of them (each broadcast as one JSON
        line, no pickle).  The caller raises: its own ``err`` where it has one, else from the failure."""
        failed, count = self.failures(err is None)
        if not count:
            return None
        mine = {"error": type(err).__name__, "message": str(err)} if err is not None else {}
        reported = []
        for src in failed[: max(1, report)]:
            doc = (self._broadcast_json(mine if self.rank == src else {}, src)) if self._active else mine
            reported.append((src, str(doc.get("error")), str(doc.get("message"))))
        return RankFailure(tuple(failed), tuple(reported), count)

    def raise_agreed(self, err: BaseException | None, what: str, *, report: int = 1, own: bool = True) -> None:
        """Agree on the step's outcome, then raise on every rank if any rank failed: a failed rank
        raises its own ``err`` (``own``) and every other rank :meth:`RankFailure.to_error` of the first
        ``report`` failed ranks (with ``own=False`` every rank raises that one, from its own ``err``).
        Returns only when every rank succeeded.  In a world of one, ``err`` itself."""
        failure = self.agree_error(err, report)
        if failure is None:
            return
        if err is not None and (own or not self._active):
            raise err
        raise failure.to_error(what) from err

    # ------------------------------------------------------------------ transport
    def _all_gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        if not self._active:
            return [mine]
        import torch.distributed as dist

        mine = mine.to(self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        return [r.cpu() for r in rows]

    def _all_reduce(self, op: str, t: torch.Tensor) -> torch.Tensor:
        if not self._active:
            return t
        import torch.distributed as dist

        t = t.to(self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.group)
        return t.cpu()

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if not self._active:
            return t
        import torch.distributed as dist

        t = t.to(self.device)
        dist.broadcast(t, src=self._global_rank(src), group=self.group)
        return t.cpu()

    def _global_rank(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _broadcast_json(self, doc: dict, src: int) -> dict:
        """Rank ``src``'s ``doc`` (string values; a too long ``message`` is shortened to fit)."""
        raw = json.dumps(doc).encode("utf-8")
        while len(raw) > _MESSAGE_BYTES:  # keep the JSON whole: shorten the message
            doc["message"] = doc["message"][: len(doc["message"]) // 2] + " ..."
            raw = json.dumps(doc).encode("utf-8")
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        got = self._broadcast(buf, src)
        return json.loads(bytes(got.tolist()).rstrip(b"\0").decode("utf-8"))
