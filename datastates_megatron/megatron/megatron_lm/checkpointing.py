"""Glue called by a patched Megatron-LM (``datastates_megatron/megatron/megatron_lm/patches/``), or one routed at run time
by :mod:`.hook`, when ``--lazy-ckpt`` is on.

The patch (or the hook) only forwards calls; every decision lives here:

* ``megatron.training.checkpointing.save_checkpoint`` -> :func:`save_checkpoint`
* ``megatron.training.checkpointing.load_checkpoint`` -> :func:`load_checkpoint`
* ``megatron.training.async_utils.maybe_finalize_async_save(blocking, terminate)`` ->
  :func:`maybe_finalize` (Megatron calls it once per iteration with ``blocking=False`` and with
  ``blocking=True, terminate=True`` before it returns or exits — also on the exit-signal,
  exit-interval and exit-duration paths), which ends in :func:`finalize_at_exit` on ``terminate``.

One process-wide :class:`~datastates_megatron.megatron.checkpointing.checkpointer.LazyCheckpointer` is created on
the first save or load from Megatron's global args, for the model/optimizer/scheduler of that call;
an ``atexit`` hook commits what is still pending if the process exits without ``terminate``.

Under ``--inprocess-restart`` (nvidia-resiliency-ext's ``Wrapper``) ``pretrain`` runs again in the
same process after a fault, with a new model, optimizer and process groups.  The checkpointer of the
aborted attempt is retired by the first save or load of the next one (:func:`_session_for`), on the
training thread: its pending checkpoints end as they would have (their commit goes through the
job's store, which outlives the attempt: committed on every rank, or abandoned on every rank), its
threads stop, its save-directory lock is released, its host cache's arena is kept for the next
checkpointer (never allocated twice), and only then is the new attempt's checkpointer built.  Ranks of
the aborted attempt that are not in the new one (a killed process, a lost node, whose place a spare
may take) are first found (:func:`_ranks_gone`), and its pending commits stop waiting for them.  An
attempt is known to be over by :func:`abort` (the runtime hook calls it where Megatron's
``AbortCheckpoint`` resets its own async worker) or, without the hook, by the default process group
having been rebuilt since the checkpointer was made.

Megatron's per-run fields travel in ``extra_state["megatron_lm"]`` as plain JSON (no pickle):
``iteration``, ``num_floating_point_operations_so_far``, consumed/skipped train samples, consumed
validation samples, Megatron's ``checkpoint_version`` and the JSON-representable subset of ``args``.

Thread-safety: meant to be driven by the training thread; the singleton is guarded by a lock, so
the ``atexit`` hook and the training thread never finalize it twice.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import itertools
import logging
import math
import os
import sys
import threading
import time
import types
import weakref
from typing import Any

from ...engine.errors import CheckpointError, FormatVersionError, LayoutMismatchError, NoCheckpointError
from . import call_params, torch_dist
from .args import LazyCkptArgsError, check_host_cache_fits, validate_lazy_ckpt_args

__all__ = [
    "EXTRA_STATE_KEY",
    "EXTRA_STATE_VERSION",
    "MegatronIntegrationError",
    "enabled",
    "get_checkpointer",
    "save_checkpoint",
    "load_checkpoint",
    "maybe_finalize",
    "finalize_at_exit",
    "abort",
    "build_extra_state",
    "apply_extra_state",
    "largest_tensor_bytes",
    "is_final_save",
]

logger = logging.getLogger(__name__)

EXTRA_STATE_KEY = "megatron_lm"
EXTRA_STATE_VERSION = 1
_MEGATRON_CHECKPOINT_VERSION = 3.0  # what Megatron-LM's generate_state_dict writes

# Arguments that must match between the saving and the resuming run (Megatron's
# check_checkpoint_args plus the parallel layout, which a lazy checkpoint cannot reshard).
_MUST_MATCH = (  # the tensor-, (virtual) pipeline- and expert-parallel sizes may differ: resharded by the load (reshard.py)
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_experts",
)


class MegatronIntegrationError(CheckpointError, RuntimeError):
    """Megatron-LM asked for something the lazy checkpointer cannot do (the message says what)."""


class _Session:
    """The process-wide checkpointer and the objects it was built for."""

    def __init__(self, ckpt: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.ckpt = ckpt
        self._ids = (_ids(model), id(optimizer), id(scheduler))
        self.skips_reported = (0, 0)  # the skip counts last written to TensorBoard
        group = _default_group()
        self._group = None if group is None else weakref.ref(group)  # the attempt's process groups
        self.aborted = threading.Event()  # set by abort(), from any thread

    def matches(self, model: Any, optimizer: Any, scheduler: Any) -> bool:
        return self._ids == (_ids(model), id(optimizer), id(scheduler))

    def ended(self) -> bool:
        """True once the training attempt this checkpointer was made in is over: aborted, or its
        default process group destroyed or replaced (an in-process restart)."""
        if self.aborted.is_set():
            return True
        return self._group is not None and self._group() is not _default_group()


_lock = threading.Lock()
_session: _Session | None = None
# the rank this process was launched as, before an in-process restart may give it another (NVRx sets
# RANK): imported at start-up through the runtime hook; a patched tree imports this at its first save
_LAUNCH_RANK = os.environ.get("RANK")
_atexit_registered = False


def _default_group() -> Any:
    """torch.distributed's default process group, or None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


