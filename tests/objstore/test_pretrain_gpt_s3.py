"""Megatron-LM's own ``pretrain_gpt.py --lazy-ckpt`` with ``--save``/``--load`` on object storage (a
bucket of the local S3 server; core_v0.16.1 by ``s3://``, main by ``msc://`` and an MSC profile):
saves through its node-local tier, the promotion uploads to the bucket, the run is killed with
``kill -9`` once a checkpoint is committed in the bucket, the node-local directory is wiped, and the
restart restores from the bucket and trains on exactly as a run that was never interrupted
(tests/integration/test_pretrain_gpt.py's comparison, to the bit).  No local directory named after
the URL is ever made.  Then (s3://) ``datastates-ckpt export`` of the bucket's latest checkpoint to
``torch_dist`` runs Megatron-LM's own conversion on it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datastates_megatron.megatron.megatron_lm import versions
from datastates_megatron.engine.format.manifest import read_tracker_text
from datastates_megatron.engine.tiers.foreign import foreign_format
from tests.integration.megatron_lm_runs import CPU_ONLY, LAZY, MEGATRON_LM_DIR, TINY, assert_same_training, launch

from .conftest import DUMMY_KEY_ID, DUMMY_SECRET

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
)

REPO = Path(__file__).resolve().parents[2]
ITERS = 8  # killed at the first commit in the bucket: the rest of the run is the margin for the kill to land
# the other trees of MEGATRON_LM_DIRS that the table runs end to end (main)
END_TO_END = [
    d
    for d in (os.environ.get("MEGATRON_LM_DIRS") or "").split(os.pathsep)
    if d and d != MEGATRON_LM_DIR and any(r.end_to_end and r.source == Path(d).name for r in versions.TESTED)
]
_MANIFEST = re.compile(r"iter_(\d+)/manifest\.json$")
_MSC_ON = re.compile(r"^\s*enable_msc \.+ True$", re.M)


def _committed(client, bucket: str, prefix: str) -> list[int]:
    """The iterations whose manifest object exists under ``prefix`` (a checkpoint exists only then)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(int(m.group(1)) for p in pages for o in p.get("Contents", []) if (m := _MANIFEST.search(o["Key"])))


def _msc_flags(tree: str | None) -> list[str]:
    """``--enable-msc`` where the tree has it (main): Megatron-LM's own object-storage switch, which
    needs multi-storage-client (pinned by scripts/setup.sh). Without it the test is skipped, never
    run without the flag; CI (``DSM_REQUIRE_MSC=1``, .ci/run) fails instead.  A tree without the
    flag takes ``msc://`` from our own profile reader alone."""
    arguments = Path(tree or MEGATRON_LM_DIR) / "megatron" / "training" / "arguments.py"
    if "'--enable-msc'" not in arguments.read_text():
        return []
    if not importlib.util.find_spec("multistorageclient"):
        why = "multi-storage-client is not installed (scripts/setup.sh pins multi-storage-client==1.3.1)"
        if os.environ.get("DSM_REQUIRE_MSC") == "1":
            pytest.fail(why)
        pytest.skip(why + "; DSM_REQUIRE_MSC=1 makes this a failure")
    return ["--enable-msc"]


def _msc_profile(tmp_path: Path, bucket: str, endpoint: str, monkeypatch) -> None:
    """An MSC configuration whose profile ``train`` is the bucket on the local server, and nothing of
    S3 in the environment: the profile alone says where and who."""
    config = {
        "profiles": {
            "train": {
                "storage_provider": {
                    "type": "s3",
                    "options": {"base_path": bucket, "endpoint_url": endpoint, "region_name": "us-east-1"},
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {"access_key": DUMMY_KEY_ID, "secret_key": DUMMY_SECRET},
                },
            }
        }
    }
    (tmp_path / "msc.json").write_text(json.dumps(config))
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.json"))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)


