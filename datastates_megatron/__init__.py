"""datastates-megatron: lazy, asynchronous, multi-level checkpointing for Megatron-LM.

Importing the package does no work, never imports megatron and needs only the stdlib: patching a
Megatron-LM tree (``datastates-ckpt patch``, ``scripts/apply_patches.sh``), ``datastates-ckpt where``
and ``--version`` run on a login node without torch, numpy or numba.  What needs them checks that they
can be found before it imports them -- ``LazyCheckpointer`` (resolved on first use), every folder of
the engine, the CLI's commands that read checkpoints: a missing one is an ``ImportError`` whose
message names it and the pip command (:mod:`._deps`).
"""

from ._deps import check_runtime as _check_runtime
from ._version import __version__

from .megatron.checkpointing.config import LazyCkptConfig

__all__ = ["LazyCheckpointer", "LazyCkptConfig", "__version__"]


def __getattr__(name):
    if name == "LazyCheckpointer":
        _check_runtime()
        from .megatron.checkpointing.checkpointer import LazyCheckpointer

        return LazyCheckpointer
    raise AttributeError(f"module 'datastates_megatron' has no attribute {name!r}")
