"""Which Hugging Face architecture a Megatron GPT checkpoint is, and its ``config.json``, from the
training arguments the checkpoint records (``extra_state["megatron_lm"]["args"]``).

Three settings map exactly: the Llama setting (RoPE, RMSNorm, SwiGLU, grouped-query attention, no
linear biases) is ``LlamaForCausalLM``; the same with every layer's MLP a mixture of experts routed
by megatron-core's default router (top-k of the logits, then a softmax over those k: the same
weights as Mixtral's softmax over all experts renormalised over the top k) is
``MixtralForCausalLM``; the plain GPT setting (learned positions, LayerNorm, GeLU,
biases, as many key/value heads as query heads) is ``GPT2LMHeadModel`` (GPT-NeoX has no learned
positions).  Any argument that changes what the network computes and that the chosen architecture
cannot express is refused with :class:`UnmappableModelError` naming it: a model that loads but
computes something else is never written.

Thread-safety: plain functions on plain values.
"""

from __future__ import annotations

import dataclasses

import torch

from ...engine.errors import CheckpointError

__all__ = ["DTYPES", "HfModel", "UnmappableModelError", "hf_model", "training_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class UnmappableModelError(CheckpointError, ValueError):
    """The checkpoint's model has no exact Hugging Face equivalent (the message names the argument)."""


@dataclasses.dataclass(frozen=True)
class HfModel:
    """The decision, taken once: the architecture, its ``config.json``, and the shape facts the
    tensor mapping needs."""

    arch: str  # "llama" | "mixtral" | "gpt2"
    config: dict
    layers: int
    heads: int
    groups: int  # key/value heads (megatron-core's query groups)
    head_dim: int
    vocab: int  # rows kept of the (padded) vocabulary
    tied: bool
    experts: int = 0  # routed experts per layer (Mixtral); 0 for a dense model


# arguments that change the computation, and the value each mapping needs (a tuple: the values it
# takes; absent from the record: the default)
_COMMON = {
    "multi_latent_attention": False,
    "mtp_num_layers": None,
    "heterogeneous_layers_config_path": None,
    "heterogeneous_layers_config_encoded_json": None,
    "experimental_attention_variant": None,
    "apply_residual_connection_post_layernorm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_layernorm_1p": False,
    "qk_layernorm": False,
    "qk_l2_norm": False,
    "attention_output_gate": False,
    "softmax_type": "vanilla",
    "window_size": None,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "quick_geglu": False,
    "squared_relu": False,
    "hybrid_attention_ratio": 0.0,
    "mrope_section": None,
    "no_rope_freq": None,
    "use_rope_scaling": False,
    "rotary_seq_len_interpolation_factor": None,
    "rope_type": (None, "rope"),
    "rotary_scaling_factor": 1.0,
    "spec": None,  # a custom layer spec: any module at all
    "yaml_cfg": None,
    "use_legacy_models": False,
    "is_hybrid_model": False,
    "enable_gpt_oss": False,
}
_LLAMA = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
}
# Mixtral's MoE block: a softmax router without bias or scaling whose top-k weights sum to 1, SwiGLU
# experts as wide as --moe-ffn-hidden-size, no shared expert, no token dropped, in every layer
_MIXTRAL = {
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,  # softmax over all then top-k, not renormalised: not Mixtral's
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_force_load_balancing": False,
    "moe_enable_routing_replay": False,
    "moe_expert_capacity_factor": None,
    "moe_input_jitter_eps": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_apply_probs_on_input": False,
    "moe_latent_size": None,
    "moe_grouped_gemm": False,  # grouped-GEMM experts are Transformer Engine's: their layout is untested here
    "moe_use_legacy_grouped_gemm": False,
}
_GPT2 = {
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "swiglu": False,
    "add_bias_linear": True,
}


def _mismatches(args: dict, want: dict) -> list[str]:
    out = []
    for name, value in want.items():
        allowed = value if isinstance(value, tuple) else (value,)
        got = args.get(name, allowed[0])
        if got not in allowed and not (None in allowed and got in (0, 0.0, "", [])):
            out.append(f"--{name.replace('_', '-')}={got!r} (needs {' or '.join(map(repr, allowed))})")
    return out


def training_dtype(args: dict) -> torch.dtype:
    """The dtype the model trained in (``--bf16``, ``--fp16``, else fp32)."""
    return torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else torch.float32


def _head_facts(args: dict, ckpt: str) -> tuple[int, int, int, int]:
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    head_dim = int(args.get("kv_channels") or hidden // heads)
    if heads % groups:
        raise UnmappableModelError(f"{ckpt}: --num-query-groups={groups} does not divide {heads} heads")
    return hidden, heads, groups, head_dim


def _decoder_config(args: dict, ckpt: str, ffn: int) -> dict:
    """The ``config.json`` entries Llama and Mixtral share (the attention, norms and RoPE)."""
    hidden, heads, groups, head_dim = _head_facts(args, ckpt)
    if hidden % heads:
        raise UnmappableModelError(
            f"{ckpt}: Llama and Mixtral need --hidden-size={hidden} to be a multiple of --num-attention-heads={heads}"
        )
    return {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": int(args["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(args.get("max_position_embeddings") or args.get("seq_length")),
        "rms_norm_eps": float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))),
        # transformers 5 reads rope_parameters, 4.x rope_theta: both, so that no version falls back
        # to its default base and loads a model that computes something else
        "rope_parameters": {"rope_type": "default", "rope_theta": float(args.get("rotary_base", 10000))},
        "rope_theta": float(args.get("rotary_base", 10000)),
    }


