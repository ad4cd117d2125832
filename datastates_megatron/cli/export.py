"""``datastates-ckpt export CKPT_DIR OUT_DIR``: its usage errors, found before anything heavy is
imported, then the hand-over to :mod:`..megatron.export` (which writes only under OUT_DIR)."""

from __future__ import annotations

import argparse

from .common import CliUsageError

__all__ = ["run"]


def _check_export(args: argparse.Namespace, flags: list[str]) -> None:
    """The export's usage errors, before anything heavy is imported."""
    from ..megatron.export.export_args import locate_script

    args.training_flags = flags
    if args.format == "torch":
        if flags:
            raise CliUsageError("export --format torch runs no Megatron-LM: give no training flags after --")
        return
    try:
        locate_script(args.megatron_lm, args.script)
    except ValueError as e:
        raise CliUsageError(str(e)) from None
    if not flags:
        raise CliUsageError(
            "export --format torch_dist needs the training flags of the run that wrote the checkpoint after "
            "`--` (model shape, parallel layout, precision, tokenizer)"
        )


def run(args: argparse.Namespace, flags: list[str]) -> int:
    """``flags``: the training flags given after ``--`` (torch_dist only)."""
    _check_export(args, flags)
    from ..megatron.export.exporter import run_export

    return run_export(args)
