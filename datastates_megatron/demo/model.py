"""The demo/test harness's GPT: megatron-core ``GPTModel`` (local layer spec, learned absolute
positions, tied embeddings, ``ffn_hidden_size = 4 * hidden``) + DDP + DistributedOptimizer, TP=PP=1,
as Megatron-LM's ``get_model`` / ``get_megatron_optimizer`` do (:mod:`.gpt` trains it).
Not thread-safe: one thread per process (the CPU shim's device rewriting is thread-local).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from ..megatron.cpu import cuda_on_cpu

__all__ = ["on_cpu", "init_distributed", "destroy_distributed", "build_gpt"]


def on_cpu() -> bool:
    """True when megatron-core runs on CPU here (no GPU, or the CPU shim installed)."""
    return not torch.cuda.is_available() or cuda_on_cpu.is_installed()


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


def build_gpt(
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
    swiglu: bool = False,
) -> tuple[list[Any], Any]:
    """Build ``([DistributedDataParallel(GPTModel)], megatron optimizer)``.

    Follows Megatron-LM's ``get_model``: GPTModel with the local (no
    transformer-engine) layer spec, ``Float16Module`` when ``bf16``, then DDP
    with ``use_distributed_optimizer=True`` and params broadcast from DP rank 0.
    The optimizer is ``get_megatron_optimizer(OptimizerConfig(optimizer='adam',
    use_distributed_optimizer=True, ...))`` - a ``ChainedOptimizer`` wrapping one
    ``DistributedOptimizer`` wrapping ``torch.optim.AdamW`` when neither TE nor
    Apex is installed.

    ``swiglu``: the MLP's gated linear unit with SiLU, as Megatron-LM's ``--swiglu`` (its fused
    ``linear_fc1`` is a megatron-core ``ShardedTensorFactory`` of two halves under TP).

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
        use_cpu_initialization=on_cpu(),
        init_method_std=0.02,
        **(dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu) if swiglu else {}),
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
    if not on_cpu():
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
