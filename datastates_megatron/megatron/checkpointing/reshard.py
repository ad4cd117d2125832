"""Load a lazy checkpoint written at another data-, tensor-, (virtual) pipeline- or expert-parallel size (same model).

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

A TP, PP, VPP or EP change goes through megatron-core's *global* coordinates.  Identity 3 records, once per
run at registration, each parameter's sharded key, global shape and global offset as the model's own
``sharded_state_dict`` declares them (:func:`.shards.global_blocks`); at load the new layout's
``sharded_state_dict`` gives each live parameter's block, and :func:`block_segments` maps every new
shard's element range onto the old blocks of the same key.  Why recorded at save rather than
derived at load from the new layout's partition dims with the old TP size: at TP1 nothing is
fragmented, so a TP1 layout cannot tell which axis a TP2 checkpoint split; the recorded offsets also
carry the global layer number (pipeline stages and virtual chunks map by it, never by local index),
the global expert index
and the vocabulary padding, and they cost one ``sharded_state_dict`` call per registration.  The
old blocks are read from the checkpoint's files, so they are checked first (:mod:`.blocks`: each in
bounds, all of one global tensor tiling it exactly once), a failure refused naming the file, rank
and parameter.  Rows that another vocabulary padding adds are zeroed after the verified copy
(``ReshardPlanner.zeros``), as megatron-core's load of an ``allow_shape_mismatch`` tensor does --
only when both runs record the same vocabulary, or the user asked for another
(:func:`check_vocabulary`); no other element is ever left unread.  Across a TP or PP change the RNG
is not restored (Megatron-LM ignores it there; across a VPP or EP change alone it is); model buffers and extra state that holds
something (FP8 metadata: not ``None`` or empty), named by local module path, are refused.

A change of CP, or another model, is refused before anything is written, in one line naming
a parameter, its shapes in the checkpoint and in this run, and both layouts (:func:`check_layout`,
:func:`plan_restore`); so is a checkpoint whose identity predates the model-parallel slice, or (for
a TP, PP, VPP or EP change) the global coordinates, naming the conversion that still works.

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
import math
import re
import time

import torch

from ...engine.errors import CheckpointError, CorruptCheckpointError, LayoutMismatchError
from ...engine.format.global_index import GlobalIndex, RangedIndex, read_index
from ...engine.storage.url import is_object_url
from ...engine.load.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem
from ...engine.format.manifest import Manifest
from ...engine.load.reader import CheckpointReader
from . import model_state, training_state
from .blocks import Block, block_segments, blocks_of, record_problem, tiling_problem
from .shards import (
    IDENTITY_VERSION,
    IDENTITY_VERSIONS_READ,
    global_blocks,
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
    "Block",
    "EXPORT_HINT",
    "CONVERT_HINT",
    "check_layout",
    "check_vocabulary",
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
_GLOBAL = ("tp", "pp", "model_chunks", "ep")  # ... except of these: mapped through megatron-core's global coordinates
_TP_PP = ("tp", "pp")  # across a change of these Megatron-LM ignores the RNG state
_OPT_NAME = re.compile(r"^opt(\d+)\.g(\d+)\.p(\d+)\.")
_TEXT = (("tp", "TP", True), ("pp", "PP", True), ("model_chunks", "VPP", False), ("dp", "DP", True))
_TEXT += (("cp", "CP", False), ("ep", "EP", False))
_VOCABULARY_HINT = "pass --lazy-ckpt-allow-vocab-change to load it anyway (rows past the checkpoint's start at zero)"


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


def _refusal(ckpt: str, old: dict, new: dict, what: str, convert: bool = False) -> LayoutMismatchError:
    """One line: what cannot be restored, both layouts and, for a layout change this module does not
    map (or ``convert``: a checkpoint too old for it), the conversion."""
    moved = [k for k in (*_MODEL_PARALLEL, "cp") if old.get(k) != new.get(k)]
    unmapped = [k for k in moved if k not in _GLOBAL]
    hint = ""
    if unmapped:
        hint = (
            f"; only the data-parallel, tensor-, (virtual) pipeline- and expert-parallel sizes may change on load "
            f"({', '.join(unmapped)} differ): {_conversion(ckpt)}"
        )
    elif convert:
        hint = f"; {_conversion(ckpt)}"

    return LayoutMismatchError(
        f"{ckpt}: cannot restore the checkpoint ({layout_text(old)}) in this run ({layout_text(new)}): {what}{hint}"
    )


def check_layout(manifest: Manifest, ckpt: str, world_size: int, layout: dict) -> bool:
    """``False``: the checkpoint has this run's layout (plain restore).  ``True``: restore by
    parameter identity with :class:`ReshardPlanner` -- a data-, tensor-, (virtual) pipeline- or
    expert-parallel change (another model the planner refuses, naming a parameter and its shapes).  A change it can tell
    from the manifest alone (the context-parallel size, a world size that does not follow from the
    data-parallel size) raises :class:`LayoutMismatchError` here, naming both layouts."""
    old = manifest.layout
    if manifest.world_size == world_size and dict(old) == dict(layout):
        return False
    sizes = [old.get(k, 1) for k in ("tp", "pp", "cp", "dp")]
    if all(isinstance(n, int) and n > 0 for n in sizes) and math.prod(sizes) != manifest.world_size:
        raise LayoutMismatchError(  # a manifest that contradicts itself: nothing is mapped from it
            f"{ckpt}: cannot restore the checkpoint ({layout_text(old)}, world size {manifest.world_size}) in this "
            f"run ({layout_text(layout)}, world size {world_size}): the checkpoint's layout does not multiply to its "
            "world size (TP×PP×CP×DP); its manifest is damaged"
        )
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
    if meta.get("identity") not in IDENTITY_VERSIONS_READ and not (legacy and meta.get("identity") == 1):
        raise LayoutMismatchError(
            f"{where}: rank {rank} tensor {name!r} has global identity version {meta.get('identity')!r}, not "
            f"{' or '.join(map(str, IDENTITY_VERSIONS_READ))} (written by an older datastates-megatron, without its model-parallel slice): it "
            f"restores only in the layout that wrote it; to load it in another layout, {_conversion(where)}"
        )
    c, sl = int(meta["chunk"]), str(meta.get("slice", ""))
    if kind == "param_shard":
        params, pieces = [], []
        blocks = meta.get("global") or {}
        for pname, shape, dtype, start, end, offset in meta["params"]:
            params.append(((sl, c, pname), shape, dtype, blocks.get(pname)))
            pieces.append(((sl, c, pname, "param"), int(offset), int(start), int(end)))
        return params, pieces, None
    key = (sl, c, meta["param"])
    what = "main" if kind == "main_param" else meta["key"]
    params = [(key, meta["shape"], meta["dtype"], meta.get("global"))]
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
        for key, shape, dtype, block in got[0]:
            value = [[int(x) for x in shape], str(dtype)]
            params[json.dumps(list(key))] = value if block is None else [*value, block]
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
        self.blocks: dict[
            tuple[str, int, str], tuple[Block, ...]
        ] = {}  # param -> where it sits in megatron's global tensors
        # sharded key -> (param, index of its block)
        self.by_global: dict[str, list[tuple[tuple[str, int, str], int]]] = collections.defaultdict(list)
        self.origins: dict[tuple[str, int, str], str] = {}  # param -> "FILE: rank R tensor T" that recorded its blocks

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

    def all_params(self) -> None:
        """Make :attr:`params` and :attr:`blocks` hold every slice's parameters (here: already)."""

    def prefetch(self, key: tuple[str, int, str, str], start: int, end: int) -> None:
        """Say that :meth:`ranges` of ``key`` will be asked, many times, within ``[start, end)`` (a
        block resharded row by row); here every piece is in memory already."""

    def _add(self, reader: CheckpointReader, rank: int, name: str, meta, legacy: bool = False) -> None:
        zero_dim = (
            isinstance(meta, dict) and meta.get("kind") == "optimizer_state" and not reader.entry(rank, name).shape
        )
        got = _described(reader.ckpt, rank, name, meta, zero_dim, legacy)
        if got is None:
            return
        params, pieces, scalar = got
        for key, shape, dtype, block in params:
            self._param(reader, key, shape, dtype)
            self._block(key, block, lambda: f"{reader.rank_file(rank).path}: rank {rank} tensor {name!r}")
        for key, offset, start, end in pieces:
            self.pieces[key].append(_Piece(rank, name, offset, start, end))
        m = _OPT_NAME.match(name)
        if m and meta.get("kind") != "param_shard":
            self.positions[(rank, int(m.group(1)), int(m.group(2)), int(m.group(3)))] = params[0][0]
        if scalar is not None:
            self.scalars.setdefault(scalar, ElementRange(rank, name, 0, 1))
            self.holders[scalar].add((rank, name))

    def _block(self, key, block, origin) -> None:
        """Record parameter ``key``'s blocks (``origin()``: who recorded them, for an error), each
        checked on its own (:func:`.blocks.record_problem`) and against an earlier record of them."""
        if block is None:
            return
        try:
            blocks = blocks_of(block)
        except (TypeError, ValueError, IndexError) as e:
            raise self._bad_blocks(origin(), key, f"has global coordinates that do not parse ({e})") from e
        known = self.blocks.get(key)
        if known is not None:
            if known != blocks:
                raise self._bad_blocks(origin(), key, f"is recorded in other global coordinates by {self.origins[key]}")
            return
        bad = record_problem(blocks, math.prod(self.params[key][0]))
        if bad is not None:
            raise self._bad_blocks(origin(), key, f"({bad[0].key}) {bad[1]}")
        self.blocks[key] = blocks
        self.origins[key] = origin()
        for i, b in enumerate(blocks):
            self.by_global[b.key].append((key, i))

    def _bad_blocks(self, origin: str, key, problem: str) -> CheckpointError:
        """The one-line refusal of a checkpoint whose global coordinates cannot be read from."""
        return CorruptCheckpointError(
            f"{origin}: parameter {_named(key)} {problem}: the checkpoint's global coordinates are damaged or "
            "crafted; nothing is restored from them"
        )

    def check_tiling(self, olds: list) -> None:
        """Raise unless the old blocks ``olds`` (``[((param, i), Block)]``, one global key) tile their
        global tensor exactly once (:func:`.blocks.tiling_problem`), naming the file and rank that
        recorded the block where it shows."""
        bad = tiling_problem(olds)
        if bad is not None:
            (key, _i), text, other = bad
            if other is not None:
                text += f" (parameter {_named(other[0])}, {self.origins[other[0]]})"
            raise self._bad_blocks(self.origins[key], key, text)

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
        self.windows: dict[tuple, tuple[int, int, list[_Piece]]] = {}  # key -> (start, end, its pieces there)
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
            shape, dtype = value[:2]
            self.params[(str(sl), int(c), pname)] = (tuple(int(x) for x in shape), str(dtype))
            self._block((str(sl), int(c), pname), value[2] if len(value) > 2 else None, lambda: self.gi.path)
        return super().params_of(slices)

    def all_params(self) -> None:
        """Every slice's parameter tables (a TP, PP or EP change maps this rank's parameters onto old
        slices other than its own; the tables grow with the model, not with the ranks)."""
        self.params_of(self.gi.slices())

    def _bad_blocks(self, origin: str, key, problem: str) -> CheckpointError:
        """The index names no rank file: the caller reads every rank file's metadata instead, and
        refuses from there, naming the file and rank (or restores, when only the index was wrong)."""
        return StaleIndexError(f"{self.gi.path}: parameter {_named(key)} {problem}")

    def prefetch(self, key: tuple[str, int, str, str], start: int, end: int) -> None:
        """Read the pieces of ``key`` overlapping ``[start, end)`` once: the :meth:`ranges` calls
        within it filter them (the same pieces, in the same order, as a query of their own)."""
        pieces = [_Piece(r, t, o, s, e) for r, t, o, s, e in self.gi.pieces(json.dumps(list(key)), start, end)]
        self.windows[key] = (start, end, pieces)

    def ranges(self, key: tuple[str, int, str, str], start: int, end: int) -> list[tuple[ElementRange, int]]:
        window = self.windows.get(key)
        if window is not None and window[0] <= start and end <= window[1]:
            found = [p for p in window[2] if p.end > start and p.start < end]
        else:
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


