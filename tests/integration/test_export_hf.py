"""``datastates-ckpt export --format hf``: a tiny GPT of each supported setting, trained a few steps
by Megatron-LM's own ``pretrain_gpt.py`` with ``--lazy-ckpt`` on CPU ranks, exported, and loaded
with ``transformers.AutoModelForCausalLM``; the logits of a fixed batch match megatron-core's own
forward of the same checkpoint (:mod:`tests.integration.megatron_core_logits`: Megatron-LM's
``gpt_builder`` at TP=PP=1, every tensor filled by its sharded key).

Tolerances, relative to the largest reference logit: fp32 1e-5; bf16 export against the fp32
reference 2e-2 (bf16 keeps 8 bits of mantissa: one rounding of every weight and of the activations
at each of the layers' matmuls).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from datastates_megatron.engine.format.file_format import RankFile
from tests.integration.megatron_lm_runs import LAZY, MEGATRON_LM_DIR, latest, launch

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
)
transformers = pytest.importorskip("transformers")

VOCAB = 600  # padded by megatron-core to a multiple of 128 x TP (640; 768 at TP2)
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LLAMA = ["--position-embedding-type", "rope", "--no-rope-fusion", "--normalization", "RMSNorm", "--swiglu"]
LLAMA += ["--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"]
UNTIED = ["--untie-embeddings-and-output-weights"]
# 4 experts on EP2, megatron-core's default router (top-2 of the logits, softmax over the 2): Mixtral
MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
# setting: (training flags, Hugging Face class, default set or slow)
SETTINGS = {
    "llama_tp2pp2_untied": ([*LLAMA, *UNTIED, *TP2, *PP2], "LlamaForCausalLM", False),
    "llama_pp2_tied": ([*LLAMA, *PP2], "LlamaForCausalLM", True),
    "gpt2_tp2": ([*TP2], "GPT2LMHeadModel", True),
    "mixtral_ep2": ([*LLAMA, *UNTIED, *MOE_EP2], "MixtralForCausalLM", True),
    # each expert's SwiGLU cut across 2 expert-TP ranks (TP1: megatron-core's MoE with TP needs sequence
    # parallelism, which its local RMSNorm, the only one on CPU, refuses)
    "mixtral_ep2_etp2": ([*LLAMA, *MOE_EP2, "--expert-tensor-parallel-size", "2"], "MixtralForCausalLM", True),
    # 4 layers, 2 model chunks per stage: global layer numbers from the chunks' recorded offsets
    "llama_pp2_vpp2": (
        [*LLAMA, *UNTIED, *PP2, "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
        "LlamaForCausalLM",
        True,
    ),  # the tiny model's defaults: learned positions, LayerNorm, GeLU
}
TIMEOUT_S = 900.0
FP32_RTOL, BF16_RTOL = 1e-5, 2e-2


def _params():
    return [pytest.param(k, marks=[pytest.mark.slow] if slow else []) for k, (_, _, slow) in SETTINGS.items()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``setting -> (iter_* directory, fixed batch, megatron-core's fp32 logits)``, each made once."""
    done: dict = {}

    def get(setting: str):
        if setting not in done:
            flags, _, _ = SETTINGS[setting]
            tmp = tmp_path_factory.mktemp(setting)
            save = tmp / "ckpt"
            args = [
                "--train-iters",
                "3",
                "--save-interval",
                "3",
                "--vocab-size",
                str(VOCAB),
                *LAZY,
                "--save",
                str(save),
            ]
            tp_pp = "--tensor-model-parallel-size" in flags and "--pipeline-model-parallel-size" in flags
            nproc = 4 if tp_pp or "--expert-tensor-parallel-size" in flags else 2  # EP2 x ETP2: 4 ranks
            run = launch(tmp, "train", [*args, *flags], nproc=nproc, timeout=TIMEOUT_S)
            assert run.returncode == 0 and latest(save) == 3, run.describe()
            ckpt = save / "iter_0000003"
            tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
            torch.save(tokens, tmp / "tokens.pt")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), MEGATRON_LM_DIR]), PYTHONWARNINGS="ignore")
            ref = subprocess.run(
                [sys.executable, "-m", "tests.integration.megatron_core_logits", str(ckpt), str(tmp / "tokens.pt")]
                + [str(tmp / "ref.pt"), "fp32"],
                capture_output=True,
                text=True,
                env=env,
                timeout=TIMEOUT_S,
            )
            assert ref.returncode == 0, ref.stderr[-4000:]
            logits = torch.load(tmp / "ref.pt")["logits"]
            assert logits.shape[:2] == (2, 24) and logits.shape[2] > VOCAB  # padded to a multiple of 128 x TP
            done[setting] = (ckpt, tokens, logits[..., :VOCAB])
        return done[setting]

    return get


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "datastates_megatron.cli", "export", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )


