"""Find, in megatron-core's live objects, every tensor a resume needs — without gathering or copying.

* model parameters: this data-parallel rank's slice of each bucket of each DDP param buffer (the
  same slicing the DistributedOptimizer uses), so across DP ranks every byte is written once;
* per inner optimizer of a ``ChainedOptimizer``: fp32 main-param shards that are not views of a
  param buffer (bf16/fp16 training; in fp32 they are the buffer slice itself) and every tensor in
  the torch optimizer's per-param state (``exp_avg``, ``exp_avg_sq``, ``step``, ...).

Each tensor gets a gate group ``opt<i>``: the pre-step hook of inner optimizer ``i`` waits only for
the snapshot of the tensors that step is about to mutate.

Tensor names are positional (``model0.buf0.bucket3.param_shard``, ``opt0.g1.p7.exp_avg``) and so only
meaningful for the data-parallel size that wrote them.  Each tensor's ``meta`` (stored by the
engine in the rank file's objects section under ``tensor_meta``) therefore also carries its *global
identity*, which :mod:`.reshard` and :mod:`..export.exporter` use to map any element back to ``(slice,
chunk, parameter name, flattened element range)``.  Every identity has ``identity`` (=
:data:`IDENTITY_VERSION`), ``slice`` and ``chunk`` (model chunk index: the virtual pipeline stage on
this rank).  ``slice`` names the model-parallel slice the parameter belongs to, which fixes what a
name and a shape mean: ``pp<P>.tp<T>`` for a dense parameter (names are local to a pipeline stage,
shapes to a tensor-parallel rank), ``pp<P>.ep<E>.etp<T>`` for an expert parameter (an
``expert_parallel_buffers`` parameter: local expert numbering, sharded by the expert data-parallel
group), ``""`` without megatron's parallel state.  Ranks with the same slice hold the same
parameters; a data-parallel change keeps every slice, so a new rank finds its new shards' elements
among the old ranks of its own slice.  Names are those of
``chunk.module.named_parameters()`` without leading ``module.`` prefixes; shapes and dtypes are the
model parameter's; element ranges index the flattened parameter:

* ``param_shard`` (+ ``buffer``, ``bucket``, ``dp_rank``, ``dp_size``): ``params`` lists
  ``[name, shape, dtype, start, end, offset]`` per parameter overlapping the shard: shard elements
  ``[offset, offset + end - start)`` hold parameter elements ``[start, end)``; byte ranges follow
  from the dtype size.  Bucket padding and the 64-element alignment gaps are simply not listed.
* ``main_param`` / ``optimizer_state`` (+ ``key``): ``param``, ``shape``, ``dtype``, ``start``,
  ``end``: the tensor holds elements ``[start, end)`` of that parameter (from the
  DistributedOptimizer's ``_get_model_param_range_map(p)["param"]``).  Torch Adam's ``step`` is a
  0-d scalar per parameter with the same identity.

Identity 3 adds ``global``: where the parameter sits in megatron-core's *global* tensor, as the
model's own ``sharded_state_dict`` declares it (:func:`global_blocks`): ``[sharded key, global shape,
global offset, block shape, allow_shape_mismatch]`` (``block shape`` is the local shape with
megatron's prepended axes, such as the layer number, as leading 1s: the flattened parameter is the
flattened block).  ``param_shard`` holds it per parameter name (``global: {name: [...]}``),
``main_param`` / ``optimizer_state`` as one list.  A parameter megatron-core declares as a
``ShardedTensorFactory`` (a fused GLU weight with ``--swiglu``: its ``w`` and ``v`` halves are
blocks of their own) records a list of such lists, one per piece the factory builds, each with the
parameter element it starts at appended; a factory whose pieces do not tile the parameter has none
(it reshards at another data-parallel size only).

Checked against megatron-core 0.16.1 (docs/megatron.md, "Where megatron-core keeps what we capture").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch

__all__ = [
    "IDENTITY_VERSION",
    "ShardRef",
    "model_chunks_of",
    "inner_optimizers",
    "distributed_optimizers",
    "collect_shards",
    "parameter_names",
    "bucket_param_ranges",
    "main_param_owners",
    "BucketShard",
    "bucket_shards",
    "param_buffers",
    "MainParam",
    "main_params",
    "MainShard",
    "main_shards",
    "storage_span",
    "model_parallel_coords",
    "expert_params",
    "parameter_keys",
    "slice_of",
    "bucket_slice",
    "model_description",
    "global_blocks",
]

log = logging.getLogger(__name__)

IDENTITY_VERSION = 3  # bumped if the meaning of the identity fields below changes (2: ``slice``; 3: ``global``)
IDENTITY_VERSIONS_READ = (2, 3)  # 2 reshards a data-parallel change only (no ``global``)


@dataclasses.dataclass(frozen=True)
class ShardRef:
    name: str
    tensor: torch.Tensor
    group: str
    meta: dict


def model_chunks_of(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def distributed_optimizers(optimizer) -> list:
    """The per-chunk megatron optimizers (``ChainedOptimizer.chained_optimizers`` or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers doing the update, in chain order."""
    return [getattr(o, "optimizer", o) for o in distributed_optimizers(optimizer)]


def _buffers(chunk) -> list[tuple[str, object]]:
    out = [(f"buf{b}", buf) for b, buf in enumerate(getattr(chunk, "buffers", []) or [])]
    out += [(f"ep_buf{b}", buf) for b, buf in enumerate(getattr(chunk, "expert_parallel_buffers", []) or [])]
    return out


def param_buffers(model) -> Iterator[tuple[int, str, object]]:
    """``(chunk index, "buf<b>" or "ep_buf<b>", buffer)`` for every DDP param buffer of every chunk."""
    for c, chunk in enumerate(model_chunks_of(model)):
        for bname, buf in _buffers(chunk):
            yield c, bname, buf


def _dp_rank_size(buf) -> tuple[int, int]:
    group = getattr(buf, "data_parallel_group", None)
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group)
    return 0, int(getattr(buf, "data_parallel_world_size", 1))


def _strip(name: str) -> str:
    while name.startswith("module."):  # Float16Module (and friends) add prefixes; Megatron strips them all
        name = name[len("module.") :]
    return name


def parameter_names(model) -> dict:
    """``{param: (chunk index, name)}``, names from ``chunk.module.named_parameters()`` without
    leading ``module.`` prefixes (local to the PP stage / VP chunk; shapes are TP-local)."""
    out = {}
    for c, chunk in enumerate(model_chunks_of(model)):
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            out.setdefault(p, (c, _strip(name)))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_param_ranges(buf, bucket, rank: int, size: int, names: dict) -> list[list]:
    """``[name, shape, dtype, start, end, offset]`` for each parameter overlapping DP rank ``rank``'s
    shard of ``bucket``: shard elements ``[offset, offset + end - start)`` hold flattened parameter
    elements ``[start, end)``.  Positions come from ``buf.param_index_map`` (buffer coordinates)."""
    step = bucket.param_data.numel() // size
    lo = bucket.offset + rank * step
    hi = lo + step
    out = []
    for p in getattr(bucket, "params_list", None) or list(bucket.params):
        p_start, p_end, _ = buf.param_index_map[p]
        a, b = max(p_start, lo), min(p_end, hi)
        if a >= b:
            continue
        _, name = names.get(p, (None, None))
        if name is None:
            raise ValueError(
                f"bucket {bucket.bucket_id}: a parameter of shape {list(p.shape)} has no name in the model"
            )
        out.append([name, list(p.shape), _dtype_name(p.dtype), a - p_start, b - p_start, a - lo])
    out.sort(key=lambda r: r[5])
    return out


@dataclasses.dataclass(frozen=True)
class BucketShard:
    """This DP rank's shard of one bucket: ``shard`` is ``views[dp_rank]`` (all DP ranks' slices)."""

    name: str
    shard: torch.Tensor
    buf: object
    views: list
    chunk: int
    buffer: str  # ``buf<b>`` or ``ep_buf<b>``
    bucket_index: int
    bucket: object
    dp_rank: int
    dp_size: int


def bucket_shards(model) -> list[BucketShard]:
    """Every bucket of every DDP param buffer of every chunk, with this rank's shard of it."""
    out = []
    for c, bname, buf in param_buffers(model):
        if getattr(buf, "param_data", None) is None:
            raise ValueError(
                f"model chunk {c} {bname} has no param_data: lazy checkpointing needs "
                "DistributedDataParallel(use_distributed_optimizer=True)"
            )
        rank, size = _dp_rank_size(buf)
        for k, bucket in enumerate(buf.buckets):
            data = bucket.param_data
            if data.numel() % size:
                raise ValueError(
                    f"chunk {c} {bname} bucket {k}: {data.numel()} elements not divisible by DP size {size}"
                )
            step = data.numel() // size
            views = [data[i * step : (i + 1) * step] for i in range(size)]
            name = f"model{c}.{bname}.bucket{k}.param_shard"
            out.append(BucketShard(name, views[rank], buf, views, c, bname, k, bucket, rank, size))
    return out