def _ids(model: Any) -> tuple[int, ...]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return tuple(id(m) for m in chunks)


def _rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _info(msg: str, *a: Any) -> None:
    """INFO on rank 0, DEBUG elsewhere (thousands of ranks must not all print)."""
    logger.log(logging.INFO if _rank() == 0 else logging.DEBUG, msg, *a)


def _get_args(args: Any) -> Any:
    if args is not None:
        return args
    from megatron.training import get_args  # Megatron-LM, not megatron-core

    return get_args()


def _megatron_checkpointing() -> types.ModuleType | None:
    try:
        from megatron.training import checkpointing
    except ImportError:
        return None
    return checkpointing


def enabled(args: Any = None) -> bool:
    """True when ``--lazy-ckpt`` is on (``args`` defaults to Megatron's global args)."""
    return bool(getattr(_get_args(args), "lazy_ckpt", False))


def get_checkpointer() -> Any:
    """The process-wide LazyCheckpointer, or None before the first save/load and after exit."""
    session = _session
    return None if session is None else session.ckpt


def commit_metrics(record: Any, stall_s: float) -> dict[str, float]:
    """The per-checkpoint telemetry, as scalars named for TensorBoard / W&B."""
    return {
        "lazy-ckpt/bytes-total": float(record.total_bytes),
        "lazy-ckpt/bytes-per-rank-max": float(record.max_rank_bytes),
        "lazy-ckpt/stall-ms": stall_s * 1e3,
        "lazy-ckpt/d2h-GBps": record.d2h_gbps,
        "lazy-ckpt/flush-GBps": record.flush_gbps,
        "lazy-ckpt/save-to-commit-s": record.commit_s,
    }


def log_commit_to_writers(record: Any, stall_s: float) -> None:
    """After each commit, the rank that holds Megatron's TensorBoard and W&B writers (Megatron-LM
    creates them on the last rank only) adds the telemetry to them; the record is the same on every
    rank (maxima over ranks), the stall is that rank's.  The log line itself comes from
    LazyCheckpointer."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return
    metrics = commit_metrics(record, stall_s)
    tb, wb = get_tensorboard_writer(), get_wandb_writer()
    if tb is not None:
        for name, value in metrics.items():
            tb.add_scalar(name, value, record.iteration)
    if wb is not None:
        wb.log(metrics, record.iteration)


def log_skips_to_writers(session: _Session, iteration: int) -> None:
    """The skipped checkpoints (storage behind: ``--lazy-ckpt-when-behind skip``) as TensorBoard
    scalars, on the rank holding Megatron's writer, whenever they changed: this rank's skipped
    saves, and the checkpoints every rank abandoned for some rank's skip."""
    counts = session.ckpt.skipped
    if counts == session.skips_reported:
        return
    session.skips_reported = counts
    try:
        from megatron.training.global_vars import get_tensorboard_writer
    except ImportError:
        return
    tb = get_tensorboard_writer()
    if tb is not None:
        tb.add_scalar("lazy-ckpt/skipped-saves", float(counts[0]), iteration)
        tb.add_scalar("lazy-ckpt/skipped-checkpoints", float(counts[1]), iteration)


