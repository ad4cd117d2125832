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
    if getattr(args, "nproc", 1) < 1:
        raise CliUsageError(f"export --nproc must be at least 1, got {args.nproc}")
    if args.format != "hf":
        used = [f for f, on in (("--dtype", args.dtype), ("--dry-run", args.dry_run)) if on]
        if used:
            raise CliUsageError(f"export {used[0]} applies to --format hf only")
    elif not args.max_shard_mb > 0:
        raise CliUsageError(f"export --max-shard-mb must be positive, got {args.max_shard_mb}")
    if args.format != "torch_dist":
        if flags:
            raise CliUsageError(f"export --format {args.format} runs no Megatron-LM: give no training flags after --")
        return
    if not flags:  # megatron-core's writer from the recorded global coordinates, on --nproc processes
        return
    try:  # Megatron-LM's own conversion (the fallback for checkpoints without global coordinates)
        locate_script(args.megatron_lm, args.script)
    except ValueError as e:
        raise CliUsageError(str(e)) from None


def run(args: argparse.Namespace, flags: list[str]) -> int:
    """``flags``: the training flags given after ``--`` (torch_dist through Megatron-LM only)."""
    _check_export(args, flags)
    from ..megatron.export.exporter import run_export

    return run_export(args)