@dataclasses.dataclass(frozen=True)
class MainParam:
    """One parameter of an inner (torch) optimizer: its main param and tensor-valued state."""

    opt: int  # index of the inner optimizer in the chain (its gate group is ``opt<opt>``)
    group: int
    index: int  # position in the param group
    param: torch.Tensor  # the main param (fp32 shard, or the model param's buffer slice in fp32 training)
    state: dict  # tensor-valued optimizer state by key (``exp_avg``, ``step``, ...), sorted

    @property
    def name(self) -> str:
        return f"opt{self.opt}.g{self.group}.p{self.index}"


def main_params(optimizer) -> Iterator[MainParam]:
    """Every main param of every inner optimizer, in chain / group / position order (the names
    ``opt<i>.g<g>.p<j>`` are these positions).  Cheap: no megatron lookups."""
    for i, inner in enumerate(inner_optimizers(optimizer)):
        for g, pg in enumerate(inner.param_groups):
            for j, p in enumerate(pg["params"]):
                state = inner.state.get(p, {})
                tensors = {k: state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)}
                yield MainParam(i, g, j, p, tensors)


@dataclasses.dataclass(frozen=True)
class MainShard:
    """A :class:`MainParam` with what the DistributedOptimizer says of it."""

    main: MainParam
    owner: tuple | None  # (model param, start, end): the flattened elements it holds; None: not a DO shard
    in_bucket: bool  # a view into this rank's bucket shards (fp32 training): saved with the bucket


