"""Fixed-budget host staging cache: one aligned (pinned on CUDA) arena used as a circular allocator.

Regions are handed out in FIFO order and may be released in any order (several flush threads); the
space of a region becomes reusable once every older region is released too.  The arena is allocated
once and reused by every checkpoint, so memory never grows past the budget; ``acquire`` blocks while
the arena is full (backpressure) and raises :class:`CacheTimeoutError` rather than hanging forever.

An in-process restart (Megatron-LM's ``--inprocess-restart``) closes one checkpointer and builds
the next in the same process: :meth:`HostCache.keep` hands a closed cache's arena, once no thread
can touch it, to the next cache of the same size and pinning in this process, so the restart neither
allocates (and pins) the arena twice nor holds two.  At most one arena per size is kept.
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
_kept_lock = threading.Lock()
_kept: dict[tuple[int, bool], torch.Tensor] = {}  # (capacity, pinned) -> an arena HostCache.keep left


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
        with _kept_lock:
            arena = _kept.pop((capacity, bool(pin)), None)
        self.reused = arena is not None  # the arena a closed cache of this process kept
        if arena is None:
            raw = torch.empty(capacity + _ALIGN, dtype=torch.uint8, pin_memory=pin)
            skip = (-raw.data_ptr()) % _ALIGN
            arena = raw[skip : skip + capacity]
        self._arena = arena
        self.capacity = capacity
        self.pinned = bool(pin)
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

    def fits_now(self, sizes) -> bool:
        """Whether regions of ``sizes`` bytes, acquired in this order, would all be placed now,
        without waiting for any release (a save that would have to wait for storage can be skipped
        instead).  O(len(sizes)); nothing is reserved."""
        with self._cond:
            live, head, tail = bool(self._live), self._head, self._tail
            for nbytes in sizes:
                need = -(-max(int(nbytes), 1) // _ALIGN) * _ALIGN
                if not live:
                    if need > self.capacity:
                        return False
                    head, tail, live = 0, need, True
                elif tail > head:
                    if tail + need <= self.capacity:
                        tail += need
                    elif need <= head:  # wraps, as _try_place does
                        tail = need
                    else:
                        return False
                elif tail + need <= head:
                    tail += need
                else:
                    return False
            return True

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

    def keep(self) -> bool:
        """After :meth:`close`, and only once no thread can write a region any more (the caller
        joined them): leave the arena to the next ``HostCache`` of this capacity and pinning in this
        process; this cache holds it no more.  False (nothing kept) when one is already kept."""
        with self._cond:
            if not self._closed:
                raise RuntimeError("HostCache.keep() before close()")
            arena, self._arena = self._arena, None
            self._live.clear()
        if arena is None:
            return False
        with _kept_lock:
            return _kept.setdefault((self.capacity, self.pinned), arena) is arena
