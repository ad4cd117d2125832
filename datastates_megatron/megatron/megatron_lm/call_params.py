"""What the glue does with each parameter of Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``.

Every parameter a tested Megatron-LM passes reaches the glue (through the patch or the runtime
hook) and has one of these fates, never a silent drop:

* used by the lazy checkpointer (iteration, model, optimizer, ...);
* passed on to Megatron's own loader where the glue falls back to it (``load_arg``, ``strict``, the
  process groups, ``rng_state_key_prefix``, ...);
* checked: a process group must span the same ranks as the ``megatron.core.parallel_state`` group
  the checkpointer uses (what Megatron itself falls back to when it is None); Megatron's converter
  arguments (``pipeline_rank``, ...) and a non-empty ``rng_state_key_prefix`` (a multi-grid model's
  RNG namespace) are refused with a :class:`~.args.LazyCkptArgsError`;
* not applicable, by design: ``checkpointing_context`` (Megatron's cache of torch_dist save
  strategies) and ``preprocess_common_state_dict_fn`` (Megatron's cross-rank comparison of the
  torch_dist common state): a lazy checkpoint has neither.

:data:`SAVE` and :data:`LOAD` list them all; a test compares them with the routed functions of
every tested tree, so a new parameter in a Megatron-LM release fails a test instead of being lost.

Thread-safety: :func:`check_groups` memoizes checked groups under a lock.
"""

from __future__ import annotations

import threading
from typing import Any

from .args import LazyCkptArgsError

__all__ = ["CONVERTER", "GROUPS", "LOAD", "SAVE", "check_converter", "check_groups", "check_rng_prefix"]

# process-group parameter -> (parallel_state getter, its arguments): the group the glue works with
GROUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "tp_group": ("get_tensor_model_parallel_group", {}),
    "pp_group": ("get_pipeline_model_parallel_group", {}),
    "dp_cp_group": ("get_data_parallel_group", {"with_context_parallel": True}),
    "dp_group": ("get_data_parallel_group", {}),
    "expt_dp_group": ("get_expert_data_parallel_group", {}),
}
# Megatron's checkpoint converter saves one rank as another (tools/checkpoint): not with --lazy-ckpt
CONVERTER = ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel", "expert_parallel")

_COMMON = {
    "checkpointing_context": "not applicable (Megatron's torch_dist strategy cache)",
    **{g: "checked: the same ranks as parallel_state's group" for g in GROUPS},
    "rng_state_key_prefix": "refused unless '' (a multi-grid model's RNG namespace)",
}
SAVE: dict[str, str] = {
    "iteration": "used",
    "model": "used",
    "optimizer": "used",
    "opt_param_scheduler": "used",
    "num_floating_point_operations_so_far": "used (extra_state)",
    **{c: "refused unless None (Megatron's checkpoint converter)" for c in CONVERTER},
    "non_persistent_ckpt": "used: a checkpoint of the node-local tier (refused without one)",
    "train_data_iterator": "used (Energon dataloader state)",
    "preprocess_common_state_dict_fn": "not applicable (torch_dist common state)",
    "release": "refused unless False",
    **_COMMON,
}
LOAD: dict[str, str] = {
    "ddp_model": "used",
    "optimizer": "used",
    "opt_param_scheduler": "used",
    "load_arg": "used ('load'), else passed to Megatron's loader",
    "strict": "passed to Megatron's loader (lazy restores every tensor)",
    "skip_load_to_model_and_opt": "passed to Megatron's loader (lazy restores in place)",
    **_COMMON,
}

_lock = threading.Lock()
_checked: dict[tuple[str, int], bool] = {}  # (parameter, id(group)) -> same ranks as parallel_state's


def check_converter(where: str, values: dict[str, Any]) -> None:
    given = {k: v for k, v in values.items() if v is not None}
    if given:
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise LazyCkptArgsError(
            f"{where}: --lazy-ckpt saves every rank as itself; Megatron's converter arguments ({shown}) "
            "are not supported (convert without --lazy-ckpt)"
        )


def check_rng_prefix(where: str, prefix: str) -> None:
    if prefix:
        raise LazyCkptArgsError(
            f"{where}: rng_state_key_prefix={prefix!r} (a multi-grid model's RNG namespace) is not supported "
            "by --lazy-ckpt, which keeps one RNG state per rank"
        )


def check_groups(where: str, groups: dict[str, Any]) -> None:
    """Each non-None group must span the ranks of the ``parallel_state`` group the checkpointer uses."""
    for name, group in groups.items():
        if group is None:
            continue
        key = (name, id(group))
        with _lock:
            same = _checked.get(key)
        if same is None:
            same = _same_ranks(where, name, group)
            with _lock:
                _checked[key] = same
        if not same:
            raise LazyCkptArgsError(
                f"{where}: {name} spans other ranks than megatron.core.parallel_state's "
                f"{GROUPS[name][0]}(): --lazy-ckpt shards by parallel_state's groups only"
            )


def _same_ranks(where: str, name: str, group: Any) -> bool:
    import torch.distributed as dist
    from megatron.core import parallel_state

    getter, kwargs = GROUPS[name]
    try:
        default = getattr(parallel_state, getter)(**kwargs)
    except (AssertionError, AttributeError, TypeError) as e:  # not initialized, or an older API
        raise LazyCkptArgsError(f"{where}: {name} is given but parallel_state.{getter}() is not available: {e}") from e
    if group is default:
        return True
    return list(dist.get_process_group_ranks(group)) == list(dist.get_process_group_ranks(default))
