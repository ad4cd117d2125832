"""Load a lazy checkpoint written at another data-parallel size (TP=PP=CP=EP=1, same model).

Tensor names in a rank file are positional (``model0.buf0.bucket0.param_shard``, ``opt0.g1.p7.exp_avg``)
and only fit the DP size that wrote them.  Each tensor's metadata also carries its *global identity*
(:mod:`.shards`): which element range of which parameter it holds.  From the metadata of every old
rank file this module builds a :class:`CheckpointIndex` — per ``(chunk, parameter, state)`` the
sorted pieces ``(old rank, tensor, offset, [start, end))`` — and then, for this rank's *new* shards
(its slice of each DDP bucket, its main-param shards and their Adam states), the exact element
ranges to read: :class:`ReshardPlanner` makes them a load plan for the engine's one verifying reader
(:class:`~..engine.reader.CheckpointReader`: zero-copy ``mmap`` views of the old files on shared
storage, every checksum chunk they touch verified once, before anything is copied in place).  No
rank gathers the full state.  The caller (``LazyCheckpointer.load``) then all-gathers the param
buffers across the new DP group.

Non-tensor state comes from one old rank: the old rank with this rank's number when there is one,
else old rank 0.  That covers optimizer ``param_groups`` (identical on every rank), the grad scaler,
the scheduler, and the RNG states (per rank: new ranks beyond the old world get old rank 0's RNG).
Non-tensor per-parameter optimizer state (a fused Adam's integer step) is re-keyed by parameter name.

Thread-safety: call from the training thread; the thread pool is owned by the reader.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import time

import torch

from ...engine.errors import CheckpointError, LayoutMismatchError
from ...engine.format.global_index import GlobalIndex, read_index
from ...engine.load.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
from ...engine.format.manifest import Manifest
from ...engine.load.reader import CheckpointReader
from .shards import (
    IDENTITY_VERSION,
    bucket_param_ranges,
    bucket_shards,
    inner_optimizers,
    main_param_owners,
    main_params,
    main_shards,
    parameter_names,
)

__all__ = [
    "EXPORT_HINT",
    "CONVERT_HINT",
    "check_layout",
    "CheckpointIndex",
    "GlobalIndexView",
    "ReshardPlanner",
    "index_summary",
    "plan_by_global_index",
    "plan_restore",
]

log = logging.getLogger(__name__)

EXPORT_HINT = "datastates-ckpt export {ckpt} OUT_DIR --megatron-lm DIR -- TRAINING_FLAGS"  # the same, on CPU ranks
CONVERT_HINT = "--load {ckpt} --lazy-ckpt-convert-to OUT_DIR"  # in a Megatron-LM run with the checkpoint's layout
_RESHARDABLE_ONLY_DP = ("tp", "pp", "cp", "ep")  # must be 1 (and equal) for a DP reshard
_OPT_NAME = re.compile(r"^opt(\d+)\.g(\d+)\.p(\d+)\.")


def check_layout(manifest: Manifest, ckpt: str, world_size: int, layout: dict) -> bool:
    """``False``: the checkpoint has this run's layout (plain restore).  ``True``: only the
    data-parallel size differs and TP=PP=CP=EP=1, so :class:`ReshardPlanner` applies.  Anything else
    raises :class:`LayoutMismatchError` naming every difference and the export path."""
    diffs = []
    if manifest.world_size != world_size:
        diffs.append(f"world size {manifest.world_size} in checkpoint, {world_size} now")
    others = []
    for key in sorted(set(manifest.layout) | set(layout)):
        if manifest.layout.get(key) != layout.get(key):
            diffs.append(f"{key}={manifest.layout.get(key)!r} in checkpoint, {layout.get(key)!r} now")
            if key != "dp":
                others.append(key)
    if not diffs:
        return False
    old_dp, new_dp = manifest.layout.get("dp"), layout.get("dp")
    hint = EXPORT_HINT.format(ckpt=_root_of(ckpt))
    reasons = []
    if others:
        reasons.append("only the data-parallel size may differ on load")
    elif not (isinstance(old_dp, int) and isinstance(new_dp, int) and old_dp > 0 and new_dp > 0):
        reasons.append("the parallel layout (dp) of the checkpoint or of this run is unknown")
    elif manifest.world_size * new_dp != world_size * old_dp:
        reasons.append("the world size does not follow from the data-parallel size")
    elif any(layout.get(k, 1) != 1 for k in _RESHARDABLE_ONLY_DP):
        reasons.append("resharding across data-parallel sizes needs TP=PP=CP=EP=1")
    if reasons:
        raise LayoutMismatchError(
            f"{ckpt}: checkpoint layout differs from this run: {'; '.join(diffs)}. {reasons[0].capitalize()}; "
            f"to change the parallel layout, convert the checkpoint to Megatron's torch_dist format in a "
            f"Megatron-LM run with the checkpoint's own layout (`{CONVERT_HINT.format(ckpt=_root_of(ckpt))}`), "
            f"then start this layout with `--load OUT_DIR` (megatron-core reshards it; later saves are lazy)"
            + f"; or offline, without a GPU: `{hint}` (the flags with the checkpoint's layout)"
        )
    return True


def _root_of(ckpt: str) -> str:
    import os

    parent = os.path.dirname(os.path.normpath(ckpt))
    return parent if os.path.basename(os.path.normpath(ckpt)).startswith("iter_") else ckpt


# ---------------------------------------------------------------------------------------------- index
@dataclasses.dataclass(frozen=True)
class _Piece:
    rank: int
    tensor: str
    offset: int  # element of the tensor holding parameter element ``start``
    start: int
    end: int


def _described(where: str, rank: int, name: str, meta, zero_dim: bool):
    """What tensor ``name`` (of rank ``rank``'s file) holds by global identity: ``None`` for a
    tensor without identity kind, else ``(params, pieces, scalar)``: ``params`` ``[(key, shape,
    dtype)]``, ``pieces`` ``[(key, offset, start, end)]`` and ``scalar`` a key or ``None`` (a 0-d
    optimizer state).  Raises :class:`LayoutMismatchError` for metadata older than the identity."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind not in ("param_shard", "main_param", "optimizer_state"):
        return None
    if meta.get("identity") != IDENTITY_VERSION:
        raise LayoutMismatchError(
            f"{where}: rank {rank} tensor {name!r} has no global identity metadata (version "
            f"{meta.get('identity')!r}, this reader knows {IDENTITY_VERSION}): the checkpoint was written "
            "before resharding was supported; load it at the data-parallel size that wrote it"
        )
    c = int(meta["chunk"])
    if kind == "param_shard":
        params, pieces = [], []
        for pname, shape, dtype, start, end, offset in meta["params"]:
            params.append(((c, pname), shape, dtype))
            pieces.append(((c, pname, "param"), int(offset), int(start), int(end)))
        return params, pieces, None
    key = (c, meta["param"])
    what = "main" if kind == "main_param" else meta["key"]
    params = [(key, meta["shape"], meta["dtype"])]
    if kind == "optimizer_state" and zero_dim:  # 0-d, e.g. torch Adam's step
        return params, [], (*key, what)
    return params, [((*key, what), 0, int(meta["start"]), int(meta["end"]))], None


def index_summary(tensors: dict, metas: dict) -> dict | None:
    """This rank's summary for the checkpoint's global index (:mod:`..engine.global_index`): its
    pieces by global identity (keys ``json [chunk, parameter, what]``; a 0-d state as the one
    element of ``[chunk, parameter, what, "scalar"]``) and each parameter's shape and dtype.
    ``None`` when its tensors carry no identity (nothing to reshard by)."""
    params, pieces = {}, []
    for name, meta in metas.items():
        try:
            got = _described("this rank", 0, name, meta, tensors[name].dim() == 0)
        except LayoutMismatchError:
            return None
        if got is None:
            continue
        for key, shape, dtype in got[0]:
            params[json.dumps(list(key))] = [[int(x) for x in shape], str(dtype)]
        for key, offset, start, end in got[1]:
            pieces.append([json.dumps(list(key)), start, end, name, offset])
        if got[2] is not None:
            pieces.append([json.dumps([*got[2], "scalar"]), 0, 1, name, 0])
    return {"params": params, "pieces": pieces} if pieces else None


class CheckpointIndex:
    """Where each element of each parameter and optimizer state lives in a checkpoint (from the
    global-identity metadata of every rank file, or of ``ranks`` only).  Keys are ``(chunk,
    parameter name, what)`` with ``what`` in ``param`` (the model value), ``main`` (fp32 main
    params of a bf16/fp16 model) or an optimizer state key.  Read-only after construction."""

    def __init__(self) -> None:
        self.params: dict[tuple[int, str], tuple[tuple[int, ...], str]] = {}
        self.pieces: dict[tuple[int, str, str], list[_Piece]] = collections.defaultdict(list)
        self.scalars: dict[tuple[int, str, str], ElementRange] = {}
        self.holders: dict[tuple[int, str, str], set[tuple[int, str]]] = collections.defaultdict(set)  # of scalars
        self.positions: dict[tuple[int, int, int, int], tuple[int, str]] = {}  # (rank, opt, group, pos) -> param

    @classmethod
    def from_reader(cls, reader: CheckpointReader, ranks=None) -> "CheckpointIndex":
        index = cls()
        for rank in range(reader.manifest.world_size) if ranks is None else ranks:
            for name, meta in reader.tensor_meta(rank).items():
                index._add(reader, rank, name, meta)
        for key in index.pieces:
            index.pieces[key].sort(key=lambda p: p.start)
        return index

    def scalar(self, key: tuple[int, str, str], start: int, end: int) -> ElementRange | None:
        """The 0-d state ``key`` of a parameter whose elements ``[start, end)`` this rank restores."""
        return self.scalars.get(key)

    def _add(self, reader: CheckpointReader, rank: int, name: str, meta) -> None:
        zero_dim = (
            isinstance(meta, dict) and meta.get("kind") == "optimizer_state" and not reader.entry(rank, name).shape
        )
        got = _described(reader.ckpt, rank, name, meta, zero_dim)
        if got is None:
            return
        params, pieces, scalar = got
        for key, shape, dtype in params:
            self._param(reader, key, shape, dtype)
        for key, offset, start, end in pieces:
            self.pieces[key].append(_Piece(rank, name, offset, start, end))
        m = _OPT_NAME.match(name)
        if m and meta.get("kind") != "param_shard":
            self.positions[(rank, int(m.group(1)), int(m.group(2)), int(m.group(3)))] = params[0][0]
        if scalar is not None:
            self.scalars.setdefault(scalar, ElementRange(rank, name, 0, 1))
            self.holders[scalar].add((rank, name))

    def _param(self, reader, key, shape, dtype) -> None:
        value = (tuple(int(s) for s in shape), str(dtype))
        if self.params.setdefault(key, value) != value:
            raise LayoutMismatchError(
                f"{reader.ckpt}: parameter {key[1]!r} (chunk {key[0]}) is recorded as both {self.params[key]} and {value}"
            )

    def ranges(self, key: tuple[int, str, str], start: int, end: int) -> list[tuple[ElementRange, int]]:
        """``(source range, position relative to start)`` pieces covering parameter elements
        ``[start, end)`` of ``key`` exactly; raises :class:`LayoutMismatchError` on a gap."""
        out = []
        pos = start
        for p in self.pieces.get(key, ()):
            if p.end <= pos or p.start >= end:
                continue
            lo, hi = max(p.start, pos), min(p.end, end)
            if lo != pos:
                break
            out.append((ElementRange(p.rank, p.tensor, p.offset + lo - p.start, hi - lo), lo - start))
            pos = hi
            if pos == end:
                break
        if pos != end:
            raise LayoutMismatchError(
                f"checkpoint does not hold elements [{pos}, {end}) of {key[2]} of parameter {key[1]!r} (chunk {key[0]})"
            )
        return out


class StaleIndexError(LayoutMismatchError):
    """The checkpoint's global index does not match its rank files' own metadata."""


class GlobalIndexView(CheckpointIndex):
    """A :class:`CheckpointIndex` answered from the checkpoint's global index
    (:mod:`..engine.global_index`): no rank file is opened to plan.  Every piece it hands out is
    remembered, so that :meth:`check` can compare them with the metadata of the files the plan
    opens anyway."""

    def __init__(self, gi: GlobalIndex) -> None:
        super().__init__()
        self.gi = gi
        self.used: list[tuple[tuple, _Piece]] = []
        for key, value in gi.params.items():
            c, pname = json.loads(key)
            shape, dtype = value
            self.params[(int(c), pname)] = (tuple(int(x) for x in shape), str(dtype))

    def ranges(self, key: tuple[int, str, str], start: int, end: int) -> list[tuple[ElementRange, int]]:
        found = [_Piece(r, t, o, s, e) for r, t, o, s, e in self.gi.pieces(json.dumps(list(key)), start, end)]
        self.pieces[key] = found  # the pieces overlapping [start, end): what the base class walks
        out = super().ranges(key, start, end)
        self.used += [(key, p) for p in found if any(r.rank == p.rank and r.tensor == p.tensor for r, _ in out)]
        return out

    def scalar(self, key: tuple[int, str, str], start: int, end: int) -> ElementRange | None:
        """A holder of the 0-d state ``key`` whose file the plan reads anyway when there is one."""
        holders = self.gi.pieces(json.dumps([*key, "scalar"]), 0, 1)
        if not holders:
            return None
        near = {r for r, *_ in self.gi.pieces(json.dumps([key[0], key[1], "param"]), start, end)}
        rank, tensor, *_ = next((h for h in holders if h[0] in near), holders[0])
        self.used.append(((*key, "scalar"), _Piece(rank, tensor, 0, 0, 1)))
        return ElementRange(rank, tensor, 0, 1)

    def check(self, local: CheckpointIndex) -> None:
        """Raise :class:`StaleIndexError` unless every piece used is what the files' own metadata say
        (``local``: the index of the files the plan reads)."""
        for key, p in self.used:
            if key[-1] == "scalar":
                ok = (p.rank, p.tensor) in local.holders.get(key[:3], ())
            else:
                ok = p in local.pieces.get(key, ())
            if not ok:
                raise StaleIndexError(
                    f"{self.gi.path}: rank {p.rank} tensor {p.tensor!r}: the global index says it holds "
                    f"elements [{p.start}, {p.end}) of {key}; its file's metadata does not"
                )


# ---------------------------------------------------------------------------------------------- plan
def _check_params(index: CheckpointIndex, names: dict, ckpt: str) -> None:
    live = {key: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p, key in names.items()}
    missing = sorted(set(live) - set(index.params))
    extra = sorted(set(index.params) - set(live))
    differ = [
        (k, index.params[k], live[k]) for k in sorted(set(live) & set(index.params)) if index.params[k] != live[k]
    ]
    problems = []
    if missing:
        problems.append(f"not in checkpoint: {[n for _, n in missing[:5]]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"not in this model: {[n for _, n in extra[:5]]}{' ...' if len(extra) > 5 else ''}")
    for (c, n), saved, now in differ[:5]:
        problems.append(f"{n!r}: checkpoint has {saved[1]} {list(saved[0])}, model has {now[1]} {list(now[0])}")
    if problems:
        raise LayoutMismatchError(f"{ckpt}: the checkpoint's parameters differ from this model: " + "; ".join(problems))


def plan_restore(model, optimizer, index: CheckpointIndex, ckpt: str = "") -> list[tuple[ElementRange, torch.Tensor]]:
    """``(source range, destination view)`` for every element this rank must restore: its shard of
    each DDP bucket, its non-view main params and every tensor of their optimizer state."""
    names = parameter_names(model)
    _check_params(index, names, ckpt)
    plan: list[tuple[ElementRange, torch.Tensor]] = []
    buckets = bucket_shards(model)
    for b in buckets:
        if b.buffer.startswith("ep_"):
            raise LayoutMismatchError(f"{ckpt}: expert-parallel buffers cannot be resharded across data-parallel sizes")
        for pname, _shape, _dtype, start, end, offset in bucket_param_ranges(
            b.buf, b.bucket, b.dp_rank, b.dp_size, names
        ):
            for r, at in index.ranges((b.chunk, pname, "param"), start, end):
                plan.append((r, b.shard[offset + at : offset + at + r.count]))
    for shard in main_shards(optimizer, buckets):
        m = shard.main
        if shard.owner is None:
            raise LayoutMismatchError(
                f"optimizer {m.opt} group {m.group} param {m.index}: not a DistributedOptimizer shard; cannot reshard"
            )
        mp, start, end = shard.owner
        c, pname = names[mp]
        if m.param.numel() and not shard.in_bucket:  # fp32 model: the main param is the buffer slice
            flat = m.param.detach().view(-1)
            plan += [(r, flat[at : at + r.count]) for r, at in index.ranges((c, pname, "main"), start, end)]
        for key, value in m.state.items():
            if value.dim() == 0:
                src = index.scalar((c, pname, key), start, end)
                if src is None:
                    raise LayoutMismatchError(f"{ckpt}: no {key!r} for parameter {pname!r} in the checkpoint")
                plan.append((src, value))
                continue
            if value.numel() != end - start:
                raise LayoutMismatchError(
                    f"optimizer state {key!r} of {pname!r} has {value.numel()} elements, shard has {end - start}"
                )
            dst = value.view(-1)
            plan += [(r, dst[at : at + r.count]) for r, at in index.ranges((c, pname, key), start, end)]
    return plan


def _remap_training(
    reader: CheckpointReader, index: CheckpointIndex, optimizer, model, source_rank: int, ranks
) -> dict:
    """The source rank's non-tensor state, with per-parameter plain optimizer state re-keyed to this
    rank's positions by parameter name (found in the files of ``ranks``: those holding this rank's
    parameters' state hold their plain state too)."""
    objects = reader.objects(source_rank)
    training = dict(objects["training"])
    by_param: dict[tuple[int, tuple[int, str]], dict] = {}
    for rank in ranks:
        saved = reader.objects(rank)["training"]["optimizers"]
        for i, opt in enumerate(saved):
            for pos, plain in opt.get("plain_state", {}).items():
                g, j = (int(x) for x in pos[1:].split(".p"))
                key = index.positions.get((rank, i, g, j))
                if key is None:
                    log.warning(
                        "rank %d: plain optimizer state %s of old rank %d has no parameter identity; dropped",
                        reader.rank,
                        pos,
                        rank,
                    )
                    continue
                by_param.setdefault((i, key), plain)
    names = parameter_names(model)
    owners = main_param_owners(optimizer)
    plain: list[dict] = [{} for _ in inner_optimizers(optimizer)]
    for m in main_params(optimizer):
        owner = owners[m.opt][m.group][m.index]
        found = by_param.get((m.opt, names[owner[0]])) if owner is not None else None
        if found:
            plain[m.opt][f"g{m.group}.p{m.index}"] = found
    training["optimizers"] = [{**o, "plain_state": p} for o, p in zip(training["optimizers"], plain)]
    return training


class ReshardPlanner(LoadPlanner):
    """This rank's shards of ``model``/``optimizer`` from a checkpoint of another DP size (or of the
    same DP size with another bucket layout), by parameter identity: only the element ranges this
    rank needs, from whichever old rank files hold them.  The plan's objects are the source rank's
    non-tensor state with ``training`` re-keyed for this rank (ready for ``training_state.restore``);
    the caller all-gathers the param buffers afterwards."""

    kind = "reshard"
    reads_all_ranks = True

    def __init__(self, model, optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def plan(self, reader: CheckpointReader) -> LoadPlan:
        t0 = time.perf_counter()
        manifest: Manifest = reader.manifest
        source = reader.rank if reader.rank < manifest.world_size else 0
        planned = self._by_global_index(reader, source)
        if planned is None:  # no (usable) global index: the metadata of every rank file
            index = CheckpointIndex.from_reader(reader)
            pairs = plan_restore(self.model, self.optimizer, index, reader.ckpt)
            planned = pairs, index, range(manifest.world_size)
        pairs, index, ranks = planned
        objects = reader.objects(source)
        training = _remap_training(reader, index, self.optimizer, self.model, source, ranks)
        files = sorted({r.rank for r, _ in pairs})
        log.info(
            "rank %d: resharding iteration %d from DP %s to DP %s: %d ranges from %d of %d rank files "
            "(plan %.3f s); non-tensor state from old rank %d",
            reader.rank,
            manifest.iteration,
            manifest.layout.get("dp"),
            _new_dp(self.model),
            len(pairs),
            len(files),
            manifest.world_size,
            time.perf_counter() - t0,
            source,
        )
        items = tuple(ReadItem(r, dst) for r, dst in pairs)
        return LoadPlan(self.kind, items, {**objects, "training": training})

    def _by_global_index(self, reader: CheckpointReader, source: int):
        return plan_by_global_index(
            reader, lambda index: plan_restore(self.model, self.optimizer, index, reader.ckpt), source
        )


def plan_by_global_index(reader: CheckpointReader, plan_fn, source: int):
    """``(pairs, index, ranks)``: ``pairs = plan_fn(index)`` planned from the checkpoint's global
    index, opening only the rank files the pairs read and ``source`` (``ranks``), whose own
    metadata are then checked against what the index said (``index``: theirs); ``None`` when the
    checkpoint has no index, or one that is damaged or disagrees with its files (logged: the
    caller then reads every rank file's metadata, and raises what is really wrong)."""
    try:
        gi = read_index(reader.ckpt, reader.manifest)
        if gi is None:
            return None
        view = GlobalIndexView(gi)
        pairs = plan_fn(view)
        ranks = sorted({r.rank for r, _ in pairs} | {source})
        local = CheckpointIndex.from_reader(reader, ranks)
        view.check(local)
    except CheckpointError as e:
        log.warning("rank %d: %s; reading every rank file's metadata instead", reader.rank, e)
        return None
    return pairs, local, ranks


def _new_dp(model) -> int | None:
    shards = bucket_shards(model)
    return shards[0].dp_size if shards else None
