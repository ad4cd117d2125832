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
import logging
import re
import time

import torch

from ..engine.errors import LayoutMismatchError
from ..engine.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
from ..engine.manifest import Manifest
from ..engine.reader import CheckpointReader
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

__all__ = ["EXPORT_HINT", "CONVERT_HINT", "check_layout", "CheckpointIndex", "ReshardPlanner", "plan_restore"]

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


class CheckpointIndex:
    """Where each element of each parameter and optimizer state lives in a checkpoint (from the
    global-identity metadata of every rank file).  Keys are ``(chunk, parameter name, what)`` with
    ``what`` in ``param`` (the model value), ``main`` (fp32 main params of a bf16/fp16 model) or an
    optimizer state key.  Read-only after construction."""

    def __init__(self) -> None:
        self.params: dict[tuple[int, str], tuple[tuple[int, ...], str]] = {}
        self.pieces: dict[tuple[int, str, str], list[_Piece]] = collections.defaultdict(list)
        self.scalars: dict[tuple[int, str, str], ElementRange] = {}
        self.positions: dict[tuple[int, int, int, int], tuple[int, str]] = {}  # (rank, opt, group, pos) -> param

    @classmethod
    def from_reader(cls, reader: CheckpointReader) -> "CheckpointIndex":
        index = cls()
        for rank in range(reader.manifest.world_size):
            for name, meta in reader.tensor_meta(rank).items():
                index._add(reader, rank, name, meta)
        for key in index.pieces:
            index.pieces[key].sort(key=lambda p: p.start)
        return index

    def _add(self, reader: CheckpointReader, rank: int, name: str, meta) -> None:
        kind = meta.get("kind") if isinstance(meta, dict) else None
        if kind not in ("param_shard", "main_param", "optimizer_state"):
            return
        if meta.get("identity") != IDENTITY_VERSION:
            raise LayoutMismatchError(
                f"{reader.ckpt}: rank {rank} tensor {name!r} has no global identity metadata (version "
                f"{meta.get('identity')!r}, this reader knows {IDENTITY_VERSION}): the checkpoint was written "
                "before resharding was supported; load it at the data-parallel size that wrote it"
            )
        c = int(meta["chunk"])
        if kind == "param_shard":
            for pname, shape, dtype, start, end, offset in meta["params"]:
                self._param(reader, (c, pname), shape, dtype)
                self.pieces[(c, pname, "param")].append(_Piece(rank, name, int(offset), int(start), int(end)))
            return
        key = (c, meta["param"])
        self._param(reader, key, meta["shape"], meta["dtype"])
        what = "main" if kind == "main_param" else meta["key"]
        m = _OPT_NAME.match(name)
        if m:
            self.positions[(rank, int(m.group(1)), int(m.group(2)), int(m.group(3)))] = key
        if kind == "optimizer_state" and not reader.entry(rank, name).shape:  # 0-d, e.g. torch Adam's step
            self.scalars.setdefault((*key, what), ElementRange(rank, name, 0, 1))
            return
        self.pieces[(*key, what)].append(_Piece(rank, name, 0, int(meta["start"]), int(meta["end"])))

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
                src = index.scalars.get((c, pname, key))
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


def _remap_training(reader: CheckpointReader, index: CheckpointIndex, optimizer, model, source_rank: int) -> dict:
    """The source rank's non-tensor state, with per-parameter plain optimizer state re-keyed to this
    rank's positions by parameter name."""
    objects = reader.objects(source_rank)
    training = dict(objects["training"])
    by_param: dict[tuple[int, tuple[int, str]], dict] = {}
    for rank in range(reader.manifest.world_size):
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
        index = CheckpointIndex.from_reader(reader)
        pairs = plan_restore(self.model, self.optimizer, index, reader.ckpt)
        source = reader.rank if reader.rank < manifest.world_size else 0
        objects = reader.objects(source)
        training = _remap_training(reader, index, self.optimizer, self.model, source)
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


def _new_dp(model) -> int | None:
    shards = bucket_shards(model)
    return shards[0].dp_size if shards else None
