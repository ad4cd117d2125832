"""The full model of a lazy checkpoint as one safetensors file (``datastates-ckpt export --format safetensors``).

Any layout, without Megatron-LM and without the old world size: the global tensors are put together
from the recorded global coordinates (:mod:`.global_tensors`), read through the engine's verifying
reader, one sharded key at a time (memory: the largest global tensor), and written in the order the
header declares (:mod:`.safetensors_file`).  Names are those of a single-rank model's ``state_dict``
(:func:`.global_tensors.exported_names`): a tied output layer is the embedding's one tensor; the
vocabulary rows keep megatron-core's padding (the global shape the checkpoint records).  Model
weights only (the optimizer state is not part of this format).

Thread-safety: plain functions; they block the calling thread.
"""

from __future__ import annotations

import logging

import torch

from ...engine.format.manifest import read_manifest
from ...engine.load.reader import CheckpointReader
from ..checkpointing.reshard import layout_text
from .global_tensors import assemble, close_index, exported_names, global_blocks, open_index
from .safetensors_file import SafetensorsWriter

__all__ = ["write_consolidated"]

log = logging.getLogger(__name__)


def write_consolidated(path: str, iteration: int, f, *, verify: bool = True, threads: int = 4) -> int:
    """Write the model of checkpoint ``path`` (an ``iter_*`` directory) to the binary file ``f`` as
    safetensors; returns the number of tensors written."""
    manifest = read_manifest(path)
    with CheckpointReader(path, manifest, verify=verify, threads=threads) as reader:
        index = open_index(reader, ranged=False)  # every file is read anyway
        try:
            blocks = global_blocks(index, path)
            names = {key: exported_names(key, bl) for key, bl in blocks.items()}
            declared = []
            for key, bl in blocks.items():
                shape = bl[0].block.global_shape
                dtype = getattr(torch, bl[0].dtype)
                declared += [(name, shape[len(idx) :] if idx else shape, dtype) for name, idx in names[key]]
            meta = {"format": "pt", "iteration": iteration, "layout": layout_text(manifest.layout)}
            writer = SafetensorsWriter(f, declared, meta)
            for key, bl in blocks.items():
                full = assemble(reader, index, bl)
                for name, idx in names[key]:
                    writer.write(name, full[idx] if idx else full)
            writer.close()
        finally:
            close_index(index)
    log.info(
        "iteration %d of %s: %d tensors of %d global keys consolidated", iteration, path, len(declared), len(blocks)
    )
    return len(declared)
