"""The ``datastates-ckpt export`` command line (stdlib only, so that ``--help`` imports no torch)."""

from __future__ import annotations

import argparse

__all__ = ["FORMATS", "MODEL_KEYS", "add_export_arguments"]

FORMATS = ("torch", "torch_dist")
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "bf16")


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``datastates-ckpt export`` arguments."""
    parser.add_argument("ckpt_dir", help="checkpoint root (its latest committed iteration) or an iter_* directory")
    parser.add_argument(
        "out_dir", help="output directory (torch: OUT_DIR/iter_N.pt; torch_dist: OUT_DIR/iter_N/ + tracker)"
    )
    parser.add_argument(
        "--format",
        dest="format",
        choices=FORMATS,
        default="torch_dist",
        help="torch: one consolidated torch.save file; torch_dist: megatron-core dist_checkpointing (default)",
    )
    parser.add_argument(
        "--iteration", type=int, default=None, help="export this iteration instead of the latest committed"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="kill the torch_dist rebuild/save subprocess after this"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip checksum verification of the data read")
    parser.add_argument(
        "--json", action="store_true", help='print {"path", "format", "iteration"} as JSON instead of the path'
    )
    g = parser.add_argument_group("model (torch_dist; default: the description stored in the checkpoint)")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help="max sequence length (position embeddings)")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--bf16", action="store_true", default=None, help="the model was trained in bf16")
    return parser
