"""datastates-megatron: lazy, asynchronous, multi-level checkpointing for Megatron-LM.

Importing the package does no work and never imports megatron; ``LazyCheckpointer`` is resolved on
first use.  It only checks that the runtime dependencies can be found: a missing one is an
``ImportError`` whose message names it and the pip command (:mod:`._deps`).
"""

from ._deps import check_runtime as _check_runtime
from ._version import __version__

from .megatron.checkpointing.config import LazyCkptConfig

_check_runtime()

__all__ = ["LazyCheckpointer", "LazyCkptConfig", "__version__"]


def __getattr__(name):
    if name == "LazyCheckpointer":
        from .megatron.checkpointing.checkpointer import LazyCheckpointer

        return LazyCheckpointer
    raise AttributeError(f"module 'datastates_megatron' has no attribute {name!r}")
