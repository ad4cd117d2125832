"""Megatron-LM's own ``torch_dist`` format, both ways, in the real ``pretrain_gpt.py`` on CPU ranks.

* A checkpoint Megatron-LM saved itself is continued as a lazy run, exported back to ``torch_dist``
  (``--lazy-ckpt-convert-to``, and offline by ``datastates-ckpt export``: the same tensors) and
  continued again from the offline export: every iteration and the final state equal a run that
  never stopped, to the bit.
* A lazy checkpoint of a TP=2 x PP=2 run, exported, is loaded by megatron-core at TP=1 PP=1 (and
  that one back at TP=2 PP=2): both hold the same full tensors, model and optimizer state.

Megatron-LM cannot resume its own ``torch_dist`` checkpoint on CPU (torch's Adam: see
:mod:`datastates_megatron.megatron.megatron_lm.torch_dist`), so "resumed natively" is the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datastates_megatron.engine.tiers.foreign import foreign_format
from datastates_megatron.engine.format.manifest import read_tracker_text
from tests.integration.megatron_lm_runs import (
    CPU_ONLY,
    LAZY,
    MEGATRON_LM_DIR,
    RANKS,
    TINY,
    assert_same_training,
    latest,
    launch,
)

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
)

ITERS = 8


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _export(tmp: Path, name: str, load: Path, target: Path, layout: list[str], nproc: int):
    run = launch(
        tmp,
        name,
        [
            "--train-iters",
            str(ITERS),
            *layout,
            "--load",
            str(load),
            "--save",
            str(tmp / f"{name}-save"),
            "--save-interval",
            "2",
            "--lazy-ckpt-convert-to",
            str(target),
            *LAZY,
        ],
        nproc=nproc,
    )
    assert run.returncode == 0, run.describe()
    return run


def _export_offline(lazy: Path, target: Path, flags: list[str]) -> dict:
    """``datastates-ckpt export --format torch_dist``: the training flags of the run that wrote ``lazy``
    (its layout: the ranks are as many as its world size), on CPU ranks whatever the machine."""
    cli = [sys.executable, "-m", "datastates_megatron.cli", "export", str(lazy), str(target), "--json"]
    cli += ["--megatron-lm", MEGATRON_LM_DIR, "--timeout-s", "240", "--", *CPU_ONLY, *TINY, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "export: rank 1 started" in done.stderr and "exported iteration" in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)


def _reference_and_megatrons_own_save(tmp: Path, flags: list[str], fmt: str):
    """An uninterrupted run, and Megatron-LM's own checkpoint (format ``fmt``) of iteration 4 of the
    same run (``--exit-interval``: the schedule is that of the full run)."""
    reference = launch(tmp, "reference", ["--train-iters", str(ITERS), *flags])
    assert reference.returncode == 0, reference.describe()
    native = tmp / "native"
    saved = launch(
        tmp,
        "native",
        ["--train-iters", str(ITERS), *flags, "--exit-interval", "4", "--save", str(native)]
        + ["--save-interval", "100", "--ckpt-format", fmt],
    )
    assert saved.returncode == 0, saved.describe()
    assert foreign_format(str(native / "iter_0000004")) == fmt
    return reference, native


# fp32: the DistributedOptimizer's main params are views of the model's; bf16: separate fp32 copies
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
# PP=2 on 2 ranks: the tied embedding gets a param-buffer bucket of its own, after a padded one
CHAIN_LAYOUT = ["--pipeline-model-parallel-size", "2"] if RANKS == 2 else []


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_megatron_checkpoint_continued_lazily_then_exported_and_continued_is_bit_exact(tmp_path, precision):
    flags = [*CHAIN_LAYOUT, *PRECISIONS[precision]]
    reference, native = _reference_and_megatrons_own_save(tmp_path, flags, "torch_dist")
    before = _file_hashes(native)

    lazy = tmp_path / "lazy"
    common = ["--train-iters", str(ITERS), *flags, "--save-interval", "2", *LAZY]
    imported = launch(
        tmp_path, "imported", [*common, "--exit-interval", "6", "--load", str(native), "--save", str(lazy)]
    )
    assert imported.returncode == 0, imported.describe()
    assert "imported Megatron torch_dist checkpoint of iteration 4" in imported.log
    assert latest(lazy) == 6  # its saves are lazy
    assert _file_hashes(native) == before  # the imported checkpoint is only read
    assert_same_training(imported, reference, range(5, 7))

    exported = tmp_path / "exported"
    _export(tmp_path, "export", lazy, exported, flags, nproc=RANKS)
    assert read_tracker_text(str(exported)) == "6"
    assert foreign_format(str(exported / "iter_0000006")) == "torch_dist"
    want = _full_tensors(exported / "iter_0000006")
    if precision == "fp32":
        _assert_optimizer_params_are_the_weights(want)
    # offline: the same conversion, driven by the CLI; Megatron-LM continues from its output
    offline = tmp_path / "offline"
    doc = _export_offline(lazy, offline, [*common])
    assert doc == {"path": str(offline / "iter_0000006"), "format": "torch_dist", "iteration": 6}
    assert read_tracker_text(str(offline)) == "6" and sorted(os.listdir(offline)) == [
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    _assert_same_tensors(_full_tensors(offline / "iter_0000006"), want, "offline export vs --lazy-ckpt-convert-to")

    again = launch(tmp_path, "again", [*common, "--load", str(offline), "--save", str(tmp_path / "lazy2")])
    assert again.returncode == 0, again.describe()
    assert "imported Megatron torch_dist checkpoint of iteration 6" in again.log
    assert_same_training(again, reference, range(7, ITERS + 1))


def _full_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``torch_dist`` checkpoint, whole, read with torch's DCP (the pickled objects
    beside them are not read: they name classes of the Megatron-LM that wrote them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint))
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def _assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    assert any(k.startswith("optimizer.") for k in got) and any(not k.startswith("optimizer.") for k in got)
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


def _assert_optimizer_params_are_the_weights(tensors: dict) -> None:
    """fp32: the optimizer's ``param`` of every parameter is that parameter (Megatron-LM's own
    ``fully_reshardable`` save breaks this for every parameter after a padded bucket, as with PP)."""
    prefix = "optimizer.state.param."
    keys = [k for k in tensors if k.startswith(prefix)]
    assert keys
    differ = [k for k in keys if not torch.equal(tensors[k], tensors[k[len(prefix) :]])]
    assert not differ, f"optimizer param != weight for {differ}"


TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# 511 + the NullTokenizer's EOD = 512 rows: padded alike at TP=1 (multiple of 128) and TP=2 (of 256)
SAME_PADDING = ["--vocab-size", "511"]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 4, reason="needs 4 GPUs under NCCL")
# -m slow for CI time: test_layout_change.py's CI cases import --lazy-ckpt-convert-to's export at
# another layout (PP2 -> TP2) with megatron-core as their reference
@pytest.mark.slow
def test_tp2_pp2_lazy_checkpoint_loads_at_tp1_pp1_through_the_export_and_back(tmp_path):
    lazy = tmp_path / "lazy"
    trained = launch(
        tmp_path,
        "trained",
        ["--train-iters", str(ITERS), "--exit-interval", "4", *TP2_PP2, *SAME_PADDING, "--save", str(lazy)]
        + ["--save-interval", "4", *LAZY],
        nproc=4,
    )
    assert trained.returncode == 0, trained.describe()
    assert latest(lazy) == 4

    at_tp2_pp2 = tmp_path / "tp2_pp2"
    _export(tmp_path, "export", lazy, at_tp2_pp2, [*TP2_PP2, *SAME_PADDING], nproc=4)
    # megatron-core loads it at TP=1 PP=1 (DP=2), and writes what it loaded
    at_tp1 = tmp_path / "tp1"
    run = _export(tmp_path, "to_tp1", at_tp2_pp2, at_tp1, SAME_PADDING, nproc=2)
    assert "imported Megatron torch_dist checkpoint of iteration 4" in run.log
    want = _full_tensors(at_tp2_pp2 / "iter_0000004")
    _assert_optimizer_params_are_the_weights(want)
    _assert_same_tensors(_full_tensors(at_tp1 / "iter_0000004"), want, "TP2 PP2 -> TP1 PP1")
    # and back: the TP=1 PP=1 checkpoint loaded at TP=2 PP=2
    back = tmp_path / "back"
    _export(tmp_path, "back", at_tp1, back, [*TP2_PP2, *SAME_PADDING], nproc=4)
    _assert_same_tensors(_full_tensors(back / "iter_0000004"), want, "TP1 PP1 -> TP2 PP2")


@pytest.mark.slow
def test_a_legacy_torch_format_checkpoint_is_continued_lazily_bit_exact(tmp_path):
    """Megatron-LM's legacy ``--ckpt-format torch`` (``distrib_optim.pt`` beside the model files):
    its loader fills the optimizer through the same per-parameter copy as ``torch_dist``."""
    flags = [*CHAIN_LAYOUT]
    reference, native = _reference_and_megatrons_own_save(tmp_path, flags, "torch")
    common = ["--train-iters", str(ITERS), *flags, "--save-interval", "4", *LAZY]
    imported = launch(tmp_path, "imported", [*common, "--load", str(native), "--save", str(tmp_path / "lazy")])
    assert imported.returncode == 0, imported.describe()
    assert "imported Megatron torch checkpoint of iteration 4" in imported.log
    assert_same_training(imported, reference, range(5, ITERS + 1))