def main_shards(optimizer, buckets: list[BucketShard]) -> Iterator[MainShard]:
    """The DistributedOptimizer shard walk: every :func:`main_params` entry with its owning model
    parameter range and whether it lies inside one of ``buckets`` (from :func:`bucket_shards`)."""
    # the whole bucket shard counts: an fp32 main param may be a view of any part of this rank's slice
    spans = [storage_span(b.shard.detach()) for b in buckets if b.shard.numel()]
    owners = main_param_owners(optimizer)
    for m in main_params(optimizer):
        rows = owners[m.opt]
        owner = rows[m.group][m.index] if m.group < len(rows) else None
        if m.param.numel():
            s, e = storage_span(m.param.detach())
            in_bucket = any(lo <= s and e <= hi for lo, hi in spans)
        else:
            in_bucket = True
        yield MainShard(m, owner, in_bucket)


def main_param_owners(optimizer) -> list[list[list]]:
    """Per inner optimizer, per param group, per position: ``(model param, start, end)`` — the model
    parameter whose flattened elements ``[start, end)`` this main shard holds — or ``None`` where the
    optimizer is not a megatron ``DistributedOptimizer`` (pairs ``model_*_groups`` with
    ``shard_*_groups`` as megatron's own copy functions do)."""
    out = []
    for do, inner in zip(distributed_optimizers(optimizer), inner_optimizers(optimizer)):
        fp32 = getattr(do, "model_fp32_groups", None)
        f16 = getattr(do, "model_float16_groups", None)
        if fp32 is None or f16 is None or not hasattr(do, "_get_model_param_range_map"):
            out.append([[None] * len(pg["params"]) for pg in inner.param_groups])
            continue
        groups = []
        for g, pg in enumerate(inner.param_groups):
            models = [*fp32[g], *f16[g]] if g < len(fp32) else []
            if len(models) != len(pg["params"]):
                log.warning(
                    "optimizer group %d: %d main shards but %d model params; no identity recorded",
                    g,
                    len(pg["params"]),
                    len(models),
                )
                groups.append([None] * len(pg["params"]))
                continue
            row = []
            for p in models:
                r = do._get_model_param_range_map(p)["param"]
                row.append((p, int(r.start), int(r.end)))
            groups.append(row)
        out.append(groups)
    return out


