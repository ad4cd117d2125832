"""A fault in the forward pass of one training iteration, for the in-process restart tests.

``DSM_FAULT_AT=<kind>:<iteration>`` (a kind below) makes this process's forward pass of
``iteration`` (the step that makes it, as ``args.curr_iteration`` numbers it: the step after
``iteration - 1``) fail, once per process: a restarted attempt that reaches ``iteration`` again
trains on.  ``DSM_FAULT_RANK=<rank>`` limits it to the process launched as that rank (its ``RANK``
when this is installed: an in-process restart may give a spare that rank later, and the spare must
not fail too).  ``DSM_FAULT_AT_LOAD=<n>`` also makes
the ``n``-th ``load_checkpoint`` of this process raise once it has restored (a second fault, in the
restart's own restore, before training resumes), on that rank too.

* ``raise``: a :class:`InjectedFault` (a ``RuntimeError``), as a bad batch or a kernel error would;
* ``hang``: the training thread stops making progress until an exception is raised in it (NVRx's
  monitor raises one into the main thread on a restart): a loop of short waits, so that the
  asynchronous exception is delivered, standing for a hang in Python code;
* ``kill``: once its checkpoints are committed and replicated (so that the restart's outcome does
  not depend on timing), the process kills itself (``SIGKILL``), as a crash or a lost node would:
  no exception, no clean-up; NVRx's monitor process reports the rank terminated, and a spare takes
  its place;
* ``kill-pending``: the commit of checkpoint ``iteration`` is left pending on every other rank, and
  this process is killed (``SIGKILL``) in the next iteration's forward pass: its first write of that
  checkpoint never returns (so it never reports it durable), and it dies once the checkpoint before
  it is committed and replicated (a fixed outcome);
* ``flush``: instead of the forward pass, the checkpoint of ``iteration``: the first write of its
  rank file raises ``EIO`` on the flush thread, as a storage target failing a write would (a
  ``pwrite``: not a file on tmpfs, which is written through a mapping).

Installed by :mod:`..megatron_lm.run` when ``DSM_FAULT_AT`` is set (only there: a test's hook for
*where* a fault happens, not a feature); it wraps ``megatron.training.training.train_step``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading

__all__ = ["ENV", "LOAD_ENV", "RANK_ENV", "InjectedFault", "install"]

ENV = "DSM_FAULT_AT"
RANK_ENV = "DSM_FAULT_RANK"
LOAD_ENV = "DSM_FAULT_AT_LOAD"
_KINDS = ("raise", "hang", "kill", "kill-pending", "flush")

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The fault ``DSM_FAULT_AT`` asked for."""


def parse(spec: str) -> tuple[str, int]:
    """``"raise:5"`` -> ``("raise", 5)``; a clear ``ValueError`` for anything else."""
    kind, _, iteration = spec.partition(":")
    if kind not in _KINDS or not iteration.isdigit() or int(iteration) < 1:
        raise ValueError(f"{ENV}={spec!r}: expected <{'|'.join(_KINDS)}>:<iteration >= 1>")
    return kind, int(iteration)