def _mixtral(args: dict, ckpt: str, dtype: torch.dtype, llama: list[str], common_config: dict) -> HfModel:
    """``MixtralForCausalLM``: the Llama setting with a mixture of experts in every layer."""
    experts, topk = int(args["num_experts"]), int(args.get("moe_router_topk") or 2)
    wrong = llama + _mismatches(args, _MIXTRAL)
    freq = args.get("moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and set(freq) == {1}):
        wrong.append(f"--moe-layer-freq={freq!r} (Mixtral has experts in every layer: needs 1)")
    if args.get("moe_router_load_balancing_type") == "sinkhorn":  # its top-k softmax weights sum to less than 1
        wrong.append("--moe-router-load-balancing-type='sinkhorn' (Mixtral renormalises the top-k weights)")
    router = args.get("moe_router_dtype")
    if router not in (None, "fp32") or (router == "fp32" and dtype != torch.float32):
        # Mixtral's router runs in the model's dtype: fp32 logits match it only in an fp32 export
        wrong.append(f"--moe-router-dtype={router!r} (a {_HF_DTYPE[dtype]} Mixtral routes in {_HF_DTYPE[dtype]})")
    if not 0 < topk <= experts:
        wrong.append(f"--moe-router-topk={topk} (needs 1 to --num-experts={experts})")
    if wrong:
        raise UnmappableModelError(f"{ckpt}: no exact Hugging Face equivalent: {wrong[0]} for the Mixtral mapping")
    hidden, heads, groups, head_dim = _head_facts(args, ckpt)
    ffn = int(args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 4 * hidden)
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_decoder_config(args, ckpt, ffn),
        "num_local_experts": experts,
        "num_experts_per_tok": topk,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        **common_config,
    }
    vocab, tied = common_config["vocab_size"], common_config["tie_word_embeddings"]
    return HfModel("mixtral", config, int(args["num_layers"]), heads, groups, head_dim, vocab, tied, experts)


def hf_model(args: dict, ckpt: str, dtype: torch.dtype) -> HfModel:
    """The Hugging Face model of the recorded training ``args`` (a dict), written in ``dtype``; raises
    :class:`UnmappableModelError` naming the first argument that prevents an exact mapping."""
    if not args:
        raise UnmappableModelError(
            f"{ckpt}: records no Megatron-LM training arguments (not saved through Megatron-LM's "
            "save_checkpoint): the architecture cannot be told, nothing is exported"
        )
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if args.get(name) is None:
            raise UnmappableModelError(f"{ckpt}: the recorded arguments lack --{name.replace('_', '-')}")
    common = _mismatches(args, _COMMON)
    if common:
        raise UnmappableModelError(f"{ckpt}: no exact Hugging Face equivalent: {common[0]}")
    hidden, heads, groups, head_dim = _head_facts(args, ckpt)
    llama, gpt2 = _mismatches(args, _LLAMA), _mismatches(args, _GPT2)
    vocab = int(args.get("vocab_size") or args["padded_vocab_size"])  # a tokenizer's run records no --vocab-size
    tied = not args.get("untie_embeddings_and_output_weights", False)
    eps = float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5)))
    layers, ffn = int(args["num_layers"]), int(args.get("ffn_hidden_size") or 4 * hidden)
    positions = int(args.get("max_position_embeddings") or args.get("seq_length"))
    common_config = {
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "dtype": _HF_DTYPE[dtype],
        "torch_dtype": _HF_DTYPE[dtype],  # transformers 4.x's name of it
        "bos_token_id": None,  # the tokenizer is not part of the checkpoint
        "eos_token_id": None,
        "use_cache": True,
    }
    experts = int(args.get("num_experts") or 0)
    if experts:
        return _mixtral(args, ckpt, dtype, llama, common_config)
    if not llama:
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **_decoder_config(args, ckpt, ffn),
            "attention_bias": False,
            "mlp_bias": False,
            **common_config,
        }
        return HfModel("llama", config, layers, heads, groups, head_dim, vocab, tied)
    if not gpt2:
        if groups != heads:
            raise UnmappableModelError(
                f"{ckpt}: GPT-2 has one key/value head per query head: --num-query-groups={groups} "
                f"with {heads} heads has no exact Hugging Face equivalent"
            )
        if head_dim * heads != hidden:
            raise UnmappableModelError(
                f"{ckpt}: GPT-2's head size is hidden/heads: --kv-channels={head_dim} with --hidden-size={hidden} "
                f"and {heads} heads has no exact Hugging Face equivalent"
            )
        # megatron-core's GeLU: erf, unless --openai-gelu or the fused bias-GeLU (both the tanh form)
        tanh = args.get("openai_gelu") or args.get("bias_gelu_fusion")
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": hidden,
            "n_inner": ffn,
            "n_layer": layers,
            "n_head": heads,
            "n_positions": positions,
            "activation_function": "gelu_new" if tanh else "gelu",
            "layer_norm_epsilon": eps,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            **common_config,
        }
        return HfModel("gpt2", config, layers, heads, groups, head_dim, vocab, tied)
    # name the argument of the setting it is nearer to
    nearer = llama if len(llama) <= len(gpt2) else gpt2
    which = "Llama" if nearer is llama else "GPT-2"
    raise UnmappableModelError(f"{ckpt}: no exact Hugging Face equivalent: {nearer[0]} for the {which} mapping")
