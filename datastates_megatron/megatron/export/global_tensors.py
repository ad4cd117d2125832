"""megatron-core's global tensors of a lazy checkpoint, assembled without Megatron-LM or the old layout.

Since identity 3 every parameter's metadata records where it sits in megatron-core's global tensor:
its sharded key, the global shape and the block's offset (:class:`..checkpointing.reshard.Block`).
:func:`global_blocks` lists the distinct blocks of a checkpoint -- one per ``(sharded key, offset)``:
the copies a data-parallel group or a tied embedding holds are one block -- from its global index
(or, for a checkpoint without one, its rank files' metadata).  :func:`read_blocks` reads blocks
through the engine's one verifying reader (every checksum chunk touched is verified before anything
is handed out) from whichever old ranks hold their element ranges; :func:`assemble` puts one global
tensor together from its blocks.

:func:`exported_names` names each global tensor by megatron-core's sharded key (without the ``module.``
prefixes of a wrapped chunk), which is also what megatron-core's ``torch_dist`` checkpoints and
conversion tools use, with the axes megatron-core prepends (the layer number, the expert number)
expanded: one tensor per global index, the number put into the key where the parameter's own name
has its local number (``decoder.layers.self_attention.linear_qkv.weight`` of global shape
``(L, 3h, h)`` becomes ``decoder.layers.<l>.self_attention.linear_qkv.weight`` for ``l < L``, the
names a single-rank model's ``state_dict`` has with Transformer Engine layers; the local layers'
``input_layernorm.weight`` is their ``self_attention.linear_qkv.layer_norm_weight``).

Thread-safety: plain functions; the reader passed in is used from the calling thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ...engine.errors import LayoutMismatchError
from ...engine.format.global_index import read_index
from ...engine.storage.url import is_object_url
from ...engine.load.load_plan import LoadPlan, ReadItem
from ...engine.load.reader import CheckpointReader
from ..checkpointing.blocks import record_problem
from ..checkpointing.reshard import Block, CheckpointIndex, GlobalIndexView, StaleIndexError

__all__ = [
    "GlobalBlock",
    "assemble",
    "assemble_at",
    "close_index",
    "count_blocks",
    "exported_names",
    "global_blocks",
    "megatron_key",
    "open_index",
    "read_blocks",
]

log = logging.getLogger(__name__)

IDENTITY_2_HINT = (
    "it was written before each tensor's global coordinates were recorded (identity 2, an older "
    "datastates-megatron): export it with "
    "Megatron-LM instead (`datastates-ckpt export CKPT OUT --format torch_dist --megatron-lm DIR -- TRAINING_FLAGS`, "
    "on as many CPU ranks as the checkpoint has)"
)


@dataclasses.dataclass(frozen=True)
class GlobalBlock:
    """One block of a global tensor and the old parameter read for it (the first by name of those
    that hold it)."""

    param: tuple[str, int, str]  # (slice, chunk, parameter name) in the checkpoint
    block: Block
    dtype: str  # torch dtype name, e.g. "float32"
    prepended: int  # axes megatron-core prepends to the parameter (layer, expert number)

    @property
    def numel(self) -> int:
        return math.prod(self.block.shape)


def open_index(reader: CheckpointReader, ranged: bool = True) -> CheckpointIndex:
    """The checkpoint's index of every slice: with ``ranged``, from its global index when it has a
    usable one (no rank file opened to plan; close with :func:`close_index`), else (or for a reader
    of every file anyway) from every rank file's metadata."""
    gi = None
    if not ranged:
        return CheckpointIndex.from_reader(reader)
    try:
        gi = None if is_object_url(reader.ckpt) else read_index(reader.ckpt, reader.manifest)
        if gi is not None:
            view = GlobalIndexView(gi)
            view.all_params()
            return view
    except StaleIndexError as e:
        log.warning("%s: %s; reading every rank file's metadata instead", reader.ckpt, e)
        _close(gi)
    return CheckpointIndex.from_reader(reader)