def model_parallel_coords() -> dict:
    """``{"tp", "pp", "ep", "etp"}``: this process's tensor-, pipeline-, expert- and expert-tensor-parallel
    ranks, or ``{}`` without megatron's parallel state."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return {
                "tp": ps.get_tensor_model_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_rank(),
                "ep": ps.get_expert_model_parallel_rank(),
                "etp": ps.get_expert_tensor_parallel_rank(),
            }
    except ImportError:
        pass
    return {}


def slice_of(coords: dict, expert: bool) -> str:
    """The model-parallel slice of a parameter on a rank with ``coords`` (:func:`model_parallel_coords`):
    ``pp<P>.tp<T>``, or ``pp<P>.ep<E>.etp<T>`` for an expert parameter; ``""`` without coordinates."""
    if not coords:
        return ""
    if expert:
        return f"pp{coords['pp']}.ep{coords['ep']}.etp{coords['etp']}"
    return f"pp{coords['pp']}.tp{coords['tp']}"


def expert_params(model) -> set:
    """The parameters held by ``expert_parallel_buffers`` (sharded by the expert data-parallel group)."""
    out = set()
    for _c, bname, buf in param_buffers(model):
        if bname.startswith("ep_"):
            out.update(getattr(buf, "param_index_map", {}))
    return out


def parameter_keys(model, coords: dict | None = None) -> dict:
    """``{param: (slice, chunk index, name)}``: each parameter's global identity on this rank
    (``coords`` default: :func:`model_parallel_coords`)."""
    names = parameter_names(model)
    coords = model_parallel_coords() if coords is None else coords
    experts = expert_params(model)
    return {p: (slice_of(coords, p in experts), c, name) for p, (c, name) in names.items()}


def global_blocks(model) -> dict:
    """``{param: [sharded key, global shape, global offset, block shape, allow_shape_mismatch]}``
    for every parameter that megatron-core's ``sharded_state_dict`` of its model chunk declares as a
    plain ``ShardedTensor`` of the parameter itself (``{}`` for a model without one).  Keys and
    offsets carry the global layer number and the tensor-parallel partition, so pipeline stages,
    virtual chunks and TP ranks of another layout map onto the same coordinates."""
    try:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.dist_checkpointing.dict_utils import nested_values
    except ImportError:
        return {}
    out: dict = {}
    for chunk in model_chunks_of(model):
        if not hasattr(chunk, "sharded_state_dict"):
            continue
        params = {id(p): p for p in chunk.parameters()}
        for sh in nested_values(chunk.sharded_state_dict()):
            if id(getattr(sh, "data", None)) not in params or getattr(sh, "flattened_range", None) is not None:
                continue
            p = params[id(sh.data)]
            if isinstance(sh, ShardedTensor):
                block = _block_of(sh)
                if block is not None:
                    out.setdefault(p, block)
            elif isinstance(sh, ShardedTensorFactory):
                pieces = _factory_blocks(sh, p, ShardedTensor, nested_values)
                if pieces is not None:
                    out.setdefault(p, pieces)
    return out


def _block_of(sh) -> list | None:
    """``[key, global shape, global offset, block shape, allow_shape_mismatch]`` of a ``ShardedTensor``
    (``None`` where its data and prepended axes do not make its global rank)."""
    block = [1] * int(sh.prepend_axis_num) + [int(x) for x in sh.data.shape]
    if len(block) != len(sh.global_shape):
        return None
    return [
        str(sh.key),
        [int(x) for x in sh.global_shape],
        [int(x) for x in sh.global_offset],
        block,
        bool(getattr(sh, "allow_shape_mismatch", False)),
    ]


def _factory_blocks(factory, param, sharded_tensor, nested_values) -> list | None:
    """The pieces a ``ShardedTensorFactory`` of ``param`` builds (a fused GLU weight: its ``w`` and
    ``v`` halves, each a ``ShardedTensor`` of its own), as ``[*block, start]`` per piece in parameter
    order, ``start`` the parameter element the piece begins at; ``None`` unless they are contiguous
    views of ``param`` that tile it exactly (anything else has no global coordinates)."""
    built = factory.build()
    subs = (
        list(nested_values(built)) if isinstance(built, dict) else list(built if isinstance(built, list) else [built])
    )
    if not param.is_contiguous():
        return None
    base, size = param.data_ptr(), param.element_size()
    pieces = []
    for sub in subs:
        data = getattr(sub, "data", None)
        if not isinstance(sub, sharded_tensor) or sub.flattened_range is not None or not data.is_contiguous():
            return None
        if data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            return None
        block = _block_of(sub)
        if block is None:
            return None
        pieces.append([*block, (data.data_ptr() - base) // size, data.numel()])
    pieces.sort(key=lambda piece: piece[5])
    at = 0
    for piece in pieces:
        if piece[5] != at:
            return None
        at += piece.pop()
    return pieces if pieces and at == param.numel() else None


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def collect_shards(model, optimizer) -> list[ShardRef]:
    """Every tensor to snapshot, with its gate group and metadata (inspection, resharding, export)."""
    chained = distributed_optimizers(optimizer)
    owner: dict[int, int] = {}  # id(buffer) -> index of the optimizer stepping it
    for i, do in enumerate(chained):
        for buf in getattr(do, "buffers", []) or []:
            owner[id(buf)] = i
    names = parameter_names(model)
    keys = parameter_keys(model) if names else {}
    blocks = global_blocks(model) if names else {}
    refs: list[ShardRef] = []
    buckets = bucket_shards(model)
    for b in buckets:
        group = f"opt{owner.get(id(b.buf), 0)}" if owner else "opt0"
        meta = {"kind": "param_shard", "dtype": str(b.shard.dtype)}
        if names:
            meta.update(
                identity=IDENTITY_VERSION,
                slice=bucket_slice(b, keys),
                chunk=b.chunk,
                buffer=b.buffer,
                bucket=b.bucket_index,
                dp_rank=b.dp_rank,
                dp_size=b.dp_size,
                params=bucket_param_ranges(b.buf, b.bucket, b.dp_rank, b.dp_size, names),
            )
            listed = {row[0] for row in meta["params"]}
            bucket_params = getattr(b.bucket, "params_list", None) or list(b.bucket.params)
            meta["global"] = {names[p][1]: blocks[p] for p in bucket_params if p in blocks and names[p][1] in listed}
        refs.append(ShardRef(b.name, b.shard, group, meta))
    for shard in main_shards(optimizer, buckets):
        m = shard.main
        ident = {}
        if shard.owner is not None and shard.owner[0] in names:
            mp, start, end = shard.owner
            sl, c, pname = keys[mp]
            ident = {
                "identity": IDENTITY_VERSION,
                "slice": sl,
                "chunk": c,
                "param": pname,
                "shape": list(mp.shape),
                "dtype": _dtype_name(mp.dtype),
                "start": start,
                "end": end,
            }
            if mp in blocks:
                ident["global"] = blocks[mp]
        group = f"opt{m.opt}"
        if not shard.in_bucket:
            refs.append(ShardRef(f"{m.name}.main", m.param.detach(), group, {"kind": "main_param", **ident}))
        for key, value in m.state.items():
            meta = {"kind": "optimizer_state", "key": key, **ident}
            refs.append(ShardRef(f"{m.name}.{key}", value.detach(), group, meta))
    return refs


def bucket_slice(b: BucketShard, keys: dict) -> str:
    """The slice of every parameter of bucket ``b`` (one buffer holds dense or expert parameters only)."""
    slices = {keys[p][0] for p in b.buf.param_index_map if p in keys}
    if len(slices) > 1:
        raise ValueError(f"model chunk {b.chunk} {b.buffer}: parameters of several model-parallel slices {slices}")
    return slices.pop() if slices else ""


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def model_description(model_chunks) -> dict | None:
    """The model's shape (stored with every checkpoint, shown by ``datastates-ckpt inspect`` and the
    ``torch`` export); ``None`` when the model does not look like a megatron-core GPT."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        return None
    config = getattr(chunks[0], "config", None)
    if config is None or not hasattr(config, "num_layers"):
        return None
    shapes = {name: tuple(p.shape) for p, (c, name) in parameter_names(chunks).items() if c == 0}
    word = shapes.get("embedding.word_embeddings.weight")
    pos = shapes.get("embedding.position_embeddings.weight")
    return {
        "arch": type(_unwrap(chunks[0])).__name__,
        "num_layers": int(config.num_layers),
        "hidden_size": int(config.hidden_size),
        "num_attention_heads": int(config.num_attention_heads),
        "ffn_hidden_size": int(config.ffn_hidden_size) if getattr(config, "ffn_hidden_size", None) else None,
        "seq_length": int(pos[0]) if pos else None,
        "vocab_size": int(word[0]) if word else None,
        "bf16": bool(getattr(config, "bf16", False)),
        "fp16": bool(getattr(config, "fp16", False)),
        "tied_embeddings": "output_layer.weight" not in shapes,
        "model_chunks": len(chunks),
    }