def _check_params(index: CheckpointIndex, keys: dict, ckpt: str, old: dict, new: dict, resize: bool = False) -> bool:
    """Raise one :class:`LayoutMismatchError` line unless the checkpoint holds, for this rank's
    model-parallel slices, exactly this model's parameters with their shapes and dtypes: it names the
    first parameter that differs (a shape first, then one missing on either side), both of its
    shapes and both layouts.  With ``resize``, ``True`` instead when only shapes differ and the
    checkpoint has global coordinates (the caller maps them, which allows only rows of a tensor
    padded to the vocabulary); ``False`` when nothing differs."""
    live = {key: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p, key in keys.items()}
    slices = {key[0] for key in live}
    saved = index.params_of(slices)
    differ = sorted(k for k in live.keys() & saved.keys() if saved[k] != live[k])
    missing = sorted(live.keys() - saved.keys())
    extra = sorted(saved.keys() - live.keys())
    bad = differ + missing + extra
    if not bad:
        return False
    if resize and not missing and not extra and all(k in index.blocks for k in differ):
        return True
    first = bad[0]
    more = f" ({len(bad) - 1} more parameters differ)" if len(bad) > 1 else ""
    if (
        not missing
        and not extra
        and all(k in index.blocks and all(b.mismatch for b in index.blocks[k]) for k in differ)
    ):
        more += f"; another vocabulary: {_VOCABULARY_HINT}"  # only tensors padded to the vocabulary differ
    raise _refusal(
        ckpt,
        old,
        new,
        f"parameter {_named(first)} is {_shape_text(saved.get(first))} in the checkpoint, "
        f"{_shape_text(live.get(first))} in this run{more}",
    )


