"""The ``datastates-ckpt`` command line: the top-level parser and one part per command.  Its
``--help`` is the reference.  Building it imports nothing heavy (no torch, numpy or numba): the
modules that read checkpoints are imported by the commands that run."""

from __future__ import annotations

import argparse

from .._version import __version__
from ..engine.names import TRACKER_NAME
from .common import EXIT_DAMAGED, EXIT_NEWER, EXIT_OK, EXIT_USAGE, PROG

__all__ = ["build_parser"]

_EXAMPLES = """\
examples:
  datastates-ckpt ls /ckpt/gpt                       what is there, which one loads next
  datastates-ckpt inspect /ckpt/gpt/iter_0000100 --rank 0 --tensors
  datastates-ckpt verify /ckpt/gpt/iter_0000100 && echo clean
  datastates-ckpt ls /ckpt/gpt --json | jq '.latest'  every subcommand takes --json (stable keys)

"""
_EPILOG = f"""\
exit status: {EXIT_OK} success (verify: every check passed); {EXIT_DAMAGED} a checkpoint is damaged
(verify found a problem, or a manifest does not parse; ls: a row is DAMAGED); {EXIT_USAGE} bad arguments
or the path is not there / not a checkpoint, or a dependency the command needs is missing (a runtime
one: exit 1, before any command runs); {EXIT_NEWER} a checkpoint was written by a newer
datastates-megatron, in a format this version cannot read (ls: a row is NEWER FORMAT and none is
DAMAGED): upgrade.  Errors are one line on stderr.

layout: SAVE_DIR/iter_0000100/manifest.json (the commit point) + one rNNNNN-<token>-<seq>.dsck per
rank; SAVE_DIR/{TRACKER_NAME} names the latest iteration for Megatron.

object storage (s3://, msc://): credentials and endpoint from the AWS environment; each request
gives up after DSM_S3_DEADLINE_S (default 30) seconds with its retries, a try after
DSM_S3_CONNECT_TIMEOUT_S (5) to connect and DSM_S3_READ_TIMEOUT_S (10) for an answer.
"""


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=fmt,
        epilog=_EXAMPLES + _EPILOG,
        description=(
            "List, inspect and verify datastates-megatron checkpoints (read-only), export one to another\n"
            "format (writes only under OUT_DIR), patch a Megatron-LM checkout, and say where the installed\n"
            "launch scripts and presets are."
        ),
    )
    p.add_argument("--version", action="version", version=f"{PROG} (datastates-megatron) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_ls, _add_inspect, _add_verify, _add_export, _add_where, _add_patch):
        add(sub, fmt)
    return p


def _add_ls(sub, fmt) -> None:
    """``ls SAVE_DIR``: the checkpoints of a save directory."""
    ls = sub.add_parser(
        "ls",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="list the checkpoints of a save directory",
        description=(
            "List every iter_* directory of SAVE_DIR, committed or not.\n\n"
            "STATE: committed (its manifest.json parses: loadable), uncommitted (no manifest: an interrupted\n"
            "or in-progress save; never loaded, removed at the next start), DAMAGED (a manifest exists but\n"
            "does not parse; the reason is printed under the row, and the loader refuses to pick a latest\n"
            "checkpoint until it is repaired or removed), NEWER FORMAT (written by a newer datastates-megatron\n"
            "in a format this version cannot read; the row says which version: upgrade to load it; while it\n"
            "is newer than every committed checkpoint, the loader refuses to pick a latest one as for\n"
            "DAMAGED; never removed), foreign (FORMAT) (not written by datastates-megatron:\n"
            "Megatron-LM's own checkpoint, FORMAT torch_dist or torch, or other files, FORMAT unknown; never\n"
            "loaded, never removed; a run refuses to start over one newer than its latest checkpoint).\n"
            "TIER: the manifest's storage tier ('persistent' unless the checkpoint says otherwise).\n"
            "WORLD: ranks that wrote it.  SIZE: bytes of every file in the directory (including leftovers).\n"
            "AGE: since the manifest was written (uncommitted: since its newest file changed).\n"
            "'<- latest' marks the checkpoint CheckpointManager.load() picks by default (the newest commit,\n"
            f"not the highest iteration); the last lines show it and what {TRACKER_NAME} says.\n"
            "Cheap: reads manifests and stats files, never rank-file contents."
        ),
    )
    ls.add_argument(
        "save_dir",
        metavar="SAVE_DIR",
        help="the directory holding iter_* checkpoint directories, or an s3://bucket/prefix or msc://profile/path",
    )
    ls.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, save_dir, checkpoints[], latest, latest_error, "
        "tracker, tracker_text, tracker_agrees); a checkpoint's state is committed, uncommitted, "
        "damaged, unreadable (permission denied), newer (a newer format) or foreign, its format (foreign only; else null) torch_dist, torch or unknown, "
        "its iteration null for Megatron's release directory",
    )


