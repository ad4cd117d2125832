"""megatron-core's own forward of a lazy checkpoint: the reference the Hugging Face export is checked
against (``python -m tests.integration.megatron_core_logits CKPT_ITER_DIR TOKENS.pt OUT.pt DTYPE``,
with ``MEGATRON_LM_DIR`` on ``PYTHONPATH``).

The model is built by Megatron-LM's own ``gpt_builder`` from the training arguments the checkpoint
records, at TP=PP=1 on one gloo process, and every tensor of its ``sharded_state_dict`` is filled
from the checkpoint's global tensor of the same sharded key: megatron-core's name for it, not the
export's table.  Writes the logits of the fixed batch ``TOKENS`` (``[batch, seq]``), the vocabulary
padding included.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.load.reader import CheckpointReader
from datastates_megatron.megatron.export.global_tensors import assemble, close_index, global_blocks, open_index
from datastates_megatron.megatron.cpu.launch import prepare
from datastates_megatron.megatron.export.hf import recorded_args

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(recorded: dict, dtype: torch.dtype):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import set_args

    from gpt_builders import gpt_builder

    args = argparse.Namespace(**recorded)
    args.params_dtype = dtype
    args.bf16, args.fp16 = dtype == torch.bfloat16, False
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.virtual_pipeline_model_parallel_size = None
    args.num_layers_per_virtual_pipeline_stage = args.num_virtual_stages_per_pipeline_rank = None
    args.sequence_parallel = False
    args.use_cpu_initialization = True
    args.perform_initialization = False
    args.yaml_cfg = None
    args.spec = None
    set_args(args)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    return gpt_builder(args, True, True)


def _fill(model, full: dict[str, torch.Tensor]) -> int:
    """Copy every sharded tensor of the model from the global tensor of its key; returns how many."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    filled = 0
    for item in model.sharded_state_dict().values():
        if isinstance(item, ShardedTensorFactory):
            pieces = item.build()
            pieces = pieces if isinstance(pieces, list) else [pieces]
        elif isinstance(item, ShardedTensor):
            pieces = [item]
        else:
            continue
        for sh in pieces:
            p = sh.prepend_axis_num
            where = tuple(sh.global_offset[:p]) + tuple(
                slice(o, o + n) for o, n in zip(sh.global_offset[p:], sh.local_shape)
            )
            with torch.no_grad():
                sh.data.copy_(full[sh.key][where].reshape(sh.data.shape))
            filled += 1
    return filled


def main() -> None:
    ckpt, tokens_path, out, dtype_name = sys.argv[1:5]
    dtype = DTYPES[dtype_name]
    prepare()  # Megatron-LM's modules on CPU, as pretrain_gpt.py ran (the CUDA shim, no triton)
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    with CheckpointReader(ckpt, read_manifest(ckpt), verify=True, threads=1) as reader:
        index = open_index(reader)
        try:
            full = {key: assemble(reader, index, bl) for key, bl in global_blocks(index, ckpt).items()}
        finally:
            close_index(index)
        recorded = recorded_args(reader)
    model = _build(recorded, dtype)
    filled = _fill(model, full)
    model.eval()
    tokens = torch.load(tokens_path)
    b, s = tokens.shape
    mask = torch.ones(s, s, dtype=torch.bool).tril().logical_not()[None, None]
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    torch.save({"logits": logits.float(), "filled": filled}, out)
    os._exit(0)  # no process-group teardown needed


if __name__ == "__main__":
    main()