# core_v0.16.1 with s3://, main with msc:// (Megatron-LM main's own spelling of object storage)
@pytest.mark.parametrize(
    "tree, scheme",
    [
        pytest.param(None, "s3", id="s3"),
        *(pytest.param(d, "msc", id=f"msc-{Path(d).name}") for d in END_TO_END),
    ],
)
def test_kill_9_then_resume_from_the_bucket_is_bit_exact(
    tmp_path, s3_env, bucket, tree, scheme, monkeypatch, uninterrupted
):
    monkeypatch.chdir(tmp_path)  # a relative directory named after the URL would land here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # the restart is the killed job requeued (its identity, as SLURM_JOB_ID): it takes the lock over at once
    monkeypatch.setenv("DSM_JOB_ID", f"pretrain-gpt-s3-{bucket}")
    client = s3_env.client()
    if scheme == "msc":
        _msc_profile(tmp_path, bucket, s3_env.endpoint, monkeypatch)
        url = "msc://train/run"
    else:
        url = f"s3://{bucket}/run"
    local = tmp_path / "node-local"
    args = [
        "--train-iters",
        str(ITERS),
        "--bf16",
        "--save",
        url,
        "--load",
        url,
        "--save-interval",
        "2",
        "--lazy-ckpt-local-dir",
        str(local),
        *_msc_flags(tree),
        *LAZY,
    ]
    reference = uninterrupted(["--train-iters", str(ITERS), "--bf16"], tree)  # test_pretrain_gpt.py's too

    killed = launch(
        tmp_path, "killed", args, kill_when=lambda: bool(_committed(client, bucket, "run")), megatron_lm_dir=tree
    )
    assert killed.returncode != 0, "the run ended before it was killed:\n" + killed.describe()
    resume_from = max(_committed(client, bucket, "run"))
    assert 2 <= resume_from < ITERS, resume_from
    shutil.rmtree(local)  # a fresh node: the restart has only the bucket

    resumed = launch(tmp_path, "resumed", args, megatron_lm_dir=tree)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {resume_from}" in resumed.log
    if "--enable-msc" in args:  # Megatron-LM's own MSC switch was on in both runs (its argument dump)
        assert _MSC_ON.search(killed.log) and _MSC_ON.search(resumed.log)
    assert_same_training(killed, reference, None)
    assert_same_training(resumed, reference, range(resume_from + 1, ITERS + 1))
    assert max(_committed(client, bucket, "run")) == ITERS  # the last save reached the bucket
    assert not any(p.name.startswith(("s3:", "msc:")) for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))
    if scheme == "s3":  # the bucket's latest checkpoint, exported to torch_dist by Megatron-LM's own code
        out = tmp_path / "exported"
        cli = [sys.executable, "-m", "datastates_megatron.cli", "export", url, str(out), "--json"]
        cli += ["--megatron-lm", MEGATRON_LM_DIR, "--timeout-s", "240", "--", *CPU_ONLY, *TINY]
        cli += ["--train-iters", str(ITERS), "--bf16", "--save-interval", "2", *LAZY]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-6000:]
        target = out / f"iter_{ITERS:07d}"
        assert json.loads(done.stdout) == {"path": str(target), "format": "torch_dist", "iteration": ITERS}
        assert foreign_format(str(target)) == "torch_dist" and read_tracker_text(str(out)) == str(ITERS)
    _export_hf_from_the_bucket(url, tmp_path)


def _export_hf_from_the_bucket(url: str, tmp_path: Path) -> None:
    """``--format hf`` reads the bucket's latest checkpoint (verified ranged GETs) and writes a model
    that transformers loads whole: the plain GPT of TINY, trained in bf16, is a bf16 GPT-2."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "datastates_megatron.cli", "export", url, str(out), "--format", "hf", "--json"]
    done = subprocess.run(
        cli, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-6000:]
    target = out / f"iter_{ITERS:07d}-hf"
    assert json.loads(done.stdout) == {"path": str(target), "format": "hf", "iteration": ITERS}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(target), output_loading_info=True)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.dtype == torch.bfloat16
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
