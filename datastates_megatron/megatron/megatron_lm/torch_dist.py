"""The two-way bridge to Megatron-LM's own checkpoint formats, run inside a Megatron-LM process.

The live model's ``sharded_state_dict`` defines the mapping both ways, so it holds for any model and
any TP/PP/VP/EP layout Megatron-LM itself saves (nothing here rebuilds an architecture):

* **export** (``--lazy-ckpt-convert-to DIR``): after the lazy checkpoint under ``--load`` is
  restored, Megatron-LM's own ``save_checkpoint`` writes it to ``DIR`` in ``torch_dist`` format
  with the optimizer state ``fully_reshardable``, so megatron-core loads it at any TP/PP/DP; then
  the process exits.
* **import**: a ``--load`` that holds a Megatron checkpoint (``torch_dist`` or legacy ``torch``) and
  no lazy one is loaded by Megatron-LM's own ``load_checkpoint`` (iteration, optimizer, scheduler,
  RNG and consumed samples, as a native resume); later saves are lazy, to ``--save``.

Without TE or apex the inner optimizer is torch's Adam, which keeps ``step`` per parameter (their
fused Adams keep it per param group), and Megatron-LM's optimizer load fails or resumes differently
with it in the ways :func:`_torch_adam_load` lists and works around; GPU stacks without TE/apex
have the same torch Adam.  Its ``fully_reshardable`` save misplaces optimizer state whatever the
optimizer (:func:`_fully_reshardable_save`).

Thread-safety: called from the training thread; every function is collective over all ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

from ...engine.dist.collective import Collective
from ...engine.errors import CheckpointError, ForeignCheckpointError
from ...engine.storage.url import is_object_url
from ...engine.tiers.foreign import ForeignCheckpoint, find_foreign, tracker_text
from ...engine.tiers.tier import committed_iterations
from ..checkpointing.shards import distributed_optimizers

__all__ = [
    "IMPORTABLE_FORMATS",
    "ConversionError",
    "native_megatron",
    "importable",
    "importable_on_every_rank",
    "prime_optimizer_state",
    "import_checkpoint",
    "export",
]

log = logging.getLogger(__name__)

IMPORTABLE_FORMATS = ("torch_dist", "torch")  # what Megatron-LM's own loader reads


class ConversionError(CheckpointError, RuntimeError):
    """An import or export that cannot be done as asked (the message says why and what to do)."""


@contextlib.contextmanager
def _attributes(obj: Any, values: dict) -> Iterator[None]:
    """``values`` set as attributes of ``obj`` for the duration; what the instance held before
    (nothing, or its own value) is put back after, also on an error."""
    missing = object()
    before = {k: vars(obj).get(k, missing) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, old in before.items():
            if old is missing:
                delattr(obj, k)
            else:
                setattr(obj, k, old)


@contextlib.contextmanager
def native_megatron(args: Any, **overrides: Any) -> Iterator[types.ModuleType]:
    """Megatron-LM's ``checkpointing`` module with ``--lazy-ckpt`` off and ``overrides`` set on
    ``args`` for the duration."""
    try:
        from megatron.training import checkpointing
    except ImportError as e:
        raise ConversionError("a Megatron-format checkpoint needs Megatron-LM's megatron.training on the path") from e
    with _attributes(args, {"lazy_ckpt": False, **overrides}):
        yield checkpointing


@contextlib.contextmanager
def _patched(objs: list, name: str, make: Any) -> Iterator[None]:
    """``obj.<name> = make(obj, current method)`` on each object for the duration."""
    with contextlib.ExitStack() as stack:
        for obj in objs:
            stack.enter_context(_attributes(obj, {name: make(obj, getattr(obj, name))}))
        yield


def importable(load_dir: str, ckpt_step: int | None = None) -> ForeignCheckpoint | None:
    """The Megatron checkpoint a native load of ``load_dir`` would read (the ``--ckpt-step`` one, else
    the one the tracker file names), when ``load_dir`` holds no committed lazy checkpoint; else None.
    A named directory in a format Megatron-LM cannot read raises :class:`ForeignCheckpointError`.
    ``load_dir`` on object storage: None (only lazy checkpoints are read from a bucket; never a
    local path spelled like the URL)."""
    if not load_dir or is_object_url(load_dir) or not os.path.isdir(load_dir) or committed_iterations(load_dir):
        return None
    found = find_foreign(load_dir)
    if not found:
        return None
    tracker = tracker_text(load_dir)
    wanted = str(ckpt_step) if ckpt_step else tracker
    if (
        ckpt_step
        and tracker not in (None, wanted)
        and (tracker == "release" or any(f.tracker_name == tracker and f.format == "torch" for f in found))
    ):
        # Megatron-LM's loader takes parts of such a checkpoint from the tracker's iteration anyway
        # (release: everything; legacy format: the distributed optimizer's parameter state)
        raise ConversionError(
            f"{load_dir}: --ckpt-step {ckpt_step} but the tracker file names {tracker!r}; Megatron-LM's loader "
            "would mix the two. Load the tracker's iteration, or copy the checkpoint wanted into a directory "
            "of its own with a tracker naming it"
        )
    for f in found:
        if wanted == f.tracker_name:
            if f.format not in IMPORTABLE_FORMATS:
                raise ForeignCheckpointError(
                    f"{f.path}: Megatron-LM checkpoint directory in an unknown format; it cannot be loaded"
                )
            return f
    return None


def importable_on_every_rank(load_dir: str, ckpt_step: int | None = None) -> ForeignCheckpoint | None:
    """:func:`importable`, decided alike on every rank (a rank that imported alone would wait in
    Megatron's collective load for ranks that took the lazy path): one rank's error, or ranks that
    see different checkpoints, raise on every rank."""
    collective = Collective()
    found, err = None, None
    try:
        found = importable(load_dir, ckpt_step)
    except CheckpointError as e:
        err = e
    except OSError as e:
        err = ConversionError(f"rank {collective.rank}: --load {load_dir} cannot be read: {e}")
    collective.raise_agreed(err, f"rank {collective.rank}: the import check of --load {load_dir}")
    mine = -2 if found is None else (-1 if found.iteration is None else found.iteration)
    least, greatest = collective.min_max(mine)
    if least != greatest:
        seen = ", ".join(
            "none" if i == -2 else "one without an iteration" if i == -1 else str(i) for i in (least, greatest)
        )
        raise ConversionError(
            f"--load {load_dir}: the ranks see different checkpoints to import (from {seen}); is the directory "
            "being written?"
        )
    return found


def _lazy_checkpoints_elsewhere(args: Any, load_dir: str, local_root: str | None) -> list[str]:
    """Where this run already has lazy checkpoints an import would ignore (``--save`` and this
    node's local tier, ``{node}`` resolved, when they are not ``--load``)."""
    out = []
    for flag, root in (("--save", args.save), ("--lazy-ckpt-local-dir", local_root)):
        if (
            root
            and not is_object_url(root)
            and os.path.abspath(root) != os.path.abspath(load_dir)
            and os.path.isdir(root)
        ):
            its = committed_iterations(root)
            if its:
                out.append(f"{flag} {root} (iteration {its[-1]})")
    return out


def _torch_adams(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers whose inner optimizer keeps ``step`` per parameter (torch's Adam:
    neither TE nor apex is installed)."""
    try:
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:
        return []
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return []
    return [d for d in distributed_optimizers(optimizer) if hasattr(d, "_init_optimizer_states_with_dummy_values")]


def prime_optimizer_state(optimizer: Any) -> list[Any]:
    """Create torch Adam's per-parameter state where it does not exist yet, by Megatron's own dummy
    step with learning rate and weight decay at 0; returns the DistributedOptimizers primed."""
    primed = [d for d in _torch_adams(optimizer) if len(d.optimizer.state) == 0]
    for dopt in primed:
        groups = dopt.optimizer.param_groups
        saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in groups]
        for g, keys in zip(groups, saved):
            g.update(dict.fromkeys(keys, 0.0))
        try:
            dopt._init_optimizer_states_with_dummy_values()
        finally:
            for g, values in zip(groups, saved):
                g.update(values)
    return primed


@contextlib.contextmanager
def _torch_adam_load(optimizer: Any) -> Iterator[None]:
    """Megatron-LM's optimizer load, made to work with torch's Adam:

    * its ``state_dict()`` needs every ``step`` to exist: :func:`prime_optimizer_state`;
    * its loaders (every sharding type, and the legacy format) copy each entry of a parameter's
      live state from the checkpoint's, which holds no per-parameter ``step`` (``KeyError: 'step'``):
      a ``step`` the source lacks is left out of the copy;
    * the checkpoint's ``step`` is in each param group's ``"step"``; per parameter, the load keeps
      the value the state had before (the primer's 1), in one tensor shared by every parameter
      (which torch's Adam would then increment once per parameter): after the load each parameter
      gets its own ``step`` tensor holding its group's;
    * when Megatron loads no optimizer state (a ``release`` checkpoint, one saved with
      ``--no-save-optim``), the primer's state is dropped: the optimizer starts fresh, as natively.
    """
    dopts = _torch_adams(optimizer)
    primed = prime_optimizer_state(optimizer)

    def copy_what_the_source_has(dopt: Any, original: Any) -> Any:
        def set_states(model_param: Any, tensors: dict) -> Any:
            if "step" in tensors or getattr(dopt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                return original(model_param, tensors)
            group_index, group_order = dopt.model_param_group_index_map[model_param]
            state = dopt.optimizer.state[dopt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                return original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        return set_states

    with _patched(dopts, "_set_main_param_and_optimizer_states", copy_what_the_source_has):
        yield
    for dopt in dopts:
        groups = dopt.optimizer.param_groups
        if dopt in primed and not any("step" in g for g in groups):
            dopt.optimizer.state.clear()  # nothing was loaded: no primer state may stay
            continue
        for group in groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = dopt.optimizer.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


def import_checkpoint(
    args: Any,
    found: ForeignCheckpoint,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    *,
    local_root: str | None = None,
    **native_kwargs: Any,
) -> tuple[int, Any]:
    """Load ``found`` (from :func:`importable`) with Megatron-LM's own loader, as a native resume;
    returns ``(iteration, num_floating_point_operations_so_far)``. ``local_root``: this rank's
    node-local tier directory, if any."""
    collective = Collective()
    try:
        elsewhere = _lazy_checkpoints_elsewhere(args, args.load, local_root)
    except OSError as e:
        elsewhere = [f"(rank {collective.rank} cannot list them: {e})"]
    err = None
    if elsewhere:
        err = ConversionError(
            f"--load {args.load} holds a Megatron {found.format} checkpoint and no lazy one, but this run "
            f"already has lazy checkpoints in {'; '.join(elsewhere)}: importing again would ignore them. To "
            "resume the lazy run, pass its --save as --load. Nothing was loaded"
        )
    collective.raise_agreed(err, f"rank {collective.rank}: the import of --load {args.load}")
    log.info("importing Megatron %s checkpoint %s with Megatron-LM's loader", found.format, found.path)
    # no autograd: in fp32 the DistributedOptimizer's main params are views of the model's leaf
    # parameters, and Megatron-LM copies into them in place (an error with grad mode on)
    with native_megatron(args) as checkpointing, _torch_adam_load(optimizer), torch.no_grad():
        return checkpointing.load_checkpoint(model, optimizer, scheduler, **native_kwargs)


def _in_buffer_coordinates(dopt: Any, state: Any) -> Any:
    """``get_parameter_state_dp_zero``'s gathered state with each bucket put back at its offset in
    the param buffer (zeros in the padding between buckets), the coordinates ``param_index_map``
    gives and the ``fully_reshardable`` save slices by."""
    if state is None:
        return state
    for gbuf_idx, by_dtype in state.items():
        if not isinstance(gbuf_idx, int):  # "buckets_coalesced"
            continue
        buffer = dopt.buffers[gbuf_idx]
        for world in by_dtype.values():
            for key, packed in list(world.items()):
                if not isinstance(packed, torch.Tensor):  # "numel_unpadded"
                    continue
                placed = torch.zeros(buffer.numel, dtype=packed.dtype, device=packed.device)
                src = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    placed[bucket.offset : bucket.offset + n].copy_(packed[src : src + n])
                    src += n
                world[key] = placed
    return state


def _fully_reshardable_save(optimizer: Any) -> contextlib.AbstractContextManager:
    """Megatron-LM's ``fully_reshardable`` save (core 0.16 and 0.19) gathers each param buffer with
    the padding between its buckets removed, then slices it by buffer coordinates: every parameter
    after a padded bucket gets another parameter's optimizer state (with PP > 1 the tied embedding
    has a bucket of its own). The gathered state is re-placed for the save."""
    dopts = [d for d in distributed_optimizers(optimizer) if hasattr(d, "get_parameter_state_dp_zero")]

    def placed(dopt: Any, original: Any) -> Any:
        return lambda *a, **kw: _in_buffer_coordinates(dopt, original(*a, **kw))

    return _patched(dopts, "get_parameter_state_dp_zero", placed)


def _check_target(target: str) -> str | None:
    """Why ``target`` cannot receive an export (None: it can): it must be new or an empty directory,
    so that nothing we did not write is overwritten (Megatron rewrites its tracker file)."""
    if os.path.islink(target):
        return "is a symbolic link"
    if not os.path.lexists(target):
        return None
    if not os.path.isdir(target):
        return "exists and is not a directory"
    try:
        names = os.listdir(target)
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    return f"is not empty ({len(names)} entries, e.g. {sorted(names)[0]!r})" if names else None


def export(args: Any, target: str, iteration: int, model: Any, optimizer: Any, scheduler: Any, num_flops: Any) -> None:
    """Write the state just loaded as Megatron's ``torch_dist`` checkpoint of ``iteration`` under
    ``target`` (a new or empty directory), optimizer state ``fully_reshardable``."""
    target = os.path.normpath(target)  # "link/" would make lstat follow the link
    collective = Collective()
    problem = _check_target(target)  # every rank checks before any rank's save creates it
    err = None
    if problem:
        err = ConversionError(
            f"--lazy-ckpt-convert-to {target}: {problem}; give a new or empty directory. Nothing was written"
        )
    collective.raise_agreed(err, f"rank {collective.rank}: --lazy-ckpt-convert-to {target}")
    if not hasattr(args, "dist_ckpt_optim_fully_reshardable"):
        raise ConversionError(
            "--lazy-ckpt-convert-to needs a Megatron-LM with --dist-ckpt-optim-fully-reshardable (core 0.16 "
            "or later): without it the optimizer state would not load at another layout. Nothing was written"
        )
    overrides = dict(save=target, ckpt_format="torch_dist", use_dist_ckpt=True, async_save=False)
    overrides.update(dist_ckpt_optim_fully_reshardable=True, distrib_optim_fully_reshardable_mem_efficient=False)
    with native_megatron(args, **overrides) as checkpointing, _fully_reshardable_save(optimizer):
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, num_flops, checkpointing_context={})
    collective.agree(True)
    if collective.rank == 0:
        log.info("exported iteration %d to %s in torch_dist format", iteration, target)
