"""``--format hf`` without Megatron-LM: the architecture decision from recorded arguments and its
refusals (one line, naming the argument), the name table's cuts (fused QKV per query group, the GLU
halves, GPT-2's transposes, the vocabulary padding), and the CLI's refusals before anything is written."""

from __future__ import annotations

import pytest
import torch

from datastates_megatron.cli import EXIT_USAGE, main
from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.megatron.checkpointing.reshard import Block
from datastates_megatron.megatron.export.global_tensors import GlobalBlock
from datastates_megatron.megatron.export.hf_config import UnmappableModelError, hf_model
from datastates_megatron.megatron.export.hf_tensors import Source, hf_rules
from tests.managers import one_checkpoint

LLAMA_ARGS = {
    "num_layers": 2,
    "hidden_size": 16,
    "ffn_hidden_size": 24,
    "num_attention_heads": 4,
    "group_query_attention": True,
    "num_query_groups": 2,
    "kv_channels": 4,
    "padded_vocab_size": 128,
    "vocab_size": 100,
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "rotary_base": 500000,
    "untie_embeddings_and_output_weights": True,
    "layernorm_epsilon": 1e-6,
    "max_position_embeddings": 64,
}
GPT2_ARGS = {
    **LLAMA_ARGS,
    "group_query_attention": False,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "swiglu": False,
    "add_bias_linear": True,
    "untie_embeddings_and_output_weights": False,
}
MIXTRAL_ARGS = {**LLAMA_ARGS, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 12}


def test_the_llama_setting_is_a_llama_config_from_the_recorded_arguments():
    m = hf_model(LLAMA_ARGS, "ckpt", torch.bfloat16)
    c = m.config
    assert (m.arch, m.groups, m.head_dim, m.vocab, m.tied) == ("llama", 2, 4, 100, False)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == 2
    assert c["rope_parameters"]["rope_theta"] == c["rope_theta"] == 500000.0 and c["rms_norm_eps"] == 1e-6
    assert (c["intermediate_size"], c["vocab_size"], c["dtype"]) == (24, 100, "bfloat16")


def test_the_plain_gpt_setting_is_gpt2_and_its_gelu_is_the_one_megatron_ran():
    m = hf_model(GPT2_ARGS, "ckpt", torch.float32)
    assert m.config["architectures"] == ["GPT2LMHeadModel"] and m.tied
    assert m.config["activation_function"] == "gelu"  # erf, megatron-core's F.gelu
    tanh = hf_model({**GPT2_ARGS, "bias_gelu_fusion": True}, "ckpt", torch.float32)
    assert tanh.config["activation_function"] == "gelu_new"  # the fused bias-GeLU is the tanh form


def test_a_moe_of_the_llama_setting_with_megatron_cores_default_router_is_mixtral():
    m = hf_model(MIXTRAL_ARGS, "ckpt", torch.float32)
    c = m.config
    assert (m.arch, m.experts, c["architectures"], c["model_type"]) == ("mixtral", 4, ["MixtralForCausalLM"], "mixtral")
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]) == (4, 2, 12)
    assert (c["num_key_value_heads"], c["head_dim"], c["router_jitter_noise"], c["sliding_window"]) == (2, 4, 0.0, None)
    assert hf_model({**MIXTRAL_ARGS, "moe_layer_freq": [1, 1]}, "ckpt", torch.float32).experts == 4
    assert hf_model({**MIXTRAL_ARGS, "moe_router_dtype": "fp32"}, "ckpt", torch.float32).experts == 4


