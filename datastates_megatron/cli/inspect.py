"""``datastates-ckpt inspect CKPT_DIR``: what one checkpoint holds -- its manifest and, per rank,
its file, tensors by dtype and stored objects.  Reads indexes only (``verify`` checks the bytes)."""

from __future__ import annotations

import argparse
import json
import os
import time

from typing import TYPE_CHECKING

from ..engine.errors import CheckpointError, FormatVersionError
from .common import JSON_SCHEMA, age, emit, exit_for, human, strip_path, when
from .reading import load_manifest, select_ranks

if TYPE_CHECKING:
    from ..engine.format.file_format import RankFile

__all__ = ["inspect_checkpoint", "run"]

_SUMMARY_KEYS = ("tensor_count", "tensor_bytes", "chunk_bytes", "dtypes", "objects", "tensor_meta_count", "tensors")


def _describe(value) -> str:
    """Short type summary of a stored object (for inspect's objects column)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} = {value!r}"
    if isinstance(value, str):
        return f"str = {value!r}" if len(value) <= 40 else f"str ({len(value)} chars)"
    if isinstance(value, bytes):
        return f"bytes ({len(value)})"
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {list(value.shape)}"
    if isinstance(value, argparse.Namespace):
        return f"Namespace ({len(vars(value))} fields)"
    if isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__} ({len(value)})"
    return type(value).__name__


def _objects_summary(objects) -> dict[str, str]:
    stored = objects.get("objects") if isinstance(objects, dict) else None
    if isinstance(stored, dict):
        return {str(k): _describe(v) for k, v in stored.items()}
    return {} if stored is None else {"<value>": _describe(stored)}


def _rank_summary(rf: RankFile, list_tensors: bool) -> dict:
    dtypes: dict[str, dict] = {}
    tensors = []
    for e in rf.entries.values():
        name = str(e.dtype).removeprefix("torch.")
        d = dtypes.setdefault(name, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += e.nbytes
        if list_tensors:
            tensors.append(
                {"name": e.name, "dtype": name, "shape": list(e.shape), "bytes": e.nbytes, "chunks": len(e.checksums)}
            )
    meta = rf.objects.get("tensor_meta") if isinstance(rf.objects, dict) else None
    return {
        "tensor_count": len(rf.entries),
        "tensor_bytes": sum(e.nbytes for e in rf.entries.values()),
        "chunk_bytes": rf.header.chunk_bytes,
        "dtypes": dtypes,
        "objects": _objects_summary(rf.objects),
        "tensor_meta_count": len(meta) if isinstance(meta, dict) else 0,
        "tensors": tensors if list_tensors else None,
    }


def inspect_checkpoint(ckpt: str, rank: int | None = None, list_tensors: bool = False) -> dict:
    """Manifest and per-rank contents of one checkpoint directory; the ``inspect --json`` document."""
    from ..engine.load.reader import open_rank

    ckpt = os.path.abspath(ckpt)
    m = load_manifest(ckpt)
    ranks = []
    for rec in select_ranks(ckpt, m, rank):
        row = {
            "rank": rec.rank,
            "file": rec.file,
            "file_bytes": rec.file_bytes,
            "data_bytes": rec.data_bytes,
            "n_tensors": rec.n_tensors,
            "error": None,
        }
        try:
            rf = open_rank(ckpt, m, rec.rank)
        except (CheckpointError, OSError) as e:
            row["error"] = strip_path(str(e), os.path.join(ckpt, rec.file))
            row["newer"] = isinstance(e, FormatVersionError)  # a newer version's file: not damage
            row.update(dict.fromkeys(_SUMMARY_KEYS))
        else:
            try:
                row.update(_rank_summary(rf, list_tensors))
            finally:
                rf.close()
        ranks.append(row)
    return {
        "schema": JSON_SCHEMA,
        "command": "inspect",
        "checkpoint": ckpt,
        "manifest": {
            "iteration": m.iteration,
            "world_size": m.world_size,
            "run_token": m.run_token,
            "commit_seq": m.commit_seq,
            "created": m.created,
            "tier": m.tier,
            "total_bytes": m.total_bytes,
            "layout": m.layout,
            "metadata": m.metadata,
        },
        "ranks": ranks,
    }


def _render_inspect(doc: dict) -> None:
    m = doc["manifest"]
    print(f"checkpoint: {doc['checkpoint']}")
    print(
        f"iteration {m['iteration']}  world size {m['world_size']}  tier {m['tier']}  commit_seq {m['commit_seq']}  "
        f"run token {m['run_token']}"
    )
    print(
        f"created {when(m['created'])} ({age(time.time() - m['created'])} ago)  tensor bytes {human(m['total_bytes'])}"
    )
    print(f"layout:   {json.dumps(m['layout'], sort_keys=True)}")
    print(f"metadata: {json.dumps(m['metadata'], sort_keys=True, default=str)}")
    for r in doc["ranks"]:
        print(f"\nrank {r['rank']}: {r['file']}  {human(r['file_bytes'])} on disk, {r['n_tensors']} tensors")
        if r["error"]:
            print(f"  {'NEWER FORMAT' if r.get('newer') else 'DAMAGED'}: {r['error']}")
            continue
        print(
            f"  tensors: {r['tensor_count']}, {human(r['tensor_bytes'])} ({r['tensor_bytes']} B), "
            f"checksum chunk {human(r['chunk_bytes'])}"
        )
        for name, d in sorted(r["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"    {name:<14} {d['count']:>7}  {human(d['bytes']):>10}")
        if r["objects"]:
            print(f"  objects ({len(r['objects'])} keys):")
            width = max(len(k) for k in r["objects"])
            for key, desc in r["objects"].items():
                print(f"    {key:<{width}}  {desc}")
        else:
            print("  objects: none")
        if r["tensor_meta_count"]:
            print(f"  tensor metadata: {r['tensor_meta_count']} entries")
        if r["tensors"] is not None:
            width = max((len(t["name"]) for t in r["tensors"]), default=4)
            print(f"  {'NAME':<{width}}  {'DTYPE':<14} {'SHAPE':<20} {'BYTES':>10}  CHUNKS")
            for t in r["tensors"]:
                shape = "[" + ", ".join(map(str, t["shape"])) + "]"
                print(f"  {t['name']:<{width}}  {t['dtype']:<14} {shape:<20} {t['bytes']:>10}  {t['chunks']}")


def run(args: argparse.Namespace) -> int:
    doc = inspect_checkpoint(args.ckpt_dir, args.rank, args.tensors)
    emit(doc) if args.json else _render_inspect(doc)
    return exit_for([r.get("newer") for r in doc["ranks"] if r["error"]])
