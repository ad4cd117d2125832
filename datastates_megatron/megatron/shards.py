"""Find, in megatron-core's live objects, every tensor a resume needs — without gathering or copying.

* model parameters: this data-parallel rank's slice of each bucket of each DDP param buffer (the
  same slicing the DistributedOptimizer uses), so across DP ranks every byte is written once;
* per inner optimizer of a ``ChainedOptimizer``: fp32 main-param shards that are not views of a
  param buffer (bf16/fp16 training; in fp32 they are the buffer slice itself) and every tensor in
  the torch optimizer's per-param state (``exp_avg``, ``exp_avg_sq``, ``step``, ...).

Each tensor gets a gate group ``opt<i>``: the pre-step hook of inner optimizer ``i`` waits only for
the snapshot of the tensors that step is about to mutate.  Checked against megatron-core 0.16.1
(layout notes: docs/_megatron_internals_notes.md).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ShardRef", "model_chunks_of", "inner_optimizers", "distributed_optimizers", "collect_shards", "param_buffer_shards"]


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


def _dp_rank_size(buf) -> tuple[int, int]:
    group = getattr(buf, "data_parallel_group", None)
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group)
    return 0, int(getattr(buf, "data_parallel_world_size", 1))


def param_buffer_shards(model) -> list[tuple[str, torch.Tensor, object, list[torch.Tensor]]]:
    """``(name, this rank's shard, buffer, all DP shards of the bucket)`` for every bucket."""
    out = []
    for c, chunk in enumerate(model_chunks_of(model)):
        for bname, buf in _buffers(chunk):
            if getattr(buf, "param_data", None) is None:
                raise ValueError(
                    f"model chunk {c} {bname} has no param_data: lazy checkpointing needs "
                    "DistributedDataParallel(use_distributed_optimizer=True)"
                )
            rank, size = _dp_rank_size(buf)
            for k, bucket in enumerate(buf.buckets):
                data = bucket.param_data
                if data.numel() % size:
                    raise ValueError(f"chunk {c} {bname} bucket {k}: {data.numel()} elements not divisible by DP size {size}")
                step = data.numel() // size
                views = [data[i * step : (i + 1) * step] for i in range(size)]
                out.append((f"model{c}.{bname}.bucket{k}.param_shard", views[rank], buf, views))
    return out


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def collect_shards(model, optimizer) -> list[ShardRef]:
    """Every tensor to snapshot, with its gate group and metadata (for inspection and resharding)."""
    chained = distributed_optimizers(optimizer)
    owner: dict[int, int] = {}  # id(buffer) -> index of the optimizer stepping it
    for i, do in enumerate(chained):
        for buf in getattr(do, "buffers", []) or []:
            owner[id(buf)] = i
    refs: list[ShardRef] = []
    spans = []
    for name, shard, buf, _ in param_buffer_shards(model):
        group = f"opt{owner.get(id(buf), 0)}" if owner else "opt0"
        refs.append(ShardRef(name, shard, group, {"kind": "param_shard", "dtype": str(shard.dtype)}))
        spans.append(_storage_span(shard.detach()) if shard.numel() else (0, 0))
        # the whole bucket counts: an fp32 main param may be a view of any part of this rank's slice
    for i, inner in enumerate(inner_optimizers(optimizer)):
        for g, pg in enumerate(inner.param_groups):
            for j, p in enumerate(pg["params"]):
                base = f"opt{i}.g{g}.p{j}"
                if p.numel():
                    s, e = _storage_span(p.detach())
                    is_view = any(a <= s and e <= b for a, b in spans)
                else:
                    is_view = True
                if not is_view:
                    refs.append(ShardRef(f"{base}.main", p.detach(), f"opt{i}", {"kind": "main_param"}))
                for key, value in sorted(inner.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        refs.append(ShardRef(f"{base}.{key}", value.detach(), f"opt{i}", {"kind": "optimizer_state", "key": key}))
    return refs