def _global_mapping(
    model, keys: dict, index: CheckpointIndex, ckpt: str, old: dict, new: dict, resized: dict | None = None
) -> dict:
    """``{live parameter key: (its Block, [(old parameter key, old Block)])}`` for a TP/PP change;
    raises one :class:`LayoutMismatchError` line naming the first parameter that cannot be mapped
    (no global coordinates on either side, absent from the checkpoint, another global shape or dtype
    -- but the rows of a tensor megatron-core pads to the vocabulary, ``allow_shape_mismatch``: those
    go into ``resized``, ``{live parameter key: (sharded key, old rows, new rows)}``, for the caller
    to judge), and a :class:`CorruptCheckpointError` line when the old blocks of a global key do not
    tile it exactly once (:meth:`CheckpointIndex.check_tiling`)."""
    index.all_params()
    if not index.blocks:
        raise _refusal(
            ckpt,
            old,
            new,
            f"its tensors carry no global coordinates (identity version 2, before {IDENTITY_VERSION}: written by "
            "an older datastates-megatron)",
            convert=True,
        )
    blocks = global_blocks(model)
    out = {}
    tiled: set[str] = set()
    for p, key in sorted(keys.items(), key=lambda kv: kv[1]):
        live = (tuple(p.shape), str(p.dtype).removeprefix("torch."))
        if p not in blocks:
            raise _refusal(
                ckpt,
                old,
                new,
                f"parameter {_named(key)} has no global coordinates in megatron-core's sharded_state_dict",
            )
        pieces = []
        for b in blocks_of(blocks[p]):
            olds = [(k, index.blocks[k[0]][k[1]]) for k in index.by_global.get(b.key, ())]
            if not olds:
                raise _refusal(
                    ckpt,
                    old,
                    new,
                    f"parameter {_named(key)} ({b.key}) is absent in the checkpoint, {_shape_text(live)} in this run",
                )
            if b.key not in tiled:
                index.check_tiling(olds)
                tiled.add(b.key)
            shape = olds[0][1].global_shape
            dtype = index.params[olds[0][0][0]][1]
            rows_only = b.mismatch and len(shape) == len(b.global_shape) > 0 and shape[1:] == b.global_shape[1:]
            if (shape != b.global_shape and not rows_only) or dtype != live[1]:
                raise _refusal(
                    ckpt,
                    old,
                    new,
                    f"parameter {_named(key)} ({b.key}) is {dtype} {list(shape)} globally in the checkpoint, "
                    f"{live[1]} {list(b.global_shape)} in this run",
                )
            if shape != b.global_shape and resized is not None:
                resized[key] = (b.key, shape[0], b.global_shape[0])
            pieces.append((b, olds))
        out[key] = pieces
    return out


