"""Crafting a checkpoint's global coordinates (the block a rank file records for a parameter) as a
crafter with our format spec could: the rank file and its manifest record resealed, the global index
rebuilt from every rank file's metadata as the commit builds it -- so only the load's own checks can
refuse it (what tests/faults/test_reshard_blocks.py plants)."""

from __future__ import annotations

import json
import os

import torch

from datastates_megatron.engine.format import global_index
from datastates_megatron.engine.format.file_format import RankFile
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.format.tagged_json import encode_objects
from datastates_megatron.megatron.checkpointing.reshard import index_summary
from tests.faults.damage import rebuild_rank_file


def _blocks_of(meta: dict, param: str) -> list:
    """Every record of ``param``'s block in one tensor's metadata (a param shard's ``global`` is by
    parameter name; an optimizer state's or main param's is its own parameter's)."""
    g = meta.get("global")
    if isinstance(g, dict):
        return [g[param]] if param in g else []
    return [g] if g is not None and meta.get("param") == param else []


def craft_block(ckpt: str, rank: int, param: str, offset: list, shape: list) -> int:
    """Make rank ``rank``'s file record ``param``'s block at ``offset`` with ``shape`` (every tensor's
    record of it); returns how many records changed."""
    manifest = read_manifest(ckpt)
    path = os.path.join(ckpt, manifest.record(rank).file)
    with RankFile(path) as rf:
        objects = dict(rf.objects)
    changed = 0
    for meta in objects["tensor_meta"].values():
        for block in _blocks_of(meta, param):
            block[2], block[3] = list(offset), list(shape)
            changed += 1
    rebuild_rank_file(path, objects_json=encode_objects(objects), rank=rank)
    rebuild_index(ckpt)
    return changed


def rebuild_index(ckpt: str) -> None:
    """The global index of ``ckpt`` from its rank files' metadata, as the commit writes it."""
    manifest = read_manifest(ckpt)
    docs = []
    for rank in range(manifest.world_size):
        with RankFile(os.path.join(ckpt, manifest.record(rank).file)) as rf:
            tensors = {name: torch.empty(e.shape, device="meta") for name, e in rf.entries.items()}
            docs.append(index_summary(tensors, rf.objects["tensor_meta"]))
    body = global_index._build(docs)
    assert body is not None, json.dumps([d["params"] for d in docs])[:400]
    global_index.write_index(os.path.dirname(ckpt), manifest, body)
