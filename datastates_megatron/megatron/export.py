"""Export a lazy checkpoint: one consolidated ``torch`` file, or a megatron-core ``torch_dist`` checkpoint.

``export(ckpt, out, "torch")`` needs no megatron: it reads every rank file through the global
identity metadata (:class:`.reshard.CheckpointIndex`) and writes ``out/iter_NNNNNNN.pt``, a
``torch.save`` of::

    {<param name>: full tensor, ...,                     # chunk c > 0: "model<c>.<name>"
     "optimizer": {<param name>: {"main", "exp_avg", "exp_avg_sq", "step"}},
     "iteration", "training" (old rank 0's non-tensor state), "extra_state", "model", "layout"}

(``main`` is the fp32 master copy: for an fp32 model it is the parameter itself.)

``export(ckpt, out, "torch_dist")`` writes ``out/iter_NNNNNNN/`` (a megatron-core ``dist_checkpointing``
checkpoint) and ``out/latest_checkpointed_iteration.txt``.  It runs one subprocess (1 rank, gloo,
CPU — no GPU needed) that rebuilds the model (:func:`.model_rebuild.rebuild`),
loads the lazy checkpoint into it through the DP-reshard path (DP=N -> 1), and calls megatron-core's
own ``dist_checkpointing.save`` on ``{"model": ddp.module.sharded_state_dict(metadata=M),
"optimizer": optimizer.sharded_state_dict(model_sd, metadata=M)}`` plus ``iteration``,
``checkpoint_version``, ``opt_param_scheduler`` and ``num_floating_point_operations_so_far`` as
common state, with ``content_metadata=M`` = :data:`CONTENT_METADATA` (optimizer format
``fully_reshardable``: megatron-core loads it at any TP/PP/DP).  Load it as Megatron-LM does:
``M = dist_checkpointing.load_content_metadata(dir)`` passed to both ``sharded_state_dict`` calls
(``is_loading=True`` for the optimizer), ``dist_checkpointing.load``, then ``load_state_dict``.
(megatron-core 0.16.1 with torch Adam — no TE/Apex — fails in ``_set_main_param_and_optimizer_states``
with ``KeyError: 'step'`` on this format: pop the per-param ``step`` around
``load_parameter_state_from_fully_reshardable``, as ``tests/integration/reshard_worker.py`` does.)
The model shape comes from the ``model`` description every lazy checkpoint stores
(:func:`.shards.model_description`); command-line flags override it (for checkpoints written before it was
stored).  It needs megatron-core and psutil (megatron-core's writer), checked before anything starts.
The subprocess (:mod:`.worker_process`) ends as soon as it or one of its child processes fails; at
``timeout_s`` or on SIGTERM its whole process group is killed and the staging directory removed; the
output directory appears whole (staged, then renamed) or not at all.  RNG states are not exported.

Limitations: both formats need a checkpoint written with TP=PP=1 (any DP) and without
expert-parallel buffers; ``torch_dist`` only rebuilds the GPT of :mod:`.model_rebuild` (local layer spec, learned
absolute positions, tied embeddings, ``ffn_hidden_size = 4 * hidden``): a checkpoint of another
architecture is refused with the list of parameters that differ.

Thread-safety: plain functions; ``export`` blocks the calling thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile

import torch

from .._deps import require

from ..engine.errors import CheckpointError, FlushError, LayoutMismatchError, NoCheckpointError
from ..engine.manifest import MANIFEST_NAME, iter_dir, read_manifest, write_tracker
from ..engine.tier import latest_committed
from ..engine.load_plan import LoadPlan, ReadItem
from ..engine.reader import CheckpointReader
from ..engine.safe_io import create_temp
from .export_args import FORMATS, MODEL_KEYS as _MODEL_KEYS, add_export_arguments
from .worker_process import run_worker, sigterm_raises, watch_children

__all__ = [
    "FORMATS",
    "CONTENT_METADATA",
    "ExportError",
    "OutputExistsError",
    "consolidate",
    "export",
    "add_export_arguments",
    "run_export",
]

log = logging.getLogger(__name__)

# as Megatron-LM's _build_sharded_state_dict_metadata, with the optimizer format that megatron-core can
# load at any TP/PP/DP ("fully_sharded_model_space" raises on flattened ranges in 0.16.1)
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


class ExportError(CheckpointError, RuntimeError):
    """The export could not be completed (the rebuild/save subprocess failed or timed out)."""


class OutputExistsError(CheckpointError, FileExistsError):
    """The export's output is already there; nothing is overwritten."""


