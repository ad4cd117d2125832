"""The model's state outside its DDP param buffers: persistent buffers and ``get_extra_state()`` values.

A module's ``state_dict`` holds three things: parameters (saved through the param buffers, see
:mod:`.shards`), persistent buffers (e.g. the MoE router's ``expert_bias`` with
``--moe-router-enable-expert-bias``) and, for a module that overrides ``get_extra_state``, its
``_extra_state`` (Transformer Engine keeps its FP8 scaling metadata there).  The last two are
small and change outside ``optimizer.step()`` (``expert_bias`` in ``finalize_model_grads``, FP8
amax history in the forward), so the step pre-hook gate cannot protect them: they are captured as
values when ``save()`` is called and stored with the checkpoint's objects (tagged JSON, tensors
copied to the host; a value the codec cannot store without pickle fails the save, naming it).

Keys are ``"<chunk>.<name>"`` with the module path as in ``state_dict`` (leading ``module.``
prefixes stripped, as for parameters).  Only meaningful for the layout that wrote them, except an
extra state that carries nothing (:func:`held_state`): ``None``, or the empty tensor Transformer
Engine returns for a layer that runs without FP8 (its ``set_extra_state`` ignores one).
"""

from __future__ import annotations

import logging

import torch

from ...engine.errors import LayoutMismatchError
from .shards import model_chunks_of

__all__ = ["capture", "held_state", "restore"]

log = logging.getLogger(__name__)


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _has_extra_state(module: torch.nn.Module) -> bool:
    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


def _walk(model):
    """``(key, module, buffer name or None)`` for every persistent buffer and every overridden
    ``get_extra_state`` (buffer name ``None``) of every chunk, in ``state_dict`` order."""
    for c, chunk in enumerate(model_chunks_of(model)):
        root = getattr(chunk, "module", chunk)
        for path, module in root.named_modules():
            prefix = f"{c}.{_strip(path) + '.' if path else ''}"
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield f"{prefix}{name}", module, name
            if _has_extra_state(module):
                yield f"{prefix}_extra_state", module, None


def capture(model) -> dict:
    """``{"buffers": {key: tensor}, "extra_state": {key: value}}`` as of now (the caller encodes it
    at once; the encoder copies tensors to the host)."""
    buffers, extra = {}, {}
    for key, module, name in _walk(model):
        if name is None:
            extra[key] = module.get_extra_state()
        else:
            buffers[key] = module._buffers[name].detach()
    return {"buffers": buffers, "extra_state": extra}


def held_state(saved: dict | None) -> list[str]:
    """The keys of :func:`capture`'s values that hold state: every buffer, and every extra state
    but ``None`` and empty tensors (a layer without FP8 metadata)."""
    saved = saved or {}
    extra = saved.get("extra_state", {})
    empty = {k for k, v in extra.items() if v is None or (isinstance(v, torch.Tensor) and v.numel() == 0)}
    return sorted([*saved.get("buffers", {}), *(k for k in extra if k not in empty)])


def restore(saved: dict | None, model, *, where: str) -> None:
    """Put :func:`capture`'s values back: buffers copied in place, extra state through
    ``set_extra_state``.  Both key sets must be this model's (checked before anything is set);
    ``saved=None`` (a checkpoint written before model state was saved) only warns."""
    entries = list(_walk(model))
    if saved is None:
        if entries:
            log.warning(
                "%s: the checkpoint holds no model buffers or extra state; %d left as built", where, len(entries)
            )
        return
    buffers, extra = saved.get("buffers", {}), saved.get("extra_state", {})
    want = {k for k, _, n in entries if n is not None}, {k for k, _, n in entries if n is None}
    for what, have, need in (("buffers", buffers, want[0]), ("extra state", extra, want[1])):
        if set(have) != need:
            missing, unknown = sorted(need - set(have)), sorted(set(have) - need)
            raise LayoutMismatchError(
                f"{where}: model {what} differ from this model's (missing in the checkpoint: {missing[:5]}, "
                f"not in this model: {unknown[:5]})"
            )
    for key, module, name in entries:
        if name is None:
            continue
        dst, src = module._buffers[name], buffers[key]
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            got = f"{src.dtype} {list(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__
            raise LayoutMismatchError(
                f"{where}: model buffer {key!r} is {got} in the checkpoint, {dst.dtype} {list(dst.shape)} here"
            )
    with torch.no_grad():
        for key, module, name in entries:
            if name is None:
                module.set_extra_state(extra[key])
            else:
                module._buffers[name].copy_(buffers[key])
