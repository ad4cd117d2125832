"""Device -> host snapshot copies, each with a completion the flush side and the gate can wait on.

CPU tensors are copied synchronously on the engine's copier thread (a background thread, so the
training thread never does the copy).  CUDA tensors are copied with ``non_blocking=True`` on a side
stream that first waits on the training stream as it was when ``save()`` was called; every region
gets a CUDA event.  The gate prefers ``compute_stream.wait_event`` (no host block) over a host sync.

Thread-safety: one ``DeviceCopier`` is used by the copier thread (``copy``) and by any thread that
waits on the returned completions; ``gate`` runs on the training thread.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DeviceCopier", "Completion", "as_bytes"]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor's storage (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be snapshotted")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


class Completion:
    """Done when the region no longer needs its source.  ``event``: CUDA event of the device->host
    copy (``None``: copied synchronously, already done).  ``written``: set by the flush thread once
    a region written straight from its source (no copy, see ``EngineOptions.source_writes``) has
    been hashed and written; ``None`` for copied regions."""

    __slots__ = ("event", "written")

    def __init__(self, event=None, written: threading.Event | None = None) -> None:
        self.event = event
        self.written = written

    def synchronize(self) -> None:
        """Wait for the copy (not for ``written``: the flush thread that sets it calls this)."""
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return (self.event is None or self.event.query()) and (self.written is None or self.written.is_set())


class DeviceCopier:
    """Issues region copies; knows whether a CUDA side stream is involved."""

    def __init__(self) -> None:
        self._side = None

    def mark_ready(self) -> object:
        """Called on the training thread in ``save()``: what the copies must wait for."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return ev

    def copy(self, src: torch.Tensor, dst: torch.Tensor, ready) -> Completion:
        """Copy ``src`` (uint8 view, any device) into ``dst`` (uint8 host view)."""
        if src.device.type != "cuda":
            dst.copy_(src)
            return Completion()
        if self._side is None:
            self._side = torch.cuda.Stream(device=src.device)
        with torch.cuda.stream(self._side):
            if ready is not None:
                self._side.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._side)
        return Completion(ev)

    @staticmethod
    def gate(completions) -> None:
        """Make the training stream wait for CUDA completions; block the host only for CPU ones
        (those are already done when issued)."""
        events = [c.event for c in completions if c.event is not None]
        if events:
            stream = torch.cuda.current_stream()
            for ev in events:
                stream.wait_event(ev)
