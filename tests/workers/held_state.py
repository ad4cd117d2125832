"""State that GPU stacks hold and CPU runs never show, rebuilt on CPU for the demo GPT:

* :class:`Fp8LikeMeta`: a module whose state lives in ``get_extra_state()`` (as Transformer Engine
  keeps its FP8 scaling metadata: an amax history updated by every forward, returned as a uint8
  tensor) plus a persistent buffer (as the MoE router's ``expert_bias``);
* :class:`MasterWeightAdam`: an inner optimizer subclass with extra per-parameter state (as TE's
  ``FusedAdam(master_weights=True)``): a ``master_param`` kept in float64, so the fp32 parameter
  alone cannot rebuild it, and an integer (non-tensor) ``step``.
"""

from __future__ import annotations

import json

import torch

from datastates_megatron.megatron.checkpointing.shards import distributed_optimizers


class Fp8LikeMeta(torch.nn.Module):
    HISTORY = 4

    def __init__(self) -> None:
        super().__init__()
        self.amax_history = torch.zeros(self.HISTORY)  # a plain attribute: only get_extra_state saves it
        self.forwards = 0
        self.register_buffer("running_scale", torch.ones(1))

    def observe(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            self.amax_history = torch.roll(self.amax_history, 1)
            self.amax_history[0] = x.detach().abs().max().float()
            self.forwards += 1
            self.running_scale.mul_(0.5).add_(self.amax_history.mean() * 0.5)

    def get_extra_state(self) -> torch.Tensor:
        blob = json.dumps({"amax": self.amax_history.tolist(), "forwards": self.forwards}).encode()
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # like TE: bytes in a uint8 tensor

    def set_extra_state(self, state: torch.Tensor) -> None:
        saved = json.loads(bytes(state.cpu().numpy().tobytes()).decode())
        self.amax_history = torch.tensor(saved["amax"], dtype=torch.float32)
        self.forwards = int(saved["forwards"])

    def report(self) -> dict:
        return {"amax": self.amax_history.tolist(), "forwards": self.forwards, "scale": self.running_scale.tolist()}


def attach_probe(chunks) -> Fp8LikeMeta:
    """An :class:`Fp8LikeMeta` under the decoder, fed by every decoder forward."""
    root = chunks[0]
    while hasattr(root, "module"):
        root = root.module
    probe = Fp8LikeMeta()
    root.decoder.add_module("fp8_meta", probe)
    root.decoder.register_forward_pre_hook(
        lambda _m, args, kwargs: probe.observe(kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True
    )
    return probe


class MasterWeightAdam(torch.optim.Optimizer):
    """Adam on a float64 ``master_param`` per parameter; the parameter gets the rounded result."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["master_param"] = p.detach().to(torch.float64)
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float64)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float64)
                    st["step"] = 0
                st["step"] += 1
                master, g = st["master_param"], p.grad.to(torch.float64)
                master.mul_(1 - group["lr"] * group["weight_decay"])
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt_().add_(group["eps"])
                master.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** st["step"]))
                p.copy_(master)


def use_master_weight_adam(optimizer) -> None:
    """Replace each DistributedOptimizer's inner torch optimizer by a :class:`MasterWeightAdam` over
    the same param groups (before a LazyCheckpointer hooks the inner optimizers).  As megatron's
    DistributedOptimizer does, the groups are assigned after construction: in fp32 training their
    params are views into the param buffer, which a torch optimizer refuses as non-leaf tensors."""
    for do in distributed_optimizers(optimizer):
        inner = do.optimizer
        new = MasterWeightAdam(
            [torch.zeros(1, requires_grad=True)],
            **{k: inner.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")},
        )
        new.param_groups = inner.param_groups
        do.optimizer = new
