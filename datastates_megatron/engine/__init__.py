"""Framework-agnostic lazy snapshot engine (torch, numpy, numba and the stdlib only; never megatron).

Importing the package imports only the stdlib (errors, options); the names that need torch, numpy or
numba (``SnapshotEngine``, ``RankFile``, ...) are resolved on first use, so that ``datastates-ckpt --help``
and ``import datastates_megatron`` stay light.
"""

from typing import TYPE_CHECKING

from .errors import (
    CacheTimeoutError,
    CheckpointError,
    CommitError,
    CopyError,
    CorruptCheckpointError,
    EncodingError,
    EngineClosedError,
    FlushError,
    ForeignCheckpointError,
    FormatVersionError,
    LayoutMismatchError,
    NoCheckpointError,
    OptionsError,
    PromotionError,
    SaveDirBusyError,
    StorageReadError,
)
from .options import EngineOptions, ManagerOptions

if TYPE_CHECKING:
    from .format.file_format import FileReceipt, RankFile, load_file
    from .save.snapshot import SaveHandle, SnapshotEngine

__all__ = [
    "SnapshotEngine",
    "SaveHandle",
    "FileReceipt",
    "EngineOptions",
    "ManagerOptions",
    "RankFile",
    "load_file",
    "CheckpointError",
    "CacheTimeoutError",
    "CommitError",
    "CopyError",
    "CorruptCheckpointError",
    "StorageReadError",
    "EncodingError",
    "EngineClosedError",
    "FlushError",
    "ForeignCheckpointError",
    "FormatVersionError",
    "LayoutMismatchError",
    "NoCheckpointError",
    "OptionsError",
    "PromotionError",
    "SaveDirBusyError",
]

_LAZY = {
    "RankFile": "format.file_format",
    "load_file": "format.file_format",
    "FileReceipt": "format.file_format",
    "SaveHandle": "save.snapshot",
    "SnapshotEngine": "save.snapshot",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