REFUSED = {
    "moe of gpt2": ({**GPT2_ARGS, "num_experts": 8}, "--position-embedding-type='learned_absolute'"),
    "moe pre-softmax": ({**MIXTRAL_ARGS, "moe_router_pre_softmax": True}, "--moe-router-pre-softmax=True"),
    "moe sigmoid": ({**MIXTRAL_ARGS, "moe_router_score_function": "sigmoid"}, "--moe-router-score-function"),
    "moe scaled": ({**MIXTRAL_ARGS, "moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor"),
    "moe shared expert": ({**MIXTRAL_ARGS, "moe_shared_expert_intermediate_size": 8}, "--moe-shared-expert"),
    "moe grouped gemm": ({**MIXTRAL_ARGS, "moe_grouped_gemm": True}, "--moe-grouped-gemm=True"),
    "moe capacity": ({**MIXTRAL_ARGS, "moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor=1.0"),
    "moe expert bias": ({**MIXTRAL_ARGS, "moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias"),
    "moe group-limited": ({**MIXTRAL_ARGS, "moe_router_num_groups": 2}, "--moe-router-num-groups=2"),
    "moe probs on input": ({**MIXTRAL_ARGS, "moe_apply_probs_on_input": True}, "--moe-apply-probs-on-input=True"),
    "moe dense layers": ({**MIXTRAL_ARGS, "moe_layer_freq": [1, 0]}, "--moe-layer-freq=[1, 0]"),
    "moe top-k": ({**MIXTRAL_ARGS, "moe_router_topk": 5}, "--moe-router-topk=5"),
    "moe sinkhorn": (
        {**MIXTRAL_ARGS, "moe_router_load_balancing_type": "sinkhorn"},
        "--moe-router-load-balancing-type",
    ),
    "moe fp64 router": ({**MIXTRAL_ARGS, "moe_router_dtype": "fp64"}, "--moe-router-dtype='fp64'"),
    "moe with qk norm": ({**MIXTRAL_ARGS, "qk_layernorm": True}, "--qk-layernorm=True"),
    "qk norm": ({**LLAMA_ARGS, "qk_layernorm": True}, "--qk-layernorm=True"),
    "interleaved rope": ({**LLAMA_ARGS, "rotary_interleaved": True}, "--rotary-interleaved=True"),
    "partial rope": ({**LLAMA_ARGS, "rotary_percent": 0.5}, "--rotary-percent=0.5"),
    "llama with biases": ({**LLAMA_ARGS, "add_bias_linear": True}, "--add-bias-linear=True"),
    "gpt2 with gqa": ({**GPT2_ARGS, "group_query_attention": True}, "--num-query-groups=2"),
    "gpt2 with rmsnorm": ({**GPT2_ARGS, "normalization": "RMSNorm"}, "--normalization='RMSNorm'"),
    "squared relu": ({**GPT2_ARGS, "squared_relu": True}, "--squared-relu=True"),
    "post-norm": ({**LLAMA_ARGS, "apply_residual_connection_post_layernorm": True}, "--apply-residual-connection"),
    "custom spec": ({**LLAMA_ARGS, "spec": ["my.module", "layer_spec"]}, "--spec=['my.module', 'layer_spec']"),
    "yarn": ({**LLAMA_ARGS, "rope_type": "yarn"}, "--rope-type='yarn' (needs None or 'rope')"),
    "no arguments": ({}, "records no Megatron-LM training arguments"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_architecture_without_an_exact_equivalent_is_refused_naming_the_argument(case):
    args, named = REFUSED[case]
    with pytest.raises(UnmappableModelError) as e:
        hf_model(args, "/ck/iter_0000003", torch.float32)
    assert named in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("/ck/iter_0000003")


def _blocks(shapes: dict) -> dict:
    """``{key: [GlobalBlock]}`` of whole tensors (the cuts read one layer of them)."""
    out = {}
    for key, shape in shapes.items():
        p = 1 if key.startswith("decoder.layers.") else 0
        out[key] = [GlobalBlock(("", 0, key), Block(key, shape, (0,) * len(shape), shape, False), "float32", p)]
    return out


LLAMA_KEYS = {
    "embedding.word_embeddings.weight": (128, 16),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),  # 2 groups x (2 q + k + v) x 4
    "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
    "decoder.layers.mlp.linear_fc1.weight": (2, 48, 16),
    "decoder.layers.mlp.linear_fc2.weight": (2, 16, 24),
    "decoder.final_layernorm.weight": (16,),
    "output_layer.weight": (128, 16),
}


def _rule(rules, name):
    return next(r for r in rules if name in r.names)


def test_fused_qkv_splits_per_query_group_and_glu_into_its_halves():
    m = hf_model(LLAMA_ARGS, "ckpt", torch.float32)
    rules = hf_rules(m, _blocks(LLAMA_KEYS), "ckpt")
    qkv = _rule(rules, "model.layers.1.self_attn.q_proj.weight")
    # rows of megatron-core's fused QKV: group g holds q heads 2g, 2g+1, then k head g, then v head g
    rows = []
    for g in range(2):
        rows += [("q", 2 * g), ("q", 2 * g + 1), ("k", g), ("v", g)]
    code = {"q": 0, "k": 100, "v": 200}
    t = torch.tensor([code[kind] + head for kind, head in rows], dtype=torch.float32).repeat_interleave(4)
    t = t[:, None].expand(32, 16)
    q, k, v = qkv.cut(t)
    assert q[::4, 0].tolist() == [0, 1, 2, 3] and k[::4, 0].tolist() == [100, 101] and v[::4, 0].tolist() == [200, 201]
    assert qkv.shapes == ((16, 16), (8, 16), (8, 16)) and qkv.sources[0].at == (1,)
    fc1 = _rule(rules, "model.layers.0.mlp.gate_proj.weight")
    gate, up = fc1.cut(torch.arange(48.0)[:, None].expand(48, 16))
    assert gate[:, 0].tolist() == list(range(24)) and up[:, 0].tolist() == list(range(24, 48))
    emb = _rule(rules, "model.embed_tokens.weight")
    assert emb.shapes == ((100, 16),)  # the padding rows are dropped
    names = [n for r in rules for n in r.names]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert len(names) == len(set(names)) == 3 + 2 * 9


def test_glu_halves_recorded_as_keys_of_their_own_are_the_gate_and_the_up_projection():
    keys = dict(LLAMA_KEYS)
    del keys["decoder.layers.mlp.linear_fc1.weight"]
    keys["decoder.layers.mlp.linear_fc1.weight_w"] = keys["decoder.layers.mlp.linear_fc1.weight_v"] = (2, 24, 16)
    rules = hf_rules(hf_model(LLAMA_ARGS, "ckpt", torch.float32), _blocks(keys), "ckpt")
    fc1 = _rule(rules, "model.layers.1.mlp.up_proj.weight")
    assert [s.key for s in fc1.sources] == [
        "decoder.layers.mlp.linear_fc1.weight_w",
        "decoder.layers.mlp.linear_fc1.weight_v",
    ]
    w, v = torch.zeros(24, 16), torch.ones(24, 16)
    gate, up = fc1.cut(w, v)
    assert gate is w and up is v


def test_gpt2_weights_are_conv1d_transposed_and_qkv_is_all_queries_then_keys_then_values():
    keys = {
        "embedding.word_embeddings.weight": (128, 16),
        "embedding.position_embeddings.weight": (64, 16),
        "decoder.final_layernorm.weight": (16,),
        "decoder.final_layernorm.bias": (16,),
    }
    for suffix, shape in {
        "self_attention.linear_qkv.layer_norm_weight": (16,),
        "self_attention.linear_qkv.layer_norm_bias": (16,),
        "self_attention.linear_qkv.weight": (48, 16),
        "self_attention.linear_qkv.bias": (48,),
        "self_attention.linear_proj.weight": (16, 16),
        "self_attention.linear_proj.bias": (16,),
        "mlp.linear_fc1.layer_norm_weight": (16,),
        "mlp.linear_fc1.layer_norm_bias": (16,),
        "mlp.linear_fc1.weight": (24, 16),
        "mlp.linear_fc1.bias": (24,),
        "mlp.linear_fc2.weight": (16, 24),
        "mlp.linear_fc2.bias": (16,),
    }.items():
        keys["decoder.layers." + suffix] = (2, *shape)
    m = hf_model(GPT2_ARGS, "ckpt", torch.float32)
    rules = hf_rules(m, _blocks(keys), "ckpt")
    assert _rule(rules, "transformer.h.0.mlp.c_fc.weight").shapes == ((16, 24),)
    bias = _rule(rules, "transformer.h.1.attn.c_attn.bias")
    rows = []  # 4 groups (one per head) of q, k, v rows of 4
    for h in range(4):
        rows += [h, 100 + h, 200 + h]
    (out,) = bias.cut(torch.tensor(rows, dtype=torch.float32).repeat_interleave(4))
    assert out[::4].tolist() == [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203]
    names = [n for r in rules for n in r.names]
    assert "lm_head.weight" not in names and names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]


def test_a_global_tensor_the_table_does_not_place_is_refused_naming_it():
    keys = {**LLAMA_KEYS, "decoder.layers.self_attention.linear_qkv.bias": (2, 32)}
    with pytest.raises(UnmappableModelError, match="'decoder.layers.self_attention.linear_qkv.bias' has no place"):
        hf_rules(hf_model(LLAMA_ARGS, "ckpt", torch.float32), _blocks(keys), "ckpt")
    fewer = {**LLAMA_KEYS, "decoder.layers.mlp.linear_fc2.weight": (3, 16, 24)}  # 3 layers, --num-layers 2
    with pytest.raises(UnmappableModelError, match="--num-layers=2"):
        hf_rules(hf_model(LLAMA_ARGS, "ckpt", torch.float32), _blocks(fewer), "ckpt")
    lacking = dict(LLAMA_KEYS)
    del lacking["output_layer.weight"]  # untied, yet no output layer
    with pytest.raises(UnmappableModelError, match="no global tensor 'output_layer.weight'"):
        hf_rules(hf_model(LLAMA_ARGS, "ckpt", torch.float32), _blocks(lacking), "ckpt")


def test_a_shape_that_does_not_fit_the_arguments_is_refused():
    keys = {**LLAMA_KEYS, "decoder.layers.self_attention.linear_qkv.weight": (2, 30, 16)}
    with pytest.raises(UnmappableModelError, match="does not fit model.layers.0.self_attn.q_proj.weight"):
        hf_rules(hf_model(LLAMA_ARGS, "ckpt", torch.float32), _blocks(keys), "ckpt")


def _with_args(root, args: dict):
    with CheckpointManager(str(root), EngineOptions(cache_bytes=1 << 20, timeout_s=30), keep_last=0) as mgr:
        mgr.register("w", torch.zeros(4))
        mgr.save(1, {"iteration": 1, "extra_state": {"megatron_lm": {"args": args}}})
        mgr.wait()
    return root


def test_an_fp32_router_of_a_bf16_export_is_refused():
    """Mixtral routes in the model's dtype: fp32 router logits in a bf16 model could pick other experts."""
    with pytest.raises(
        UnmappableModelError, match="--moe-router-dtype='fp32' \\(a bfloat16 Mixtral routes in bfloat16\\)"
    ):
        hf_model({**MIXTRAL_ARGS, "moe_router_dtype": "fp32"}, "ckpt", torch.bfloat16)


MIXTRAL_KEYS = {
    **{k: v for k, v in LLAMA_KEYS.items() if not k.startswith("decoder.layers.mlp.linear_fc")},
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
    "decoder.layers.mlp.router.weight": (2, 4, 16),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 24, 16),  # layer, global expert, 2 x 12 rows
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 16, 12),
}


def _blocks_of(shapes: dict) -> dict:
    """``_blocks`` with the expert axis prepended too (megatron-core's global expert number)."""
    out = _blocks(shapes)
    for key, shape in shapes.items():
        if ".experts." in key:
            out[key] = [GlobalBlock(("", 0, key), Block(key, shape, (0,) * len(shape), shape, False), "float32", 2)]
    return out


def test_each_expert_of_each_layer_is_its_gate_up_and_down_in_the_hub_names():
    m = hf_model(MIXTRAL_ARGS, "ckpt", torch.float32)
    rules = hf_rules(m, _blocks_of(MIXTRAL_KEYS), "ckpt")
    fc1 = _rule(rules, "model.layers.1.block_sparse_moe.experts.3.w3.weight")
    assert fc1.names == ("model.layers.1.block_sparse_moe.experts.3.w1.weight", fc1.names[1])
    assert fc1.sources[0].at == (1, 3) and fc1.shapes == ((12, 16), (12, 16))
    gate, up = fc1.cut(torch.arange(24.0)[:, None].expand(24, 16))  # megatron-core's GLU: gate rows first
    assert gate[:, 0].tolist() == list(range(12)) and up[:, 0].tolist() == list(range(12, 24))
    assert _rule(rules, "model.layers.0.block_sparse_moe.experts.2.w2.weight").sources[0].at == (0, 2)
    router = _rule(rules, "model.layers.1.block_sparse_moe.gate.weight")
    assert router.shapes == ((4, 16),) and router.sources[0] == Source("decoder.layers.mlp.router.weight", (1,))
    names = [n for r in rules for n in r.names]
    assert len(names) == len(set(names)) == 3 + 2 * (7 + 4 * 3)
    assert not any("mlp.gate_proj" in n or "mlp.down_proj" in n for n in names)


def test_experts_recorded_for_another_expert_count_are_refused():
    keys = {**MIXTRAL_KEYS, "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 8, 16, 12)}
    with pytest.raises(UnmappableModelError, match="does not hold the 4 experts of each layer \\(--num-experts=4\\)"):
        hf_rules(hf_model(MIXTRAL_ARGS, "ckpt", torch.float32), _blocks_of(keys), "ckpt")
    dense = {**LLAMA_KEYS, "decoder.layers.mlp.router.weight": (2, 4, 16)}  # a dense MLP: not this model's
    with pytest.raises(UnmappableModelError, match="'decoder.layers.mlp.linear_fc1.weight' has no place"):
        hf_rules(hf_model(MIXTRAL_ARGS, "ckpt", torch.float32), _blocks_of(dense), "ckpt")


@pytest.mark.parametrize("what", ["no arguments", "moe grouped gemm"])
def test_the_cli_refuses_in_one_line_and_writes_nothing(what, tmp_path, capsys):
    ckpt = (
        one_checkpoint(tmp_path / "ckpt") if what == "no arguments" else _with_args(tmp_path / "ckpt", REFUSED[what][0])
    )
    out = tmp_path / "out"
    assert main(["export", str(ckpt), str(out), "--format", "hf"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and REFUSED[what][1] in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "safetensors", "--dtype", "bf16"], "export --dtype applies to --format hf only"),
        (["--format", "torch_dist", "--dry-run"], "export --dry-run applies to --format hf only"),
        (["--format", "hf", "--max-shard-mb", "0"], "export --max-shard-mb must be positive, got 0.0"),
        (["--format", "hf", "--", "--num-layers", "2"], "runs no Megatron-LM"),
    ],
)
def test_hf_usage_errors_are_one_line(args, message, tmp_path, capsys):
    ckpt = one_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(ckpt), str(tmp_path / "out"), *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_transformers_reads_the_experts_of_the_mixtral_config_written():
    transformers = pytest.importorskip("transformers")
    config = dict(hf_model(MIXTRAL_ARGS, "ckpt", torch.float32).config)
    config.pop("architectures"), config.pop("model_type")
    got = transformers.MixtralConfig(**config)
    assert (got.num_local_experts, got.num_experts_per_tok, got.intermediate_size) == (4, 2, 12)
    assert got.rope_parameters["rope_theta"] == 500000.0 and got.head_dim == 4 and got.router_jitter_noise == 0.0


def test_transformers_reads_the_rope_base_and_the_dtype_of_the_config_written():
    """A base other than transformers' default: a config it misread would load and compute otherwise."""
    transformers = pytest.importorskip("transformers")
    config = dict(hf_model(LLAMA_ARGS, "ckpt", torch.bfloat16).config)
    config.pop("architectures"), config.pop("model_type")
    got = transformers.LlamaConfig(**config)
    assert got.rope_parameters["rope_theta"] == 500000.0 and got.dtype == torch.bfloat16
    assert (got.head_dim, got.num_key_value_heads, got.intermediate_size) == (4, 2, 24)
