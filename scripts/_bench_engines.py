"""The checkpoint engines that ``scripts/bench_peers.py`` compares, behind one small protocol.

Every engine checkpoints the same live megatron-core training state (a list of DDP chunks built
with ``use_distributed_optimizer=True`` and the optimizer from ``get_megatron_optimizer``) and is
driven the way its own framework drives it:

============== ==============================================================================
``baseline``     nothing (the reference for every ratio)
``torch_save``   ``torch.save`` of this rank's state (:func:`rank_state`) to ``rank{r}.pt``, then
                 ``fsync`` of the file and of its directory -- synchronous
``mcore_sync``   megatron-core ``dist_checkpointing.save`` with the ``torch_dist`` strategy wrapped
                 in ``FullyParallelSaveStrategyWrapper`` (what Megatron-LM's ``save_checkpoint``
                 does, ``distrib_optim_sharding_type='dp_reshardable'``) -- synchronous
``mcore_async``  the same with ``async_sharded_save=True``; the request goes to an
                 ``AsyncCallsQueue`` and ``maybe_finalize_async_calls(blocking=False)`` runs once
                 per iteration, as Megatron-LM's training loop does
``mcore_reshardable``
                 ``mcore_sync`` with ``distrib_optim_sharding_type='fully_reshardable'`` (Megatron-LM's
                 ``--dist-ckpt-optim-fully-reshardable``): optimizer state that megatron-core
                 reshards at another TP, PP or EP size
``dcp_async``    ``torch.distributed.checkpoint.async_save`` of :func:`rank_state` with a
                 ``DefaultStager`` (TorchTitan's ``async_with_pinned_mem`` mode): the save call waits
                 for the previous upload, and a step pre-hook on every inner torch optimizer waits
                 for staging before ``optimizer.step()`` mutates the state
``ours``         :class:`datastates_megatron.LazyCheckpointer`
============== ==============================================================================

Protocol (:class:`Engine`): ``save(iteration)`` at Megatron's save point (after ``train_step``),
``tick()`` once per iteration after it, ``drain()`` until every started checkpoint is durable,
``restore()`` loads the newest checkpoint into the live model and optimizer in place,
``close()`` releases threads, processes and hooks (idempotent).  Checkpoint directories are
``<root>/iter_XXXXXXX`` for every engine, so :meth:`Engine.last_dir` can be measured.

Thread-safety: none of these objects is thread-safe; drive each from the training thread.  All
methods except ``tick`` of the synchronous engines are collective (every rank, same order).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

__all__ = [
    "ENGINES",
    "BenchOptions",
    "Workload",
    "Engine",
    "GateTimer",
    "inner_optimizers",
    "rank_state",
    "iter_dir",
    "dir_bytes",
    "evict_page_cache",
    "snapshot_state",
    "scramble_state",
    "compare_state",
    "thread_cpu_s",
]


# --------------------------------------------------------------------------- #
# workload and the rank-local state
# --------------------------------------------------------------------------- #
def add_workload_args(parser: Any) -> None:
    """The workload's flags, one definition for every benchmark that trains it (bench_peers,
    bench_paired, bench_ckpt_cpu): megatron-core GPT + DistributedOptimizer, 19.5 M parameters."""
    g = parser.add_argument_group("workload")
    g.add_argument("--layers", type=int, default=6, help="transformer layers")
    g.add_argument("--hidden", type=int, default=512, help="hidden size (FFN = 4x)")
    g.add_argument("--heads", type=int, default=8, help="attention heads")
    g.add_argument("--seq-len", type=int, default=128, help="sequence length")
    g.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    g.add_argument("--micro-batch", type=int, default=4, help="micro-batch size per rank")
    g.add_argument("--bf16", action="store_true", help="bf16 model with fp32 main params")
    g.add_argument("--seed", type=int, default=1234, help="seed of weights and batches")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")


def build_workload(args: Any) -> tuple[list, Any, Any]:
    """(model chunks, optimizer, LR scheduler) of the workload ``add_workload_args`` describes."""
    from datastates_megatron.demo import gpt

    chunks, optimizer = gpt.build(
        args.layers, args.hidden, args.heads, args.seq_len, args.vocab, bf16=args.bf16, seed=args.seed, lr=args.lr
    )
    return chunks, optimizer, gpt.make_scheduler(optimizer, lr=args.lr, warmup_steps=2, decay_steps=1000)


def workload_batch(args: Any, iteration: int) -> dict:
    """This rank's batch of ``iteration`` (1-based)."""
    from datastates_megatron.demo import gpt

    return gpt.batch(
        iteration - 1,
        gpt.dp_rank(),
        seed=args.seed,
        micro_batch_size=args.micro_batch,
        seq_len=args.seq_len,
        vocab=args.vocab,
    )


