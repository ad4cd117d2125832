"""Load a lazy checkpoint written at another data-parallel size (any TP, PP, VPP, EP and CP; same model).

Tensor names in a rank file are positional (``model0.buf0.bucket0.param_shard``, ``opt0.g1.p7.exp_avg``)
and only fit the DP size that wrote them.  Each tensor's metadata also carries its *global identity*
(:mod:`.shards`): which element range of which parameter of which model-parallel slice it holds.
From the checkpoint's global index (or the metadata of every old rank file) this module builds a
:class:`CheckpointIndex` -- per ``(slice, chunk, parameter, state)`` the sorted pieces ``(old rank,
tensor, offset, [start, end))`` -- and then, for this rank's *new* shards (its slice of each DDP
bucket, dense buffers by the data-parallel group and expert buffers by the expert data-parallel group,
its main-param shards and their Adam states), the exact element ranges to read: :class:`ReshardPlanner`
makes them a load plan for the engine's one verifying reader (:class:`~..engine.load.reader.CheckpointReader`:
zero-copy ``mmap`` views of the old files on shared storage, every checksum chunk they touch verified
once, before anything is copied in place).  No rank gathers the full state.  The caller
(``LazyCheckpointer.load``) then all-gathers the param buffers across the new DP groups.

Only the data-parallel size may differ: a change of TP, PP, VPP or EP, or another model, is refused
before anything is written, in one line naming a parameter, its shapes in the checkpoint and in this
run, and both layouts (:func:`check_layout`, :func:`plan_restore`); so is a checkpoint whose identity
predates the model-parallel slice, naming the conversion that still works.

Non-tensor state comes from one old rank of this rank's model-parallel slices (the ranks its plan
reads): the old rank with this rank's number when it is one of them, else the lowest.  That covers
optimizer ``param_groups``, the grad scaler, the scheduler, the model's buffers and extra state, and
the RNG states (which differ by tensor, pipeline and expert rank).  Non-tensor per-parameter optimizer
state (a fused Adam's integer step) is re-keyed by parameter identity.

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
from ...engine.format.global_index import GlobalIndex, RangedIndex, read_index
from ...engine.load.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
from ...engine.format.manifest import Manifest
from ...engine.load.reader import CheckpointReader
from .shards import (
    IDENTITY_VERSION,
    bucket_param_ranges,
    bucket_shards,
    bucket_slice,
    inner_optimizers,
    main_param_owners,
    main_params,
    main_shards,
    parameter_keys,
    parameter_names,
)

__all__ = [
    "EXPORT_HINT",
    "CONVERT_HINT",
    "check_layout",
    "layout_text",
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
_MODEL_PARALLEL = ("tp", "pp", "model_chunks", "ep")  # a change of these is refused naming a parameter
_OPT_NAME = re.compile(r"^opt(\d+)\.g(\d+)\.p(\d+)\.")
_TEXT = (("tp", "TP", True), ("pp", "PP", True), ("model_chunks", "VPP", False), ("dp", "DP", True))
_TEXT += (("cp", "CP", False), ("ep", "EP", False))


def layout_text(layout: dict) -> str:
    """``TP2×PP4×DP8`` (``×VPP<n>``, ``×CP<n>``, ``×EP<n>`` where not 1) for a manifest's layout."""
    parts = [
        f"{label}{layout[key]}"
        for key, label, always in _TEXT
        if key in layout and (always or layout[key] not in (1, None))
    ]
    return "×".join(parts) or "no recorded layout"


def _conversion(ckpt: str) -> str:
    root = _root_of(ckpt)
    return (
        f"convert the checkpoint to Megatron's torch_dist format in a Megatron-LM run with the checkpoint's own "
        f"layout (`{CONVERT_HINT.format(ckpt=root)}`), then start this layout with `--load OUT_DIR` (megatron-core "
        f"reshards it; later saves are lazy); or offline, without a GPU: `{EXPORT_HINT.format(ckpt=root)}` (the "
        "flags with the checkpoint's layout)"
    )