def _add_checkpoint_args(cmd, fetched: str) -> None:
    """The arguments ``inspect`` and ``verify`` share: the checkpoint (a directory or its URL, whose
    rank objects are fetched, then ``fetched``) and ``--rank``."""
    cmd.add_argument(
        "ckpt_dir",
        metavar="CKPT_DIR",
        help="one checkpoint directory, e.g. SAVE_DIR/iter_0000100, or its URL (s3://bucket/prefix/iter_0000100: its "
        f"rank objects are fetched into a temporary directory under TMPDIR{fetched})",
    )
    cmd.add_argument("--rank", type=int, metavar="N", help="only rank N (default: every rank)")


def _add_inspect(sub, fmt) -> None:
    """``inspect CKPT_DIR``: what one checkpoint holds."""
    ins = sub.add_parser(
        "inspect",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="show what one checkpoint holds",
        description=(
            "Show one checkpoint: manifest (iteration, world size, tier, run token, commit sequence, creation\n"
            "time, layout, metadata) and per rank: file and bytes, tensor count and bytes by dtype, and the\n"
            "stored non-tensor objects (top-level keys with a short type summary).  A rank file that cannot\n"
            "be opened, or is not the one the manifest committed, is shown as DAMAGED (exit 1).\n"
            "Reads indexes only; use `verify` to check the tensor bytes."
        ),
    )
    _add_checkpoint_args(ins, fetched="")
    ins.add_argument(
        "--tensors", action="store_true", help="list every tensor (name, dtype, shape, bytes, checksum chunks)"
    )
    ins.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, checkpoint, manifest{}, ranks[]; a rank's "
        "'tensors' is null without --tensors, its 'error' is null unless it is damaged)",
    )


def _add_verify(sub, fmt) -> None:
    """``verify CKPT_DIR``: every checksum re-checked."""
    ver = sub.add_parser(
        "verify",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="re-check every checksum of a checkpoint",
        description=(
            "Re-check a checkpoint end to end: for each rank, that its file exists with the size, header\n"
            "checksum, index checksum, tag and iteration the manifest committed, that tensor count and bytes\n"
            "match, then every per-chunk XXH64 of every tensor (in parallel: the kernel releases the GIL).\n"
            "Prints one ERROR line per bad tensor (or per unusable file) naming rank, file and tensor, then a\n"
            "summary; exit 0 when clean, 1 otherwise.  Progress goes to stderr: a bar on a terminal, else\n"
            "a line every --progress-every seconds (bytes, GB/s, ETA: for Slurm logs).  Alignment padding\n"
            "between tensors is not covered by checksums (it holds no data)."
        ),
    )
    _add_checkpoint_args(ver, fetched=" and checked there")
    ver.add_argument("--threads", type=int, metavar="N", help="hashing threads (default: min(8, CPUs))")
    ver.add_argument("-q", "--quiet", action="store_true", help="no progress")
    ver.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between progress lines when stderr is not a terminal (default: 30)",
    )
    ver.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, command, checkpoint, iteration, world_size, ok, "
        "ranks_checked, tensors_checked, bytes_checked, seconds, threads, errors[{rank, file, "
        "tensor, chunks, kind, message}], unreferenced_files); kind is one of missing, size, file, "
        "manifest, checksum",
    )