# ---------------------------------------------------------------------------------------------- locate
def _locate(ckpt_dir: str, iteration: int | None) -> tuple[str, int]:
    """``(iteration directory, iteration)`` for a checkpoint root (latest committed, or ``iteration``)
    or an ``iter_*`` directory itself."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    if os.path.isfile(os.path.join(ckpt_dir, MANIFEST_NAME)):
        m = read_manifest(ckpt_dir)
        if iteration is not None and iteration != m.iteration:
            raise NoCheckpointError(f"{ckpt_dir} holds iteration {m.iteration}, not {iteration}")
        return ckpt_dir, m.iteration
    if not os.path.isdir(ckpt_dir):
        raise NoCheckpointError(f"{ckpt_dir}: no such directory")
    it = latest_committed(ckpt_dir) if iteration is None else int(iteration)
    return iter_dir(ckpt_dir, it), it


# ---------------------------------------------------------------------------------------------- torch
def consolidate(ckpt_dir: str, iteration: int | None = None, *, verify: bool = True, threads: int = 4) -> dict:
    """The whole checkpoint as one state dict of full tensors (format: module docstring).  Reads
    every rank file once; needs memory for the whole model and optimizer state."""
    from .reshard import CheckpointIndex

    path, it = _locate(ckpt_dir, iteration)
    manifest = read_manifest(path)
    if any(manifest.layout.get(k, 1) != 1 for k in ("tp", "pp", "cp", "ep")):
        raise LayoutMismatchError(
            f"{path}: export needs a checkpoint written with TP=PP=CP=EP=1; layout is {manifest.layout}"
        )
    with CheckpointReader(path, manifest, verify=verify, threads=threads) as reader:
        index = CheckpointIndex.from_reader(reader)
        plan = []
        out: dict = {}
        optimizer: dict = {}
        whats: dict = {}
        for c, name, what in index.pieces:
            whats.setdefault((c, name), set()).add(what)
        for c, name, what in index.scalars:
            whats.setdefault((c, name), set()).add(what)
        for (c, name), (shape, dtype) in sorted(index.params.items()):
            key = name if c == 0 else f"model{c}.{name}"
            numel = math.prod(shape)
            out[key] = torch.empty(shape, dtype=getattr(torch, dtype))
            plan += [(r, out[key].view(-1)[at : at + r.count]) for r, at in index.ranges((c, name, "param"), 0, numel)]
            states = {}
            for what in sorted(whats.get((c, name), ()) - {"param"}):
                scalar = index.scalars.get((c, name, what))
                if scalar is not None:  # torch Adam's step
                    states[what] = torch.empty((), dtype=reader.entry(scalar.rank, scalar.tensor).dtype)
                    plan.append((scalar, states[what]))
                    continue
                first = index.pieces[(c, name, what)][0]
                states[what] = torch.empty(shape, dtype=reader.entry(first.rank, first.tensor).dtype)
                plan += [
                    (r, states[what].view(-1)[at : at + r.count]) for r, at in index.ranges((c, name, what), 0, numel)
                ]
            if states:
                optimizer[key] = states
        reader.execute(LoadPlan("export", tuple(ReadItem(r, dst) for r, dst in plan)))
        for key, states in optimizer.items():
            if "main" not in states:  # fp32 model: the master copy is the parameter itself
                states["main"] = out[key].detach().clone().float()
        objects = reader.objects(0)
    if not out:
        raise ExportError(
            f"{path}: no Megatron parameter maps in this checkpoint (not written by LazyCheckpointer, or by a "
            "version before they were recorded): nothing to export"
        )
    objects = objects if isinstance(objects, dict) else {}
    out["optimizer"] = optimizer
    out.update(
        iteration=it,
        training=objects.get("training"),
        extra_state=objects.get("extra_state"),
        model=objects.get("model"),
        layout=dict(manifest.layout),
    )
    return out


# ---------------------------------------------------------------------------------------------- torch_dist
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_model(stored: dict | None, overrides: dict | None, path: str) -> dict:
    desc = dict(stored or {})
    desc.update({k: v for k, v in (overrides or {}).items() if v is not None})
    missing = [k for k in _MODEL_KEYS if desc.get(k) is None]
    if missing:
        raise LayoutMismatchError(
            f"{path}: the checkpoint stores no model description for {missing}; pass them "
            "(--num-layers --hidden-size --num-attention-heads --seq-length --vocab-size, --bf16)"
        )
    if desc.get("ffn_hidden_size") not in (None, 4 * int(desc["hidden_size"])):
        raise LayoutMismatchError(
            f"{path}: ffn_hidden_size {desc['ffn_hidden_size']} != 4 * hidden_size: model_rebuild cannot rebuild it"
        )
    if desc.get("fp16"):
        raise LayoutMismatchError(f"{path}: fp16 models are not supported by the torch_dist export")
    if desc.get("model_chunks", 1) != 1:
        raise LayoutMismatchError(f"{path}: {desc['model_chunks']} model chunks; the torch_dist export rebuilds one")
    return desc


def _export_torch_dist(path: str, it: int, out_dir: str, overrides: dict | None, timeout_s: float, verify: bool) -> str:
    manifest = read_manifest(path)
    if any(manifest.layout.get(k, 1) != 1 for k in ("tp", "pp", "cp", "ep")):
        raise LayoutMismatchError(
            f"{path}: export needs a checkpoint written with TP=PP=CP=EP=1; layout is {manifest.layout}"
        )
    with CheckpointReader(path, manifest, verify=False) as reader:
        stored = reader.objects(0).get("model")
    desc = _resolve_model(stored, overrides, path)
    target = iter_dir(out_dir, it)
    if os.path.exists(target):
        raise OutputExistsError(f"{target} exists; nothing was overwritten")
    os.makedirs(out_dir, exist_ok=True)
    # SIGTERM: the worker is killed and the staging directory removed, then the signal acts
    with sigterm_raises(f"torch_dist export of iteration {it} of {path}"):
        staging = tempfile.mkdtemp(prefix=f".export-{it}-", dir=out_dir)
        try:
            job = {
                "ckpt_root": os.path.dirname(path),
                "iteration": it,
                "model": desc,
                "out": os.path.join(staging, "ckpt"),
                "scratch": os.path.join(staging, "scratch"),
                "verify": verify,
            }
            outcome = run_worker(
                [sys.executable, "-m", __name__, "--worker", json.dumps(job)],
                _worker_env(),
                timeout_s,
                marker="EXPORT-OK",
                prefix="export worker: ",
            )
            if outcome.returncode is None:
                raise ExportError(
                    f"{path}: torch_dist export of iteration {it} did not finish within {timeout_s:.0f} s (killed)"
                )
            if outcome.returncode != 0 or not outcome.done:
                raise ExportError(
                    f"{path}: torch_dist export of iteration {it} failed ({outcome.how}):\n{outcome.tail[-3000:]}"
                )
            os.replace(job["out"], target)  # the directory appears whole, or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # ours (mkdtemp); rmtree follows no link
    write_tracker(out_dir, it)
    return target


def _worker_env() -> dict:
    env = dict(os.environ)
    env.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    return env


def _worker(job: dict) -> None:
    """Subprocess body (1 rank, CPU): rebuild, reshard-load, ``dist_checkpointing.save``."""
    from ..engine.faults import hold_point

    print(f"started (pid {os.getpid()})", flush=True)
    hold_point("export_worker")  # the fault tests' stalled worker
    watch_children()  # megatron-core's writer processes: one that dies must not leave us waiting
    from megatron.core import dist_checkpointing

    from . import model_rebuild
    from .checkpointer import LazyCheckpointer
    from .config import LazyCkptConfig

    model_rebuild.init_distributed(seed=1234)
    chunks, optimizer = model_rebuild.rebuild(job["model"])
    print(f"rebuilt the model ({job['model']}); loading iteration {job['iteration']}", flush=True)
    config = LazyCkptConfig(
        save_dir=job["scratch"],
        load_dir=job["ckpt_root"],
        host_cache_gb=0.01,
        keep_last=0,
        verify_on_load=bool(job["verify"]),
    )
    with LazyCheckpointer(chunks, optimizer, config) as ckpt:
        it, extra = ckpt.load(job["iteration"])
    with CheckpointReader(
        iter_dir(job["ckpt_root"], it), read_manifest(iter_dir(job["ckpt_root"], it)), verify=False
    ) as reader:
        scheduler = (reader.objects(0).get("training") or {}).get("scheduler")
    megatron_lm = (extra or {}).get("megatron_lm") if isinstance(extra, dict) else None
    model_sd = chunks[0].module.sharded_state_dict(metadata=dict(CONTENT_METADATA))
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=dict(CONTENT_METADATA)),
        "iteration": it,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": scheduler,
        "num_floating_point_operations_so_far": (megatron_lm or {}).get("num_floating_point_operations_so_far", 0),
    }
    os.makedirs(job["out"], exist_ok=True)
    print(f"loaded iteration {it}; saving torch_dist", flush=True)
    dist_checkpointing.save(state, job["out"], content_metadata=dict(CONTENT_METADATA))
    torch.distributed.barrier()
    print("EXPORT-OK", flush=True)
    model_rebuild.destroy_distributed()


def _write_new(target: str, write) -> None:
    """``write(file)`` into a temp file we create (``O_EXCL | O_NOFOLLOW``: a link planted at its
    predictable name is refused, never written through), fsync it, then link it to ``target``
    (``link`` fails on an existing name: nothing is overwritten) and drop the temp name."""
    tmp = f"{target}.tmp-{os.getpid()}"
    fd = create_temp(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise OutputExistsError(f"{target} exists; nothing was overwritten") from None
        except OSError as e:  # a file system without hard links: a rename, after the same check
            if os.path.lexists(target):
                raise OutputExistsError(f"{target} exists; nothing was overwritten") from e
            os.rename(tmp, target)
    except CheckpointError:
        raise
    except OSError as e:
        raise FlushError(f"{target}: cannot write the export: {e}") from e
    finally:
        try:
            os.unlink(tmp)  # ours: created above
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------- entry
def export(
    ckpt_dir: str,
    out_dir: str,
    fmt: str = "torch_dist",
    *,
    iteration: int | None = None,
    model: dict | None = None,
    timeout_s: float = 600.0,
    verify: bool = True,
) -> str:
    """Export checkpoint ``ckpt_dir`` (a root: its latest committed or ``iteration``; or an
    ``iter_*`` directory) to ``out_dir`` in ``fmt`` (``torch`` or ``torch_dist``); returns the path
    written.  ``model`` overrides the stored model description (keys as :func:`.shards.model_description`)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "torch_dist":  # megatron-core's writer needs psutil: without it, its processes die
        require(["megatron.core", "psutil"], "the torch_dist export", extra="megatron")
    path, it = _locate(ckpt_dir, iteration)
    if fmt == "torch":
        target = os.path.join(os.path.abspath(out_dir), f"iter_{it:07d}.pt")
        if os.path.exists(target):
            raise OutputExistsError(f"{target} exists; nothing was overwritten")
        state = consolidate(path, it, verify=verify)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _write_new(target, lambda f: torch.save(state, f))
        log.info("exported iteration %d of %s to %s", it, path, target)
        return target
    target = _export_torch_dist(path, it, os.path.abspath(out_dir), model, timeout_s, verify)
    log.info("exported iteration %d of %s to %s (torch_dist)", it, path, target)
    return target


def run_export(args: argparse.Namespace) -> int:
    """Run ``datastates-ckpt export`` from parsed arguments; prints the path written, returns 0
    (errors propagate as :class:`CheckpointError` subclasses for the CLI to report)."""
    overrides = {k: getattr(args, k, None) for k in _MODEL_KEYS}
    path = export(
        args.ckpt_dir,
        args.out_dir,
        args.format,
        iteration=args.iteration,
        model=overrides,
        timeout_s=args.timeout_s,
        verify=not args.no_verify,
    )
    if getattr(args, "json", False):
        iteration = int(os.path.basename(path).split("_")[1].split(".")[0])
        json.dump({"path": path, "format": args.format, "iteration": iteration}, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(path)
    return 0


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m datastates_megatron.megatron.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        _worker(json.loads(argv[1]))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run_export(add_export_arguments(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
