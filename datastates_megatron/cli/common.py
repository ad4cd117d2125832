"""What every ``datastates-ckpt`` command shares: the exit statuses, the usage error, the ``--json``
writer and the text formatting of sizes, ages and times."""

from __future__ import annotations

import json
import sys
import time

from ..engine.errors import CheckpointError

__all__ = [
    "PROG",
    "JSON_SCHEMA",
    "EXIT_OK",
    "EXIT_DAMAGED",
    "EXIT_USAGE",
    "EXIT_NEWER",
    "CliUsageError",
    "emit",
    "exit_for",
    "human",
    "age",
    "when",
    "strip_path",
]

PROG = "datastates-ckpt"
JSON_SCHEMA = 1
EXIT_OK = 0  # success; for verify: every check passed
EXIT_DAMAGED = 1  # a checkpoint is damaged (verify found a problem, a manifest or rank file is unreadable)
EXIT_USAGE = 2  # bad arguments, or the path is not there / not a checkpoint
EXIT_NEWER = 3  # a checkpoint was written by a newer datastates-megatron (a newer format): upgrade to read it


class CliUsageError(CheckpointError, ValueError):
    """An argument does not fit the checkpoint (e.g. ``--rank`` beyond its world size)."""


def emit(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=1, sort_keys=True, default=str)
    sys.stdout.write("\n")


def exit_for(problems: list[bool]) -> int:
    """The exit status of ``inspect``/``verify`` from their problems (True: a newer version's file):
    damage wins; only newer-format files is "upgrade" (3)."""
    if not problems:
        return EXIT_OK
    return EXIT_NEWER if all(problems) else EXIT_DAMAGED


def human(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def strip_path(message: str, path: str) -> str:
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