def thread_cpu_s() -> collections.Counter:
    """CPU seconds used so far by each kind of live thread of this process (Linux; empty elsewhere).

    Keyed by the Python thread name without its rank and index (``dsm-flush-r0_1`` ->
    ``dsm-flush``), else the OS name (gloo's threads); from ``/proc/self/task/*/schedstat``
    (nanoseconds on CPU).  A thread that exits between two calls loses its time."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: collections.Counter = collections.Counter()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[re.sub(r"_\d+$", "", re.sub(r"-r\d+", "", name))] += ns / 1e9
    return out


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """Engine knobs taken from the command line.

    host_cache_gb / flush_threads / keep_last: ours (``LazyCkptConfig``).
    local_dir / persist_interval: ours_local's node-local tier and promotion interval.
    dcp_checkpointer: ``"process"`` (TorchTitan's ``async_with_pinned_mem``) or ``"thread"``.
    """

    host_cache_gb: float = 1.0
    flush_threads: int = 2
    keep_last: int = 2
    dcp_checkpointer: str = "process"
    local_dir: str = "/dev/shm/dsm-bench-local"
    persist_interval: int = 10

    def __post_init__(self) -> None:
        if self.dcp_checkpointer not in ("thread", "process"):
            raise ValueError(f"dcp_checkpointer must be 'thread' or 'process', got {self.dcp_checkpointer!r}")


class Workload:
    """What an engine checkpoints: the live model chunks, optimizer and LR scheduler of one run.

    ``io_group`` is a gloo group reserved for background checkpoint collectives (DCP runs its
    finish-phase gather on it from a worker thread, so it must not share the training groups).
    """

    def __init__(self, chunks: list, optimizer: Any, scheduler: Any, root: Path, io_group: Any) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.root = Path(root)
        self.io_group = io_group
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()


def inner_optimizers(optimizer: Any) -> list:
    """The torch optimizers inside megatron's ``ChainedOptimizer`` / ``DistributedOptimizer``."""
    return [do.optimizer for do in getattr(optimizer, "chained_optimizers", [optimizer])]


def _buffers(chunk: Any) -> list:
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def _on_real_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def rank_state(chunks: list, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's share of the training state as a flat ``{name: tensor}`` of live tensors.

    * ``param/c{chunk}.b{buffer}.k{bucket}``: this rank's slice of every DDP bucket's
      ``param_data`` (the DistributedOptimizer's shard, ``shard_buffer`` slicing);
    * ``main/o{opt}.g{group}.p{i}``: the fp32 main params -- only where they are separate tensors
      (bf16/fp16 models); in fp32 they are views into ``param_data`` and already covered;
    * ``{exp_avg,exp_avg_sq,step}/o{opt}.g{group}.p{i}``: the inner optimizer's state.

    The tensors are live (views included): callers that serialise whole storages (``torch.save``)
    must clone views first.
    """
    out: dict[str, torch.Tensor] = {}
    buffer_storages = set()
    for ci, chunk in enumerate(chunks):
        for bi, buf in enumerate(_buffers(chunk)):
            buffer_storages.add(buf.param_data.untyped_storage().data_ptr())
            dp = buf.data_parallel_world_size
            r = buf.data_parallel_group.rank()
            for k, bucket in enumerate(buf.buckets):
                size = bucket.param_data.numel() // dp
                out[f"param/c{ci}.b{bi}.k{k}"] = bucket.param_data[r * size : (r + 1) * size]
    for oi, inner in enumerate(inner_optimizers(optimizer)):
        for gi, group in enumerate(inner.param_groups):
            for pi, p in enumerate(group["params"]):
                tag = f"o{oi}.g{gi}.p{pi}"
                if p.untyped_storage().data_ptr() not in buffer_storages:
                    out[f"main/{tag}"] = p.detach()
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"{key}/{tag}"] = value
    return out


def iter_dir(root: Path, iteration: int) -> Path:
    """Megatron's checkpoint directory naming, used by every engine here."""
    return Path(root) / f"iter_{iteration:07d}"


def dir_bytes(path: Path) -> int:
    """Sum of the sizes of the regular files under ``path`` (0 if it does not exist)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def evict_page_cache(path: Path) -> None:
    """Drop the clean page-cache pages of every file under ``path`` (POSIX_FADV_DONTNEED), so a
    restore reads from the device rather than from memory.  Best effort."""
    if not hasattr(os, "posix_fadvise"):
        return
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _param_all_gather(chunks: list) -> None:
    """Refill the other ranks' slices of ``param_data`` after only this rank's shard was loaded."""
    for chunk in chunks:
        chunk.start_param_sync(force_sync=True)


# --------------------------------------------------------------------------- #
# restore verification
# --------------------------------------------------------------------------- #
def snapshot_state(chunks: list, optimizer: Any) -> dict[str, torch.Tensor]:
    """Clones of everything a restore must bring back: every full ``param_data`` buffer plus the
    optimizer's main params and state (by position)."""
    snap = {
        f"buffer/{ci}.{bi}": buf.param_data.detach().clone()
        for ci, chunk in enumerate(chunks)
        for bi, buf in enumerate(_buffers(chunk))
    }
    for oi, inner in enumerate(inner_optimizers(optimizer)):
        for gi, group in enumerate(inner.param_groups):
            for pi, p in enumerate(group["params"]):
                snap[f"main/o{oi}.g{gi}.p{pi}"] = p.detach().clone()
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        snap[f"{key}/o{oi}.g{gi}.p{pi}"] = value.detach().clone()
    return snap


@torch.no_grad()
def scramble_state(chunks: list, optimizer: Any) -> None:
    """Overwrite the state in place (params -> 0.5, Adam moments -> 0) so that only a restore that
    really copies data passes :func:`compare_state`."""
    for chunk in chunks:
        for buf in _buffers(chunk):
            buf.param_data.fill_(0.5)
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                p.detach().fill_(0.5)
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        value.zero_()


def compare_state(chunks: list, optimizer: Any, snap: dict[str, torch.Tensor]) -> list[str]:
    """Names whose live values differ from ``snap`` (empty list: the restore was exact)."""
    live = snapshot_state(chunks, optimizer)
    bad = sorted(set(snap) ^ set(live))
    for key, ref in snap.items():
        cur = live.get(key)
        if cur is not None and not (cur.shape == ref.shape and torch.equal(cur.float(), ref.float())):
            bad.append(key)
    return bad


# --------------------------------------------------------------------------- #
# step-gate timing
# --------------------------------------------------------------------------- #
class GateTimer:
    """Measures how long ``optimizer.step()`` waits in the step pre-hooks of the inner optimizers.

    Registers a first and a last pre-hook on every inner optimizer; :meth:`order` (call it before
    each step) moves them back to the two ends of the hook list, so hooks that an engine registers
    later (or re-registers) are still bracketed.  :meth:`take` returns and resets the total.
    """

    def __init__(self, optimizer: Any) -> None:
        self._t0 = 0.0
        self._total = 0.0
        self._handles = []
        for inner in inner_optimizers(optimizer):
            first = inner.register_step_pre_hook(self._start)
            last = inner.register_step_pre_hook(self._end)
            self._handles.append((inner, first, last))

    def _start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _end(self, *_: Any) -> None:
        self._total += time.perf_counter() - self._t0

    def order(self) -> None:
        for inner, first, last in self._handles:
            hooks = inner._optimizer_step_pre_hooks
            if first.id in hooks and last.id in hooks:
                hooks.move_to_end(first.id, last=False)
                hooks.move_to_end(last.id, last=True)

    def take(self) -> float:
        total, self._total = self._total, 0.0
        return total

    def close(self) -> None:
        for _inner, first, last in self._handles:
            first.remove()
            last.remove()
        self._handles = []


# --------------------------------------------------------------------------- #
# engines
# --------------------------------------------------------------------------- #
class Engine:
    """No checkpoint (the baseline), and the protocol every engine follows."""

    name = "baseline"
    persists = False

    def __init__(self, w: Workload, opts: BenchOptions) -> None:
        self.w = w
        self.opts = opts
        self.last_iteration: int | None = None

    def save(self, iteration: int) -> None:
        """Start (or do) a checkpoint of ``iteration``; the time this takes is a training stall."""

    def tick(self) -> None:
        """Once per iteration after the save point (also a stall when it blocks)."""

    def drain(self) -> None:
        """Block until every started checkpoint is durable."""

    def restore(self) -> int | None:
        """Load the newest checkpoint into the live model/optimizer in place; its iteration."""
        return None

    def last_dir(self) -> Path | None:
        return None if self.last_iteration is None else iter_dir(self.w.root, self.last_iteration)

    def extras(self) -> dict:
        """Engine-specific figures of this rank (summed or maximised over ranks by the report)."""
        return {}

    def close(self) -> None:
        """Release threads, processes and hooks (idempotent)."""


class TorchSaveEngine(Engine):
    """``torch.save`` of :func:`rank_state` + fsync, synchronous (views cloned first: ``torch.save``
    writes a view's whole storage)."""

    name = "torch_save"
    persists = True

    def _file(self, iteration: int) -> Path:
        return iter_dir(self.w.root, iteration) / f"rank{self.w.rank}.pt"

    def save(self, iteration: int) -> None:
        state = {
            k: (v.clone() if v.numel() != v.untyped_storage().nbytes() // v.element_size() else v)
            for k, v in rank_state(self.w.chunks, self.w.optimizer).items()
        }
        payload = {
            "iteration": iteration,
            "tensors": state,
            "scheduler": None if self.w.scheduler is None else self.w.scheduler.state_dict(),
        }
        path = self._file(iteration)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".pt.tmp")
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        self.last_iteration = iteration

    def restore(self) -> int | None:
        if self.last_iteration is None:
            return None
        payload = torch.load(self._file(self.last_iteration), map_location="cpu", weights_only=True)
        live = rank_state(self.w.chunks, self.w.optimizer)
        with torch.no_grad():
            for key, saved in payload["tensors"].items():
                live[key].copy_(saved)
        _param_all_gather(self.w.chunks)
        return int(payload["iteration"])


class McoreEngine(Engine):
    """megatron-core ``dist_checkpointing`` (``torch_dist`` + fully parallel save), as Megatron-LM's
    ``save_checkpoint`` / ``load_checkpoint`` drive it (one model chunk); the distributed optimizer's
    state in ``sharding_type`` (Megatron-LM's default, ``dp_reshardable``: a DP change only)."""

    name = "mcore_sync"
    persists = True
    async_save = False
    sharding_type = "dp_reshardable"

    def __init__(self, w: Workload, opts: BenchOptions) -> None:
        super().__init__(w, opts)
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        if len(w.chunks) != 1:
            raise ValueError("the megatron-core engines here support one model chunk")
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # Megatron-LM 0.16.1 _build_sharded_state_dict_metadata with default args.
        self._content_metadata = {
            "distrib_optim_sharding_type": self.sharding_type,
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
        }
        self._metadata = dict(self._content_metadata, dp_cp_group=dp_group)
        self._strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"), dp_group, False
        )
        self._queue = None
        if self.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()

    def _sharded_state_dict(self, is_loading: bool) -> dict:
        model_sd = self.w.chunks[0].module.sharded_state_dict(metadata=self._metadata)
        optim_sd = self.w.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=self._metadata)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, iteration: int) -> None:
        from megatron.core import dist_checkpointing

        d = iter_dir(self.w.root, iteration)
        if self.w.rank == 0:
            d.mkdir(parents=True, exist_ok=True)
        with self._save_context():
            state = self._sharded_state_dict(is_loading=False)
        state["iteration"] = iteration
        state["checkpoint_version"] = 3.0
        if self.w.scheduler is not None:
            state["opt_param_scheduler"] = self.w.scheduler.state_dict()
        request = dist_checkpointing.save(
            state,
            str(d),
            self._strategy,
            async_sharded_save=self.async_save,
            validate_access_integrity=True,
            content_metadata=self._content_metadata,
        )
        if self._queue is not None:
            self._queue.schedule_async_request(request)
        torch.distributed.barrier()  # Megatron-LM's save_checkpoint ends with one
        self.last_iteration = iteration

    def tick(self) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def drain(self) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def restore(self) -> int | None:
        from megatron.core import dist_checkpointing

        if self.last_iteration is None:
            return None
        with self._load_context():
            sharded = self._sharded_state_dict(is_loading=True)
            loaded = dist_checkpointing.load(sharded, str(iter_dir(self.w.root, self.last_iteration)))
            with torch.no_grad():
                self.w.chunks[0].module.load_state_dict(loaded["model"])
                self.w.optimizer.load_state_dict(loaded["optimizer"])
        return int(loaded["iteration"])

    def _save_context(self) -> contextlib.AbstractContextManager:
        """Around building the state to save."""
        return contextlib.nullcontext()

    def _load_context(self) -> contextlib.AbstractContextManager:
        """Around building the state to load, the load and putting it into the live objects."""
        return contextlib.nullcontext()

    def close(self) -> None:
        if self._queue is not None:
            queue, self._queue = self._queue, None
            queue.close()


