"""Non-tensor training state: capture it at save time as plain values, put it back on load.

Covers optimizer ``param_groups`` hyper-parameters (and non-tensor per-param state such as a fused
Adam's integer step), the grad scaler, the ``OptimizerParamScheduler``, and every RNG (Python,
numpy, torch CPU, CUDA, and Megatron's CUDA RNG tracker when present).  Values go through the
engine's tagged-JSON codec, so loading never unpickles anything.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .shards import distributed_optimizers, inner_optimizers

__all__ = ["capture", "restore", "capture_rng", "restore_rng"]


def capture_rng() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core import tensor_parallel

        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except (ImportError, AttributeError, RuntimeError):
        pass
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _plain_group(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def capture(optimizer, scheduler) -> dict:
    """Everything but tensors registered for snapshot; values are copies taken now."""
    opts = []
    for do, inner in zip(distributed_optimizers(optimizer), inner_optimizers(optimizer)):
        extra_state = {}
        for g, pg in enumerate(inner.param_groups):
            for j, p in enumerate(pg["params"]):
                plain = {k: v for k, v in inner.state.get(p, {}).items() if not isinstance(v, torch.Tensor)}
                if plain:
                    extra_state[f"g{g}.p{j}"] = plain
        scaler = getattr(do, "grad_scaler", None)
        opts.append(
            {
                "param_groups": [_plain_group(pg) for pg in inner.param_groups],
                "plain_state": extra_state,
                "grad_scaler": scaler.state_dict() if scaler is not None else None,
            }
        )
    return {
        "optimizers": opts,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng(),
    }


def restore(state: dict, optimizer, scheduler, *, with_optimizer: bool = True, with_rng: bool = True) -> None:
    """Put :func:`capture`'s values back: optimizer groups, plain state, grad scaler and scheduler
    (``with_optimizer``) and the RNG states (``with_rng``)."""
    if with_optimizer:
        _restore_optimizer(state, optimizer, scheduler)
    if with_rng:
        restore_rng(state["rng"])


def _restore_optimizer(state: dict, optimizer, scheduler) -> None:
    opts = list(zip(distributed_optimizers(optimizer), inner_optimizers(optimizer)))
    if len(opts) != len(state["optimizers"]):
        from ...engine.errors import LayoutMismatchError

        raise LayoutMismatchError(
            f"checkpoint has {len(state['optimizers'])} chained optimizers, this run has {len(opts)}"
        )
    for (do, inner), saved in zip(opts, state["optimizers"]):
        for pg, saved_pg in zip(inner.param_groups, saved["param_groups"]):
            pg.update(saved_pg)
        for g, pg in enumerate(inner.param_groups):
            for j, p in enumerate(pg["params"]):
                plain = saved["plain_state"].get(f"g{g}.p{j}")
                if plain:
                    inner.state[p].update(plain)
        scaler = getattr(do, "grad_scaler", None)
        if scaler is not None and saved["grad_scaler"] is not None:
            scaler.load_state_dict(saved["grad_scaler"])
    if scheduler is not None and state["scheduler"] is not None:
        # OptimizerParamScheduler.load_state_dict *adds* the saved step count: start from zero
        scheduler.num_steps = 0
        scheduler.load_state_dict(state["scheduler"])
