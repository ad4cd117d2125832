"""A reshard never reads a crafted block (#49): one rank's word-embedding block of a TP2×DP1
checkpoint crafted -- overlapping the other rank's with the right element count, past the end of
the tensor, or of a negative shape -- is refused when the checkpoint is loaded at TP1, in one line
naming the file, the rank and the parameter, every live tensor as it was; before, each loaded with
rows zero-filled as if they were vocabulary padding.  The crafting (tests/faults/crafted_blocks.py)
reseals the rank file and rebuilds the global index, as a crafter with our format spec could."""

from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("megatron.core")

from tests.distributed.ranks import describe, run_ranks  # noqa: E402
from tests.faults.crafted_blocks import craft_block  # noqa: E402

WORKER = "tests.workers.reshard_worker"
WORD = "embedding.word_embeddings.weight"
# rank 1 (tensor-parallel rank 1) holds rows [128, 256) of the [256, 64] embedding: offset [128, 0], shape [128, 64]
CASES = {"overlap": ([64, 0], [128, 64]), "past": ([256, 0], [128, 64]), "negative": ([128, 0], [-128, 64])}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP2×DP1 checkpoint of iteration 2."""
    root = tmp_path_factory.mktemp("tp2") / "ckpt"
    res = run_ranks(WORKER, 2, ["tp2", "--total", "2", "--save", str(root), "--save-at", "2"], timeout=240)
    assert all(r["returncode"] == 0 and r["result"] for r in res), describe(res)
    return root


def _load_at_tp1(root) -> dict:
    args = ["run", "--warm", "1", "--total", "3", "--load", str(root), "--load-at", "2"]
    (r,) = run_ranks(WORKER, 1, args, timeout=240)
    assert r["returncode"] == 0 and r["result"] is not None, describe([r])
    return r["result"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_word_embedding_block_is_refused_naming_file_rank_and_parameter(tp2, tmp_path, case):
    root = tmp_path / "ckpt"
    shutil.copytree(tp2, root)
    assert craft_block(str(root / "iter_0000002"), 1, WORD, *CASES[case]) == 4  # the param's and its 3 states'
    result = _load_at_tp1(root)
    err = result.get("error", "")
    assert err.startswith("CorruptCheckpointError: ") and "\n" not in err, result
    assert re.search(r"iter_0000002/r00001-\S+\.dsck: rank 1 tensor '[^']+': ", err), err
    assert f"parameter '{WORD}' (slice pp0.tp1, chunk 0)" in err and "damaged or crafted" in err, err
    assert result["digest_before"] == result["digest_after"], result


def test_a_crafted_global_index_alone_falls_back_to_the_rank_files_and_loads(tp2, tmp_path):
    """Only the index says the crafted block (the rank files are the ones written): the load reads
    every rank file's metadata instead, and restores what they say."""
    root = tmp_path / "ckpt"
    shutil.copytree(tp2, root)
    ckpt = root / "iter_0000002"
    kept = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.name != "global_index.dsgi"}
    craft_block(str(ckpt), 1, WORD, *CASES["overlap"])
    for name, data in kept.items():
        (ckpt / name).write_bytes(data)
    result = _load_at_tp1(root)
    assert "error" not in result and sorted(result["losses"]) == ["3"], result
    assert result["embedding_rows"]["zero"] == [] and result["embedding_rows"]["rows"] == 256, result


def test_the_checkpoint_as_written_loads_at_tp1(tp2):
    result = _load_at_tp1(tp2)
    assert "error" not in result and sorted(result["losses"]) == ["3"], result
    assert result["embedding_rows"]["zero"] == [] and result["embedding_rows"]["zero_exp_avg"] == [], result
