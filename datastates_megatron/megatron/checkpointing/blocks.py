"""Where a parameter sits in megatron-core's global tensors (identity 3 ``global``), and the two
questions a reshard asks of those blocks: which old elements a new block's element range reads
(:func:`block_segments`), and whether the old blocks are fit to read at all.

The blocks come from the checkpoint's files, so they are checked before any is read from: each one
on its own (:func:`record_problem`: in bounds, no negative size, its pieces the parameter's own
elements) and all the blocks of one global tensor together (:func:`tiling_problem`: replicas aside,
disjoint and covering it exactly).  A load that trusted them would read one rank's rows into
another's place, or leave rows that no file holds -- and megatron-core's ``allow_shape_mismatch``
would zero them as if they were vocabulary padding.

Pure functions of their arguments: thread-safe.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["Block", "blocks_of", "block_segments", "record_problem", "tiling_problem"]


@dataclasses.dataclass(frozen=True)
class Block:
    """Where one parameter sits in megatron-core's global tensor ``key`` (identity 3 ``global``):
    the parameter's flattened elements ``[start, start + size)`` are the flattened block ``[offset,
    offset + shape)`` of ``global_shape`` (``start`` 0 and the whole parameter, but for a piece of a
    ``ShardedTensorFactory`` such as a fused GLU weight's ``w`` and ``v`` halves)."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    mismatch: bool  # allow_shape_mismatch: the global shape follows the vocabulary padding
    start: int = 0

    @property
    def size(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n

    @classmethod
    def of(cls, value) -> "Block":
        key, global_shape, offset, shape, *rest = value
        t = lambda xs: tuple(int(x) for x in xs)  # noqa: E731
        mismatch = bool(rest[0]) if rest else False
        return cls(str(key), t(global_shape), t(offset), t(shape), mismatch, int(rest[1]) if len(rest) > 1 else 0)


def blocks_of(value) -> tuple[Block, ...]:
    """The blocks of one parameter's recorded ``global``: one ``[key, ...]``, or a list of them (the
    pieces of a ``ShardedTensorFactory``, each with the parameter element it starts at)."""
    if value and isinstance(value[0], (list, tuple)):
        return tuple(Block.of(v) for v in value)
    return (Block.of(value),)


def _ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    out = 0
    for i, n in zip(index, shape):
        out = out * n + i
    return out


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def block_segments(new: Block, olds: list, start: int, end: int) -> tuple[list, list]:
    """How elements ``[start, end)`` of the flattened block ``new`` come from the flattened old
    blocks ``olds`` (``[(name, Block)]``, same global key): ``(segments, gaps)``, ``segments``
    ``[(name, old start, old end, position relative to start)]`` in order, ``gaps`` ``[(a, b)]``
    (relative positions) that no old block holds -- rows past the old vocabulary padding.  Where old
    blocks overlap (a tied embedding's copies) the first by name is read.  Every block is split on
    at most the axes megatron-core fragments; the walk goes by runs of the last axis any block
    splits, so its cost is the number of such runs in ``[start, end)``, not of elements."""
    nd = len(new.shape)
    split = [ax for ax in range(nd) if new.shape[ax] != new.global_shape[ax]]
    split += [ax for _, ob in olds for ax in range(nd) if ob.shape[ax] != new.global_shape[ax]]
    f = max(split, default=0)
    inner = 1
    for n in new.shape[f + 1 :]:
        inner *= n
    # the old blocks that meet the new one on every axis before f, in name order
    cands = sorted(
        (
            (name, ob)
            for name, ob in olds
            if all(
                ob.offset[ax] < new.offset[ax] + new.shape[ax] and new.offset[ax] < ob.offset[ax] + ob.shape[ax]
                for ax in range(f)
            )
        ),
        key=lambda c: c[0],
    )
    row_len = new.shape[f] * inner
    segments, gaps = [], []
    if start >= end:
        return segments, gaps
    n0, n1 = new.offset[f], new.offset[f] + new.shape[f]
    for row in range(start // row_len, (end - 1) // row_len + 1):
        outer = tuple(o + i for o, i in zip(new.offset[:f], _unravel(row, new.shape[:f])))
        spans = []
        for name, ob in cands:
            if not all(ob.offset[ax] <= outer[ax] < ob.offset[ax] + ob.shape[ax] for ax in range(f)):
                continue
            lo, hi = max(n0, ob.offset[f]), min(n1, ob.offset[f] + ob.shape[f])
            if lo < hi:
                spans.append((lo, -hi, name, ob))
        spans.sort(key=lambda s: (s[0], s[1]))
        pos = n0
        pieces = []
        for lo, neg_hi, name, ob in spans:
            hi = -neg_hi
            if hi <= pos:
                continue
            if lo > pos:
                pieces.append((None, pos, lo))
            lo = max(lo, pos)
            pieces.append(((name, ob), lo, hi))
            pos = hi
        if pos < n1:
            pieces.append((None, pos, n1))
        for src, lo, hi in pieces:
            na = (row * new.shape[f] + lo - n0) * inner
            nb = na + (hi - lo) * inner
            a, b = max(na, start), min(nb, end)
            if a >= b:
                continue
            if src is None:
                gaps.append((a - start, b - start))
                continue
            name, ob = src
            old_row = _ravel(tuple(g - o for g, o in zip(outer, ob.offset[:f])), ob.shape[:f])
            oa = (old_row * ob.shape[f] + lo - ob.offset[f]) * inner + (a - na)
            last = segments[-1] if segments else None
            if last and last[0] == name and last[2] == oa and last[3] + last[2] - last[1] == a - start:
                segments[-1] = (name, last[1], oa + b - a, last[3])
            else:
                segments.append((name, oa, oa + b - a, a - start))
    return segments, gaps


def _negative(xs) -> bool:
    return any(x < 0 for x in xs)


def record_problem(blocks: tuple[Block, ...], numel: int) -> tuple[Block, str] | None:
    """``(block, what is wrong with it)`` for the first of one parameter's recorded ``blocks`` that
    cannot be where ``numel`` elements of it sit -- another number of dimensions than its global
    shape, a negative offset or size, out of its global shape, or pieces that are not the
    parameter's elements ``[0, numel)`` in order -- else ``None``.  The text continues "parameter
    NAME ..."."""
    at = 0
    for b in sorted(blocks, key=lambda b: b.start):
        where = f"is recorded at offset {list(b.offset)} with shape {list(b.shape)}"
        nd = len(b.global_shape)
        if not len(b.offset) == len(b.shape) == nd:
            return b, f"{where}: not the {nd} dimensions of its global shape {list(b.global_shape)}"
        if _negative(b.global_shape) or _negative(b.offset) or _negative(b.shape):
            return b, f"{where} in a global shape {list(b.global_shape)}: a negative offset or size"
        if math.prod(b.global_shape) >= 1 << 62:
            return b, f"{where} in a global shape {list(b.global_shape)}: more elements than any tensor holds"
        if any(o + n > g for o, n, g in zip(b.offset, b.shape, b.global_shape)):
            return b, f"{where}, outside its global shape {list(b.global_shape)}"
        if b.start != at:
            return b, f"{where} from its element {b.start}, where its element {at} is due"
        at += b.size
    if at != numel:
        return blocks[-1], f"is recorded in blocks of {at} elements in all, for a parameter of {numel}"
    return None


def _one_per_cell(offsets: np.ndarray, ends: np.ndarray, cuts: list, grid: list) -> bool:
    """Whether each block is one cell of the grid the blocks cut, and each cell one block: an exact
    tiling, told in numpy (megatron-core's blocks always are; ~0.1 s for 50k blocks, where the
    cell-by-cell walk costs 50x that)."""
    if len(offsets) != math.prod(grid):
        return False
    lo = np.stack([np.searchsorted(c, offsets[:, ax]) for ax, c in enumerate(cuts)], 1)
    hi = np.stack([np.searchsorted(c, ends[:, ax]) for ax, c in enumerate(cuts)], 1)
    if not (hi - lo == 1).all():
        return False
    return np.unique(np.ravel_multi_index(tuple(lo.T), grid)).size == len(offsets)


def tiling_problem(olds: list) -> tuple[object, str, object] | None:
    """``(name, what is wrong, other)`` when the blocks ``olds`` (``[(name, Block)]``, one global key, each
    one fine on its own: :func:`record_problem`) do not tile their global tensor exactly once, else
    ``None``.  Identical blocks are replicas (a tied embedding's copies, a norm held by every tensor
    -parallel rank) and count once; any other two must be disjoint, and together they must cover
    every element.  ``name`` is the block the problem shows at: the later by name of two that
    overlap, or where an element is uncovered, a replica (a block recorded twice where another was
    due), else the first; ``other`` the name of the block it overlaps (else ``None``).  The text
    continues "parameter NAME ...".  Cost: the cells of the grid the
    blocks cut (the number of distinct blocks for megatron-core's even fragments; a crafted set that
    cuts more is refused before anything is allocated)."""
    ordered = sorted(olds, key=lambda o: o[0])
    distinct: dict = {}
    replicas = []
    for name, b in ordered:
        if distinct.setdefault((b.offset, b.shape), (name, b))[0] != name:
            replicas.append(name)
    items = list(distinct.values())
    first, gs, key = items[0][0], items[0][1].global_shape, items[0][1].key
    for name, b in items:
        if b.global_shape != gs:
            text = f"is recorded in a global shape {list(b.global_shape)}, another block of {key} in {list(gs)}"
            return name, text, None
    items = [(name, b) for name, b in items if all(b.shape)]
    if math.prod(gs) == 0:
        return None
    nd = len(gs)
    offsets = np.array([b.offset for _, b in items], dtype=np.int64).reshape(len(items), nd)
    ends = offsets + np.array([b.shape for _, b in items], dtype=np.int64).reshape(len(items), nd)
    cuts = [np.unique(np.concatenate([[0, g], offsets[:, ax], ends[:, ax]])) for ax, g in enumerate(gs)]
    grid = [len(c) - 1 for c in cuts]
    if math.prod(grid) > 4 * len(items) + 64:
        text = (
            f"is one of {len(items)} blocks of {key} {list(gs)} that cut it into {math.prod(grid)} pieces, not a grid"
        )
        return first, text, None
    if _one_per_cell(offsets, ends, cuts, grid):
        return None
    cuts = [c.tolist() for c in cuts]
    owner = np.full(grid, -1, dtype=np.int64)  # the slow way, for a set that is not one block per cell
    for i, (name, b) in enumerate(items):
        cell = tuple(slice(c.index(o), c.index(o + n)) for c, o, n in zip(cuts, b.offset, b.shape))
        taken = np.argwhere(owner[cell] >= 0)
        if len(taken):
            at = tuple(int(c[s.start + int(j)]) for c, s, j in zip(cuts, cell, taken[0]))
            other_name, other = items[int(owner[cell][tuple(taken[0])])]
            text = (
                f"is recorded at offset {list(b.offset)} with shape {list(b.shape)}, over element {list(at)} of "
                f"{key}, which the block at offset {list(other.offset)} with shape {list(other.shape)} holds"
            )
            return name, text, other_name
        owner[cell] = i
    hole = np.argwhere(owner < 0)
    if len(hole):
        at = [int(c[int(j)]) for c, j in zip(cuts, hole[0])]
        text = f"is one of {len(items)} distinct blocks of {key} {list(gs)}, which leave its element {at} in no block"
        return (replicas[0] if replicas else first), text, None
    return None
