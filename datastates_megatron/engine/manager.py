"""CheckpointManager: per-rank engine + cross-rank commit + retention + restore, framework-agnostic.

It turns "save these registered tensors as iteration N" into a Megatron-style checkpoint directory
that either exists whole (committed manifest) or not at all, and loads the latest one back in place.
Works without ``torch.distributed`` (one process) and with it (any backend: commits use their own
gloo group).  Thread-safety: one training thread calls every method; the work runs on owned threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time

import torch

from .commit import CommitRecord, Committer, Ticket
from .errors import CheckpointError
from .manifest import (
    committed_iterations,
    committed_manifests,
    iter_dir,
    latest_committed,
    list_iterations,
    rank_file_name,
)
from .options import EngineOptions
from .restore import RestoreStats, open_checkpoint, open_rank, restore_into, validate_world
from .retention import remove_uncommitted
from .snapshot import SnapshotEngine

__all__ = ["CheckpointManager", "LoadResult"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    iteration: int
    objects: object
    metadata: dict
    stats: RestoreStats


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class CheckpointManager:
    """Save / commit / retain / load for one rank.  A context manager; ``close()`` is idempotent.

    ``on_error="warn"`` logs a failed save instead of raising; nothing is committed for it and the
    previous checkpoint stays the latest.  ``layout`` (e.g. ``{"tp": 1, "pp": 1, "dp": 2}``) is
    recorded in the manifest and must match on load.
    """

    def __init__(
        self,
        root: str,
        options: EngineOptions | None = None,
        *,
        keep_last: int = 2,
        keep_every: int = 0,
        on_error: str = "raise",
        layout: dict | None = None,
        load_root: str | None = None,
        verify_on_load: bool = True,
        restore_threads: int = 4,
    ) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world_size = dist.get_world_size() if dist else 1
        self.root = os.path.abspath(root)
        self.load_root = os.path.abspath(load_root or root)
        self.layout = dict(layout or {})
        self.on_error = on_error
        self.verify_on_load = verify_on_load
        self.restore_threads = restore_threads
        opts = dataclasses.replace(options or EngineOptions(), rank=self.rank)
        self._seq = 0
        self._closed = False
        self.last_commit: CommitRecord | None = None
        token = self._agree_token(dist)
        self.token = token
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            found = committed_manifests(self.root)
            removed = remove_uncommitted(self.root, list_iterations(self.root), {it: {r.file for r in m.ranks} for it, m in found.items()}, set())
            if removed:
                log.info("rank 0: removed %d leftover(s) of uncommitted checkpoints under %s", len(removed), self.root)
            next_seq = max((m.commit_seq for m in found.values()), default=-1) + 1
        else:
            next_seq = 0
        self._group = dist.new_group(backend="gloo") if dist and self.world_size > 1 else None
        if dist:
            dist.barrier(group=self._group)
        self.engine = SnapshotEngine(opts)
        self.committer = Committer(
            self.root, rank=self.rank, world_size=self.world_size, group=self._group, token=token,
            layout=self.layout, next_commit_seq=next_seq, keep_last=keep_last, keep_every=keep_every,
            timeout_s=opts.timeout_s,
        )  # fmt: skip

    def _agree_token(self, dist) -> str:
        value = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        if dist and self.world_size > 1:
            if dist.get_backend() == "nccl":
                value = value.cuda()
            dist.broadcast(value, src=0)
        return f"{int(value.item()):016x}"

    # ------------------------------------------------------------------ registration
    def register(self, name: str, tensor: torch.Tensor, *, group: str = "default", meta: dict | None = None) -> None:
        self.engine.register(name, tensor, group=group, meta=meta)

    def clear(self) -> None:
        self.engine.clear()

    # ------------------------------------------------------------------ save path
    def save(self, iteration: int, objects=None, metadata: dict | None = None) -> bool:
        """Start checkpoint ``iteration`` (collective: every rank calls it in the same order).

        Returns at once; ``False`` if it could not start and ``on_error="warn"``."""
        self._check_open()
        self._surface_errors()
        self._seq += 1
        d = iter_dir(self.root, iteration)
        try:
            os.makedirs(d, exist_ok=True)
            name = rank_file_name(self.rank, self.token, self._seq)
            handle = self.engine.save(iteration, os.path.join(d, name), objects, tag=name)
        except CheckpointError as e:
            self._handle(e)
            handle = None
        t_save = time.perf_counter()
        if handle is None:
            # the other ranks still expect this rank in the agreement for this sequence number
            import concurrent.futures as cf

            failed: cf.Future = cf.Future()
            failed.set_exception(CheckpointError("save did not start"))
            self.committer.submit(Ticket(iteration, self._seq, failed, dict(metadata or {}), t_save))
            return False
        self.committer.submit(Ticket(iteration, self._seq, handle.durable, dict(metadata or {}), t_save))
        return True

    def wait_for_snapshot(self, group: str | None = None) -> None:
        """Gate: returns once pending copies are complete; the caller may then mutate the tensors."""
        self.engine.wait_for_snapshot(group)

    def poll(self) -> list[CommitRecord]:
        """Non-blocking: checkpoints committed since the last call (raises or logs failures)."""
        self._surface_errors()
        out = []
        while True:
            try:
                got = self.committer.poll()
            except CheckpointError as e:
                self._handle(e)
                continue
            out.extend(got)
            break
        if out:
            self.last_commit = out[-1]
        return out

    def wait(self, timeout: float | None = None) -> list[CommitRecord]:
        """Block until every pending checkpoint is committed (or has failed)."""
        try:
            self.engine.wait(timeout)
        except CheckpointError as e:
            self._handle(e)
        self.committer.drain(timeout)
        return self.poll()

    @property
    def latest_committed(self) -> int | None:
        return self.committer.latest

    def _surface_errors(self) -> None:
        while True:
            try:
                self.engine.poll()
                return
            except CheckpointError as e:
                self._handle(e)

    def _handle(self, err: CheckpointError) -> None:
        if self.on_error == "raise":
            raise err
        log.warning("rank %d: checkpoint failed, training goes on (on_error=warn): %s", self.rank, err)

    # ------------------------------------------------------------------ load path
    def latest(self, root: str | None = None) -> int:
        return latest_committed(root or self.load_root)

    def load(self, iteration: int | None = None, *, root: str | None = None, verify: bool | None = None) -> LoadResult:
        """Restore checkpoint ``iteration`` (default: the latest committed) into the registered tensors."""
        self._check_open()
        root = os.path.abspath(root or self.load_root)
        if iteration is None:
            iteration = latest_committed(root)
        ckpt, manifest = open_checkpoint(root, iteration)
        validate_world(manifest, ckpt, self.world_size, self.layout)
        rf = open_rank(ckpt, manifest, self.rank)
        try:
            stats = restore_into(
                rf, self.engine.registered, self.rank,
                verify=self.verify_on_load if verify is None else verify, threads=self.restore_threads,
            )  # fmt: skip
            objects = rf.objects["objects"]
        finally:
            rf.close()
        log.info("rank %d: loaded iteration %d from %s (%d bytes)", self.rank, iteration, ckpt, stats.bytes)
        return LoadResult(iteration, objects, manifest.metadata, stats)

    def committed(self) -> list[int]:
        return committed_iterations(self.root)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Drain (commit what is pending), then stop every thread; idempotent."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            self._closed = True
            try:
                self.engine.close(timeout)
            finally:
                self.committer.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"rank {self.rank}: checkpoint manager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except CheckpointError as e:
                log.error("rank %d: error while closing after another error: %s", self.rank, e)


