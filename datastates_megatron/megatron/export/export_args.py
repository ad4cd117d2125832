"""The ``datastates-ckpt export`` command line (stdlib only, so that ``--help`` imports no torch)."""

from __future__ import annotations

import argparse
import os

__all__ = [
    "DEFAULT_NPROC",
    "DEFAULT_SCRIPT",
    "DEFAULT_SHARD_MB",
    "FORMATS",
    "HF_DTYPES",
    "add_export_arguments",
    "locate_script",
]

FORMATS = ("torch", "torch_dist", "safetensors", "hf")
HF_DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_SHARD_MB = 5120  # transformers' save_pretrained default (5 GB shards)
DEFAULT_NPROC = 2  # processes of the torch_dist export from global coordinates
DEFAULT_SCRIPT = "pretrain_gpt.py"


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``datastates-ckpt export`` arguments (the training flags after ``--`` are split off by the
    CLI before parsing: ``args.training_flags``)."""
    parser.add_argument(
        "ckpt_dir",
        help="checkpoint root (its latest committed iteration) or an iter_* directory; or an s3:// or msc:// URL of either",
    )
    parser.add_argument(
        "out_dir",
        help="output directory (torch: OUT_DIR/iter_N.pt; safetensors: OUT_DIR/iter_N.safetensors; "
        "torch_dist: OUT_DIR/iter_N/ + tracker; hf: OUT_DIR/iter_N-hf/, a Hugging Face model directory)",
    )
    parser.add_argument(
        "--format",
        dest="format",
        choices=FORMATS,
        default="torch_dist",
        help="torch_dist (default): Megatron-LM's own dist_checkpointing format of the model weights, any "
        "layout, written by megatron-core on --nproc processes (needs megatron-core, not Megatron-LM); with "
        "training flags after `--`, Megatron-LM's own conversion instead (model and optimizer; see below). "
        "safetensors: the full model as one consolidated safetensors file (a single-rank model's parameter "
        "names; any layout; needs neither). torch: one consolidated torch.save file of model and optimizer "
        "(TP=PP=1 checkpoints). hf: a Hugging Face model directory (config.json, sharded safetensors and their "
        "index) that transformers' AutoModelForCausalLM loads: the Llama setting (RoPE, RMSNorm, SwiGLU, GQA, no "
        "biases) as LlamaForCausalLM, the plain GPT setting (learned positions, LayerNorm, GeLU, biases) as "
        "GPT2LMHeadModel; any other architecture is refused naming the argument. safetensors, hf and torch_dist "
        "without flags need a checkpoint that records "
        "global coordinates (written since identity 3); older ones: the Megatron-LM path",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=DEFAULT_NPROC,
        help="torch_dist without training flags: this many gloo CPU processes share the checkpoint's "
        "tensors, whatever its world size (default: %(default)s)",
    )
    parser.add_argument(
        "--iteration", type=int, default=None, help="export this iteration instead of the latest committed"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip checksum verification of the data read")
    parser.add_argument(
        "--json", action="store_true", help='print {"path", "format", "iteration"} as JSON instead of the path'
    )
    h = parser.add_argument_group("hf")
    h.add_argument(
        "--dtype",
        choices=HF_DTYPES,
        default=None,
        help="the type of the tensors written (default: the training dtype, from the recorded --bf16/--fp16)",
    )
    h.add_argument(
        "--dry-run",
        action="store_true",
        help="print the name mapping (Megatron global tensor -> Hugging Face tensor, shape, shard) and the "
        "shards, and write nothing",
    )
    h.add_argument(
        "--max-shard-mb",
        type=float,
        default=DEFAULT_SHARD_MB,
        help="start a new model-*.safetensors shard before one would pass this many MiB (default: %(default)s)",
    )
    g = parser.add_argument_group(
        "torch_dist with training flags after `--` (Megatron-LM's own --lazy-ckpt-convert-to, run on CPU ranks)",
        "The fallback for a checkpoint without global coordinates (identity 2), and the way to export the\n"
        "optimizer state too. Runs SCRIPT of the Megatron-LM checkout with the training flags given after `--` (those of the run\n"
        "that wrote the checkpoint; on CPU its model needs --transformer-impl local) on as many gloo CPU\n"
        "ranks as the checkpoint's world size, with --load, --ckpt-step, --save (a scratch directory),\n"
        "--lazy-ckpt and --lazy-ckpt-convert-to set by the export.  No GPU is used.",
    )
    g.add_argument(
        "--megatron-lm",
        metavar="DIR",
        default=None,
        help="the Megatron-LM checkout (patched or not) to run (default: $MEGATRON_LM_DIR)",
    )
    g.add_argument(
        "--script",
        default=DEFAULT_SCRIPT,
        help="its training script that built the model, relative to DIR (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-s", type=float, default=600.0, help="kill the ranks after this many seconds (default: %(default)s)"
    )
    return parser


def locate_script(megatron_lm: str | None, script: str) -> str:
    """``script`` in the Megatron-LM checkout ``megatron_lm`` (else ``$MEGATRON_LM_DIR``), absolute;
    ``ValueError`` naming what is missing otherwise."""
    tree = megatron_lm or os.environ.get("MEGATRON_LM_DIR")
    if not tree:
        raise ValueError(
            "the torch_dist export runs Megatron-LM's own script: pass --megatron-lm DIR (a Megatron-LM "
            "checkout) or set MEGATRON_LM_DIR"
        )
    where = "--megatron-lm" if megatron_lm else "MEGATRON_LM_DIR="
    path = os.path.join(os.path.abspath(tree), script)
    if not os.path.isdir(os.path.join(tree, "megatron")):
        raise ValueError(f"{where}{' ' if megatron_lm else ''}{tree}: not a Megatron-LM checkout (no megatron/)")
    if not os.path.isfile(path):
        raise ValueError(f"{where}{' ' if megatron_lm else ''}{tree}: no training script {path}")
    return path