def _close(gi) -> None:
    close = getattr(gi, "close", None)
    if close is not None:
        close()


def close_index(index: CheckpointIndex) -> None:
    """Close the global index a :class:`GlobalIndexView` reads (nothing for another index)."""
    if isinstance(index, GlobalIndexView):
        _close(index.gi)


def megatron_key(key: str) -> str:
    """The sharded key as megatron-core's checkpoints name it: without the ``module.`` prefixes that
    the recorded key has where it was taken from a wrapped model chunk."""
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


def global_blocks(index: CheckpointIndex, ckpt: str) -> dict[str, list[GlobalBlock]]:
    """``{sharded key: [GlobalBlock]}``, blocks in offset order, keys sorted.  Raises
    :class:`LayoutMismatchError` naming a parameter without global coordinates."""
    index.all_params()
    if not index.params:
        raise LayoutMismatchError(
            f"{ckpt}: no parameter with a global identity in this checkpoint: nothing to export from global "
            f"coordinates; if {IDENTITY_2_HINT.replace(': export it', ', export it', 1)}"
        )
    seen: dict[tuple[str, tuple[int, ...]], GlobalBlock] = {}
    olds: dict[str, list] = {}  # megatron key -> [((param, i), Block)], for the tiling check
    for pkey in sorted(index.params):
        pieces = index.blocks.get(pkey)
        if not pieces:
            raise LayoutMismatchError(
                f"{ckpt}: parameter {pkey[2]!r} (slice {pkey[0] or '-'}, chunk {pkey[1]}) has no global "
                f"coordinates: {IDENTITY_2_HINT}; or megatron-core declares it otherwise than as a plain "
                "ShardedTensor or a factory of contiguous pieces, which only Megatron-LM's export rebuilds"
            )
        shape, dtype = index.params[pkey]
        bad = record_problem(tuple(pieces), math.prod(shape))  # the pieces tile the parameter, in its order
        if bad is not None:
            raise LayoutMismatchError(f"{ckpt}: parameter {pkey[2]!r} (slice {pkey[0]}) ({bad[0].key}) {bad[1]}")
        for i, block in enumerate(pieces):
            gb = GlobalBlock(pkey, block, dtype, len(block.shape) - len(shape))
            seen.setdefault((megatron_key(block.key), block.offset), gb)  # one per block, however wrapped
            olds.setdefault(megatron_key(block.key), []).append(((pkey, i), block))
    for group in olds.values():
        index.check_tiling(group)  # the reshard's check: in bounds, disjoint, covering, replicas once
    out: dict[str, list[GlobalBlock]] = {}
    for (key, _), gb in sorted(seen.items()):
        out.setdefault(key, []).append(gb)
    return out


def count_blocks(path: str) -> int:
    """The number of distinct global blocks of checkpoint ``path`` (an ``iter_*`` directory); raises
    what :func:`global_blocks` raises, before anything is started or written."""
    from ...engine.format.manifest import read_manifest

    with CheckpointReader(path, read_manifest(path), verify=False, threads=1) as reader:
        index = open_index(reader)
        try:
            return sum(len(b) for b in global_blocks(index, path).values())
        finally:
            close_index(index)