def _logits(model_dir: str, tokens: torch.Tensor, cls: str) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == cls
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("setting", _params())
def test_the_export_loads_in_transformers_and_computes_megatron_cores_logits(setting, trained, tmp_path):
    ckpt, tokens, want = trained(setting)
    done = _cli(str(ckpt.parent), str(tmp_path / "out"), "--format", "hf", "--max-shard-mb", "0.2", "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    model_dir = tmp_path / "out" / "iter_0000003-hf"
    assert doc == {"path": str(model_dir), "format": "hf", "iteration": 3}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_0000003-hf"]  # no staging left
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(
        [*shards, "model.safetensors.index.json", "config.json", "generation_config.json"]
    )
    got = _logits(str(model_dir), tokens, SETTINGS[setting][1])
    assert got.shape == want.shape  # the vocabulary padding is gone
    assert _relative(got, want) <= FP32_RTOL


def test_a_bf16_export_is_within_bf16_rounding_of_the_fp32_forward(trained, tmp_path):
    ckpt, tokens, want = trained("llama_tp2pp2_untied")
    done = _cli(str(ckpt), str(tmp_path / "out"), "--format", "hf", "--dtype", "bf16")
    assert done.returncode == 0, done.stderr[-4000:]
    model_dir = tmp_path / "out" / "iter_0000003-hf"
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(model_dir / "model-00001-of-00001.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    got = _logits(str(model_dir), tokens, "LlamaForCausalLM")
    assert 0 < _relative(got, want) <= BF16_RTOL  # not zero: the export is bf16, not the fp32 weights


def test_dry_run_prints_the_mapping_and_the_shards_and_writes_nothing(trained, tmp_path):
    ckpt, _, _ = trained("llama_tp2pp2_untied")
    out = tmp_path / "out"
    done = _cli(str(ckpt), str(out), "--format", "hf", "--dry-run")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"LlamaForCausalLM -> {out / 'iter_0000003-hf'} (float32)"
    assert (
        "  decoder.layers.self_attention.linear_qkv.weight[1] -> model.layers.1.self_attn.k_proj.weight [32, 64] "
        "model-00001-of-00001.safetensors" in lines
    )
    assert "  output_layer.weight -> lm_head.weight [600, 64] model-00001-of-00001.safetensors" in lines
    assert any(line.startswith("  model-00001-of-00001.safetensors: ") for line in lines)
    assert not out.exists()


def test_an_existing_export_is_never_overwritten(trained, tmp_path):
    ckpt, _, _ = trained("llama_tp2pp2_untied")
    first = _cli(str(ckpt), str(tmp_path), "--format", "hf")
    assert first.returncode == 0, first.stderr[-4000:]
    config = tmp_path / "iter_0000003-hf" / "config.json"
    before = config.read_bytes()
    again = _cli(str(ckpt), str(tmp_path), "--format", "hf", "--dtype", "bf16")
    assert again.returncode != 0
    assert "exists; nothing was overwritten" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert config.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003-hf"]


def test_a_damaged_rank_file_ends_the_export_in_one_line_and_leaves_nothing(trained, tmp_path):
    ckpt, _, _ = trained("llama_tp2pp2_untied")
    copy = tmp_path / "ckpt" / ckpt.name
    shutil.copytree(ckpt, copy)
    victim = sorted(copy.glob("*.dsck"))[-1]
    rank_file = RankFile(str(victim))
    try:  # a byte in the middle of its parameters' bucket (DP1: every parameter of the rank is there)
        entry = max((e for n, e in rank_file.entries.items() if n.endswith("param_shard")), key=lambda e: e.nbytes)
        at = entry.offset + entry.nbytes // 2
    finally:
        rank_file.close()
    with open(victim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    done = _cli(str(copy), str(out), "--format", "hf")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and victim.name in lines[0], done.stderr[-4000:]
    assert not out.exists() or not any(out.iterdir())  # no model directory, no staging left
