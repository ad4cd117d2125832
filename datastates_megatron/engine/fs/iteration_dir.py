"""One mkdir per iteration directory, not one per rank, and never on the training thread.

The tier's writer (rank 0; a node leader on the local tier) creates ``iter_*`` on a flush thread
just before it opens its rank file -- never on the training thread, where a stalled metadata server
would stop training (issue 41).  Every other rank only checks it -- one ``lstat``, a metadata read,
on a flush thread just before its file is opened, usually after the writer has made it -- and
creates it only if it is still missing.  At N ranks a save thus costs about one mkdir instead of N (N - 1 of
which would fail with ``EEXIST`` on the parallel file system's metadata server).  A directory that
is a symlink is refused on every rank, as :func:`.safe_io.make_dir` refuses it: we never write
through a link.

A directory that cannot be made or used fails that rank's file: the error reaches the commit, where
every rank abandons the checkpoint, and the caller at its next ``save``/``poll``/``wait``/``close``
(docs/reliability.md, "Storage errors after save() returned").
"""

from __future__ import annotations

import errno
import functools
import os
import stat

from ..errors import CheckpointError
from .safe_io import make_dir

__all__ = ["prepare_iteration_dir"]


def prepare_iteration_dir(path: str, writer: bool, then=None, *, rank: int = 0):
    """What a flush thread runs before opening the rank file: the writer creates ``path``, another
    rank checks it (:func:`_join`); then ``then``, e.g. moving a recycled file into place."""
    return functools.partial(_make if writer else _join, path, then, rank)


def _failed(rank: int, path: str, op: str, e: BaseException) -> CheckpointError:
    """One line: the rank, the directory, the operation and the errno (name and text).  A plain
    :class:`CheckpointError`: the engine logs an ``OSError`` from ``before_open`` and writes past it."""
    cause = e.__cause__ if isinstance(e, CheckpointError) else e  # make_dir's FlushError wraps the OSError
    if not isinstance(cause, OSError) or cause.errno is None:  # a refusal (a symlink): it says why
        err = CheckpointError(f"rank {rank}: {e}")
    else:
        why = f"{errno.errorcode.get(cause.errno, cause.errno)} ({cause.strerror})"
        err = CheckpointError(f"rank {rank}: {path}: cannot prepare the iteration directory ({op}): {why}")
    return err


def _make(path: str, then, rank: int) -> None:
    """Flush thread of the writer.  Raises :class:`CheckpointError` (not an ``OSError``, which the
    engine would log and write past) when ``path`` cannot be made."""
    try:
        make_dir(path)
    except OSError as e:  # make_dir's FlushError is one: a plain CheckpointError, or the engine writes past it
        raise _failed(rank, path, "mkdir", e) from e
    if then is not None:
        then()


def _join(path: str, then, rank: int) -> None:
    """Flush thread of a rank that is not the writer.  Raises :class:`CheckpointError` (not an
    ``OSError``, which the engine would log and write past) when ``path`` cannot be used."""
    try:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            make_dir(path)  # before the writer: make it (exist_ok), then check it as the writer does
            mode = os.lstat(path).st_mode
    except OSError as e:
        raise _failed(rank, path, "lstat/mkdir", e) from e
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"rank {rank}: {path}: is not a directory (a symlink?); refusing to follow or use it")
    if then is not None:
        then()