def is_final_save(args: Any, iteration: int) -> str | None:
    """Why Megatron-LM's save of ``iteration`` is its last before the run ends (never skipped,
    then), or ``None``: the end of training (``--train-iters``), ``--exit-interval``, a phase
    transition, a signal received (``--exit-signal-handler``) or ``--exit-duration-in-mins`` passed
    -- the conditions under which ``training.checkpoint_and_decide_exit`` and ``pretrain`` save and
    then leave.  The duration is this rank's clock (Megatron's own decision is the maximum over
    ranks, taken a moment before the save)."""
    train_iters = getattr(args, "train_iters", None)
    if train_iters and iteration >= train_iters:
        return "the end of training"
    exit_interval = getattr(args, "exit_interval", None)
    if exit_interval and iteration % exit_interval == 0:
        return "--exit-interval"
    if iteration in (getattr(args, "phase_transition_iterations", None) or ()):
        return "a phase transition"
    try:
        from megatron.training import global_vars, training
    except ImportError:
        return None
    if getattr(args, "exit_signal_handler", False):
        handler = global_vars.get_signal_handler()
        if handler is not None and any(handler.signals_received()):
            return "a signal"
    minutes = getattr(args, "exit_duration_in_mins", None)
    start = getattr(training, "_TRAIN_START_TIME", None)
    if minutes and start is not None and (time.time() - start) / 60.0 > minutes:
        return "--exit-duration-in-mins"
    return None