def plan_restore(
    model,
    optimizer,
    index: CheckpointIndex,
    ckpt: str = "",
    old: dict | None = None,
    new: dict | None = None,
    by_slice: dict | None = None,
    optimizer_state: bool = True,
    zeros: list | None = None,
    rekey: dict | None = None,
    resized: dict | None = None,
    resize: bool = False,
) -> list[tuple[ElementRange, torch.Tensor]]:
    """``(source range, destination view)`` for every element this rank must restore: its shard of
    each DDP bucket, its non-view main params and every tensor of their optimizer state (those two
    only with ``optimizer_state``).  ``old``, ``new``: the checkpoint's and this run's layouts (named
    in a refusal; a change of the data-parallel size is mapped by parameter, of TP, PP and EP through
    megatron-core's global coordinates, any other refused).  ``by_slice``, when given, is filled with
    ``{slice: old ranks}``: the old rank files the plan reads per model-parallel slice.  ``zeros``,
    when given, gets the destination views no old element covers: the rows past the checkpoint's of a
    tensor megatron-core pads to the vocabulary (``allow_shape_mismatch``), listed in ``resized``
    (``{parameter key: (sharded key, old rows, new rows)}``, for the caller to judge against both
    runs' vocabularies); without ``zeros``, and anywhere else, an element no old block holds is
    refused.  ``resize`` (another vocabulary, asked for): at a data-parallel change or in the same
    layout, parameters of other shapes are mapped through the global coordinates too.  ``rekey``, when given, gets ``{parameter key: the old parameter key read for its scalar
    state}`` (a TP, PP or EP change)."""
    old, new = dict(old or {}), dict(new or old or {})
    keys = parameter_keys(model)
    moved = [k for k in (*_MODEL_PARALLEL, "cp") if old.get(k) != new.get(k)]
    mapping = None
    grown: dict = {}
    by_global = bool(moved) and not set(moved) - set(_GLOBAL)
    if not by_global:
        by_global = _check_params(index, keys, ckpt, old, new, resize)
        if moved:  # a model-parallel change not mapped here (the parameters matched, or only their shapes differ)
            what = "parameters of other shapes" if by_global else "the parameters of this rank's slices match"
            raise _refusal(ckpt, old, new, f"{what}, but the layout differs")
    if by_global:
        mapping = _global_mapping(model, keys, index, ckpt, old, new, grown)
        if resized is not None:
            resized.update(grown)
        if rekey is not None:
            rekey.update({key: pieces[0][1][0][0][0] for key, pieces in mapping.items()})
    names = parameter_names(model)
    plan: list[tuple[ElementRange, torch.Tensor]] = []
    found = by_slice if by_slice is not None else {}

    def add_old(key, start, end, dst):
        for r, at in index.ranges(key, start, end):
            plan.append((r, dst[at : at + r.count]))
            found.setdefault(key[0], set()).add(r.rank)

    def add(key, start, end, dst):
        if mapping is None:
            return add_old(key, start, end, dst)
        for b, olds in mapping[key[:3]]:  # one block, or the pieces of a ShardedTensorFactory
            lo, hi = max(start, b.start), min(end, b.start + b.size)
            if lo >= hi:
                continue
            base = lo - start
            segments, gaps = block_segments(b, olds, lo - b.start, hi - b.start)
            windows: dict = {}
            for (okey, i), oa, ob, _pos in segments:  # the old range each old block is read in
                at = index.blocks[okey][i].start
                w = windows.get(okey)
                windows[okey] = (min(w[0], at + oa), max(w[1], at + ob)) if w else (at + oa, at + ob)
            for okey, (wa, wb) in windows.items():
                index.prefetch((*okey, key[3]), wa, wb)
            for (okey, i), oa, ob, pos in segments:
                at = index.blocks[okey][i].start
                add_old((*okey, key[3]), at + oa, at + ob, dst[base + pos : base + pos + ob - oa])
            if gaps and (zeros is None or key[:3] not in grown or grown[key[:3]][1] >= grown[key[:3]][2]):
                a, _ = gaps[0]
                raise _refusal(
                    ckpt,
                    old,
                    new,
                    f"the checkpoint holds no element {lo + a} of {key[3]} of parameter {_named(key)} ({b.key})",
                )
            if gaps:
                zeros.extend(dst[base + a : base + e] for a, e in gaps)

    def scalar_key(pkey, key):
        return (*(mapping[pkey][0][1][0][0][0] if mapping is not None else pkey), key)

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
                src = index.scalar(scalar_key(pkey, key), start, end)
                if src is None:
                    raise LayoutMismatchError(f"{ckpt}: no {key!r} for parameter {_named(pkey)} in the checkpoint")
                plan.append((src, value))
                found.setdefault(scalar_key(pkey, key)[0], set()).add(src.rank)
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
    reader: CheckpointReader, index: CheckpointIndex, optimizer, model, source_rank: int, ranks, rekey=None
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
        key = keys[owner[0]] if owner is not None else None
        key = (rekey or {}).get(key, key)
        found = by_param.get((m.opt, key)) if key is not None else None
        if found:
            plain[m.opt][f"g{m.group}.p{m.index}"] = found
    training["optimizers"] = [{**o, "plain_state": p} for o, p in zip(training["optimizers"], plain)]
    return training