class McoreAsyncEngine(McoreEngine):
    name = "mcore_async"
    async_save = True


class McoreReshardableEngine(McoreEngine):
    """``mcore_sync`` with the optimizer state that megatron-core reshards at any TP/PP/EP size:
    ``fully_reshardable``, what Megatron-LM 0.16.1 writes with ``--dist-ckpt-optim-fully-reshardable``
    (the state gathered on DP rank 0 at save and laid out per parameter; each rank loads what it
    needs of it).  ``fully_sharded_model_space`` is deprecated and refused by 0.16.1's
    ``ShardedTensor`` ("flattened_range is not supported")."""

    name = "mcore_reshardable"
    sharding_type = "fully_reshardable"

    # megatron-core 0.16.1's own fully_reshardable save and load need, as in Megatron-LM (and in our
    # --lazy-ckpt-convert-to, which writes this format), two fixes: its save slices the gathered
    # state at the wrong offsets after a padded bucket, and its load cannot copy into torch Adam's
    # per-parameter ``step`` (KeyError: 'step'); the same as the conversion uses
    def _save_context(self) -> contextlib.AbstractContextManager:
        from datastates_megatron.megatron.megatron_lm.torch_dist import _fully_reshardable_save

        return _fully_reshardable_save(self.w.optimizer)

    def _load_context(self) -> contextlib.AbstractContextManager:
        from datastates_megatron.megatron.megatron_lm.torch_dist import _torch_adam_load

        return _torch_adam_load(self.w.optimizer)


