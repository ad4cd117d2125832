"""``datastates-ckpt patch MEGATRON_DIR``: the --lazy-ckpt source patch applied (or checked, or
reverted) from the installed package.  Stdlib and git only: it runs from a login node without torch,
numpy or numba."""

from __future__ import annotations

import argparse

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from ..megatron.megatron_lm.patching import main

    return main(args)
