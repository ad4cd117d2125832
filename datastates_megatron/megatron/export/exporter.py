"""Export a lazy checkpoint: one consolidated ``torch`` or ``safetensors`` file, Megatron-LM's ``torch_dist``
checkpoint, or a Hugging Face model directory (``hf``, :mod:`.hf`).

``export(ckpt, out, "safetensors")`` writes ``out/iter_NNNNNNN.safetensors``, the full model of any
layout from the recorded global coordinates (:mod:`.consolidated`); ``export(ckpt, out,
"torch_dist", nproc=N)`` (no ``flags``) writes ``out/iter_NNNNNNN/`` and the tracker with
megatron-core's own writer on N processes, whatever the old world size (:mod:`.dist_export`).  Both
need a checkpoint of identity 3 and no Megatron-LM.

``export(ckpt, out, "torch")`` needs no megatron: it reads every rank file through the global
identity metadata (:class:`..checkpointing.reshard.CheckpointIndex`) and writes ``out/iter_NNNNNNN.pt``, a
``torch.save`` of::

    {<param name>: full tensor, ...,                     # chunk c > 0: "model<c>.<name>"
     "optimizer": {<param name>: {"main", "exp_avg", "exp_avg_sq", "step"}},
     "iteration", "training" (old rank 0's non-tensor state), "extra_state", "model", "layout"}

(``main`` is the fp32 master copy: for an fp32 model it is the parameter itself.)  It needs a
checkpoint written with TP=PP=CP=EP=1 (any DP).

``export(ckpt, out, "torch_dist", megatron_lm=DIR, flags=[...])`` (the fallback for identity 2, and the
export of the optimizer state) writes ``out/iter_NNNNNNN/`` and
``out/latest_checkpointed_iteration.txt`` by the one conversion there is: Megatron-LM's own training
script (``DIR/pretrain_gpt.py`` by default) with the training flags of the run that wrote the
checkpoint, plus ``--load --ckpt-step --lazy-ckpt --lazy-ckpt-convert-to`` (:mod:`..megatron_lm.torch_dist`'s
``export``: any model, any TP/PP/EP layout, the optimizer ``fully_reshardable``), run on as many gloo
CPU ranks as the checkpoint's world size (:mod:`.export_ranks`, :mod:`..cpu.launch`; no GPU).  The
flags must build the model the checkpoint holds on CPU (``--transformer-impl local``); the CPU ones
(gloo, no fusions) are added.  Its ranks run as one process group (:mod:`.worker_process`): the first
rank that fails ends the export with its output; at ``timeout_s`` or on SIGTERM the whole group is
killed and the staging directory removed; the output appears whole (staged in ``out/.export-*``,
then renamed) or not at all.

A checkpoint on object storage (``s3://bucket/prefix[/iter_NNNNNNN]``, ``msc://profile/path``) is
fetched first, every rank object by ranged GETs verified against its chunk checksums
(:func:`...engine.storage.fetch.fetch_checkpoint`), into a temporary directory (``TMPDIR``: room
for the checkpoint; removed after), and exported from there by the one path above: the export
reads every byte of the checkpoint anyway.

Thread-safety: plain functions; ``export`` blocks the calling thread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile

import torch

from ..._output import write_line
from ..._deps import require

from ...engine.errors import CheckpointError, FlushError, LayoutMismatchError, NoCheckpointError
from ...engine.format.manifest import read_manifest, write_tracker
from ...engine.names import MANIFEST_NAME, iter_dir, iteration_of
from ...engine.storage.url import is_object_url
from ...engine.tiers.tier import latest_committed
from ...engine.load.load_plan import LoadPlan, ReadItem
from ...engine.load.reader import CheckpointReader
from ...engine.fs.safe_io import create_temp
from . import export_ranks
from .export_args import DEFAULT_NPROC, DEFAULT_SCRIPT, DEFAULT_SHARD_MB, FORMATS, locate_script
from .worker_process import run_worker, sigterm_raises

__all__ = [
    "FORMATS",
    "ExportError",
    "OutputExistsError",
    "consolidate",
    "export",
    "rank_command",
    "run_export",
]

log = logging.getLogger(__name__)


SUFFIXES = {"torch": ".pt", "safetensors": ".safetensors"}  # one-file formats: OUT_DIR/iter_N<suffix>


class ExportError(CheckpointError, RuntimeError):
    """The export could not be completed (bad arguments, or its Megatron-LM ranks failed or timed out)."""


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
    path = iter_dir(ckpt_dir, it)
    if iteration is not None:
        read_manifest(path)  # not committed there: refused before anything is written
    return path, it


@contextlib.contextmanager
def _local_copy(location: str, iteration: int | None, verify: bool):
    """``location`` itself when it is a path; for an object-storage URL (a save location: its latest
    committed or ``iteration``; or ``SAVE_URL/iter_NNNNNNN``), a verified copy of the checkpoint in a
    temporary directory, removed when the block ends."""
    if not is_object_url(location):
        yield location
        return
    from ...engine.storage import ObjectMissingError, open_storage
    from ...engine.storage.fetch import fetch_checkpoint
    from ...engine.storage.survey import survey_objects

    head, _, last = location.rstrip("/").rpartition("/")
    named = iteration_of(last) if "://" in head else None
    save_url = head if named is not None else location.rstrip("/")
    if named is not None and iteration is not None and iteration != named:
        raise NoCheckpointError(f"{location} is iteration {named}, not {iteration}")
    with open_storage(save_url) as st, tempfile.TemporaryDirectory(prefix="dsm-export-") as tmp:
        it = named if named is not None else iteration if iteration is not None else survey_objects(st).latest()
        try:
            d, _ = fetch_checkpoint(st, it, tmp, verify=verify)
        except ObjectMissingError as e:
            raise NoCheckpointError(f"{st.url(f'iter_{it:07d}')}: not a committed checkpoint ({e})") from e
        log.info("fetched iteration %d of %s for the export", it, save_url)
        yield d


# ---------------------------------------------------------------------------------------------- torch
def consolidate(ckpt_dir: str, iteration: int | None = None, *, verify: bool = True, threads: int = 4) -> dict:
    """The whole checkpoint as one state dict of full tensors (format: module docstring).  Reads
    every rank file once; needs memory for the whole model and optimizer state."""
    from ..checkpointing.reshard import CheckpointIndex

    path, it = _locate(ckpt_dir, iteration)
    manifest = read_manifest(path)
    if any(manifest.layout.get(k, 1) != 1 for k in ("tp", "pp", "cp", "ep")):
        raise LayoutMismatchError(
            f"{path}: export needs a checkpoint written with TP=PP=CP=EP=1; layout is {manifest.layout}"
        )
    with CheckpointReader(path, manifest, verify=verify, threads=threads) as reader:
        index = CheckpointIndex.from_reader(reader, legacy=True)  # TP=PP=EP=1: any identity version
        plan = []
        out: dict = {}
        optimizer: dict = {}
        whats: dict = {}
        for sl, c, name, what in index.pieces:
            whats.setdefault((sl, c, name), set()).add(what)
        for sl, c, name, what in index.scalars:
            whats.setdefault((sl, c, name), set()).add(what)
        for (sl, c, name), (shape, dtype) in sorted(index.params.items()):
            key = name if c == 0 else f"model{c}.{name}"
            numel = math.prod(shape)
            out[key] = torch.empty(shape, dtype=getattr(torch, dtype))
            pkey = (sl, c, name)
            plan += [(r, out[key].view(-1)[at : at + r.count]) for r, at in index.ranges((*pkey, "param"), 0, numel)]
            states = {}
            for what in sorted(whats.get(pkey, ()) - {"param"}):
                scalar = index.scalars.get((*pkey, what))
                if scalar is not None:  # torch Adam's step
                    states[what] = torch.empty((), dtype=reader.entry(scalar.rank, scalar.tensor).dtype)
                    plan.append((scalar, states[what]))
                    continue
                first = index.pieces[(*pkey, what)][0]
                states[what] = torch.empty(shape, dtype=reader.entry(first.rank, first.tensor).dtype)
                plan += [
                    (r, states[what].view(-1)[at : at + r.count]) for r, at in index.ranges((*pkey, what), 0, numel)
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
# structure-neutral flags that let a GPU run's model build on gloo CPU ranks (the layer implementation
# is the run's own: it decides the parameters the checkpoint holds)
CPU_FLAGS = (
    "--distributed-backend",
    "gloo",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
)


def rank_command(script: str, flags: list[str], root: str, it: int, staging: str, verify: bool) -> list[str]:
    """One rank's command line: the run's ``flags``, then the CPU flags and what the conversion sets
    (later than the run's own: argparse keeps the last)."""
    return [
        sys.executable,
        "-m",
        export_ranks.__name__,
        "rank",
        script,
        *flags,
        *CPU_FLAGS,
        "--load",
        root,
        "--ckpt-step",
        str(it),
        "--save",
        os.path.join(staging, "scratch"),  # the lazy run's --save, never written: it converts and ends
        "--save-interval",
        str(2**31 - 1),  # Megatron-LM asserts one with --save
        "--lazy-ckpt",
        "--lazy-ckpt-verify-on-load" if verify else "--no-lazy-ckpt-verify-on-load",
        "--lazy-ckpt-convert-to",
        os.path.join(staging, "converted"),
    ]


def _failure(outcome) -> str:
    """The failing rank and its error's last line, from the ranks' output tail."""
    lines = [line.rstrip() for line in outcome.tail.splitlines() if line.strip()]
    ended = [i for i, line in enumerate(lines) if line.startswith("rank ") and ": ending the other ranks" in line]
    if not ended:
        return outcome.how
    before = [line for line in lines[: ended[-1]] if not line[0].isspace()]
    cause = f": {before[-1][:300]}" if before else ""
    return lines[ended[-1]].split(": ending")[0] + cause


def _staged_torch_dist(path: str, it: int, out_dir: str, starter_for, timeout_s: float, what: str) -> str:
    """Run the ranks ``starter_for(staging)`` starts, which write ``staging/converted/iter_N``; rename
    it to ``out_dir/iter_N`` (whole, or not at all) and write the tracker."""
    target = iter_dir(out_dir, it)
    if os.path.lexists(target):
        raise OutputExistsError(f"{target} exists; nothing was overwritten")
    os.makedirs(out_dir, exist_ok=True)
    # SIGTERM: the ranks are killed and the staging directory removed, then the signal acts
    with sigterm_raises(what):
        staging = tempfile.mkdtemp(prefix=f".export-{it}-", dir=out_dir)
        try:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
            outcome = run_worker(starter_for(staging), env, timeout_s, marker=export_ranks.DONE, prefix="export: ")
            if outcome.returncode is None:
                raise ExportError(f"{what} did not finish within {timeout_s:.0f} s (killed)")
            if outcome.returncode != 0 or not outcome.done:
                raise ExportError(f"{what} failed ({_failure(outcome)}); the ranks' output is above")
            written = iter_dir(os.path.join(staging, "converted"), it)
            if not os.path.isdir(written):
                raise ExportError(f"{what}: the ranks ended without writing {os.path.basename(written)}")
            os.replace(written, target)  # the directory appears whole, or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # ours (mkdtemp); rmtree follows no link
    write_tracker(out_dir, it)
    return target


def _export_torch_dist(
    path: str, it: int, out_dir: str, script: str, flags: list[str], timeout_s: float, verify: bool
) -> str:
    """Megatron-LM's own conversion on as many ranks as the checkpoint has (the fallback)."""
    world = read_manifest(path).world_size

    def starter(staging: str) -> list[str]:
        command = rank_command(script, flags, os.path.dirname(path), it, staging, verify)
        return [sys.executable, "-m", export_ranks.__name__, "start", "--nproc", str(world), "--", *command]

    return _staged_torch_dist(path, it, out_dir, starter, timeout_s, f"torch_dist export of iteration {it} of {path}")


def _export_torch_dist_global(path: str, it: int, out_dir: str, nproc: int, timeout_s: float, verify: bool) -> str:
    """megatron-core's writer on ``nproc`` processes, from the recorded global coordinates
    (:mod:`.dist_export`)."""
    from . import dist_export
    from .global_tensors import count_blocks

    blocks = count_blocks(path)  # a checkpoint without global coordinates is refused before anything starts
    log.info("iteration %d of %s: %d global blocks over %d processes", it, path, blocks, nproc)

    def starter(staging: str) -> list[str]:
        converted = iter_dir(os.path.join(staging, "converted"), it)
        os.makedirs(converted)  # megatron-core writes into an existing directory
        command = [sys.executable, "-m", dist_export.__name__, path, str(it), converted]
        command += ["--no-verify"] if not verify else []
        return [sys.executable, "-m", export_ranks.__name__, "start", "--nproc", str(nproc), "--", *command]

    what = f"torch_dist export of iteration {it} of {path} on {nproc} processes"
    return _staged_torch_dist(path, it, out_dir, starter, timeout_s, what)


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
    megatron_lm: str | None = None,
    script: str = DEFAULT_SCRIPT,
    flags: list[str] | tuple[str, ...] = (),
    timeout_s: float = 600.0,
    verify: bool = True,
    nproc: int = DEFAULT_NPROC,
    dtype: str | None = None,
    dry_run: bool = False,
    max_shard_mb: float = DEFAULT_SHARD_MB,
) -> str:
    """Export checkpoint ``ckpt_dir`` (a root: its latest committed or ``iteration``; or an
    ``iter_*`` directory) to ``out_dir`` in ``fmt`` (:data:`FORMATS`); returns the path written.
    ``torch_dist`` without ``flags``: megatron-core's writer on ``nproc`` processes from the
    recorded global coordinates (:mod:`.dist_export`); with ``flags`` (the training flags of the run
    that wrote it): ``script`` of the Megatron-LM checkout ``megatron_lm`` (else ``$MEGATRON_LM_DIR``)
    on as many ranks as the checkpoint has -- the fallback for checkpoints without global coordinates.
    ``hf``: a Hugging Face model directory ``out_dir/iter_N-hf`` (:mod:`.hf`) in ``dtype`` (default
    the training dtype), shards of at most ``max_shard_mb`` MiB; ``dry_run`` prints its plan and
    writes nothing."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ExportError(f"--nproc must be a positive number of processes, got {nproc!r}")
    script_path = None
    if fmt == "torch_dist":  # megatron-core's writer needs psutil: without it, its processes die
        require(["psutil"], "the torch_dist export", extra="megatron")
        if flags:
            try:
                script_path = locate_script(megatron_lm, script)
            except ValueError as e:
                raise ExportError(str(e)) from None
        else:
            require(["megatron.core"], "the torch_dist export", extra="megatron")
    elif flags:
        raise ExportError(
            f"--format {fmt} runs no Megatron-LM: training flags are not used ({' '.join(flags[:3])} ...)"
        )
    with _local_copy(ckpt_dir, iteration, verify) as local:
        path, it = _locate(local, iteration)
        if fmt == "hf":
            from .hf import export_hf

            try:
                target = export_hf(
                    path,
                    it,
                    out_dir,
                    dtype=dtype,
                    dry_run=dry_run,
                    shard_bytes=int(max_shard_mb * 2**20),
                    verify=verify,
                )
            except FileExistsError as e:
                raise OutputExistsError(str(e)) from None
            if not dry_run:
                log.info("exported iteration %d of %s to %s (hf)", it, ckpt_dir, target)
            return target
        if fmt in ("torch", "safetensors"):
            target = iter_dir(os.path.abspath(out_dir), it) + SUFFIXES[fmt]
            if os.path.exists(target):
                raise OutputExistsError(f"{target} exists; nothing was overwritten")
            if fmt == "torch":
                state = consolidate(path, it, verify=verify)
                write = lambda f: torch.save(state, f)  # noqa: E731
            else:
                from .consolidated import write_consolidated

                write = lambda f: write_consolidated(path, it, f, verify=verify)  # noqa: E731
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _write_new(target, write)
            log.info("exported iteration %d of %s to %s", it, ckpt_dir, target)
            return target
        if flags:
            target = _export_torch_dist(path, it, os.path.abspath(out_dir), script_path, list(flags), timeout_s, verify)
        else:
            target = _export_torch_dist_global(path, it, os.path.abspath(out_dir), nproc, timeout_s, verify)
    log.info("exported iteration %d of %s to %s (torch_dist)", it, ckpt_dir, target)
    return target


def run_export(args: argparse.Namespace) -> int:
    """Run ``datastates-ckpt export`` from parsed arguments; prints the path written, returns 0
    (errors propagate as :class:`CheckpointError` subclasses for the CLI to report)."""
    path = export(
        args.ckpt_dir,
        args.out_dir,
        args.format,
        iteration=args.iteration,
        megatron_lm=args.megatron_lm,
        script=args.script,
        flags=getattr(args, "training_flags", None) or [],
        timeout_s=args.timeout_s,
        verify=not args.no_verify,
        nproc=args.nproc,
        dtype=getattr(args, "dtype", None),
        dry_run=getattr(args, "dry_run", False),
        max_shard_mb=getattr(args, "max_shard_mb", DEFAULT_SHARD_MB),
    )
    if getattr(args, "dry_run", False):
        return 0  # the plan is what it prints
    if getattr(args, "json", False):
        stem = os.path.splitext(path)[0] if path.endswith(tuple(SUFFIXES.values())) else path.removesuffix("-hf")
        iteration = iteration_of(stem)
        write_line(json.dumps({"path": path, "format": args.format, "iteration": iteration}, sort_keys=True))
    else:
        write_line(path)
    return 0