def _refusal(ckpt: str, old: dict, new: dict, what: str) -> LayoutMismatchError:
    """One line: what cannot be restored, both layouts and, for a layout change, the conversion."""
    moved = [k for k in (*_MODEL_PARALLEL, "cp") if old.get(k) != new.get(k)]
    hint = (
        f"; only the data-parallel size may change on load ({', '.join(moved)} differ): {_conversion(ckpt)}"
        if moved
        else ""
    )
    return LayoutMismatchError(
        f"{ckpt}: cannot restore the checkpoint ({layout_text(old)}) in this run ({layout_text(new)}): {what}{hint}"
    )


def check_layout(manifest: Manifest, ckpt: str, world_size: int, layout: dict) -> bool:
    """``False``: the checkpoint has this run's layout (plain restore).  ``True``: restore by
    parameter identity with :class:`ReshardPlanner` -- a data-parallel change, or a change of TP, PP,
    VPP or EP, which the planner refuses naming a parameter and its shapes.  A change it can tell
    from the manifest alone (the context-parallel size, a world size that does not follow from the
    data-parallel size) raises :class:`LayoutMismatchError` here, naming both layouts."""
    old = manifest.layout
    if manifest.world_size == world_size and dict(old) == dict(layout):
        return False
    if any(old.get(k) != layout.get(k) for k in _MODEL_PARALLEL):
        return True
    old_dp, new_dp = old.get("dp"), layout.get("dp")
    reason = None
    if old.get("cp") != layout.get("cp"):
        reason = f"the context-parallel size differs ({old.get('cp')!r} in the checkpoint, {layout.get('cp')!r} now)"
    elif not (isinstance(old_dp, int) and isinstance(new_dp, int) and old_dp > 0 and new_dp > 0):
        reason = "the data-parallel size of the checkpoint or of this run is unknown"
    elif manifest.world_size * new_dp != world_size * old_dp:
        reason = (
            f"the world size ({manifest.world_size} in the checkpoint, {world_size} now) does not follow from "
            "the data-parallel size"
        )
    if reason is not None:
        raise LayoutMismatchError(
            f"{ckpt}: cannot restore the checkpoint ({layout_text(old)}, world size {manifest.world_size}) in this "
            f"run ({layout_text(layout)}, world size {world_size}): {reason}; {_conversion(ckpt)}"
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


def _described(where: str, rank: int, name: str, meta, zero_dim: bool, legacy: bool = False):
    """What tensor ``name`` (of rank ``rank``'s file) holds by global identity: ``None`` for a
    tensor without identity kind, else ``(params, pieces, scalar)``: ``params`` ``[(key, shape,
    dtype)]`` with keys ``(slice, chunk, parameter)``, ``pieces`` ``[(key + (what,), offset, start,
    end)]`` and ``scalar`` a key or ``None`` (a 0-d optimizer state).  Raises
    :class:`LayoutMismatchError`, naming the conversion, for an identity of another version
    (``legacy``: identity 1 is read too, with slice ``""``: for a TP=PP=EP=1 checkpoint only)."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind not in ("param_shard", "main_param", "optimizer_state"):
        return None
    if meta.get("identity") != IDENTITY_VERSION and not (legacy and meta.get("identity") == 1):
        raise LayoutMismatchError(
            f"{where}: rank {rank} tensor {name!r} has global identity version {meta.get('identity')!r}, not "
            f"{IDENTITY_VERSION} (written by an older datastates-megatron, without its model-parallel slice): it "
            f"restores only in the layout that wrote it; to load it in another layout, {_conversion(where)}"
        )
    c, sl = int(meta["chunk"]), str(meta.get("slice", ""))
    if kind == "param_shard":
        params, pieces = [], []
        for pname, shape, dtype, start, end, offset in meta["params"]:
            params.append(((sl, c, pname), shape, dtype))
            pieces.append(((sl, c, pname, "param"), int(offset), int(start), int(end)))
        return params, pieces, None
    key = (sl, c, meta["param"])
    what = "main" if kind == "main_param" else meta["key"]
    params = [(key, meta["shape"], meta["dtype"])]
    if kind == "optimizer_state" and zero_dim:  # 0-d, e.g. torch Adam's step
        return params, [], (*key, what)
    return params, [((*key, what), 0, int(meta["start"]), int(meta["end"]))], None


def index_summary(tensors: dict, metas: dict) -> dict | None:
    """This rank's summary for the checkpoint's global index (:mod:`..engine.global_index`): its
    pieces by global identity (keys ``json [slice, chunk, parameter, what]``; a 0-d state as the one
    element of ``[slice, chunk, parameter, what, "scalar"]``) and each parameter's shape and dtype
    (keys ``json [slice, chunk, parameter]``).
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
    global-identity metadata of every rank file, or of ``ranks`` only).  Keys are ``(slice, chunk,
    parameter name, what)`` with ``what`` in ``param`` (the model value), ``main`` (fp32 main
    params of a bf16/fp16 model) or an optimizer state key; parameters are ``(slice, chunk,
    parameter name)``.  Read-only after construction."""

    def __init__(self) -> None:
        self.params: dict[tuple[str, int, str], tuple[tuple[int, ...], str]] = {}
        self.pieces: dict[tuple[str, int, str, str], list[_Piece]] = collections.defaultdict(list)
        self.scalars: dict[tuple[str, int, str, str], ElementRange] = {}
        self.holders: dict[tuple[str, int, str, str], set[tuple[int, str]]] = collections.defaultdict(set)
        self.positions: dict[tuple[int, int, int, int], tuple[str, int, str]] = {}  # (rank, opt, group, pos) -> param

    @classmethod
    def from_reader(cls, reader: CheckpointReader, ranks=None, legacy: bool = False) -> "CheckpointIndex":
        """``legacy``: identity 1 too (no model-parallel slice; for a TP=PP=EP=1 checkpoint only)."""
        index = cls()
        for rank in range(reader.manifest.world_size) if ranks is None else ranks:
            for name, meta in reader.tensor_meta(rank).items():
                index._add(reader, rank, name, meta, legacy)
        for key in index.pieces:
            index.pieces[key].sort(key=lambda p: p.start)
        return index

    def scalar(self, key: tuple[str, int, str, str], start: int, end: int) -> ElementRange | None:
        """The 0-d state ``key`` of a parameter whose elements ``[start, end)`` this rank restores."""
        return self.scalars.get(key)

    def params_of(self, slices) -> dict[tuple[str, int, str], tuple[tuple[int, ...], str]]:
        """The parameters of model-parallel ``slices``: ``{(slice, chunk, name): (shape, dtype)}``."""
        return {key: value for key, value in self.params.items() if key[0] in slices}

    def _add(self, reader: CheckpointReader, rank: int, name: str, meta, legacy: bool = False) -> None:
        zero_dim = (
            isinstance(meta, dict) and meta.get("kind") == "optimizer_state" and not reader.entry(rank, name).shape
        )
        got = _described(reader.ckpt, rank, name, meta, zero_dim, legacy)
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
                f"{reader.ckpt}: parameter {_named(key)} is recorded as both {self.params[key]} and {value}"
            )

    def ranges(self, key: tuple[str, int, str, str], start: int, end: int) -> list[tuple[ElementRange, int]]:
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
                f"checkpoint does not hold elements [{pos}, {end}) of {key[3]} of parameter {_named(key)}"
            )
        return out


class StaleIndexError(LayoutMismatchError):
    """The checkpoint's global index does not match its rank files' own metadata."""


class GlobalIndexView(CheckpointIndex):
    """A :class:`CheckpointIndex` answered from the checkpoint's global index
    (:mod:`..engine.global_index`): no rank file is opened to plan.  Every piece it hands out is
    remembered, so that :meth:`check` can compare them with the metadata of the files the plan
    opens anyway."""

    def __init__(self, gi: GlobalIndex | RangedIndex) -> None:
        super().__init__()
        self.gi = gi
        self.used: list[tuple[tuple, _Piece]] = []
        if gi.unsliced:  # an index of identity 1
            raise StaleIndexError(
                f"{gi.path}: a parameter key is not [slice, chunk, parameter] (an index of identity 1: no "
                "model-parallel slice)"
            )

    def params_of(self, slices) -> dict[tuple[str, int, str], tuple[tuple[int, ...], str]]:
        """Read from the index for ``slices`` only (a ranged index reads those slices' tables)."""
        for key, value in self.gi.params_of(sorted(set(slices))).items():
            parsed = json.loads(key)
            if not (isinstance(parsed, list) and len(parsed) == 3):
                raise StaleIndexError(f"{self.gi.path}: parameter key {key!r} is not [slice, chunk, parameter]")
            sl, c, pname = parsed
            shape, dtype = value
            self.params[(str(sl), int(c), pname)] = (tuple(int(x) for x in shape), str(dtype))
        return super().params_of(slices)

    def ranges(self, key: tuple[str, int, str, str], start: int, end: int) -> list[tuple[ElementRange, int]]:
        found = [_Piece(r, t, o, s, e) for r, t, o, s, e in self.gi.pieces(json.dumps(list(key)), start, end)]
        self.pieces[key] = found  # the pieces overlapping [start, end): what the base class walks
        out = super().ranges(key, start, end)
        self.used += [(key, p) for p in found if any(r.rank == p.rank and r.tensor == p.tensor for r, _ in out)]
        return out

    def scalar(self, key: tuple[str, int, str, str], start: int, end: int) -> ElementRange | None:
        """A holder of the 0-d state ``key`` whose file the plan reads anyway when there is one."""
        holders = self.gi.pieces(json.dumps([*key, "scalar"]), 0, 1)
        if not holders:
            return None
        near = {r for r, *_ in self.gi.pieces(json.dumps([*key[:3], "param"]), start, end)}
        rank, tensor, *_ = next((h for h in holders if h[0] in near), holders[0])
        self.used.append(((*key, "scalar"), _Piece(rank, tensor, 0, 0, 1)))
        return ElementRange(rank, tensor, 0, 1)

    def check(self, local: CheckpointIndex) -> None:
        """Raise :class:`StaleIndexError` unless every piece used is what the files' own metadata say
        (``local``: the index of the files the plan reads)."""
        for key, p in self.used:
            if key[-1] == "scalar":
                ok = (p.rank, p.tensor) in local.holders.get(key[:4], ())
            else:
                ok = p in local.pieces.get(key, ())
            if not ok:
                raise StaleIndexError(
                    f"{self.gi.path}: rank {p.rank} tensor {p.tensor!r}: the global index says it holds "
                    f"elements [{p.start}, {p.end}) of {key}; its file's metadata does not"
                )


# ---------------------------------------------------------------------------------------------- plan
def _named(key: tuple) -> str:
    """``'name' (slice pp0.tp1, chunk 0)`` for a parameter key ``(slice, chunk, name, ...)``."""
    return f"{key[2]!r} ({f'slice {key[0]}, ' if key[0] else ''}chunk {key[1]})"


def _shape_text(value) -> str:
    return f"{value[1]} {list(value[0])}" if value is not None else "absent"


def _check_params(index: CheckpointIndex, keys: dict, ckpt: str, old: dict, new: dict) -> None:
    """Raise one :class:`LayoutMismatchError` line unless the checkpoint holds, for this rank's
    model-parallel slices, exactly this model's parameters with their shapes and dtypes: it names the
    first parameter that differs (a shape first, then one missing on either side), both of its
    shapes and both layouts."""
    live = {key: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p, key in keys.items()}
    slices = {key[0] for key in live}
    saved = index.params_of(slices)
    differ = sorted(k for k in live.keys() & saved.keys() if saved[k] != live[k])
    missing = sorted(live.keys() - saved.keys())
    extra = sorted(saved.keys() - live.keys())
    bad = differ + missing + extra
    if not bad:
        return
    first = bad[0]
    more = f" ({len(bad) - 1} more parameters differ)" if len(bad) > 1 else ""
    raise _refusal(
        ckpt,
        old,
        new,
        f"parameter {_named(first)} is {_shape_text(saved.get(first))} in the checkpoint, "
        f"{_shape_text(live.get(first))} in this run{more}",
    )


def plan_restore(
    model,
    optimizer,
    index: CheckpointIndex,
    ckpt: str = "",
    old: dict | None = None,
    new: dict | None = None,
    by_slice: dict | None = None,
    optimizer_state: bool = True,
) -> list[tuple[ElementRange, torch.Tensor]]:
    """``(source range, destination view)`` for every element this rank must restore: its shard of
    each DDP bucket, its non-view main params and every tensor of their optimizer state (those two
    only with ``optimizer_state``).  ``old``, ``new``: the checkpoint's and this run's layouts (named
    in a refusal; any change but the data-parallel size is refused).  ``by_slice``, when given, is
    filled with ``{slice: old ranks}``: the old rank files the plan reads per model-parallel slice."""
    old, new = dict(old or {}), dict(new or old or {})
    keys = parameter_keys(model)
    _check_params(index, keys, ckpt, old, new)
    moved = [k for k in (*_MODEL_PARALLEL, "cp") if old.get(k) != new.get(k)]
    if moved:  # the parameters matched, yet the model-parallel layout differs: no reshard of that here
        raise _refusal(ckpt, old, new, "the parameters of this rank's slices match, but the layout differs")
    names = parameter_names(model)
    plan: list[tuple[ElementRange, torch.Tensor]] = []
    found = by_slice if by_slice is not None else {}

    def add(key, start, end, dst):
        for r, at in index.ranges(key, start, end):
            plan.append((r, dst[at : at + r.count]))
            found.setdefault(key[0], set()).add(r.rank)

    buckets = bucket_shards(model)
    for b in buckets:
        sl = bucket_slice(b, keys)
        for pname, _shape, _dtype, start, end, offset in bucket_param_ranges(
            b.buf, b.bucket, b.dp_rank, b.dp_size, names
        ):
            add((sl, b.chunk, pname, "param"), start, end, b.shard[offset : offset + end - start])
    for shard in main_shards(optimizer, buckets) if optimizer_state else ():
        m = shard.main
        if shard.owner is None:
            raise LayoutMismatchError(
                f"optimizer {m.opt} group {m.group} param {m.index}: not a DistributedOptimizer shard; cannot reshard"
            )
        mp, start, end = shard.owner
        pkey = keys[mp]
        if m.param.numel() and not shard.in_bucket:  # fp32 model: the main param is the buffer slice
            add((*pkey, "main"), start, end, m.param.detach().view(-1))
        for key, value in m.state.items():
            if value.dim() == 0:
                src = index.scalar((*pkey, key), start, end)
                if src is None:
                    raise LayoutMismatchError(f"{ckpt}: no {key!r} for parameter {_named(pkey)} in the checkpoint")
                plan.append((src, value))
                found.setdefault(pkey[0], set()).add(src.rank)
                continue
            if value.numel() != end - start:
                raise LayoutMismatchError(
                    f"optimizer state {key!r} of {_named(pkey)} has {value.numel()} elements, shard has {end - start}"
                )
            add((*pkey, key), start, end, value.view(-1))
    return plan


def source_rank(rank: int, world_size: int, by_slice: dict) -> int:
    """The old rank whose non-tensor state (RNG, model buffers, optimizer groups, scheduler) this
    rank takes: one of its own model-parallel slices -- every slice if one rank is in all of them,
    else the dense ones (``pp<P>.tp<T>``) -- ``rank`` itself when it is one, else the lowest."""
    sets = list(by_slice.values())
    dense = [v for k, v in by_slice.items() if ".ep" not in k]
    for group in (sets, dense):
        common = set.intersection(*group) if group else set()
        if common:
            return rank if rank in common else min(common)
    return rank if rank < world_size else 0


def _remap_training(
    reader: CheckpointReader, index: CheckpointIndex, optimizer, model, source_rank: int, ranks
) -> dict:
    """The source rank's non-tensor state, with per-parameter plain optimizer state re-keyed to this
    rank's positions by parameter identity (found in the files of ``ranks``: those holding this
    rank's parameters' state hold their plain state too)."""
    objects = reader.objects(source_rank)
    training = dict(objects["training"])
    by_param: dict[tuple[int, tuple[str, int, str]], dict] = {}
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
    keys = parameter_keys(model)
    owners = main_param_owners(optimizer)
    plain: list[dict] = [{} for _ in inner_optimizers(optimizer)]
    for m in main_params(optimizer):
        owner = owners[m.opt][m.group][m.index]
        found = by_param.get((m.opt, keys[owner[0]])) if owner is not None else None
        if found:
            plain[m.opt][f"g{m.group}.p{m.index}"] = found
    training["optimizers"] = [{**o, "plain_state": p} for o, p in zip(training["optimizers"], plain)]
    return training


class ReshardPlanner(LoadPlanner):
    """This rank's shards of ``model``/``optimizer`` from a checkpoint of another DP size (or of the
    same DP size with another bucket layout), by parameter identity: only the element ranges this
    rank needs, from whichever old rank files of its model-parallel slices hold them.  ``layout``:
    this run's (the checkpoint's is its manifest's); any difference but the data-parallel size is
    refused, naming a parameter.  The plan's objects are the source rank's non-tensor state with
    ``training`` re-keyed for this rank (ready for ``training_state.restore``); the caller
    all-gathers the param buffers afterwards."""

    kind = "reshard"
    reads_all_ranks = True

    def __init__(self, model, optimizer, layout: dict | None = None, optimizer_state: bool = True) -> None:
        """``optimizer_state=False``: the model only (its param buffers; main params and optimizer
        state are left as they are, and the plan's ``training`` is the source rank's, not re-keyed)."""
        self.model = model
        self.optimizer = optimizer
        self.layout = dict(layout) if layout is not None else None
        self.optimizer_state = optimizer_state

    def plan(self, reader: CheckpointReader) -> LoadPlan:
        t0 = time.perf_counter()
        manifest: Manifest = reader.manifest
        old = dict(manifest.layout)
        new = self.layout if self.layout is not None else old
        by_slice: dict[str, set[int]] = {}

        def plan_fn(index):
            by_slice.clear()
            return plan_restore(
                self.model, self.optimizer, index, reader.ckpt, old, new, by_slice, self.optimizer_state
            )

        planned = plan_by_global_index(reader, plan_fn, None)
        if planned is None:  # no (usable) global index: the metadata of every rank file
            index = CheckpointIndex.from_reader(reader)
            planned = plan_fn(index), index, range(manifest.world_size)
        pairs, index, ranks = planned
        source = source_rank(reader.rank, manifest.world_size, by_slice)
        objects = reader.objects(source)
        training = objects["training"]
        if self.optimizer_state:
            training = _remap_training(reader, index, self.optimizer, self.model, source, sorted({*ranks, source}))
        files = sorted({r.rank for r, _ in pairs})
        if reader.rank == 0 and old != new:
            log.info("resharding iteration %d: %s → %s", manifest.iteration, layout_text(old), layout_text(new))
        log.debug(
            "rank %d: iteration %d by parameter identity: %d ranges from %d of %d rank files (plan %.3f s); "
            "non-tensor state from old rank %d",
            reader.rank,
            manifest.iteration,
            len(pairs),
            len(files),
            manifest.world_size,
            time.perf_counter() - t0,
            source,
        )
        items = tuple(ReadItem(r, dst) for r, dst in pairs)
        return LoadPlan(self.kind, items, {**objects, "training": training})


def plan_by_global_index(reader: CheckpointReader, plan_fn, source: int | None):
    """``(pairs, index, ranks)``: ``pairs = plan_fn(index)`` planned from the checkpoint's global
    index, opening only the rank files the pairs read and ``source`` (``ranks``; ``None``: none
    besides), whose own metadata are then checked against what the index said (``index``: theirs);
    ``None`` when the checkpoint has no index, or one that is damaged or disagrees with its files
    (logged: the caller then reads every rank file's metadata, and raises what is really wrong)."""
    gi = None
    try:
        gi = read_index(reader.ckpt, reader.manifest)
        if gi is None:
            return None
        reader.records_from(gi)  # the records of the files it opens, from the index (closed with the reader)
        view = GlobalIndexView(gi)
        pairs = plan_fn(view)
        ranks = sorted({r.rank for r, _ in pairs} | ({source} if source is not None else set()))
        local = CheckpointIndex.from_reader(reader, ranks)
        view.check(local)
    except CheckpointError as e:
        if gi is not None:
            reader.records_from(None)
        log.warning("rank %d: %s; reading every rank file's metadata instead", reader.rank, e)
        return None
    return pairs, local, ranks
