"""One mkdir per iteration directory, not one per rank.

The tier's writer (rank 0; a node leader on the local tier) creates ``iter_*`` on the training
thread when it starts a save.  Every other rank only checks it -- one ``lstat``, a metadata read, on a
flush thread just before its file is opened, by when the writer has made it -- and creates it
only if it is still missing.  At N ranks a save thus costs about one mkdir instead of N (N - 1 of
which would fail with ``EEXIST`` on the parallel file system's metadata server).  A directory that
is a symlink is refused on every rank, as :func:`.safe_io.make_dir` refuses it: we never write
through a link.
"""

from __future__ import annotations

import functools
import os
import stat

from ..errors import CheckpointError
from .safe_io import make_dir

__all__ = ["prepare_iteration_dir"]


def prepare_iteration_dir(path: str, writer: bool, then=None):
    """The writer: create ``path`` now.  Returns what a flush thread runs before opening the rank
    file (``then`` after the check, e.g. moving a recycled file into place), or ``None``."""
    if writer:
        make_dir(path)
        return then
    return functools.partial(_join, path, then)


def _join(path: str, then) -> None:
    """Flush thread of a rank that is not the writer.  Raises :class:`CheckpointError` (not an
    ``OSError``, which the engine would log and write past) when ``path`` cannot be used."""
    try:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            make_dir(path)  # before the writer: make it (exist_ok), then check it as the writer does
            mode = os.lstat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot prepare the iteration directory: {e}") from e
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: is not a directory (a symlink?); refusing to follow or use it")
    if then is not None:
        then()
