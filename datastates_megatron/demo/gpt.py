"""TEST/DEMO harness: a small megatron-core GPT trained with the DistributedOptimizer.

Runs on CPU over gloo (via :mod:`datastates_megatron.megatron.cpu.cuda_on_cpu`, applied
automatically when no GPU is present) or on GPUs over NCCL. It mirrors what
Megatron-LM's ``get_model`` / ``get_megatron_optimizer`` / ``train_step`` do for
TP=PP=1, with the pieces a checkpointing test needs exposed:

>>> init_distributed(seed=1234)                            # torchrun env vars
>>> chunks, opt = build(2, 64, 4, 32, 256, bf16=False, seed=1234)
>>> sched = make_scheduler(opt, lr=1e-3, warmup_steps=2, decay_steps=100)
>>> for it in range(5):
...     loss = train_step(chunks, opt, batch(it, dp_rank(), seed=1234, seq_len=32,
...                                          vocab=256), scheduler=sched)

Everything is deterministic: for the same seed, world size and thread count the
losses are bit-identical across runs (dropout is 0; batches depend only on
``(seed, iteration, dp_rank)``; the RNG only feeds weight init).

Not thread-safe: drive it from one thread per process (the CPU shim's device
rewriting is thread-local to the thread that called :func:`init_distributed`).
"""

from __future__ import annotations

from typing import Any

import torch

from .model import build_gpt as build
from .model import destroy_distributed, init_distributed, on_cpu

__all__ = [
    "init_distributed",
    "destroy_distributed",
    "dp_rank",
    "dp_size",
    "build",
    "make_scheduler",
    "batch",
    "train_step",
]


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def make_scheduler(
    optimizer: Any,
    *,
    lr: float = 1e-3,
    init_lr: float | None = None,
    warmup_steps: int = 2,
    decay_steps: int = 1000,
    weight_decay: float = 0.01,
) -> Any:
    """An ``OptimizerParamScheduler`` (linear warmup from ``init_lr`` (default
    ``lr/10``), cosine decay to ``lr/10``), or None if megatron-core lacks it.

    It writes ``lr`` and ``weight_decay`` into every ``optimizer.param_groups``
    entry on construction and on each ``step(increment)``; Megatron steps it
    after ``optimizer.step()`` (as :func:`train_step` does).

    Note its ``load_state_dict`` *adds* the saved ``num_steps`` to the current one
    (it calls ``step(increment=num_steps)``): only load into a fresh scheduler, or
    set ``num_steps = 0`` first.
    """
    try:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    except ImportError:  # pragma: no cover - older megatron-core
        return None
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr * 0.1 if init_lr is None else init_lr,
        max_lr=lr,
        min_lr=lr * 0.1,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style="cosine",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


# --------------------------------------------------------------------------- #
# data + step
# --------------------------------------------------------------------------- #
_MASK64 = (1 << 64) - 1


def _mix(*xs: int) -> int:
    """splitmix64-style combination of small ints into a 63-bit seed."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def batch(
    iteration: int, rank: int, *, seed: int = 1234, micro_batch_size: int = 4, seq_len: int = 32, vocab: int = 256
) -> dict[str, torch.Tensor]:
    """Deterministic synthetic batch that depends only on (seed, iteration, rank).

    Each row is an arithmetic progression mod ``vocab`` with a random start and a
    stride in [1, 8), so next-token loss falls quickly. Returns ``tokens``,
    ``labels`` (tokens shifted by one), ``position_ids``, ``loss_mask`` and
    ``attention_mask=None`` (the local spec builds the causal mask itself).
    Tensors are on CPU; :func:`train_step` moves them to the model's device.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(_mix(seed, iteration, rank))
    start = torch.randint(0, vocab, (micro_batch_size, 1), generator=g, device="cpu")
    stride = torch.randint(1, 8, (micro_batch_size, 1), generator=g, device="cpu")
    seq = (start + stride * torch.arange(seq_len + 1, device="cpu")) % vocab
    position_ids = torch.arange(seq_len, device="cpu").unsqueeze(0).expand(micro_batch_size, -1)
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "position_ids": position_ids.contiguous(),
        "loss_mask": torch.ones(micro_batch_size, seq_len, dtype=torch.float32, device="cpu"),
        "attention_mask": None,
    }


def _device() -> torch.device:
    if on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def train_step(model_chunks: list[Any], optimizer: Any, data: dict[str, Any], scheduler: Any = None) -> float:
    """One Megatron-style training step; returns the loss averaged over DP ranks.

    Order (as in Megatron-LM ``train_step`` for one microbatch):
    ``zero_grad_buffer()`` per chunk, ``optimizer.zero_grad()``, forward,
    ``scale_loss(loss).backward()``, ``finish_grad_sync()`` per chunk
    (reduce-scatter into this rank's grad shard), ``optimizer.step()`` (copy
    grads to main shards, clip, inner Adam step, copy main params into the param
    buffer, all-gather params), then ``scheduler.step(1)`` if given.

    Raises RuntimeError if the optimizer skipped the update (inf/nan grads).
    """
    model = model_chunks[0]
    dev = _device()
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()

    tokens = data["tokens"].to(dev)
    labels = data["labels"].to(dev)
    position_ids = data["position_ids"].to(dev)
    loss_mask = data["loss_mask"].to(dev)
    attention_mask = data.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(dev)

    per_token = model(tokens, position_ids, attention_mask, labels=labels)
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    optimizer.scale_loss(loss).backward()

    for chunk in model_chunks:
        chunk.finish_grad_sync()
    update_successful, _grad_norm, _num_zeros = optimizer.step()
    if not update_successful:
        raise RuntimeError("optimizer skipped the update (inf/nan in gradients)")
    if scheduler is not None:
        scheduler.step(increment=1)

    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    reported = loss.detach().clone().reshape(1)
    torch.distributed.all_reduce(reported, group=group)
    return float(reported.item() / torch.distributed.get_world_size(group))