class DcpAsyncEngine(Engine):
    """``torch.distributed.checkpoint.async_save`` + ``DefaultStager``, TorchTitan style."""

    name = "dcp_async"
    persists = True

    def __init__(self, w: Workload, opts: BenchOptions) -> None:
        super().__init__(w, opts)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        cuda = torch.cuda.is_available() and any(_on_real_gpu(t) for t in rank_state(w.chunks, w.optimizer).values())
        process = opts.dcp_checkpointer == "process"
        self._kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        # TorchTitan: StagingOptions(True, True, True, True); pinning and non-blocking copies
        # need a GPU, shared memory is what hands the staged tensors to the writer process.
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=process, use_async_staging=True, use_non_blocking_copy=cuda
            )
        )
        self._staging = None
        self._upload = None
        self._hooks = [inner.register_step_pre_hook(self._wait_for_staging) for inner in inner_optimizers(w.optimizer)]

    def _state(self, iteration: int) -> dict:
        return {f"rank{self.w.rank}": rank_state(self.w.chunks, self.w.optimizer), "iteration": iteration}

    def _wait_for_staging(self, *_: Any) -> None:
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def save(self, iteration: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._wait_for_staging()
        if self._upload is not None:  # TorchTitan's _async_wait: one upload in flight
            upload, self._upload = self._upload, None
            upload.result()
        response = dcp.async_save(
            self._state(iteration),
            checkpoint_id=str(iter_dir(self.w.root, iteration)),
            process_group=self.w.io_group,
            async_checkpointer_type=self._kind,
            async_stager=self._stager,
        )
        self._staging = response.staging_completion
        self._upload = response.upload_completion
        self.last_iteration = iteration

    def drain(self) -> None:
        self._wait_for_staging()
        if self._upload is not None:
            upload, self._upload = self._upload, None
            upload.result()

    def restore(self) -> int | None:
        import torch.distributed.checkpoint as dcp

        if self.last_iteration is None:
            return None
        state = self._state(-1)
        dcp.load(state, checkpoint_id=str(iter_dir(self.w.root, self.last_iteration)), process_group=self.w.io_group)
        _param_all_gather(self.w.chunks)
        return int(state["iteration"])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._stager is not None:
            stager, self._stager = self._stager, None
            stager.close()


class ControlEngine(Engine):
    """No checkpoint, run as an engine: an A/A control whose ratios to the baseline show how far
    this machine's own drift moves a ratio."""

    name = "control"


class LazyEngine(Engine):
    """Ours: :class:`datastates_megatron.LazyCheckpointer` (its own gate pre-hook)."""

    name = "ours"
    persists = True

    def __init__(self, w: Workload, opts: BenchOptions) -> None:
        super().__init__(w, opts)
        from datastates_megatron import LazyCheckpointer, LazyCkptConfig

        config = LazyCkptConfig(
            save_dir=str(w.root),
            host_cache_gb=opts.host_cache_gb,
            flush_threads=opts.flush_threads,
            keep_last=opts.keep_last,
            when_behind="wait",  # every checkpoint taken, as the peers take them: a fair comparison
            **self._tier_options(w, opts),
        )
        self._ckpt = LazyCheckpointer(w.chunks, w.optimizer, config, opt_param_scheduler=w.scheduler)

    def _tier_options(self, w: Workload, opts: BenchOptions) -> dict:
        return {}

    def extras(self) -> dict:
        """The host cache's size and high-water mark (what a save stages into)."""
        stats = self._ckpt.stats
        return {"cache_bytes": stats.get("cache_bytes", 0), "cache_peak_bytes": stats.get("cache_peak_bytes", 0)}

    def save(self, iteration: int) -> None:
        self._ckpt.save(iteration)
        self.last_iteration = iteration

    def tick(self) -> None:
        self._ckpt.poll()

    def drain(self) -> None:  # as at the end of a run: the newest checkpoint promoted too
        self._ckpt.wait(persist=True, promote_newest=True)

    def restore(self) -> int | None:
        iteration, _extra = self._ckpt.load()
        return iteration

    def close(self) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()


class LazyLocalEngine(LazyEngine):
    """Ours with a node-local tier: every checkpoint committed under ``local_dir`` (per engine run),
    those at iteration multiples of ``persist_interval`` promoted to ``root`` in the background; restore reads the
    newest tier every rank has (the local one here)."""

    name = "ours_local"

    def _tier_options(self, w: Workload, opts: BenchOptions) -> dict:
        self._local = Path(opts.local_dir) / w.root.name
        if w.rank == 0:
            shutil.rmtree(self._local, ignore_errors=True)
        torch.distributed.barrier()
        return {
            "local_dir": str(self._local / "{node}"),
            "persist_interval": opts.persist_interval,
            "local_keep_last": opts.keep_last,
        }

    def last_dir(self) -> Path | None:
        if self.last_iteration is None:
            return None
        from datastates_megatron.engine.tiers.run_id import local_tier_dir

        nodes = sorted(p for p in self._local.iterdir() if p.is_dir()) if self._local.is_dir() else []
        run_dir = local_tier_dir(str(nodes[0]), str(self.w.root)) if nodes else None
        return iter_dir(Path(run_dir), self.last_iteration) if run_dir else None

    def close(self) -> None:
        super().close()
        if self.w.rank == 0:
            shutil.rmtree(self._local, ignore_errors=True)


class LazyReplicatedEngine(LazyLocalEngine):
    """``ours_local`` with one partner replica per rank, every rank its own "node" (its own local
    directory; ``LOCAL_WORLD_SIZE=1`` while the checkpointer starts): each local checkpoint is also
    streamed to the partner rank over a gloo group of the pair after its local commit.

    :meth:`recover` measures a node loss after the run: the last rank's node-local directory is
    deleted and the newest checkpoint restored (the lost ranks' files fetched from their partners),
    then every node-local directory is deleted and the last checkpoint the promotion interval
    persisted is restored from ``root`` -- what a restart would load without replicas."""

    name = "ours_replicated"

    def __init__(self, w: Workload, opts: BenchOptions) -> None:
        saved = os.environ.get("LOCAL_WORLD_SIZE")
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        try:
            super().__init__(w, opts)
        finally:
            if saved is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = saved
        self.persisted_by_interval: int | None = None

    def _tier_options(self, w: Workload, opts: BenchOptions) -> dict:
        return {**super()._tier_options(w, opts), "replicas": 1}

    def drain(self) -> None:
        from datastates_megatron.engine.tiers.tier import committed_iterations

        self._ckpt.wait(persist=True)  # the interval's promotions, not yet the end-of-run one
        persisted = committed_iterations(str(self.w.root)) if self.w.rank == 0 else []
        box = [max(persisted, default=None)]
        torch.distributed.broadcast_object_list(box, src=0)
        self.persisted_by_interval = box[0]
        super().drain()

    def extras(self) -> dict:
        r = self._ckpt._mgr.replication
        out = super().extras()
        if r:
            out.update(replication_bytes=r.stats.bytes_sent, replication_s=r.stats.seconds)
        return out

    def recover(self, check: Callable[[], list[str]]) -> dict:
        """Collective: seconds, bytes and iterations lost restoring after a lost node, from the
        partner replica and from ``root``; ``check()`` (the mismatches against the last saved
        state) runs right after the partner restore."""
        out = {}
        nodes = sorted(p for p in self._local.iterdir() if p.is_dir())
        for source, lost in (("partner", nodes[-1:]), ("persistent", nodes)):
            torch.distributed.barrier()
            if self.w.rank == 0:
                for node in lost:
                    shutil.rmtree(node)
            torch.distributed.barrier()
            evict_page_cache(self.w.root)
            fetched = self._ckpt._mgr.replication.stats.bytes_fetched
            t0 = time.perf_counter()
            it = self._ckpt.load(None if source == "partner" else self.persisted_by_interval)[0]
            out[source] = {
                "fetched": self._ckpt._mgr.replication.stats.bytes_fetched - fetched,
                "s": time.perf_counter() - t0,
                "iteration": it,
                "lost_iterations": self.last_iteration - it,
                "bytes": self._ckpt.restored_bytes,
                "from": self._ckpt.restored_from,
            }
            if source == "partner":
                out[source]["mismatch"] = check()
        return out


ENGINES: dict[str, Callable[[Workload, BenchOptions], Engine]] = {
    cls.name: cls
    for cls in (
        Engine,
        ControlEngine,
        TorchSaveEngine,
        McoreEngine,
        McoreAsyncEngine,
        McoreReshardableEngine,
        DcpAsyncEngine,
        LazyEngine,
        LazyLocalEngine,
        LazyReplicatedEngine,
    )
}
