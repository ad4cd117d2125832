"""Load plans: which element ranges of which rank files go to which live tensors, plus the non-tensor
state the load returns; the planner interface, and the same-layout planner.

As in ``torch.distributed.checkpoint``, a load is a plan executed by one verifying reader
(:class:`.reader.CheckpointReader`): restoring into the layout that wrote the checkpoint and
resharding it (``megatron.reshard.ReshardPlanner``) differ only in their planner.  A planner looks at
the checkpoint through the reader (manifest, rank files' indexes and objects) and never writes; the
reader validates and verifies the whole plan before the first byte reaches a destination.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

import torch

from ..errors import LayoutMismatchError
from ..format.manifest import Manifest

if TYPE_CHECKING:
    from .reader import CheckpointReader

__all__ = ["ElementRange", "ReadItem", "LoadPlan", "LoadPlanner", "SameLayoutPlanner", "validate_world"]


@dataclasses.dataclass(frozen=True)
class ElementRange:
    """Elements ``[start, start + count)`` of the flattened tensor ``tensor`` in rank ``rank``'s file."""

    rank: int
    tensor: str
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """``source`` goes to ``dest``: a live tensor of ``source.count`` elements of the source's dtype
    (any shape), written in place.  ``label`` names the destination in messages."""

    source: ElementRange
    dest: torch.Tensor
    label: str = ""


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Everything one rank's load reads and writes.  ``kind`` names the planner that made it;
    ``objects`` is the non-tensor state the load returns (as the planner prepared it)."""

    kind: str
    items: tuple[ReadItem, ...]
    objects: object = None

    @property
    def ranks(self) -> list[int]:
        """The rank files the plan reads."""
        return sorted({it.source.rank for it in self.items})


class LoadPlanner(abc.ABC):
    """Makes this rank's :class:`LoadPlan` for one checkpoint.  ``reads_all_ranks``: the plan may
    read any rank's file (so it needs a tier whose manifest lists every rank)."""

    kind: str = ""
    reads_all_ranks: bool = False

    @abc.abstractmethod
    def plan(self, reader: "CheckpointReader") -> LoadPlan:
        """The plan; raises a ``CheckpointError`` (naming file, rank, tensor) when none fits."""


def validate_world(manifest: Manifest, ckpt: str, world_size: int, layout: dict) -> None:
    """Raise :class:`LayoutMismatchError` naming every difference between the checkpoint and this world."""
    diffs = []
    if manifest.world_size != world_size:
        diffs.append(f"world size {manifest.world_size} in checkpoint, {world_size} now")
    for key in sorted(set(manifest.layout) | set(layout)):
        if manifest.layout.get(key) != layout.get(key):
            diffs.append(f"{key}={manifest.layout.get(key)!r} in checkpoint, {layout.get(key)!r} now")
    if diffs:
        raise LayoutMismatchError(f"{ckpt}: checkpoint layout differs from this run: " + "; ".join(diffs))


class SameLayoutPlanner(LoadPlanner):
    """Every registered tensor from the tensor of the same name in this rank's own file, whole: the
    checkpoint must come from this world (size and ``layout``) and hold exactly these tensors, with
    these dtypes and shapes."""

    kind = "same_layout"

    def __init__(self, targets: dict[str, torch.Tensor], world_size: int, layout: dict) -> None:
        self.targets = dict(targets)
        self.world_size = world_size
        self.layout = dict(layout)

    def plan(self, reader: "CheckpointReader") -> LoadPlan:
        validate_world(reader.manifest, reader.ckpt, self.world_size, self.layout)
        rank = reader.rank
        rf = reader.rank_file(rank)
        self.check_tensor_set(rf.path, rf.entries, rank)
        items = tuple(
            ReadItem(ElementRange(rank, name, 0, dst.numel()), dst, name) for name, dst in self.targets.items()
        )
        return LoadPlan(self.kind, items, rf.objects["objects"])

    def matches(self, entries: dict) -> bool:
        """Whether a file with these index ``entries`` holds exactly the registered tensors."""
        return set(entries) == set(self.targets) and all(
            entries[n].dtype == t.dtype and entries[n].shape == tuple(t.shape) for n, t in self.targets.items()
        )

    def check_tensor_set(self, path: str, entries: dict, rank: int) -> None:
        missing = sorted(set(self.targets) - set(entries))
        extra = sorted(set(entries) - set(self.targets))
        problems = []
        if missing:
            problems.append(f"missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            problems.append(f"not expected by this model: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        for name in sorted(set(self.targets) & set(entries)):
            e, t = entries[name], self.targets[name]
            if e.dtype != t.dtype or e.shape != tuple(t.shape):
                problems.append(
                    f"tensor {name!r}: checkpoint has {e.dtype} {list(e.shape)}, model has {t.dtype} {list(t.shape)}"
                )
        if problems:
            raise LayoutMismatchError(f"{path}: rank {rank}: " + "; ".join(problems[:8]))
