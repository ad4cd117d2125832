"""Exception hierarchy: one base class, specific subclasses that also inherit the matching builtin.

Every subclass of :class:`CheckpointError`, in any module of the package, is registered by its class
name when it is defined, so an error agreed across ranks (which travels as a class name and a message,
never pickled) arrives under its own class on every rank (:func:`error_class_named`)."""

from __future__ import annotations

import errno

from .._version import VERSION_RE, __version__

__all__ = [
    "CheckpointError",
    "EngineClosedError",
    "CacheTimeoutError",
    "FlushError",
    "CopyError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "RankFileError",
    "NoCheckpointError",
    "LayoutMismatchError",
    "CommitError",
    "PromotionError",
    "EncodingError",
    "ForeignCheckpointError",
    "SaveDirBusyError",
    "LockLostError",
    "CheckpointAccessError",
    "StorageReadError",
    "OptionsError",
    "error_class_named",
    "make_error",
]

_REGISTRY: dict[str, type] = {}


class CheckpointError(Exception):
    """Base class of every error this package raises on purpose."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        known = _REGISTRY.get(cls.__name__)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}: an error class named {cls.__name__} already exists "
                f"({known.__module__}.{known.__qualname__}); errors cross ranks by name, so names must differ"
            )
        _REGISTRY[cls.__name__] = cls


def error_class_named(name: str) -> type[CheckpointError]:
    """The package's error class called ``name`` (``CheckpointError`` for any other name)."""
    return _REGISTRY.get(name, CheckpointError)


def make_error(cls: type[CheckpointError], message: str) -> CheckpointError:
    """An instance of ``cls`` carrying ``message``, also for classes whose constructor takes other
    arguments (:class:`OptionsError`): the message is what crossed the ranks, not the arguments."""
    try:
        return cls(message)
    except TypeError:
        err = cls.__new__(cls)
        Exception.__init__(err, message)
        return err


class EngineClosedError(CheckpointError, RuntimeError):
    """The engine was used after ``close()``."""


class CacheTimeoutError(CheckpointError, TimeoutError):
    """Waiting for host-cache space, an in-flight slot or a peer took longer than the timeout."""


class CopyError(CheckpointError):
    """A device -> host snapshot copy failed."""


class FlushError(CheckpointError, OSError):
    """Writing or fsyncing a rank file failed (full disk, I/O error, unwritable directory)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is damaged: wrong magic, truncation, or a checksum mismatch."""


class FormatVersionError(CorruptCheckpointError):
    """A file or manifest was written in a newer format than this reader knows: not damage (the CLI
    says so apart, and nothing deletes it); upgrading datastates-megatron reads it."""

    @classmethod
    def newer(cls, path: str, what: str, version: int, newest: int, writer: str | None = None) -> FormatVersionError:
        """The one message for every newer format: who wrote it (``writer``, as far as the unverified
        file says), and what this version reads."""
        who = writer if writer and VERSION_RE.match(writer) else "an unknown version"
        return cls(
            f"{path}: written by datastates-megatron {who} ({what} format {version}); this is "
            f"datastates-megatron {__version__} (reads {what} formats <= {newest}): upgrade to load it"
        )


class RankFileError(CorruptCheckpointError):
    """A rank file is not the one its manifest committed: ``kind`` says how -- ``missing``, ``size``
    (another length) or ``file`` (not a regular file, unreadable, or another file) -- and ``problem``
    says it without the path and rank, for a report that names them itself (``datastates-ckpt verify``).
    Only the message crosses ranks: elsewhere ``kind`` is ``file`` and ``problem`` the message."""

    def __init__(self, message: str, kind: str = "file", problem: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.problem = message if problem is None else problem


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class LayoutMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by a different world (size, parallel layout, tensor set)."""


class CommitError(CheckpointError):
    """Ranks could not agree on a checkpoint, or writing its manifest failed: nothing was committed."""


class PromotionError(CommitError):
    """A checkpoint's promotion to the persistent tier failed on some rank (its copy to ``--save``,
    a bucket): nothing of it is committed there; its node-local copy stays committed.  Raised once,
    by the next ``wait(persist=True)`` unless a newer promotion was committed since (logged instead
    with ``on_error="warn"``); ``poll`` and ``save`` never raise it: an outage of the store does not
    stop training.  ``iteration``: the checkpoint not promoted."""

    def __init__(self, message: str, iteration: int | None = None) -> None:
        super().__init__(message)
        self.iteration = iteration

    def __reduce__(self):
        return type(self), (str(self), self.iteration)


class EncodingError(CheckpointError, TypeError):
    """A non-tensor value cannot be stored without pickle."""


class ForeignCheckpointError(CheckpointError, FileExistsError):
    """The directory holds a checkpoint this package did not write (Megatron-LM's own) that a run
    starting here would silently skip."""


class SaveDirBusyError(CheckpointError, RuntimeError):
    """Another job (or another manager in this process) is writing to the same save directory."""


class CheckpointAccessError(CheckpointError, PermissionError):
    """A checkpoint file exists but this process may not read it (EACCES/EPERM): not damage."""


class StorageReadError(CheckpointError, OSError):
    """Reading a committed checkpoint failed in the storage, not in its bytes: an I/O error
    (``errno`` in :data:`READ_ERRNOS`) or a read that did not return within the restore's deadline.
    Not damage: the ranks agree on the next candidate (another tier, an older checkpoint) instead
    of refusing, as they do for a :class:`CorruptCheckpointError`.  ``errno``: the read's (``None``
    for a read that did not return, or where only the message crossed ranks)."""

    def __init__(self, message: str, err: int | None = None) -> None:
        super().__init__(message)
        self.errno = err


# errnos of a read that the storage failed (the file may be intact): a restore falls back on them
READ_ERRNOS = frozenset(
    getattr(errno, n) for n in ("EIO", "ETIMEDOUT", "ESTALE", "EREMOTEIO", "ENOLINK", "ENOTCONN") if hasattr(errno, n)
)


class LockLostError(CheckpointError, RuntimeError):
    """The save directory's lock file was removed or replaced while this job held the lock: another
    job may have started there, so this one must not commit (nor run retention) any more."""


class OptionsError(CheckpointError, ValueError):
    """Invalid options.  ``problems`` lists every one found as ``(field, text)`` pairs, the text
    reading on from the field name (``("flush_threads", "must be >= 1, got 0")``), so a front end
    (the ``--lazy-ckpt*`` flags) can name its own spelling of each field."""

    def __init__(self, what: str, problems: list[tuple[str, str]]) -> None:
        self.what = what
        self.problems = list(problems)
        super().__init__(f"invalid {what}: " + "; ".join(f"{field} {text}" for field, text in self.problems))

    def __reduce__(self):
        return type(self), (self.what, self.problems)
