"""StallReport: one rank's skipped saves, told as stall episodes -- one warning when an episode
starts, one when it ends -- never one line per iteration.

A stall episode is a run of consecutive saves this rank skipped because its storage was behind
(``when_behind="skip"``).  Storage that keeps falling behind (checkpoints more often than it can
write them) makes short episodes one after the other: those starting within ``quiet_s`` of the end
of the last one warned about are logged at INFO, and counted all the same.  Thread-safety: the
training thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import time

__all__ = ["StallReport"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Episode:
    first: int
    since: float
    quiet: bool  # within quiet_s of the last episode warned about: logged at INFO
    last: int = 0
    count: int = 0


class StallReport:
    """The skips of rank ``rank`` saving to ``root``; :attr:`skipped` counts every one."""

    def __init__(self, rank: int, root: str, quiet_s: float = 60.0) -> None:
        self.rank, self.root, self.quiet_s = rank, root, quiet_s
        self.skipped = 0
        self._episode: _Episode | None = None
        self._quiet_until = 0.0

    def skipped_save(self, iteration: int, why: str, in_flight_s: float) -> None:
        """The save of ``iteration`` was skipped (``why``: what the storage is behind with; the
        oldest checkpoint not yet committed was saved ``in_flight_s`` seconds ago)."""
        self.skipped += 1
        episode = self._episode
        if episode is None:
            now = time.perf_counter()
            episode = self._episode = _Episode(iteration, now, now < self._quiet_until)
            log.log(
                logging.INFO if episode.quiet else logging.WARNING,
                "rank %d: storage behind: checkpoint of iteration %d skipped: %s, %s (oldest for %.1f s); "
                "training goes on, the next checkpoints are attempted as usual (this stall's skips are counted)",
                self.rank,
                iteration,
                self.root,
                why,
                in_flight_s,
            )
        episode.last = iteration
        episode.count += 1

    def staged(self, iteration: int) -> None:
        """The save of ``iteration`` was staged: the episode going on, if any, ended (logged once)."""
        episode, self._episode = self._episode, None
        if episode is None:
            return
        now = time.perf_counter()
        if not episode.quiet:
            self._quiet_until = now + self.quiet_s
        log.log(
            logging.INFO if episode.quiet else logging.WARNING,
            "rank %d: storage of %s caught up: %d checkpoint(s) skipped (iterations %d..%d) over %.1f s; "
            "iteration %d staged",
            self.rank,
            self.root,
            episode.count,
            episode.first,
            episode.last,
            now - episode.since,
            iteration,
        )
