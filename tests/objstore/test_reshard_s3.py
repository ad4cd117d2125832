"""A checkpoint in a bucket (the demo GPT on 2 CPU gloo ranks, megatron-core, saved through the
node-local tier to the local S3 server) restored at another data-parallel size and exported, read
from the bucket alone:

- DP=2 -> DP=1: right after the load every parameter, main param and Adam state equals, element for
  element, what the saving run held, as the same restore from a directory gives
  (tests/integration/test_reshard.py); the restore fetched by ranged GETs only the byte ranges its
  plan reads (each verified against its chunk checksums) -- fewer bytes than the rank objects hold,
  and for the model alone (``--model-only``) under half of them;
- ``datastates-ckpt export s3://... --format torch``: every element equal to what the run held."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from datastates_megatron.cli import EXIT_OK, main
from tests.distributed.ranks import describe, run_ranks
from tests.integration.test_reshard import TOTAL, WORKER

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] is not None for r in results), describe(results)
    return [r["result"] for r in results]


def _object_bytes(client, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for p in pages for o in p.get("Contents", ()) if o["Key"].endswith(".dsck"))


@pytest.fixture
def dp2_in_bucket(bucket, s3_env, tmp_path):
    """DP=2 fp32 with small buckets: iteration 3 committed in the bucket, and its reference."""
    url = f"s3://{bucket}/gpt"
    args = ["run", *TOTAL, "--bucket-size", "20000", "--save", url, "--save-at", "3"]
    _ok(
        run_ranks(
            WORKER, 2, [*args, "--local", str(tmp_path / "node0"), "--ref-out", str(tmp_path / "ref")], timeout=300
        )
    )
    return url, tmp_path / "ref"


def test_dp2_to_dp1_from_the_bucket_fetches_only_what_it_reads(dp2_in_bucket, bucket, s3_env, tmp_path):
    url, ref = dp2_in_bucket
    stored = _object_bytes(s3_env.client(), bucket, "gpt/iter_0000003/")
    (one,) = _ok(
        run_ranks(
            WORKER,
            1,
            ["run", *TOTAL, "--load", url, "--load-at", "3", "--ref-in", str(ref), "--save", url]
            + ["--local", str(tmp_path / "fresh-node")],  # an empty node-local tier: the bucket only
            timeout=300,
        )
    )
    assert one["mismatches"] == [], one["mismatches"]
    (restore,) = one["restore"].values()
    # DP=1 reads nearly all of both objects (every Adam state), each byte once
    assert restore["bytes"] < restore["fetched_bytes"] < stored, (restore, stored)
    assert not any(p.name.endswith(".dsck") for p in (tmp_path / "fresh-node").rglob("*"))  # nothing left
    # the model alone: the parameters' chunks and each object's metadata, well under half the bytes
    (model,) = _ok(
        run_ranks(
            WORKER,
            1,
            ["run", *TOTAL, "--load", url, "--load-at", "3", "--ref-in", str(ref), "--save", url, "--model-only"]
            + ["--local", str(tmp_path / "fresh-node-2")],
            timeout=300,
        )
    )
    assert model["mismatches"] == [], model["mismatches"]
    (restore,) = model["restore"].values()
    assert restore["bytes"] < restore["fetched_bytes"] < stored // 2, (restore, stored)


def test_export_torch_of_a_bucket_checkpoint(dp2_in_bucket, tmp_path, capsys):
    url, ref_dir = dp2_in_bucket
    assert main(["export", f"{url}/iter_0000003", str(tmp_path / "out"), "--format", "torch"]) == EXIT_OK
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "out" / "iter_0000003.pt")
    state = torch.load(path, weights_only=False)
    ref = [torch.load(ref_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, value in ref[0]["params"].items():
        assert torch.equal(state[name], value), name
        for rr in ref:
            if name in rr["states"]:
                start, end, st = rr["states"][name]
                for key in ("main", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(state["optimizer"][name][key].view(-1)[start:end], st[key].view(-1)), (name, key)
    assert state["iteration"] == 3 and state["layout"]["dp"] == 2
    # the save location itself: its latest committed checkpoint
    assert main(["export", url, str(tmp_path / "out2"), "--format", "torch", "--json"]) == EXIT_OK
    assert '"iteration": 3' in capsys.readouterr().out
