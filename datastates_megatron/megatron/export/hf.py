"""A lazy checkpoint as a Hugging Face model directory (``datastates-ckpt export --format hf``).

``OUT/iter_NNNNNNN-hf/`` holds ``config.json``, ``generation_config.json``,
``model-0000N-of-0000M.safetensors`` and ``model.safetensors.index.json``: what
``transformers.AutoModelForCausalLM.from_pretrained`` loads.  The architecture and its config come
from the training arguments the checkpoint records (:mod:`.hf_config`), the tensors from the
recorded global coordinates through the one name table (:mod:`.hf_tensors`): any TP/PP/VPP/DP
layout, on one process, without Megatron-LM or a model build.

Streamed: the plan (every output name, shape and shard) is made before any byte is read; then one
layer of one global tensor at a time is read through the verifying reader
(:func:`.global_tensors.assemble_at`), cut into its outputs, cast and appended to the open shard.
Memory: the largest layer tensor and its cut copies, whatever the model's size.  The directory is
staged in ``OUT/.export-hf-*`` (ours, ``mkdtemp``), every file fsynced, then renamed whole to its
name; an existing one is never overwritten.

Thread-safety: plain functions; they block the calling thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile

import torch

from ..._output import write_line
from ...engine.errors import CheckpointError, FlushError
from ...engine.format.manifest import read_manifest
from ...engine.fs.durable import fsync_dir
from ...engine.fs.safe_io import create_temp
from ...engine.load.reader import CheckpointReader
from .global_tensors import assemble_at, close_index, global_blocks, open_index
from .hf_config import DTYPES, HfModel, hf_model, training_dtype
from .hf_tensors import Rule, hf_rules
from .safetensors_file import SafetensorsWriter

__all__ = ["DEFAULT_SHARD_BYTES", "HfPlan", "export_hf", "hf_dir", "plan_hf", "recorded_args"]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default (5 GB shards)
INDEX = "model.safetensors.index.json"


def hf_dir(out_dir: str, iteration: int) -> str:
    """The model directory an export of ``iteration`` writes under ``out_dir``."""
    return os.path.join(os.path.abspath(out_dir), f"iter_{iteration:07d}-hf")


@dataclasses.dataclass(frozen=True)
class HfPlan:
    """What the export writes: the model, the rules in write order, and each output's shard."""

    model: HfModel
    dtype: torch.dtype
    rules: tuple[Rule, ...]
    shard_of: dict  # output name -> shard number (0-based)
    shards: int

    def file(self, shard: int) -> str:
        return f"model-{shard + 1:05d}-of-{self.shards:05d}.safetensors"

    def outputs(self):
        """``(rule, name, shape)`` in write order."""
        for rule in self.rules:
            for name, shape in zip(rule.names, rule.shapes):
                yield rule, name, shape

    def nbytes(self, shape) -> int:
        return torch.Size(shape).numel() * self.dtype.itemsize


def recorded_args(reader: CheckpointReader) -> dict:
    """The Megatron-LM arguments rank 0 recorded (``{}`` when there are none)."""
    objects = reader.objects(0)
    extra = objects.get("extra_state") if isinstance(objects, dict) else None
    meg = extra.get("megatron_lm") if isinstance(extra, dict) else None
    args = meg.get("args") if isinstance(meg, dict) else None
    return args if isinstance(args, dict) else {}


def plan_hf(path: str, reader: CheckpointReader, index, dtype: str | None, shard_bytes: int) -> HfPlan:
    """The plan of checkpoint ``path`` (an ``iter_*`` directory) read by ``reader`` through ``index``."""
    args = recorded_args(reader)
    out_dtype = DTYPES[dtype] if dtype else training_dtype(args)
    model = hf_model(args, path, out_dtype)
    rules = hf_rules(model, global_blocks(index, path), path)
    plan = HfPlan(model, out_dtype, tuple(rules), {}, 0)
    shard, used = 0, 0
    for _, name, shape in plan.outputs():  # in write order, a new shard when the next would overflow
        size = plan.nbytes(shape)
        if used and used + size > shard_bytes:
            shard, used = shard + 1, 0
        plan.shard_of[name] = shard
        used += size
    return dataclasses.replace(plan, shards=shard + 1)


