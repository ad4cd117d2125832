"""Worker for tests/distributed/test_call_params.py: the process groups Megatron-LM passes to
``save_checkpoint`` / ``load_checkpoint`` checked against megatron-core's ``parallel_state`` on real
gloo ranks (2 ranks: data parallel 2, tensor parallel 1)."""

import json

import torch.distributed as dist
from megatron.core import parallel_state as ps

from datastates_megatron._output import write_line
from datastates_megatron.megatron.megatron_lm import call_params
from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError


def _check(**groups):
    try:
        call_params.check_groups("iteration 7", groups)
        return "ok"
    except LazyCkptArgsError as e:
        return str(e)


def main():
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    everyone = dist.new_group([0, 1])  # every rank creates every group, in the same order
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    out = {
        "none": _check(tp_group=None, dp_group=None),
        "parallel_state's own": _check(
            dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group()
        ),
        "same ranks, another group": _check(dp_group=everyone, dp_cp_group=everyone, tp_group=alone),
        "other ranks": _check(dp_group=alone),
        "other ranks, tp": _check(tp_group=everyone),
    }
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    write_line("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