class ReshardPlanner(LoadPlanner):
    """This rank's shards of ``model``/``optimizer`` from a checkpoint of another DP, TP, PP or EP size
    (or of the same layout with another bucket layout), by parameter identity: only the element
    ranges this rank needs, from whichever old rank files hold them.  ``layout``: this run's (the
    checkpoint's is its manifest's); a CP change is refused.  The plan's objects are the source rank's non-tensor state with
    ``training`` re-keyed for this rank (ready for ``training_state.restore``); the caller
    all-gathers the param buffers afterwards."""

    kind = "reshard"
    reads_all_ranks = True

    def __init__(
        self,
        model,
        optimizer,
        layout: dict | None = None,
        optimizer_state: bool = True,
        vocabulary: int | None = None,
        vocabulary_change: bool = False,
    ) -> None:
        """``optimizer_state=False``: the model only (its param buffers; main params and optimizer
        state are left as they are, and the plan's ``training`` is the source rank's, not re-keyed).
        ``vocabulary``: this run's vocabulary before padding (``None``: not declared); the rows of
        another padding are zero-filled or dropped only when the checkpoint records the same one,
        another vocabulary only with ``vocabulary_change`` (:func:`check_vocabulary`)."""
        self.model = model
        self.optimizer = optimizer
        self.layout = dict(layout) if layout is not None else None
        self.optimizer_state = optimizer_state
        self.vocabulary = vocabulary
        self.vocabulary_change = vocabulary_change
        self.zeros: tuple[torch.Tensor, ...] = ()  # views the last plan leaves to zero (vocabulary padding)

    def plan(self, reader: CheckpointReader) -> LoadPlan:
        t0 = time.perf_counter()
        manifest: Manifest = reader.manifest
        old = dict(manifest.layout)
        new = self.layout if self.layout is not None else old
        by_slice: dict[str, set[int]] = {}
        zeros: list[torch.Tensor] = []
        rekey: dict = {}
        resized: dict = {}

        def plan_fn(index):
            by_slice.clear()
            zeros.clear()
            rekey.clear()
            resized.clear()
            return plan_restore(
                self.model,
                self.optimizer,
                index,
                reader.ckpt,
                old,
                new,
                by_slice,
                self.optimizer_state,
                zeros,
                rekey,
                resized,
                self.vocabulary_change,
            )

        planned = plan_by_global_index(reader, plan_fn, None)
        if planned is None:  # no (usable) global index: the metadata of every rank file
            index = CheckpointIndex.from_reader(reader)
            planned = plan_fn(index), index, range(manifest.world_size)
        pairs, index, ranks = planned
        source = source_rank(reader.rank, manifest.world_size, by_slice)
        objects = reader.objects(source)
        if resized:
            recorded = objects.get("vocabulary")
            why = check_vocabulary(resized, recorded, self.vocabulary, self.vocabulary_change)
            if why is not None:
                raise _refusal(reader.ckpt, old, new, why)
            if reader.rank == 0:
                key, rows, now = next(iter(resized.values()))
                level = logging.INFO if recorded == self.vocabulary else logging.WARNING  # padding only, or asked for
                log.log(
                    level,
                    "iteration %d: %s has %d rows in the checkpoint (vocabulary %s), %d in this run (vocabulary %s): "
                    "rows past the checkpoint's start at zero (parameter, main parameter and optimizer moments), rows "
                    "past this run's are not read",
                    manifest.iteration,
                    key,
                    rows,
                    recorded,
                    now,
                    self.vocabulary,
                )
        training = objects["training"]
        if self.optimizer_state:
            training = _remap_training(
                reader, index, self.optimizer, self.model, source, sorted({*ranks, source}), rekey
            )
        moved = [k for k in _GLOBAL if old.get(k) != new.get(k)]
        if moved:
            objects = dict(objects)
            training = self._across_model_parallel(reader, objects, training, old, new, set(moved) & set(_TP_PP))
        self.zeros = tuple(zeros)
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

    def _across_model_parallel(
        self, reader: CheckpointReader, objects: dict, training: dict, old, new, tp_pp: bool
    ) -> dict:
        """Non-tensor state across a TP, PP or EP change, by Megatron-LM's rules: across a TP or PP
        change (``tp_pp``) the RNG states are ignored (this process keeps its own, as Megatron-LM's
        load does at another (TP, PP)); model
        buffers and extra state, named by local module path, are refused (before anything is written)
        unless they hold nothing (extra state ``None`` -- megatron-core's own layers -- or empty --
        Transformer Engine's layers without FP8: :func:`.model_state.held_state`)."""
        held = model_state.held_state(objects.get("model_state"))
        if held:
            raise _refusal(
                reader.ckpt,
                old,
                new,
                f"model buffers or extra state ({', '.join(held[:3])}) are kept per local module and cannot be "
                "mapped to another tensor-, pipeline- or expert-parallel layout",
                convert=True,
            )
        objects["model_state"] = model_state.capture(self.model)  # no buffers, no extra state but None: as built
        if not tp_pp:
            return training
        if reader.rank == 0:
            log.info(
                "(TP, PP) changed (%s → %s): RNG state ignored, as Megatron-LM does",
                layout_text(old),
                layout_text(new),
            )
        return {**training, "rng": training_state.capture_rng()}