def largest_tensor_bytes(model: Any) -> int:
    """Bytes of the largest parameter or buffer of ``model`` (a module or a list of chunks)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    best = 0
    for chunk in chunks:
        for t in itertools.chain(chunk.parameters(), chunk.buffers()):
            best = max(best, t.numel() * t.element_size())
    return best


def abort() -> None:
    """The training attempt is being aborted (an in-process restart): mark the checkpointer so that
    the next attempt's first save or load retires it.  Safe from any thread (NVRx calls its abort
    steps from its monitor thread while the training thread may still be running); touches nothing
    else: the pending checkpoints end on the training thread (see the module docstring)."""
    session = _session
    if session is not None:
        session.aborted.set()
        logger.warning("rank %d: training attempt aborted; the lazy checkpointer is retired at the next start", _rank())


def _on_this_machine(config: Any) -> Any:
    """``{node}`` of ``--lazy-ckpt-local-dir`` resolved from the rank this process was launched as
    (``rank // LOCAL_WORLD_SIZE`` of it): an in-process restart that makes a spare take a rank of
    another node leaves it on its own machine's directory (the engine resolves ``{node}`` from the
    current rank)."""
    import torch.distributed as dist

    if not config.local_dir or "{node}" not in config.local_dir or not _LAUNCH_RANK or not dist.is_initialized():
        return config
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world) or world
    machine, node = int(_LAUNCH_RANK) // per_node, dist.get_rank() // per_node
    if machine != node and per_node > 1:
        logger.warning(
            "rank %d: this process was launched on node %d, and its rank now belongs to node %d: a spare took "
            "the rank of another node's process, and that node's local checkpoints will lack this rank's file "
            "(its restores then read a replica or --save); give spares whole nodes (--inprocess-granularity node)",
            dist.get_rank(),
            machine,
            node,
        )
    return dataclasses.replace(config, local_dir=config.local_dir.format(node=machine))


def _ranks_gone(ended: _Session | None) -> list[int]:
    """At the first save or load of an attempt under ``--inprocess-restart`` (every rank of it, a
    spare included): the ranks of the aborted attempt whose processes are not in this one (killed,
    or a lost node): its pending commits must not wait for them.  Each rank tells rank 0 the rank
    it had (one gather), and rank 0 tells every rank who is missing (one broadcast)."""
    import torch.distributed as dist

    mine = (ended.ckpt.rank, ended.ckpt.world_size) if ended is not None else (-1, 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    had = [None] * world if rank == 0 else None
    dist.gather_object(mine, had, dst=0)
    gone = [None]
    if rank == 0:
        before = max(w for _, w in had)
        gone[0] = sorted(set(range(before)) - {r for r, _ in had})
        if gone[0]:
            logger.warning("rank 0: in-process restart: rank(s) %s of the aborted attempt are gone", gone[0])
    dist.broadcast_object_list(gone, src=0)
    return gone[0]


def _retire(session: _Session) -> None:
    """Close the checkpointer of an ended attempt (caller holds ``_lock``): its pending checkpoints
    end as they would have, committed or abandoned alike on every rank; an error is logged (it was
    the old attempt's), never raised into the new one."""
    ckpt = session.ckpt
    try:
        ckpt.close(keep_cache=True)  # the next attempt's checkpointer takes the arena
    except CheckpointError as e:
        logger.warning("rank %d: the aborted attempt's pending lazy checkpoints were not committed: %s", _rank(), e)
    last = ckpt.commits[-1].iteration if ckpt.commits else None
    logger.warning(
        "rank %d: in-process restart: the aborted attempt's lazy checkpointer is closed (its newest commit: %s); "
        "starting a new one",
        _rank(),
        "none" if last is None else f"iteration {last}",
    )


def run_vocabulary(args: Any) -> int | None:
    """The vocabulary megatron-core pads (to ``--make-vocab-size-divisible-by`` × TP): the
    tokenizer's, from which Megatron-LM's ``build_tokenizer`` computes ``args.padded_vocab_size``;
    ``--vocab-size`` when no tokenizer is built; ``None`` when neither is known."""
    try:
        from megatron.training.global_vars import get_tokenizer

        size = get_tokenizer().vocab_size
    except (ImportError, AssertionError, AttributeError):  # no tokenizer built (get_tokenizer asserts)
        size = getattr(args, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _session_for(args: Any, model: Any, optimizer: Any, scheduler: Any) -> _Session:
    global _session, _atexit_registered
    with _lock:
        ended = None
        if _session is not None and _session.ended():
            _session, ended = None, _session
        if _session is None and getattr(args, "inprocess_restart", False):
            try:
                gone = _ranks_gone(ended)  # every rank of the attempt: a spare too
                if ended is not None and gone:
                    ended.ckpt.forget_ranks(gone)
            except BaseException:  # another fault: the next attempt retires it (still ended), never leaked
                _session = ended
                raise
        if ended is not None:
            _retire(ended)
        if _session is not None:
            if not _session.matches(model, optimizer, scheduler):
                raise MegatronIntegrationError(
                    f"rank {_rank()}: --lazy-ckpt checkpoints the model, optimizer and scheduler "
                    "objects of its first save/load; this call passed different ones (e.g. a "
                    "model-only load with optimizer=None), which lazy checkpoints do not support"
                )
            return _session
        # the patch's parse-time check, again (problems named by flag), and the config it builds
        config = _on_this_machine(validate_lazy_ckpt_args(args))
        if not config.streaming:
            check_host_cache_fits(config, largest_tensor_bytes(model), what="largest model tensor")
        from ..checkpointing.checkpointer import LazyCheckpointer

        ckpt = LazyCheckpointer(
            model, optimizer, config, opt_param_scheduler=scheduler, vocab_size=run_vocabulary(args)
        )
        ckpt.on_commit.append(log_commit_to_writers)
        _session = _Session(ckpt, model, optimizer, scheduler)
        if not _atexit_registered:
            atexit.register(_finalize_atexit)
            _atexit_registered = True
        _info(
            "rank %d: lazy checkpointer started (save=%s, load=%s, host cache %.2f GiB%s, %d flush threads)",
            _rank(),
            config.save_dir,
            config.effective_load_dir,
            config.host_cache_gb,
            " reused from the aborted attempt" if ckpt.cache_reused else "",
            config.flush_threads,
        )
        return _session


# --------------------------------------------------------------------------- #
# extra state: Megatron's per-run fields, JSON only
# --------------------------------------------------------------------------- #
def _json_scalar(v: Any) -> Any:
    """``v`` as a JSON scalar, or :data:`_SKIP`. An enum is stored by name (``args.exit_signal`` is
    a ``signal.Signals``, an ``IntEnum``: an ``int`` to ``isinstance`` that the encoder refuses)."""
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, float):
        return v if math.isfinite(v) else _SKIP
    return v if v is None or isinstance(v, (bool, int, str)) else _SKIP


_SKIP = object()


def _json_args(args: Any) -> dict[str, Any]:
    """The arguments JSON can hold (scalars, enums by name, flat lists of those); the rest is
    skipped: they are kept for the resume-time checks, never applied back to ``args``."""
    out: dict[str, Any] = {}
    for k, v in sorted(vars(args).items()):
        if k.startswith("_"):
            continue
        if isinstance(v, (list, tuple)):
            v = [_json_scalar(x) for x in v]
            if _SKIP not in v:
                out[k] = v
        elif (v := _json_scalar(v)) is not _SKIP:
            out[k] = v
    return out


def _number(x: Any) -> int | float:
    if hasattr(x, "item"):  # a 0-d tensor or numpy scalar
        x = x.item()
    return x if isinstance(x, int) and not isinstance(x, bool) else float(x)


def build_extra_state(args: Any, iteration: int, num_floating_point_operations_so_far: Any = 0) -> dict[str, Any]:
    """The ``extra_state`` saved with each checkpoint: Megatron's per-run fields as plain JSON."""
    return {
        EXTRA_STATE_KEY: {
            "version": EXTRA_STATE_VERSION,
            "iteration": int(iteration),
            "num_floating_point_operations_so_far": _number(num_floating_point_operations_so_far or 0),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
            "checkpoint_version": _MEGATRON_CHECKPOINT_VERSION,
            "args": _json_args(args),
        }
    }


def apply_extra_state(args: Any, iteration: int, extra_state: Any, *, where: str = "") -> int | float:
    """Check and apply a loaded ``extra_state`` to ``args``; return the FLOPs counter to resume.

    Sets ``args.consumed_train_samples``, ``args.skipped_train_samples`` and
    ``args.consumed_valid_samples``. Raises :class:`LayoutMismatchError` when the model shape or the
    parallel layout differ from the saving run, :class:`FormatVersionError` for a newer version.
    """
    meg = (extra_state or {}).get(EXTRA_STATE_KEY) if isinstance(extra_state, dict) else None
    if meg is None:
        logger.warning(
            "rank %d: lazy checkpoint of iteration %d%s carries no Megatron-LM state "
            "(not saved through megatron_lm.save_checkpoint): consumed samples and "
            "FLOPs are not restored",
            _rank(),
            iteration,
            where,
        )
        return 0
    version = meg.get("version", 0)
    if version > EXTRA_STATE_VERSION:
        raise FormatVersionError(
            f"rank {_rank()}: lazy checkpoint of iteration {iteration}{where} has Megatron-LM extra "
            f"state version {version}; this datastates_megatron reads <= {EXTRA_STATE_VERSION}"
        )
    saved = meg.get("args") or {}
    diffs = [
        f"{name}: checkpoint {saved[name]!r}, run {getattr(args, name)!r}"
        for name in _MUST_MATCH
        if name in saved and hasattr(args, name) and saved[name] != getattr(args, name)
    ]
    if diffs:
        raise LayoutMismatchError(
            f"rank {_rank()}: lazy checkpoint of iteration {iteration}{where} was saved by a run "
            f"with different arguments ({'; '.join(diffs)}); a lazy checkpoint is resharded to another data-, "
            "tensor-, (virtual) pipeline- or expert-parallel size only"
        )
    args.consumed_train_samples = int(meg.get("consumed_train_samples", 0))
    args.skipped_train_samples = int(meg.get("skipped_train_samples", 0))
    args.consumed_valid_samples = int(meg.get("consumed_valid_samples", 0))
    return meg.get("num_floating_point_operations_so_far", 0)


def _partial_load(args: Any) -> tuple[bool, bool, bool]:
    """``(finetune, load the optimizer, load the RNG)`` from Megatron-LM's ``--finetune``,
    ``--no-load-optim`` and ``--no-load-rng``, with Megatron-LM's meaning: ``--finetune`` loads the
    model only (and resets the iteration and consumed samples); the optimizer state comes with the
    scheduler."""
    finetune = bool(getattr(args, "finetune", False))
    return (
        finetune,
        not finetune and not getattr(args, "no_load_optim", False),
        not finetune and not getattr(args, "no_load_rng", False),
    )


def _flops_of(extra_state: Any) -> int | float:
    """The FLOPs counter a checkpoint carries (Megatron-LM returns it with ``--finetune`` too)."""
    meg = (extra_state or {}).get(EXTRA_STATE_KEY) if isinstance(extra_state, dict) else None
    return (meg or {}).get("num_floating_point_operations_so_far", 0)


def _after_load(args: Any, iteration: int, optimizer: Any) -> None:
    """What Megatron's own load_checkpoint does to global state besides restoring tensors."""
    try:
        from megatron.core import num_microbatches_calculator as nmc
    except ImportError:
        nmc = None
    # Unset before initialize_megatron (tools, tests); Megatron-LM training always sets it.
    if getattr(nmc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None:
        nmc.update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    mcp = _megatron_checkpointing()
    if mcp is None:
        return
    if hasattr(mcp, "set_loaded_iteration"):
        mcp.set_loaded_iteration(iteration)
    if hasattr(mcp, "get_checkpoint_version") and mcp.get_checkpoint_version() is None:
        mcp.set_checkpoint_version(_MEGATRON_CHECKPOINT_VERSION)
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        for group in optimizer.param_groups:  # as Megatron's load_checkpoint does
            group.setdefault("default_config", True)


# --------------------------------------------------------------------------- #
# the entry points the patch calls
# --------------------------------------------------------------------------- #
def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: Any = 0,
    checkpointing_context: Any = None,
    *,
    pipeline_rank: Any = None,
    expert_rank: Any = None,
    tensor_rank: Any = None,
    pipeline_parallel: Any = None,
    expert_parallel: Any = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
    preprocess_common_state_dict_fn: Any = None,
    release: bool = False,
    tp_group: Any = None,
    pp_group: Any = None,
    dp_cp_group: Any = None,
    dp_group: Any = None,
    expt_dp_group: Any = None,
    rng_state_key_prefix: str = "",
    args: Any = None,
) -> None:
    """Megatron's ``save_checkpoint`` for ``--lazy-ckpt``: schedule the checkpoint and return.

    The device->host copies overlap the next forward/backward; the checkpoint is committed later
    (:func:`maybe_finalize`). Takes every parameter of Megatron's function; what happens to each is
    in :mod:`.call_params` (used, checked, refused or not applicable; never dropped unseen).
    """
    args = _get_args(args)
    where = f"iteration {iteration}"
    if non_persistent_ckpt and getattr(args, "lazy_ckpt_local_dir", None) is None:
        # Megatron's non-persistent checkpoints are our node-local tier's (megatron_flags.adopt):
        # saved like any other, the persist interval (--save-interval) leaves them local
        raise LazyCkptArgsError(
            f"iteration {iteration}: a Megatron non-persistent checkpoint needs a node-local tier: "
            "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir DIR, or --lazy-ckpt-local-dir DIR"
        )
    if release:
        raise LazyCkptArgsError(
            f"iteration {iteration}: --lazy-ckpt cannot write a 'release' checkpoint; save it without --lazy-ckpt"
        )
    call_params.check_converter(
        where,
        dict(
            pipeline_rank=pipeline_rank,
            expert_rank=expert_rank,
            tensor_rank=tensor_rank,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
        ),
    )
    call_params.check_rng_prefix(where, rng_state_key_prefix)
    call_params.check_groups(
        where,
        dict(
            tp_group=tp_group,
            pp_group=pp_group,
            dp_cp_group=dp_cp_group,
            dp_group=dp_group,
            expt_dp_group=expt_dp_group,
        ),
    )
    session = _session_for(args, model, optimizer, opt_param_scheduler)
    mcp = _megatron_checkpointing()
    if train_data_iterator is not None and mcp is not None and hasattr(mcp, "maybe_save_dataloader_state"):
        # Only Megatron Energon loaders have state; written synchronously next to the checkpoint.
        mcp.maybe_save_dataloader_state(train_data_iterator, iteration, getattr(args, "dataloader_save", None))
    extra = build_extra_state(args, iteration, num_floating_point_operations_so_far)
    final = is_final_save(args, iteration)
    start = time.perf_counter()
    started = session.ckpt.save(iteration, extra_state=extra, final=final is not None)
    log_skips_to_writers(session, iteration)
    _info(
        "rank %d: %s lazy checkpoint of iteration %d to %s (training blocked %.3f s%s)",
        _rank(),
        "scheduled" if started else "did not schedule",
        iteration,
        args.save,
        time.perf_counter() - start,
        f"; the last before the run ends: {final}" if final else "",
    )


def load_checkpoint(
    ddp_model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    checkpointing_context: Any = None,
    skip_load_to_model_and_opt: bool = False,
    *,
    tp_group: Any = None,
    pp_group: Any = None,
    dp_cp_group: Any = None,
    dp_group: Any = None,
    expt_dp_group: Any = None,
    rng_state_key_prefix: str = "",
    args: Any = None,
) -> tuple[int, int | float]:
    """Megatron's ``load_checkpoint`` for ``--lazy-ckpt``; returns ``(iteration, num_flops_so_far)``.

    Restores model, optimizer, scheduler and RNG in place from the newest committed lazy checkpoint
    under ``--load`` (or ``--ckpt-step``), sets ``args.consumed_train_samples`` /
    ``skipped_train_samples`` / ``consumed_valid_samples``, updates the micro-batch calculator and
    Megatron's loaded-iteration record. Returns ``(0, 0)`` when there is none, as Megatron does.
    Falls back to Megatron's own loader for ``load_arg != "load"`` and for ``--pretrained-checkpoint``
    when ``--load`` holds no lazy checkpoint yet. A ``--load`` holding only a Megatron checkpoint is
    imported with Megatron's own loader, and ``--lazy-ckpt-convert-to`` writes what was loaded in
    ``torch_dist`` format and exits (:mod:`.torch_dist`). Megatron's loader gets every parameter
    it was given (process groups and ``rng_state_key_prefix`` only where set: older releases lack
    them); a lazy load checks them (:mod:`.call_params`). ``strict`` and
    ``skip_load_to_model_and_opt`` do not apply to a lazy load (tensors are restored in place, all of them).
    """
    args = _get_args(args)
    groups = dict(
        tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group, expt_dp_group=expt_dp_group
    )
    native_kwargs = dict(
        load_arg=load_arg,
        strict=strict,
        checkpointing_context=checkpointing_context,
        skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        **{k: v for k, v in groups.items() if v is not None},
        **({"rng_state_key_prefix": rng_state_key_prefix} if rng_state_key_prefix else {}),
    )
    if load_arg != "load":
        _info(
            "rank %d: --%s is loaded by Megatron's own loader (not a lazy checkpoint)",
            _rank(),
            load_arg.replace("_", "-"),
        )
        with torch_dist.native_megatron(args) as mcp:
            return mcp.load_checkpoint(ddp_model, optimizer, opt_param_scheduler, **native_kwargs)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if getattr(args, "load", None) is None:
        if pretrained is None:
            return 0, 0
        with torch_dist.native_megatron(args) as mcp:
            return mcp.load_checkpoint(ddp_model, optimizer, opt_param_scheduler, **native_kwargs)

    where = f"--load {args.load}"
    call_params.check_rng_prefix(where, rng_state_key_prefix)
    call_params.check_groups(where, groups)
    session = _session_for(args, ddp_model, optimizer, opt_param_scheduler)
    requested = getattr(args, "ckpt_step", None) or None  # Megatron treats 0 as unset
    convert_to = getattr(args, "lazy_ckpt_convert_to", None)
    found = torch_dist.importable_on_every_rank(args.load, requested)
    if found is not None:
        iteration, num_flops = torch_dist.import_checkpoint(
            args, found, ddp_model, optimizer, opt_param_scheduler, local_root=session.ckpt.local_dir, **native_kwargs
        )
        _info(
            "rank %d: imported Megatron %s checkpoint of iteration %d from %s",
            _rank(),
            found.format,
            iteration,
            found.path,
        )
    else:
        finetune, load_optim, load_rng = _partial_load(args)
        try:
            iteration, extra_state = session.ckpt.load(requested, optimizer=load_optim, rng=load_rng)
        except NoCheckpointError:
            if requested is not None or convert_to:
                raise
            if pretrained is not None:
                _info(
                    "rank %d: no lazy checkpoint under --load %s; loading --pretrained-checkpoint %s "
                    "with Megatron's loader",
                    _rank(),
                    args.load,
                    pretrained,
                )
                with torch_dist.native_megatron(args) as mcp:
                    return mcp.load_checkpoint(ddp_model, optimizer, opt_param_scheduler, **native_kwargs)
            if getattr(args, "exit_on_missing_checkpoint", False):
                logger.error(
                    "rank %d: no lazy checkpoint under --load %s and --exit-on-missing-checkpoint is set: exiting",
                    _rank(),
                    args.load,
                )
                sys.exit()
            _info("rank %d: no lazy checkpoint under --load %s; starting from scratch", _rank(), args.load)
            return 0, 0
        where = f" under {args.load}"
        if finetune:  # as Megatron-LM: the model only, its arguments unchecked, samples and iteration from 0
            num_flops = _flops_of(extra_state)
            _info(
                "rank %d: loaded the model of lazy checkpoint of iteration %d%s (--finetune)", _rank(), iteration, where
            )
            iteration = 0
        else:
            num_flops = apply_extra_state(args, iteration, extra_state, where=where)
            skipped = [flag for flag, loaded in (("optimizer", load_optim), ("RNG", load_rng)) if not loaded]
            _info(
                "rank %d: loaded lazy checkpoint of iteration %d%s%s",
                _rank(),
                iteration,
                where,
                f" (not loaded: {', '.join(skipped)})" if skipped else "",
            )
        _after_load(args, iteration, optimizer)
    if convert_to:
        torch_dist.export(args, convert_to, iteration, ddp_model, optimizer, opt_param_scheduler, num_flops)
        finalize_at_exit()
        sys.exit(0)  # converted, as asked: no training (as Megatron-LM ends after --exit-interval)
    return iteration, num_flops


def maybe_finalize(blocking: bool = False, terminate: bool = False) -> list[int]:
    """Commit finished checkpoints; called where Megatron calls ``maybe_finalize_async_save``.

    ``blocking=False``: non-blocking poll (re-raises a stored background error once).
    ``blocking=True``: wait until every pending checkpoint is committed. ``terminate=True``:
    :func:`finalize_at_exit`. Returns the iterations committed by this call, where known.
    """
    if terminate:
        finalize_at_exit()
        return []
    session = _session
    if session is None:
        return []
    if blocking:
        session.ckpt.wait(persist=True)
    committed = list(session.ckpt.poll() or [])
    for it in committed:
        _info("rank %d: committed lazy checkpoint of iteration %d", _rank(), it)
    return committed


def finalize_at_exit() -> None:
    """Wait until every pending checkpoint is committed (with a node-local tier, the newest one
    promoted to ``--save`` too), then close the checkpointer. Idempotent.

    A later save or load starts a new checkpointer (Megatron's ``pretrain`` may save once more after
    ``train`` has finalized).
    """
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    try:
        session.ckpt.wait(persist=True, promote_newest=True)
        _info("rank %d: all lazy checkpoints committed", _rank())
    finally:
        session.ckpt.close()


def _finalize_atexit() -> None:
    try:
        finalize_at_exit()
    except Exception:  # the interpreter is exiting: report, do not mask the exit status
        logger.exception("rank %d: pending lazy checkpoints could not be committed at exit", _rank())
