"""``datastates-ckpt export`` from the recorded global coordinates: a lazy checkpoint of the real
``pretrain_gpt.py`` at TP=2 x PP=2 (4 CPU ranks, vocabulary padded by TP), exported without
Megatron-LM and without its world size,

* ``--format safetensors``: one file that the ``safetensors`` library reads back equal to the full
  tensors of megatron-core's own consolidation (the same checkpoint converted by Megatron-LM at
  TP2 x PP2 with ``--lazy-ckpt-convert-to``, read whole), one tensor per global layer;
* ``--format torch_dist --nproc 2``: 2 processes, whose output megatron-core's
  ``dist_checkpointing.load_plain_tensors`` loads equal to the same full tensors, and from which
  Megatron-LM's ``pretrain_gpt.py`` fine-tunes at TP1 x PP1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.megatron_lm_runs import LAZY, MEGATRON_LM_DIR, latest, launch
from tests.integration.test_torch_dist_bridge import _full_tensors

pytestmark = [
    pytest.mark.slow,  # two 4-rank pretrain_gpt.py runs (train, and Megatron-LM's conversion for reference)
    pytest.mark.skipif(
        not MEGATRON_LM_DIR,
        reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
    ),
]
safetensors = pytest.importorskip("safetensors.torch")

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--vocab-size", "600"]
LAYERS = "decoder.layers."
TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The lazy checkpoint of iteration 4 at TP2 x PP2, and megatron-core's full model tensors of it
    (Megatron-LM's own conversion at the same layout, read whole)."""
    tmp = tmp_path_factory.mktemp("tp2pp2")
    lazy, ref = tmp / "lazy", tmp / "ref"
    common = ["--train-iters", "8", *TP2_PP2, "--save-interval", "4", *LAZY]
    first = launch(tmp, "first", [*common, "--exit-interval", "4", "--save", str(lazy)], nproc=4, timeout=TIMEOUT_S)
    assert first.returncode == 0 and latest(lazy) == 4, first.describe()
    convert = [*common, "--load", str(lazy), "--save", str(lazy), "--lazy-ckpt-convert-to", str(ref)]
    converted = launch(tmp, "convert", convert, nproc=4, timeout=TIMEOUT_S)
    assert converted.returncode == 0, converted.describe()
    want = {k: v for k, v in _full_tensors(ref / "iter_0000004").items() if not k.startswith("optimizer.")}
    assert "embedding.word_embeddings.weight" in want and want["embedding.word_embeddings.weight"].shape[0] == 768
    return lazy, want


def _cli(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "datastates_megatron.cli", "export", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_safetensors_export_is_the_full_model_one_tensor_per_global_layer(saved, tmp_path):
    lazy, want = saved
    doc = _cli(str(lazy), str(tmp_path / "st"), "--format", "safetensors")
    assert doc == {"path": str(tmp_path / "st" / "iter_0000004.safetensors"), "format": "safetensors", "iteration": 4}
    got = safetensors.load_file(doc["path"])
    expected_names = set()
    for key, full in want.items():
        if key.startswith(LAYERS):  # the layer axis: one tensor per global layer, as a single-rank model names it
            names = [f"{LAYERS}{layer}.{key[len(LAYERS) :]}" for layer in range(full.shape[0])]
            value = torch.stack([got[n] for n in names])
        else:
            names = [key]
            value = got[key]
        expected_names.update(names)
        assert value.dtype == full.dtype and torch.equal(value, full), key
    assert set(got) == expected_names


_LOAD = """
import sys, tempfile, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.save(dist_checkpointing.load_plain_tensors(sys.argv[1]), sys.argv[2])
"""


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    """The lazy TP2 x PP2 checkpoint exported to torch_dist on 2 processes."""
    lazy, _ = saved
    out = tmp_path_factory.mktemp("td") / "td"
    doc = _cli(str(lazy), str(out), "--format", "torch_dist", "--nproc", "2")
    assert doc["path"] == str(out / "iter_0000004") and (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not any(p.name.startswith(".export-") for p in out.iterdir())  # the staging directory is gone
    return out


def test_torch_dist_export_of_a_4_rank_checkpoint_runs_on_2_processes_and_megatron_core_loads_it(
    saved, exported, tmp_path
):
    _, want = saved
    loaded = tmp_path / "loaded.pt"
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(exported / "iter_0000004"), str(loaded)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(loaded, weights_only=False)
    assert (got.pop("iteration"), got.pop("checkpoint_version")) == (4, 3.0)
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, differ


def test_megatron_lm_fine_tunes_from_the_torch_dist_export_at_tp1_pp1(exported, tmp_path):
    """The export holds the model weights only, without the layers' ``_extra_state`` objects
    (``None`` for megatron-core's local layers): Megatron-LM loads it with ``--finetune`` and a
    strictness that logs the keys it lacks."""
    flags = ["--train-iters", "2", "--vocab-size", "600", "--load", str(exported), "--finetune"]
    flags += ["--no-load-optim", "--no-load-rng", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness", "log_all"]
    run = launch(tmp_path, "finetune", flags, nproc=2, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.describe()
    assert f"successfully loaded checkpoint from {exported} [ t 1/1, p 1/1 ]" in run.log, run.describe()
    assert sorted(run.iterations()) == [1, 2]