def read_blocks(
    reader: CheckpointReader, index: CheckpointIndex, blocks: list[GlobalBlock], files: dict | None = None
) -> list[torch.Tensor]:
    """Each block's values (shape ``block.shape``), read by one verified plan (from a global index:
    after the pieces it named are checked against the metadata of the files read).  ``files``: a
    cache of those files' metadata index by the ranks read, for a caller that reads many times."""
    out, items = [], []
    if isinstance(index, GlobalIndexView):
        index.used.clear()  # what this plan uses
    for gb in blocks:
        t = torch.empty(gb.block.shape, dtype=getattr(torch, gb.dtype))
        flat = t.view(-1)
        start = gb.block.start  # a factory's piece starts inside its parameter
        for r, at in index.ranges((*gb.param, "param"), start, start + gb.numel):
            items.append(ReadItem(r, flat[at : at + r.count], f"{gb.block.key} {list(gb.block.offset)}"))
        out.append(t)
    if isinstance(index, GlobalIndexView):  # the pieces the index named are those the files record
        ranks = tuple(sorted({it.source.rank for it in items}))
        local = files.get(ranks) if files is not None else None
        if local is None:
            local = CheckpointIndex.from_reader(reader, list(ranks))
            if files is not None:
                files[ranks] = local
        index.check(local)
    reader.execute(LoadPlan("export", tuple(items)))
    return out


def _where(block: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(block.offset, block.shape))


def assemble(
    reader: CheckpointReader, index: CheckpointIndex, blocks: list[GlobalBlock], files: dict | None = None
) -> torch.Tensor:
    """The global tensor of ``blocks`` (one sharded key's), whole (``files``: :func:`read_blocks`)."""
    first = blocks[0]
    full = torch.empty(first.block.global_shape, dtype=getattr(torch, first.dtype))
    for gb, values in zip(blocks, read_blocks(reader, index, blocks, files)):
        full[_where(gb.block)] = values
    return full


def assemble_at(
    reader: CheckpointReader,
    index: CheckpointIndex,
    blocks: list[GlobalBlock],
    at: tuple[int, ...],
    files: dict | None = None,
) -> torch.Tensor:
    """``global[at]`` for an index ``at`` into the axes megatron-core prepends (one layer of a
    ``decoder.layers.*`` tensor), reading only the blocks that lie there: the memory is one layer's,
    not the stack's.  A block that spans several prepended indices is read whole and cut."""
    p = len(at)
    if p == 0:
        return assemble(reader, index, blocks, files)
    here = [gb for gb in blocks if gb.block.offset[:p] == at]
    if not here or any(n != 1 for gb in blocks for n in gb.block.shape[:p]):  # then ``here`` tiles global[at]
        return assemble(reader, index, blocks, files)[at]
    first = here[0]
    full = torch.empty(first.block.global_shape[p:], dtype=getattr(torch, first.dtype))
    for gb, values in zip(here, read_blocks(reader, index, here, files)):
        full[_where(gb.block)[p:]] = values.reshape(gb.block.shape[p:])
    return full


def exported_names(key: str, blocks: list[GlobalBlock]) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, index into the prepended axes)]`` for the global tensor ``key`` (module docstring):
    ``[(key, ())]`` when megatron-core prepends no axis, or when the parameter's name does not show
    where its local numbers stand."""
    first = blocks[0]
    p = first.prepended
    if p == 0:
        return [(key, ())]
    name, ktoks = megatron_key(first.param[2]).split("."), key.split(".")
    at, i, j = [], 0, 0  # the key's token positions where the name has a local number
    while i < len(name) and j <= len(ktoks):
        if j < len(ktoks) and name[i] == ktoks[j]:
            j += 1
        elif name[i].isdigit():
            at.append(j)
        else:
            break  # the rest is renamed by the module's keys map (input_layernorm -> linear_qkv.layer_norm_*)
        i += 1
    if len(at) != p:
        log.warning("%s: cannot tell where its %d prepended axes stand in %r: exported whole", key, p, first.param[2])
        return [(key, ())]
    out = []
    for flat in range(math.prod(first.block.global_shape[:p])):
        idx, rest = [], flat
        for n in reversed(first.block.global_shape[:p]):
            idx.append(rest % n)
            rest //= n
        idx.reverse()
        toks = list(ktoks)
        for pos, v in sorted(zip(at, idx), reverse=True):
            toks.insert(pos, str(v))
        out.append((".".join(toks), tuple(idx)))
    return out
