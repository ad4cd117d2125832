"""The Python examples of the docs run as written (README.md "Using it", docs/api.md), on one CPU
rank with the demo GPT (megatron-core, the DistributedOptimizer) standing for the user's model,
optimizer and scheduler.  The one change: docs/api.md's ``/lustre/run1/ckpt`` is the directory the
README's example saved to, so its ``load()`` finds a checkpoint (on an empty directory it raises
``NoCheckpointError``, as its comment says), continues the training and saves."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.distributed.ranks import describe, run_ranks
from tests.doc_paths import python_examples

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

README = "python example 1 of README.md"
API = "python example 1 of docs/api.md"


def _run_examples(args: list[str]) -> dict:
    """In a forked rank, in directory ``args[0]``: the README example, then docs/api.md's."""
    os.chdir(args[0])
    from datastates_megatron.demo import gpt
    from datastates_megatron.engine.tiers.tier import committed_iterations

    gpt.init_distributed(seed=3)
    model, optimizer = gpt.build(2, 64, 4, 32, 256, seed=3)
    scheduler = gpt.make_scheduler(optimizer, lr=1e-3, warmup_steps=1, decay_steps=10)

    def train_step():
        data = gpt.batch(1, gpt.dp_rank(), seed=3, micro_batch_size=2, seq_len=32, vocab=256)
        return gpt.train_step(model, optimizer, data, scheduler=scheduler)

    train_step()
    examples = python_examples()
    readme = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iteration": 3}
    exec(compile(examples[README], "README.md", "exec"), readme)
    api = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "train_step": train_step}
    api.update(train_iters=6, save_interval=2, batch=8)
    code = examples[API].replace('"/lustre/run1/ckpt"', '"ckpt"')
    exec(compile(code, "docs/api.md", "exec"), api)
    return {
        "readme_loaded": readme["iteration"],
        "api_loaded": api["iteration"],
        "committed": committed_iterations("ckpt"),
    }


def test_the_python_examples_run_as_written(tmp_path):
    examples = python_examples()
    assert set(examples) >= {README, API}, sorted(examples)
    assert '"/lustre/run1/ckpt"' in examples[API]
    (result,) = run_ranks(_run_examples, 1, [str(tmp_path)], timeout=240)
    assert result["returncode"] == 0 and result["result"], describe([result])
    got = result["result"]
    assert got["readme_loaded"] == 3 and got["api_loaded"] == 3  # each load() finds the README's save
    assert sorted(got["committed"]) == [3, 4, 6], got  # api.md saves every save_interval, keeps the last 3
