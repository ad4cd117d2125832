"""LazyCheckpointer: lazy asynchronous checkpoints of a megatron-core model + DistributedOptimizer.

``save(it)`` captures the non-tensor state and returns at once; the shards' device -> host copies
overlap the next forward/backward, and a step pre-hook on every inner torch optimizer makes
``optimizer.step()`` wait for the copies of exactly the shards it is about to mutate.  Flushing and
the cross-rank commit run on background threads.  ``load()`` restores everything in place.

Thread-safety: call every method from the training thread (all ranks, same order: ``save`` and
``load`` are collective).  Hooks run on the training thread inside ``optimizer.step()``.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from ...engine.tiers.commit import CommitRecord
from ...engine.errors import CheckpointError, EngineClosedError, OptionsError
from ...engine.manager import CheckpointManager
from ...engine.load.load_plan import LoadPlan, LoadPlanner, SameLayoutPlanner
from ...engine.load.reader import CheckpointReader
from . import model_state, reshard, training_state
from .config import LazyCkptConfig
from .shards import (
    bucket_shards,
    collect_shards,
    distributed_optimizers,
    inner_optimizers,
    main_params,
    model_chunks_of,
    model_description,
    param_buffers,
)

__all__ = ["LazyCheckpointer", "UnsupportedModelError"]

log = logging.getLogger(__name__)


def parallel_layout(model_chunks) -> dict:
    """Parallel sizes a checkpoint is tied to (recorded in the manifest, checked on load)."""
    layout = {"model_chunks": len(model_chunks)}
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            layout.update(
                tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                dp=ps.get_data_parallel_world_size(),
                cp=ps.get_context_parallel_world_size(),
                ep=ps.get_expert_model_parallel_world_size(),
            )
    except ImportError:
        pass
    return layout


class UnsupportedModelError(CheckpointError, TypeError):
    """``LazyCheckpointer`` was given a model or optimizer that is not megatron-core's (it reads
    DDP param buffers and the shards of a Megatron optimizer)."""


def _qualname(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _check_model_and_optimizer(model_chunks: list, optimizer) -> None:
    """Raise :class:`UnsupportedModelError` unless every chunk is a megatron-core
    ``DistributedDataParallel`` and ``optimizer`` a ``MegatronOptimizer``."""
    try:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import MegatronOptimizer
    except ImportError as e:
        raise UnsupportedModelError(
            f"LazyCheckpointer checkpoints megatron-core models and optimizers, and megatron-core cannot be "
            f"imported here ({e}); install it (pip install 'datastates-megatron[megatron]')"
        ) from e
    if not model_chunks:
        raise UnsupportedModelError("LazyCheckpointer: the model is an empty list; pass the model chunk(s)")
    for c, chunk in enumerate(model_chunks):
        if not isinstance(chunk, DistributedDataParallel):
            where = f"model chunk {c} is" if len(model_chunks) > 1 else "the model is"
            raise UnsupportedModelError(
                f"LazyCheckpointer needs megatron-core DistributedDataParallel model chunk(s) (one, or the list "
                f"Megatron-LM's get_model returns), but {where} a {_qualname(chunk)}: wrap the module in "
                "megatron.core.distributed.DistributedDataParallel(config, DistributedDataParallelConfig("
                "use_distributed_optimizer=True), module)"
            )
    if not isinstance(optimizer, MegatronOptimizer):
        raise UnsupportedModelError(
            f"LazyCheckpointer needs a megatron-core optimizer (megatron.core.optimizer.MegatronOptimizer: "
            f"DistributedOptimizer, ChainedOptimizer, ... as get_megatron_optimizer returns), but the optimizer "
            f"is a {_qualname(optimizer)}: build it with megatron.core.optimizer.get_megatron_optimizer("
            "OptimizerConfig(...), model_chunks)"
        )


class _SameLayoutFirst(LoadPlanner):
    """A checkpoint of this run's layout: this rank's file holding exactly the registered tensors is
    restored whole (the same-layout plan); one whose tensor set differs -- bucket sizes changed --
    by parameter identity.  Chosen by inspecting the file's index, never by catching an error.
    Reads this rank's file first, so it may read a node-local tier."""

    reads_all_ranks = False

    def __init__(self, same: SameLayoutPlanner, identity: LoadPlanner) -> None:
        self.same, self.identity = same, identity

    def plan(self, reader: CheckpointReader) -> LoadPlan:
        if self.same.matches(reader.rank_file(reader.rank).entries):
            return self.same.plan(reader)
        log.info(
            "rank %d: the checkpoint's tensor set differs from this model's; restoring by parameter identity",
            reader.rank,
        )
        return self.identity.plan(reader)