def _add_export(sub, fmt) -> None:
    """``export CKPT_DIR OUT_DIR``: another format (its arguments: :mod:`..megatron.export.export_args`)."""
    exp = sub.add_parser(
        "export",
        usage="%(prog)s [options] CKPT_DIR OUT_DIR [-- TRAINING_FLAGS...]",
        formatter_class=fmt,
        epilog=_EPILOG,
        help="write a checkpoint in another format",
        description=(
            "Convert a committed checkpoint, any layout, on a few CPU processes, without Megatron-LM:\n"
            "--format torch_dist (default) writes Megatron-LM's own dist_checkpointing checkpoint of the\n"
            "model weights with megatron-core's writer on --nproc processes, whatever the checkpoint's\n"
            "world size (megatron-core loads it at any TP/PP/DP); --format safetensors writes the full\n"
            "model as one safetensors file.  Both read the global coordinates recorded since identity 3.\n"
            "For an older checkpoint, or to export the optimizer state, give the training flags after\n"
            "`--`: torch_dist then runs Megatron-LM itself with --lazy-ckpt-convert-to on as many CPU\n"
            "ranks as the checkpoint has.  --format torch writes one consolidated torch.save file (full\n"
            "parameters, per-parameter optimizer state, non-tensor state; TP=PP=1 checkpoints).  Every\n"
            "byte read is checksum-verified unless --no-verify.  Prints the path written.\n\n"
            "  datastates-ckpt export SAVE_DIR OUT_DIR --nproc 2\n"
            "  datastates-ckpt export SAVE_DIR OUT_DIR --format safetensors\n"
            "  datastates-ckpt export SAVE_DIR OUT_DIR --megatron-lm ~/Megatron-LM -- \\\n"
            "      --num-layers 2 --hidden-size 64 ... --transformer-impl local --tensor-model-parallel-size 2"
        ),
    )
    from ..megatron.export.export_args import add_export_arguments

    add_export_arguments(exp)


def _add_where(sub, fmt) -> None:
    """``where [NAME]``: the installed package's data directories."""
    where = sub.add_parser(
        "where",
        formatter_class=fmt,
        help="print where the launch scripts, presets and patches are installed",
        description=(
            "Print where the installed package keeps its data: the Slurm launch scripts (launch), their\n"
            "model presets (configs) and the Megatron-LM patches, one NAME PATH per line; with NAME, only\n"
            "that path (for scripts):\n\n"
            '  sbatch --nodes=1 "$(datastates-ckpt where launch)/gpu_multinode.sbatch"\n'
            '  cp -r "$(datastates-ckpt where configs)" my-presets'
        ),
    )
    where.add_argument("name", nargs="?", metavar="NAME", help="one of them (launch, configs, patches, package)")
    where.add_argument("--json", action="store_true", help="print one JSON object {NAME: PATH}")


def _add_patch(sub, fmt) -> None:
    """``patch MEGATRON_DIR``: the source patch, applied from the installed package (not read-only)."""
    from ..megatron.megatron_lm import patching, versions

    pat = sub.add_parser(
        "patch",
        formatter_class=fmt,
        help="apply the --lazy-ckpt patch to a Megatron-LM tree",
        description=(
            "Apply (or --check, or --revert) the --lazy-ckpt source patch to a Megatron-LM checkout or copy:\n"
            "the patch for the version in MEGATRON_DIR/megatron/core/package_info.py, shipped in this package.\n"
            f"Tested versions: {versions.tested_names()}.\n"
            "Idempotent: applying twice or reverting an unpatched tree says so and does nothing.  Only the\n"
            "work tree changes (git apply; nothing is staged).  Exit status: 0 done or nothing to do, 1 the\n"
            "patch does not apply (git's reasons are printed), 2 usage error, not a Megatron-LM tree, or an\n"
            "untested version."
        ),
    )
    patching.add_arguments(pat)
