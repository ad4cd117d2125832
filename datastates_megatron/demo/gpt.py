"""TEST/DEMO harness: a small megatron-core GPT trained with the DistributedOptimizer.

Runs on CPU over gloo (via :mod:`datastates_megatron.demo.cuda_on_cpu`, applied
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

import os
from datetime import timedelta
from typing import Any

import torch

from . import cuda_on_cpu

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


def _on_cpu() -> bool:
    return not torch.cuda.is_available() or cuda_on_cpu.is_installed()


# --------------------------------------------------------------------------- #
# process groups
# --------------------------------------------------------------------------- #
def init_distributed(seed: int = 1234, *, timeout_s: float = 120.0, num_threads: int | None = 1) -> None:
    """Initialise torch.distributed and megatron's parallel state (TP=PP=1).

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
    ``LOCAL_RANK`` on GPU) from the environment, as torchrun sets them. Uses gloo
    on CPU (installing the CUDA-on-CPU shim), NCCL on GPU. Seeds the CPU RNG and
    megatron's CUDA RNG tracker (``model_parallel_cuda_manual_seed``).

    ``num_threads`` pins ``torch.set_num_threads`` (1 keeps CPU runs
    deterministic and avoids oversubscription); ``None`` leaves it alone.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    cpu = not torch.cuda.is_available()
    if cpu:
        cuda_on_cpu.install()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo" if cpu else "nccl",
            init_method="env://",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


# --------------------------------------------------------------------------- #
# model + optimizer
# --------------------------------------------------------------------------- #
def build(
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq_len: int = 32,
    vocab: int = 256,
    bf16: bool = False,
    seed: int = 1234,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int | None = None,
) -> tuple[list[Any], Any]:
    """Build ``([DistributedDataParallel(GPTModel)], megatron optimizer)``.

    Follows Megatron-LM's ``get_model``: GPTModel with the local (no
    transformer-engine) layer spec, ``Float16Module`` when ``bf16``, then DDP
    with ``use_distributed_optimizer=True`` and params broadcast from DP rank 0.
    The optimizer is ``get_megatron_optimizer(OptimizerConfig(optimizer='adam',
    use_distributed_optimizer=True, ...))`` - a ``ChainedOptimizer`` wrapping one
    ``DistributedOptimizer`` wrapping ``torch.optim.AdamW`` when neither TE nor
    Apex is installed.

    Requires :func:`init_distributed` first. Re-seeds the RNG tracker with
    ``seed`` so that two builds with the same seed give identical weights.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # On CPU allocate directly on the host; on GPU use megatron's default.
        use_cpu_initialization=_on_cpu(),
        init_method_std=0.02,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if not _on_cpu():
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(config, model)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()
    model_chunks = [ddp]

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr * 0.1,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, model_chunks)
    return model_chunks, optimizer


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
    if _on_cpu():
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