class LazyCheckpointer:
    """Checkpoints ``model`` (a megatron-core ``DistributedDataParallel`` chunk or a list of them)
    and ``optimizer`` (a ``MegatronOptimizer``: what ``get_megatron_optimizer`` returns) under
    ``config.save_dir``; anything else raises :class:`UnsupportedModelError` (a ``TypeError``)
    before any file or thread is created.  ``vocab_size``: the run's vocabulary before megatron-core
    pads it (Megatron-LM: its tokenizer's), recorded with every checkpoint; a load at another padding
    zero-fills or drops embedding rows only when both runs declare the same one (``None``: not
    declared; another padding is then refused unless ``config.allow_vocab_change``).  A context manager."""

    def __init__(
        self, model, optimizer, config: LazyCkptConfig, opt_param_scheduler=None, vocab_size: int | None = None
    ) -> None:
        _check_model_and_optimizer(model_chunks_of(model), optimizer)
        self.model = model_chunks_of(model)
        self.optimizer = optimizer
        self.scheduler = opt_param_scheduler
        self.config = config
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
        ):
            raise OptionsError(f"vocab_size: a positive int or None, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self._mgr = CheckpointManager(
            config.save_dir,
            config.engine_options(),
            config.manager_options(),
            layout=parallel_layout(self.model),
            load_root=config.effective_load_dir,
            local_root=config.local_dir,
            summarize=reshard.index_summary,  # each checkpoint's global index: a reshard opens only what it reads
        )
        self.rank = self._mgr.rank
        self.restored_from: str | None = None  # the tier directory the last load read this rank's state from
        self.restored_bytes = 0  # and how many bytes it read
        self._signature = None
        self._hooked: list[int] = []
        self._hook_handles: list = []
        self._stall: dict[int, float] = {}  # iteration -> save-call + gate time on this rank
        self._last_saved: int | None = None
        self.commits: collections.deque[CommitRecord] = collections.deque(maxlen=1000)
        self.on_commit: list = []  # callables(record, stall_s) run on the training thread after a commit
        self._closed = False
        self._model_description = model_description(self.model)  # the torch export's "model"
        self._refresh()

    # ------------------------------------------------------------------ registration and hooks
    def _refresh(self) -> None:
        """(Re)register shards when they changed (Adam state appears at the first step; a
        ``load_state_dict`` replaces state tensors) and hook the current inner optimizers."""
        signature = self._fingerprint()
        if signature != self._signature:
            self._mgr.clear()
            for r in collect_shards(self.model, self.optimizer):
                self._mgr.register(r.name, r.tensor, group=r.group, meta=r.meta)
            self._signature = signature
        inners = inner_optimizers(self.optimizer)
        if [id(o) for o in inners] != self._hooked:
            self._remove_hooks()
            for i, inner in enumerate(inners):
                self._hook_handles.append(inner.register_step_pre_hook(self._gate_hook(f"opt{i}")))
            self._hooked = [id(o) for o in inners]

    def _fingerprint(self) -> list:
        """Changes whenever :func:`collect_shards` would return other tensors (a bucket or main param
        replaced, optimizer state created or swapped) -- a few hundred ``data_ptr`` calls instead of
        re-walking the model and rebuilding every identity on each save."""
        out: list = []
        for _c, _name, buf in param_buffers(self.model):
            data = getattr(buf, "param_data", None)
            out.append(None if data is None else (data.data_ptr(), data.numel(), data.dtype))
        out += [(id(inner), id(inner.state), len(inner.state)) for inner in inner_optimizers(self.optimizer)]
        for m in main_params(self.optimizer):
            out.append((m.param.data_ptr(), m.param.numel()))
            out += [(v.data_ptr(), v.numel(), v.dtype) for v in m.state.values()]
        return out

    def _gate_hook(self, group: str):
        def hook(_optimizer, _args, _kwargs):
            t0 = time.perf_counter()
            self._mgr.wait_for_snapshot(group)
            if self._last_saved is not None:
                self._stall[self._last_saved] = self._stall.get(self._last_saved, 0.0) + time.perf_counter() - t0

        return hook

    def _remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self._hooked = []

    # ------------------------------------------------------------------ save path
    def save(self, iteration: int, extra_state=None, *, final: bool = False) -> bool:
        """Start a checkpoint of ``iteration``; returns at once (``False``: not started, on_error=warn,
        or skipped because this rank's storage is behind: ``when_behind``).  ``final`` (the save
        before the run ends): never skipped; it waits for the storage, bounded by ``timeout_s``."""
        t0 = time.perf_counter()
        self._check_open()
        self.poll()
        self._refresh()
        objects = {
            "iteration": int(iteration),
            "extra_state": extra_state,
            "training": training_state.capture(self.optimizer, self.scheduler),
            "model_state": model_state.capture(self.model),
            "model": self._model_description,
            "vocabulary": self.vocab_size,
        }
        started = self._mgr.save(iteration, objects, metadata={"iteration": int(iteration)}, final=final)
        if started:  # the stall of a skipped save is no checkpoint's
            self._last_saved = int(iteration)
            self._stall[int(iteration)] = time.perf_counter() - t0
        return started

    @property
    def skipped(self) -> tuple[int, int]:
        """(saves this rank skipped, checkpoints every rank abandoned because some rank skipped
        its save): what storage stalls cost so far."""
        return self._mgr.skipped, self._mgr.abandoned_skips

    def poll(self) -> list[int]:
        """Non-blocking: iterations committed since the last call (a background error is re-raised
        once here, or logged with ``on_error="warn"``)."""
        return self._report(self._mgr.poll())

    def wait(self, persist: bool = True, promote_newest: bool = False) -> list[int]:
        """Block until every pending checkpoint is committed; with a local tier and ``persist=True``,
        also until every scheduled promotion is committed on the persistent tier.
        ``promote_newest`` (end of a run; ``close`` does it): the newest local checkpoint is
        promoted too, whatever ``persist_interval`` says."""
        self._check_open()
        return self._report(self._mgr.wait(persist=persist, promote_newest=promote_newest))

    def _report(self, records: list[CommitRecord]) -> list[int]:
        for rec in records:
            self.commits.append(rec)
            stall = self._stall.pop(rec.iteration, 0.0)
            if self.rank == 0:
                log.info(
                    "lazy-ckpt: committed iteration %d (%s) | %.1f MB total, %.1f MB/rank max | stall %.2f ms | "
                    "D2H %.2f GB/s | flush %.2f GB/s | save->commit %.3f s",
                    rec.iteration,
                    rec.tier,
                    rec.total_bytes / 1e6,
                    rec.max_rank_bytes / 1e6,
                    stall * 1e3,
                    rec.d2h_gbps,
                    rec.flush_gbps,
                    rec.commit_s,
                )
            for callback in self.on_commit:
                callback(rec, stall)
        return [r.iteration for r in records]

    @property
    def local_dir(self) -> str | None:
        """This rank's node-local tier directory (``{node}`` resolved), or None without one."""
        return self._mgr.local_root

    @property
    def stats(self) -> dict:
        """Telemetry of this rank: cache peak, waits, and the last commit record."""
        eng = self._mgr.engine
        return {
            "cache_bytes": eng.cache.capacity,
            "cache_peak_bytes": eng.cache.peak_used,
            "cache_wait_s": eng.cache.wait_seconds,
            "gate_wait_s": eng.gate_wait_s,
            "slot_wait_s": eng.slot_wait_s,
            "skipped": self._mgr.skipped,
            "abandoned_skips": self._mgr.abandoned_skips,
            "last_commit": self.commits[-1] if self.commits else None,
        }

    # ------------------------------------------------------------------ load path
    def load(self, iteration: int | None = None, *, optimizer: bool = True, rng: bool = True):
        """Restore the latest committed checkpoint (or ``iteration``) in place: model shards (then
        all-gathered across data-parallel ranks), model buffers and extra state, main params,
        optimizer state, scheduler, RNG.  ``optimizer=False`` (Megatron-LM's ``--no-load-optim``,
        ``--finetune``): the model only; main params are refreshed from it, optimizer state and
        scheduler are left as they are.  ``rng=False`` (``--no-load-rng``): the RNG states too.

        A checkpoint written at another data-, tensor-, pipeline- or expert-parallel size (same
        model, VPP and CP) is resharded on the fly (:mod:`.reshard`); any other layout change raises
        ``LayoutMismatchError`` on every rank before a live tensor changes, naming a parameter, its
        shapes, both layouts and the conversion (``--lazy-ckpt-convert-to``, :mod:`..megatron_lm.torch_dist`).
        Returns ``(iteration, extra_state)``; raises ``NoCheckpointError`` when there is none."""
        self._check_open()
        self._mgr.wait()
        # the one restore decision (collective, made on rank 0 -- no other rank reads a manifest):
        # the tier and iteration, each rank's source, and the checkpoint's layout checked on rank 0
        # (LayoutMismatchError here, on every rank alike, before anything is touched; another
        # data-parallel size: resharded); NoCheckpointError when there is none
        choice = self._mgr.choose(iteration, check=self._layout_differs)
        self._drain_param_gathers()
        created = self._ensure_optimizer_state() if optimizer else []
        try:
            self._refresh()
            planner = self._planner(choice.reshard) if optimizer else self._model_planner()
            result = self._mgr.load(choice, planner=planner)
        except BaseException:
            for inner in created:  # leave a fresh optimizer as fresh as it was
                inner.state.clear()
            self._refresh()
            raise
        with torch.no_grad():
            for view in getattr(planner, "zeros", ()):  # rows a vocabulary padding adds: zero, as megatron-core
                view.zero_()
        self._gather_params()
        where = f"rank {self.rank}: iteration {result.iteration}"
        model_state.restore(result.objects.get("model_state"), self.model, where=where)
        training_state.restore(
            result.objects["training"], self.optimizer, self.scheduler, with_optimizer=optimizer, with_rng=rng
        )
        if not optimizer:
            self._reload_main_params()
        self.restored_from, self.restored_bytes = result.root, result.stats.bytes
        log.info(
            "rank %d: restored iteration %d (%s plan, %.1f MB, %.1f MB verified, read-ahead %.2f s, verify %.2f s, "
            "copy %.2f s)",
            self.rank,
            result.iteration,
            result.plan_kind,
            result.stats.bytes / 1e6,
            result.stats.verified_bytes / 1e6,
            result.stats.read_ahead_s,
            result.stats.verify_s,
            result.stats.copy_s,
        )
        return result.iteration, result.objects["extra_state"]

    def _layout_differs(self, manifest, ckpt: str) -> bool:
        """Rank 0, in the restore decision: :func:`.reshard.check_layout` of the chosen checkpoint."""
        return reshard.check_layout(manifest, ckpt, self._mgr.world_size, self._mgr.layout)

    def _planner(self, other_dp: bool) -> LoadPlanner:
        """The planner the manifest's layout calls for: another layout is planned by parameter
        identity (a data-parallel change resharded, any other refused); this run's layout is
        restored by :class:`_SameLayoutFirst`."""
        identity = reshard.ReshardPlanner(
            self.model,
            self.optimizer,
            self._mgr.layout,
            vocabulary=self.vocab_size,
            vocabulary_change=self.config.allow_vocab_change,
        )
        if other_dp:
            return identity
        same = SameLayoutPlanner(self._mgr.engine.registered, self._mgr.world_size, self._mgr.layout)
        return _SameLayoutFirst(same, identity)

    def _model_planner(self) -> LoadPlanner:
        """A model-only load: the param buffers by parameter identity, in any reshardable layout."""
        return reshard.ReshardPlanner(
            self.model,
            self.optimizer,
            self._mgr.layout,
            optimizer_state=False,
            vocabulary=self.vocab_size,
            vocabulary_change=self.config.allow_vocab_change,
        )

    def _reload_main_params(self) -> None:
        """After a model-only load, the fp32 main params of a bf16/fp16 model from the restored
        model params, as Megatron-LM's loader does (in fp32 they are the param buffer itself)."""
        config = getattr(distributed_optimizers(self.optimizer)[0], "config", None)
        if getattr(config, "bf16", False) or getattr(config, "fp16", False):
            self.optimizer.reload_model_params()

    def _ensure_optimizer_state(self) -> list:
        """Adam state is created lazily by the first step; a fresh optimizer gets it the way
        megatron-core does before a distributed-checkpoint load (a step on zero grads, overwritten
        right after by the restore).  Returns the optimizers whose state was created here."""
        created = []
        for inner in inner_optimizers(self.optimizer):
            params = [p for pg in inner.param_groups for p in pg["params"] if p.numel()]
            if params and all(p in inner.state and inner.state[p] for p in params):
                continue
            with torch.no_grad():
                saved = [p.detach().clone() for p in params]
                for p in params:
                    p.grad = torch.zeros_like(p)
                inner.step()
                inner.zero_grad()
                for p, s in zip(params, saved):
                    p.copy_(s)  # the dummy step must not leak into tensors the checkpoint may not cover
            created.append(inner)
        return created

    def _gather_params(self) -> None:
        """Every DP rank restored only its own slice of each bucket: all-gather the rest, in place
        into the bucket (one ``all_gather_into_tensor`` per bucket, as megatron's param sync does)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        for b in bucket_shards(self.model):
            if b.dp_size > 1:
                dist.all_gather_into_tensor(
                    b.bucket.param_data, b.shard, group=getattr(b.buf, "data_parallel_group", None)
                )

    def _drain_param_gathers(self) -> None:
        """An overlapped param all-gather still in flight (``overlap_param_gather``) would land on
        top of the restored buffers: finish it before the restore writes them."""
        for chunk in self.model:
            for bucket_group in [
                *getattr(chunk, "bucket_groups", []),
                *getattr(chunk, "expert_parallel_bucket_groups", []),
            ]:
                handle = getattr(bucket_group, "param_gather_handle", None)
                if handle is not None:
                    handle.wait()
                    bucket_group.param_gather_handle = None

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, keep_cache: bool = False) -> None:
        """Commit what is pending (the newest local checkpoint promoted), remove the optimizer hooks,
        stop every thread; idempotent.  ``keep_cache`` (an in-process restart): the host cache's
        arena is left to the next checkpointer of this process instead of being freed."""
        if self._closed:
            return
        self._remove_hooks()
        try:
            self._report(self._mgr.wait(promote_newest=True))
        finally:
            self._closed = True
            self._mgr.close(keep_cache=keep_cache)

    def forget_ranks(self, ranks) -> None:
        """Ranks of this checkpointer's world that died (an in-process restart went on without
        them): its pending checkpoints are abandoned instead of waiting for them.  Before :meth:`close`."""
        self._mgr.forget_ranks(ranks)

    @property
    def world_size(self) -> int:
        return self._mgr.world_size

    @property
    def cache_reused(self) -> bool:
        """Whether this checkpointer's host cache is the arena an earlier one of this process kept."""
        return self._mgr.engine.cache.reused

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"rank {self.rank}: LazyCheckpointer is closed")

    def __enter__(self) -> "LazyCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
