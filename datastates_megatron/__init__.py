"""datastates-megatron: lazy, asynchronous, multi-level checkpointing for Megatron-LM.

Importing the package does no work and never imports megatron; ``LazyCheckpointer`` is resolved on
first use.
"""

from ._version import __version__
from .megatron.config import LazyCkptConfig

__all__ = ["LazyCheckpointer", "LazyCkptConfig", "__version__"]


def __getattr__(name):
    if name == "LazyCheckpointer":
        from .megatron.checkpointer import LazyCheckpointer

        return LazyCheckpointer
    raise AttributeError(f"module 'datastates_megatron' has no attribute {name!r}")
