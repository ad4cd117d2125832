"""The fault filesystem's rules: which calls (operation, path glob) stall, slow down or fail, and
the calls stalled now.  Standard library only (tests import it without mfusepy)."""

from __future__ import annotations

import errno
import os
import re
import threading

MiB = 1 << 20
HOLD_LIMIT_S = 600.0  # a held call never waits longer than this (the server must never hang for ever)

# operation names a rule may use; a name on the left also matches the calls on the right
ALIASES = {"open": ("open", "create"), "stat": ("getattr",), "fsync": ("fsync", "fsyncdir")}
OPERATIONS = (
    "getattr access readlink readdir opendir mkdir rmdir unlink rename link symlink chmod chown truncate "
    "utimens open create read write flush release fsync fsyncdir statfs fallocate"
).split()


def glob_regex(pattern: str) -> re.Pattern:
    """``**`` any run of characters, ``*`` any run without ``/``, ``?`` one character but ``/``."""
    out, i = [], 0
    pattern = pattern.lstrip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


class Rule:
    """One fault: which calls (operations, path glob) and what happens to them."""

    def __init__(self, rid: int, spec: dict) -> None:
        self.id = rid
        ops = spec.get("op") or "*"
        ops = [ops] if isinstance(ops, str) else list(ops)
        self.ops = set()
        for op in ops:
            if op == "*":
                self.ops.update(OPERATIONS)
                continue
            expanded = ALIASES.get(op, (op,))
            unknown = [o for o in expanded if o not in OPERATIONS]
            if unknown:
                raise ValueError(f"unknown operation {op!r}; known: {', '.join(OPERATIONS)} and {', '.join(ALIASES)}")
            self.ops.update(expanded)
        self.path = spec.get("path") or "**"
        self.regex = glob_regex(self.path)
        err = spec.get("errno")
        if isinstance(err, str):
            if not hasattr(errno, err):
                raise ValueError(f"unknown errno {err!r}")
            err = getattr(errno, err)
        self.errno = err
        self.stall_s = float(spec.get("stall_s") or 0.0)
        self.hold = bool(spec.get("hold"))
        self.s_per_mib = float(spec.get("s_per_mib") or 0.0)
        self.times = spec.get("times")
        self.hits = 0
        self.released = threading.Event()

    def matches(self, op: str, paths) -> bool:
        return op in self.ops and any(p is not None and self.regex.match(p) for p in paths)

    def describe(self) -> dict:
        return {"id": self.id, "ops": sorted(self.ops), "path": self.path, "errno": self.errno, "hits": self.hits}


class Faults:
    """The rules in force and the calls they are stalling; thread-safe (one lock, one condition)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rules: list[Rule] = []
        self._next = 1
        self.blocked = 0
        self.calls: dict[str, int] = {}

    def add(self, spec: dict) -> int:
        with self._cond:
            rule = Rule(self._next, spec)
            self._next += 1
            self._rules.append(rule)
            return rule.id

    def clear(self, rid: int | None = None) -> int:
        """Remove rule ``rid`` (all: ``None``) and let go of every call it stalls; returns how many."""
        with self._cond:
            gone = [r for r in self._rules if rid is None or r.id == rid]
            self._rules = [r for r in self._rules if r not in gone]
        for r in gone:
            r.released.set()
        return len(gone)

    def stats(self) -> dict:
        with self._cond:
            return {
                "blocked": self.blocked,
                "rules": [r.describe() for r in self._rules],
                "calls": dict(self.calls),
            }

    def wait_blocked(self, n: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.blocked >= n, timeout)

    def _match(self, op: str, paths) -> Rule | None:
        with self._cond:
            self.calls[op] = self.calls.get(op, 0) + 1
            for rule in reversed(self._rules):
                if rule.matches(op, paths):
                    if rule.times is not None and rule.hits >= rule.times:
                        continue
                    rule.hits += 1
                    return rule
        return None

    def apply(self, op: str, paths, nbytes: int = 0) -> None:
        """Run the newest matching rule for this call: stall, slow down, then raise its errno."""
        rule = self._match(op, paths)
        if rule is None:
            return
        wait = HOLD_LIMIT_S if rule.hold else rule.stall_s + rule.s_per_mib * nbytes / MiB
        if wait > 0:
            with self._cond:
                self.blocked += 1
                self._cond.notify_all()
            try:
                rule.released.wait(wait)
            finally:
                with self._cond:
                    self.blocked -= 1
                    self._cond.notify_all()
        if rule.errno:
            raise OSError(rule.errno, os.strerror(rule.errno))
