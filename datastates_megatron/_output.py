"""One line, one write: how a process that shares a pipe with others prints.

``print(text)`` hands its stream the text and the newline in two calls; with Python's output
unbuffered (``PYTHONUNBUFFERED=1`` or ``-u``: how the export and the test launchers run their ranks)
those are two ``write(2)``\\ s, and another process's line can land between them: ``rank 0 started
(pid 1)rank 1 started (pid 2)``.  :func:`write_line` hands the stream the whole line at once and
flushes it, so a line shorter than ``PIPE_BUF`` (4 KiB) reaches a pipe whole, whoever else writes
to it.  Stdlib only.
"""

from __future__ import annotations

import sys

__all__ = ["write_line"]


def write_line(text: str = "", stream=None) -> None:
    """Write ``text`` and its newline to ``stream`` (default: ``sys.stdout``) in one call, then flush."""
    out = sys.stdout if stream is None else stream
    out.write(f"{text}\n")
    out.flush()
