"""Opening one checkpoint for ``inspect`` and ``verify``: its manifest, with the CLI's errors (what a
missing, unreadable or damaged one is, and a hint when retention removed it), and the ranks asked for."""

from __future__ import annotations

import os
import stat

from typing import TYPE_CHECKING

from ..engine.errors import CheckpointError, CorruptCheckpointError, FormatVersionError, NoCheckpointError
from .common import PROG, CliUsageError

if TYPE_CHECKING:
    from ..engine.format.manifest import Manifest

__all__ = ["load_manifest", "select_ranks"]


def load_manifest(ckpt: str) -> Manifest:
    from ..engine.format.manifest import read_manifest
    from ..engine.names import MANIFEST_NAME
    from ..engine.tiers.tier import list_iterations

    try:
        is_dir = stat.S_ISDIR(os.stat(ckpt).st_mode)
    except FileNotFoundError:
        raise NoCheckpointError(f"{ckpt}: no such checkpoint directory{retention_hint(ckpt)}") from None
    except PermissionError as e:
        raise NoCheckpointError(f"{ckpt}: permission denied ({e.strerror}): cannot look into it") from None
    except OSError as e:  # ENAMETOOLONG, ELOOP: not "no such checkpoint"
        from ..engine.fs.safe_io import os_error_text

        raise NoCheckpointError(f"{ckpt}: cannot look into it: {os_error_text(e)}") from None
    if not is_dir:
        raise NoCheckpointError(f"{ckpt}: not a directory: not a checkpoint")
    try:
        return read_manifest(ckpt)
    except NoCheckpointError as e:
        hint = ""
        if list_iterations(ckpt):
            hint = f" (this looks like a save directory: try `{PROG} ls {ckpt}`)"
        raise NoCheckpointError(f"{e}{hint}") from e
    except FormatVersionError:
        raise  # not damage: "written by datastates-megatron X ...: upgrade"
    except CorruptCheckpointError as e:
        raise type(e)(f"damaged manifest: {e}") from e
    except CheckpointError:
        raise  # permission denied (CheckpointAccessError) is not damage
    except OSError as e:
        raise CorruptCheckpointError(f"{os.path.join(ckpt, MANIFEST_NAME)}: cannot read the manifest: {e}") from e


def retention_hint(ckpt: str) -> str:
    """When ``ckpt`` is an ``iter_*`` older than the newest checkpoint committed beside it, it was most
    likely removed by the trainer's retention after it was listed (a reader racing a saving run)."""
    from ..engine.names import iteration_of
    from ..engine.tiers.tier import latest_committed

    iteration = iteration_of(ckpt)
    try:
        newest = latest_committed(os.path.dirname(os.path.normpath(ckpt)) or ".")
    except (CheckpointError, OSError):
        return ""
    if iteration is None or newest <= iteration:
        return ""
    return (
        f" (iteration {newest} is committed beside it: retention of a running trainer may have removed"
        " this one since it was listed; list again)"
    )


def select_ranks(ckpt: str, m: Manifest, rank: int | None) -> list:
    """The manifest's records, or the one of ``rank`` (a node-local manifest lists only some ranks)."""
    if rank is None:
        return list(m.ranks)
    found = [r for r in m.ranks if r.rank == rank]
    if not found:
        listed = [r.rank for r in m.ranks]
        shown = listed if len(listed) <= 8 else f"{listed[:8]} ..."
        raise CliUsageError(
            f"{ckpt}: --rank {rank} is not in this checkpoint (world size {m.world_size}, {m.tier} "
            f"manifest lists ranks {shown})"
        )
    return found