def _print_plan(plan: HfPlan, target: str) -> None:
    write_line(f"{plan.model.config['architectures'][0]} -> {target} ({str(plan.dtype).removeprefix('torch.')})")
    for rule, name, shape in plan.outputs():
        src = " + ".join(s.key if not s.at else f"{s.key}[{','.join(map(str, s.at))}]" for s in rule.sources)
        write_line(f"  {src} -> {name} {list(shape)} {plan.file(plan.shard_of[name])}")
    sizes = [0] * plan.shards
    for _, name, shape in plan.outputs():
        sizes[plan.shard_of[name]] += plan.nbytes(shape)
    for shard, size in enumerate(sizes):
        write_line(f"  {plan.file(shard)}: {size} bytes")
    write_line(f"  {INDEX}, config.json, generation_config.json")


def _write_file(path: str, write) -> None:
    """A new file of ours (``O_EXCL | O_NOFOLLOW``) written by ``write(f)`` and fsynced."""
    with os.fdopen(create_temp(path), "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: str, doc: dict) -> None:
    _write_file(path, lambda f: f.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()))


def _write_model(plan: HfPlan, reader: CheckpointReader, index, blocks, staging: str, meta: dict) -> None:
    """The shards, in plan order: each rule's sources read (one layer each), cut, cast and appended
    to the open shard, which is fsynced and closed before the next is created."""
    outputs = list(plan.outputs())
    declared: list[list] = [[] for _ in range(plan.shards)]
    for _, name, shape in outputs:
        declared[plan.shard_of[name]].append((name, shape, plan.dtype))
    shard, f, writer = -1, None, None
    files: dict = {}  # the metadata of the rank files read, built once per set of ranks
    try:
        for rule in plan.rules:
            values = [assemble_at(reader, index, blocks[s.key], s.at, files) for s in rule.sources]
            for name, t in zip(rule.names, rule.cut(*values)):
                if plan.shard_of[name] != shard:  # the next shard: close this one, open it
                    if writer is not None:
                        writer.close()
                        f.flush()
                        os.fsync(f.fileno())
                        f.close()
                    shard = plan.shard_of[name]
                    f = os.fdopen(create_temp(os.path.join(staging, plan.file(shard))), "wb")
                    writer = SafetensorsWriter(f, declared[shard], meta)
                    log.info("writing %s", plan.file(shard))
                writer.write(name, t.to(plan.dtype).contiguous())
            del values
        writer.close()
        f.flush()
        os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()


def export_hf(
    path: str,
    iteration: int,
    out_dir: str,
    *,
    dtype: str | None = None,
    dry_run: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    verify: bool = True,
    threads: int = 4,
) -> str:
    """Export checkpoint ``path`` (an ``iter_*`` directory of ``iteration``) as a Hugging Face model
    directory under ``out_dir`` (``dtype``: ``fp32``, ``bf16`` or ``fp16``, default the training
    dtype); returns its path.  ``dry_run``: print the name mapping and the shards, write nothing.
    An existing model directory raises ``FileExistsError`` (the exporter's ``OutputExistsError``)."""
    target = hf_dir(out_dir, iteration)
    if not dry_run and os.path.lexists(target):
        raise FileExistsError(f"{target} exists; nothing was overwritten")
    manifest = read_manifest(path)
    with CheckpointReader(path, manifest, verify=verify, threads=threads) as reader:
        index = open_index(reader)
        try:
            plan = plan_hf(path, reader, index, dtype, shard_bytes)
            if dry_run:
                _print_plan(plan, target)
                return target
            blocks = global_blocks(index, path)
            os.makedirs(out_dir, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=f".export-hf-{iteration}-", dir=out_dir)
            try:
                os.chmod(staging, 0o755)  # a model directory others may read (mkdtemp makes it 0700)
                meta = {"format": "pt", "iteration": iteration}
                _write_model(plan, reader, index, blocks, staging, meta)
                total = sum(plan.nbytes(shape) for _, _, shape in plan.outputs())
                weight_map = {name: plan.file(shard) for name, shard in plan.shard_of.items()}
                _write_json(os.path.join(staging, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
                _write_json(os.path.join(staging, "config.json"), plan.model.config)
                _write_json(os.path.join(staging, "generation_config.json"), {"_from_model_config": True})
                fsync_dir(staging)
                if os.path.lexists(target):
                    raise FileExistsError(f"{target} exists; nothing was overwritten")
                os.rename(staging, target)  # the directory appears whole, or not at all
                fsync_dir(os.path.dirname(target))
            except (CheckpointError, FileExistsError):
                raise
            except OSError as e:
                raise FlushError(f"{target}: cannot write the export: {e}") from e
            finally:
                if os.path.isdir(staging):
                    shutil.rmtree(staging, ignore_errors=True)  # ours (mkdtemp); rmtree follows no link
        finally:
            close_index(index)
    log.info(
        "iteration %d of %s: %d tensors in %d shards to %s", iteration, path, len(plan.shard_of), plan.shards, target
    )
    return target