def install(spec: str) -> None:
    """Wrap ``train_step`` so that the forward pass of the iteration ``spec`` names fails once."""
    from megatron.training import training
    from megatron.training.global_vars import get_args

    kind, iteration = parse(spec)
    only = os.environ.get(RANK_ENV)
    mine = only is None or int(only) == int(os.environ.get("RANK", "0"))  # the launch rank, decided once
    if kind == "flush":
        _fail_a_write(iteration, mine)
        if os.environ.get(LOAD_ENV):
            _fail_a_load(int(os.environ[LOAD_ENV]), mine)
        return
    if kind == "kill-pending":
        _block_a_write(iteration, mine)
        iteration += 1  # killed in the next forward pass
    fired = threading.Event()
    original = training.train_step

    def fault(rank: int) -> None:
        from . import training_record

        fired.set()
        training_record.event("fault")  # when it hit (scripts/bench_recovery.py's phases)
        log.warning("rank %d: injected fault (%s) in the forward pass of iteration %d", rank, kind, iteration)
        if kind in ("kill", "kill-pending"):
            from ..megatron_lm.checkpointing import get_checkpointer

            ckpt = get_checkpointer()
            if ckpt is not None and kind == "kill":  # its checkpoints committed and replicated first
                ckpt.wait()
            elif ckpt is not None:  # the one before the pending one, committed and replicated
                _committed_and_replicated(ckpt, iteration - 1 - get_args().save_interval)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "raise":
            raise InjectedFault(f"rank {rank}: injected fault in the forward pass of iteration {iteration}")
        stop = threading.Event()  # never set: only an asynchronous exception ends the wait
        while True:
            stop.wait(0.05)

    @functools.wraps(original)
    def train_step(forward_step_func, *args, **kwargs):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        step = getattr(get_args(), "curr_iteration", -1) + 1  # the iteration this step makes
        if fired.is_set() or step != iteration or not mine:
            return original(forward_step_func, *args, **kwargs)

        def forward_step(*f_args, **f_kwargs):
            fault(rank)
            return forward_step_func(*f_args, **f_kwargs)

        return original(forward_step, *args, **kwargs)

    training.train_step = train_step
    if os.environ.get(LOAD_ENV):
        _fail_a_load(int(os.environ[LOAD_ENV]), mine)


def _on_first_write(iteration: int, mine: bool, fault) -> None:
    """The first write of this process's rank file of checkpoint ``iteration`` (on the flush thread
    that makes it) calls ``fault(rank)`` first, once per process: it raises, or never returns."""
    from datastates_megatron.engine.format import writer
    from datastates_megatron.engine.names import iteration_of

    fired = threading.Lock()
    original = writer.RankFileWriter.write

    @functools.wraps(original)
    def write(self, data, offset):
        import torch.distributed as dist

        if mine and iteration_of(os.path.basename(os.path.dirname(self.path))) == iteration and fired.acquire(False):
            fault(dist.get_rank() if dist.is_initialized() else 0)
        return original(self, data, offset)

    writer.RankFileWriter.write = write


def _fail_a_write(iteration: int, mine: bool) -> None:
    """The first write of this process's rank file of checkpoint ``iteration`` raises ``EIO``."""
    import errno

    def fail(rank: int) -> None:
        log.warning("rank %d: injected fault (flush) in the write of checkpoint %d", rank, iteration)
        raise OSError(errno.EIO, f"rank {rank}: injected write fault in checkpoint {iteration}")

    _on_first_write(iteration, mine, fail)


def _block_a_write(iteration: int, mine: bool) -> None:
    """The first write of this process's rank file of checkpoint ``iteration`` never returns."""

    def block(rank: int) -> None:
        log.warning("rank %d: injected fault (a write that never returns) in checkpoint %d", rank, iteration)
        threading.Event().wait()  # until the process is killed

    _on_first_write(iteration, mine, block)


def _committed_and_replicated(ckpt, iteration: int, timeout_s: float = 120.0) -> None:
    """Wait (training thread) until ``iteration`` is this rank's newest commit and its replication
    is done: ``ckpt.wait()`` would wait for the blocked write too."""
    import time

    mgr = ckpt._mgr  # a test hook: the commit and replication state, without a wait on every save
    deadline = time.monotonic() + timeout_s
    while (mgr.latest_committed or 0) < iteration and time.monotonic() < deadline:
        time.sleep(0.01)
    if mgr.replication is not None:
        mgr.replication.drain(timeout_s)


def _fail_a_load(nth: int, mine: bool) -> None:
    """The ``nth`` ``load_checkpoint`` that ``setup_model_and_optimizer`` calls raises after it returns."""
    from megatron.training import training

    original = training.load_checkpoint
    calls = [0]

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        import torch.distributed as dist

        result = original(*args, **kwargs)
        calls[0] += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if calls[0] == nth and mine:
            log.warning("rank %d: injected fault after load %d", rank, nth)
            raise InjectedFault(f"rank {rank}: injected fault after load {nth}")
        return result

    training.load_checkpoint = load_checkpoint
