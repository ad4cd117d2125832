"""Bounded retries with exponential backoff for one request to the store.

A request that fails in a way another try may cure (a dropped connection, a timeout, a 5xx, a
throttling answer) is tried again after ``base * 2**i`` seconds (capped at ``cap``, with jitter),
at most ``attempts`` times in all, and only while another try fits before the request's deadline
(:mod:`.timeouts`: a try is started only if it can end, unanswered, before it); then the last error
is raised as an
:class:`.base.ObjectStorageError` naming the object.  An answer another try cannot change (404,
403, 412) is raised at once.  The policy is this module's alone: the S3 client's own retries are
turned off, so that the bound here is the bound.

Thread-safety: a :class:`Retry` is immutable; :meth:`Retry.call` may run on many threads.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time

__all__ = ["Retry"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Retry:
    attempts: int = 5
    base_s: float = 0.2
    cap_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"retry policy needs attempts >= 1 and 0 <= base_s <= cap_s, got {self}")

    def delay(self, i: int) -> float:
        """Seconds to wait before try ``i + 2`` (after the ``i + 1``-th failure)."""
        d = min(self.cap_s, self.base_s * (2**i))
        return d * (0.5 + random.random() / 2)

    def call(self, fn, *, transient, what: str, fail, deadline_s: float = math.inf, try_s: float = 0.0):
        """``fn()``, tried again while ``transient(error)`` says another try may cure it and one
        more try of at most ``try_s`` seconds, after its backoff, ends within ``deadline_s`` of the
        first; ``fail(error, tries)`` builds the error raised (for the last transient one, or at
        once for one that is not)."""
        end = time.monotonic() + deadline_s
        for i in range(self.attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below, re-raised as ours
                if not transient(e):
                    raise fail(e, i + 1) from None
                wait = self.delay(i)
                if i + 1 == self.attempts or time.monotonic() + wait + try_s > end:
                    raise fail(e, i + 1) from None
                log.warning(
                    "%s failed (%s); try %d of at most %d in %.2fs", what, type(e).__name__, i + 2, self.attempts, wait
                )
                time.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover
