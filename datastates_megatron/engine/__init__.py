"""Framework-agnostic lazy snapshot engine (torch, numpy, numba and the stdlib only; never megatron)."""

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
    SaveDirBusyError,
)
from .file_format import RankFile, load_file
from .options import EngineOptions
from .snapshot import FileReceipt, SaveHandle, SnapshotEngine

__all__ = [
    "SnapshotEngine",
    "SaveHandle",
    "FileReceipt",
    "EngineOptions",
    "RankFile",
    "load_file",
    "CheckpointError",
    "CacheTimeoutError",
    "CommitError",
    "CopyError",
    "CorruptCheckpointError",
    "EncodingError",
    "EngineClosedError",
    "FlushError",
    "ForeignCheckpointError",
    "FormatVersionError",
    "LayoutMismatchError",
    "NoCheckpointError",
    "SaveDirBusyError",
]
