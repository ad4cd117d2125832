"""Fixed-budget host staging cache: one aligned (pinned on CUDA) arena used as a circular allocator.

Regions are handed out in FIFO order and may be released in any order (several flush threads); the
space of a region becomes reusable once every older region is released too.  The arena is allocated
once and reused by every checkpoint, so memory never grows past the budget; ``acquire`` blocks while
the arena is full (backpressure) and raises :class:`CacheTimeoutError` rather than hanging forever.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import torch

from ..errors import CacheTimeoutError, EngineClosedError

__all__ = ["HostCache", "Region"]

_ALIGN = 4096


@dataclasses.dataclass(eq=False)
class Region:
    """A slice ``[start, start + nbytes)`` of the arena; ``tensor`` is a uint8 view over it."""

    start: int
    nbytes: int
    tensor: torch.Tensor
    released: bool = False


class HostCache:
    """Bounded circular staging arena.  Thread-safe: any thread may ``acquire`` and ``release``."""

    def __init__(self, capacity: int, *, pin: bool | None = None) -> None:
        capacity = capacity // _ALIGN * _ALIGN
        if capacity < _ALIGN:
            raise ValueError(f"host cache budget must be at least {_ALIGN} bytes, got {capacity}")
        if pin is None:
            pin = torch.cuda.is_available()
        raw = torch.empty(capacity + _ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = (-raw.data_ptr()) % _ALIGN
        self._arena = raw[skip : skip + capacity]
        self.capacity = capacity
        self.pinned = pin
        self._live: collections.deque[Region] = collections.deque()
        self._head = 0  # start of the oldest live region
        self._tail = 0  # first free byte after the newest live region
        self.peak_used = 0
        self.wait_seconds = 0.0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def used(self) -> int:
        with self._cond:
            return self._held()

    def _held(self) -> int:
        """Bytes unavailable now: live regions plus any arena end skipped by a wrap-around."""
        if not self._live:
            return 0
        if self._tail > self._head:
            return self._tail - self._head
        return self.capacity - self._head + self._tail

    def _try_place(self, nbytes: int) -> int | None:
        """Return the start offset if ``nbytes`` fits now, else ``None``."""
        if not self._live:
            self._head = self._tail = 0
            return 0 if nbytes <= self.capacity else None
        if self._tail > self._head:
            if self._tail + nbytes <= self.capacity:
                return self._tail
            if nbytes <= self._head:  # wrap: skip the unusable end of the arena
                return 0
            return None
        # wrapped (or exactly full): free space is [tail, head)
        if self._tail + nbytes <= self._head:
            return self._tail
        return None

    def acquire(self, nbytes: int, timeout: float) -> Region:
        """Reserve ``nbytes`` (rounded up to 4 KiB), waiting up to ``timeout`` seconds for space."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if need > self.capacity:
            raise ValueError(f"a region of {nbytes} bytes cannot fit a host cache of {self.capacity} bytes")
        deadline = time.monotonic() + timeout
        with self._cond:
            waited_from = None
            while True:
                if self._closed:
                    raise EngineClosedError("host cache is closed")
                placed = self._try_place(need)
                if placed is not None:
                    break
                if waited_from is None:
                    waited_from = time.monotonic()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CacheTimeoutError(
                        f"waited {timeout:.1f}s for {need} bytes of host cache "
                        f"({self._held()}/{self.capacity} bytes held by regions still being flushed)"
                    )
                self._cond.wait(left)
            if waited_from is not None:
                self.wait_seconds += time.monotonic() - waited_from
            region = Region(placed, need, self._arena[placed : placed + need])
            self._live.append(region)
            self._tail = placed + need
            self.peak_used = max(self.peak_used, self._held())
            return region

    def release(self, region: Region) -> None:
        """Give a region back; idempotent.  Space is reclaimed once all older regions are released."""
        with self._cond:
            if region.released:
                return
            region.released = True
            while self._live and self._live[0].released:
                self._live.popleft()
                self._head = self._live[0].start if self._live else self._tail
            if not self._live:
                self._head = self._tail = 0
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with :class:`EngineClosedError`; idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