def _vocabulary(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_vocabulary(resized: dict, recorded, declared, change: bool) -> str | None:
    """Why the rows of the tensors ``resized`` (``{parameter key: (sharded key, rows in the
    checkpoint, rows now)}``, tensors megatron-core pads to the vocabulary) may not be zero-filled or
    dropped, or ``None``: they may when both runs declare the same vocabulary (``recorded`` by the
    checkpoint, ``declared`` by this run) and each run's rows hold its vocabulary -- only the padding
    differs, as megatron-core pads to ``--make-vocab-size-divisible-by`` × TP -- or, for another
    vocabulary, when the user asked for it (``change``: ``--lazy-ckpt-allow-vocab-change``)."""
    key, (sharded, rows, now) = next(iter(resized.items()))
    name = f"parameter {_named(key)} ({sharded}) has {rows} rows in the checkpoint, {now} in this run"
    if change:
        return None
    if not _vocabulary(recorded):
        return f"{name}, and the checkpoint records no vocabulary: the rows that differ cannot be told from padding; {_VOCABULARY_HINT}"
    if not _vocabulary(declared):
        return f"{name}, and this run declares no vocabulary: the rows that differ cannot be told from padding; {_VOCABULARY_HINT}"
    if recorded != declared:
        return f"{name}: another vocabulary ({recorded} in the checkpoint, {declared} in this run); {_VOCABULARY_HINT}"
    if any(rows < recorded or now < declared for _, rows, now in resized.values()):
        return f"{name}, fewer than the vocabulary of {recorded}: its rows are not the padded vocabulary"
    return None


def plan_by_global_index(reader: CheckpointReader, plan_fn, source: int | None):
    """``(pairs, index, ranks)``: ``pairs = plan_fn(index)`` planned from the checkpoint's global
    index, opening only the rank files the pairs read and ``source`` (``ranks``; ``None``: none
    besides), whose own metadata are then checked against what the index said (``index``: theirs);
    ``None`` when the checkpoint has no index, or one that is damaged or disagrees with its files
    (logged: the caller then reads every rank file's metadata, and raises what is really wrong)."""
    gi = None
    try:
        gi = None if is_object_url(reader.ckpt) else read_index(reader.ckpt, reader.manifest)
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
