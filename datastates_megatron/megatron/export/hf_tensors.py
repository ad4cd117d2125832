"""The one name table from megatron-core's global tensors to a Hugging Face model's tensors, with
the cut each needs: the fused QKV split per query group, the GLU halves apart (each expert's too),
GPT-2's ``Conv1D`` weights transposed, the vocabulary padding dropped.

A :class:`Rule` reads one layer of one or two global tensors (:class:`Source`) and yields one or
more output tensors; the rules of a model cover every global key of the checkpoint and every layer
of it, or :func:`hf_rules` refuses the checkpoint naming what is left over.  Output shapes are found
by running each cut on ``meta`` tensors, so the plan (names, shapes, shards) is known before any
byte is read.

Thread-safety: plain functions and frozen values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from .global_tensors import GlobalBlock
from .hf_config import HfModel, UnmappableModelError

__all__ = ["Rule", "Source", "hf_rules"]

LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.experts."  # megatron-core's sharded prefix of the routed experts (global expert axis)
_GLU = ("mlp.linear_fc1.weight", EXPERTS + "linear_fc1.weight")  # fused SwiGLU weights, or their halves
# megatron-core's two names of a layer's norms (Transformer Engine's fused ones and the local layers')
_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


@dataclasses.dataclass(frozen=True)
class Source:
    """One global tensor (its sharded key) at one index of its prepended axes (the layer; ``()``
    for a tensor without)."""

    key: str
    at: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """``cut(sources' values) -> outputs``, named ``names``, of ``shapes``."""

    sources: tuple[Source, ...]
    names: tuple[str, ...]
    cut: Callable[..., list[torch.Tensor]]
    shapes: tuple[tuple[int, ...], ...] = ()


# ---------------------------------------------------------------------------------------------- cuts
def _same(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _pair(w: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    return [w, v]


def _transposed(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.t()]


def _vocab(rows: int, t: torch.Tensor) -> list[torch.Tensor]:
    """The first ``rows`` rows: megatron-core pads the vocabulary to a multiple of its TP size."""
    if t.shape[0] < rows:
        raise ValueError(f"{t.shape[0]} vocabulary rows, fewer than --vocab-size={rows}")
    return [t[:rows]]


def _qkv(m: HfModel, t: torch.Tensor) -> list[torch.Tensor]:
    """megatron-core's fused QKV rows (weight or bias) are, per query group, that group's query
    heads, then its key head, then its value head: q, k and v apart, each in head order."""
    per, d, rest = m.heads // m.groups, m.head_dim, t.shape[1:]
    if t.shape[0] != m.groups * (per + 2) * d:
        raise ValueError(f"fused QKV has {t.shape[0]} rows, not {m.groups}*({per}+2)*{d}")
    q, k, v = torch.split(t.reshape(m.groups, (per + 2) * d, *rest), [per * d, d, d], dim=1)
    return [q.reshape(m.heads * d, *rest), k.reshape(m.groups * d, *rest), v.reshape(m.groups * d, *rest)]


def _gpt2_qkv(m: HfModel, t: torch.Tensor) -> list[torch.Tensor]:
    """GPT-2's ``c_attn``: all queries, then all keys, then all values; a weight as ``Conv1D``
    stores it, ``(in, out)``."""
    out = torch.cat(_qkv(m, t), dim=0)
    return [out.t() if t.dim() == 2 else out]


def _glu(t: torch.Tensor) -> list[torch.Tensor]:
    """A fused SwiGLU ``linear_fc1``: its first half of rows is the gate (``w``), the second the up
    projection (``v``), each in TP rank order (megatron-core's sharded layout)."""
    if t.shape[0] % 2:
        raise ValueError(f"fused GLU weight has an odd number of rows ({t.shape[0]})")
    return list(torch.chunk(t, 2, dim=0))


# ---------------------------------------------------------------------------------------------- tables
def _llama(m: HfModel) -> tuple[dict, dict]:
    layer = "model.layers.{l}."
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": ((layer + "input_layernorm.weight",), _same),
        "self_attention.linear_qkv.weight": (
            tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"),
            functools.partial(_qkv, m),
        ),
        "self_attention.linear_proj.weight": ((layer + "self_attn.o_proj.weight",), _same),
        "mlp.linear_fc1.layer_norm_weight": ((layer + "post_attention_layernorm.weight",), _same),
        "mlp.linear_fc1.weight": ((layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), _glu),
        "mlp.linear_fc2.weight": ((layer + "mlp.down_proj.weight",), _same),
    }
    whole = {
        "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), functools.partial(_vocab, m.vocab)),
        "decoder.final_layernorm.weight": (("model.norm.weight",), _same),
        "output_layer.weight": (("lm_head.weight",), functools.partial(_vocab, m.vocab)),
    }
    return per_layer, whole


def _mixtral(m: HfModel) -> tuple[dict, dict]:
    """Llama's attention and norms; the MoE block in the hub's Mixtral names (``block_sparse_moe``,
    ``w1`` gate, ``w3`` up, ``w2`` down) of the published Mixtral checkpoints, which transformers 5
    merges into its fused expert tensors on load."""
    per_layer, whole = _llama(m)
    for mlp in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
        del per_layer[mlp]
    moe = "model.layers.{l}.block_sparse_moe."
    per_layer["mlp.router.weight"] = ((moe + "gate.weight",), _same)
    per_layer[EXPERTS + "linear_fc1.weight"] = ((moe + "experts.{e}.w1.weight", moe + "experts.{e}.w3.weight"), _glu)
    per_layer[EXPERTS + "linear_fc2.weight"] = ((moe + "experts.{e}.w2.weight",), _same)
    return per_layer, whole


def _gpt2(m: HfModel) -> tuple[dict, dict]:
    layer = "transformer.h.{l}."
    qkv = functools.partial(_gpt2_qkv, m)
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": ((layer + "ln_1.weight",), _same),
        "self_attention.linear_qkv.layer_norm_bias": ((layer + "ln_1.bias",), _same),
        "self_attention.linear_qkv.weight": ((layer + "attn.c_attn.weight",), qkv),
        "self_attention.linear_qkv.bias": ((layer + "attn.c_attn.bias",), qkv),
        "self_attention.linear_proj.weight": ((layer + "attn.c_proj.weight",), _transposed),
        "self_attention.linear_proj.bias": ((layer + "attn.c_proj.bias",), _same),
        "mlp.linear_fc1.layer_norm_weight": ((layer + "ln_2.weight",), _same),
        "mlp.linear_fc1.layer_norm_bias": ((layer + "ln_2.bias",), _same),
        "mlp.linear_fc1.weight": ((layer + "mlp.c_fc.weight",), _transposed),
        "mlp.linear_fc1.bias": ((layer + "mlp.c_fc.bias",), _same),
        "mlp.linear_fc2.weight": ((layer + "mlp.c_proj.weight",), _transposed),
        "mlp.linear_fc2.bias": ((layer + "mlp.c_proj.bias",), _same),
    }
    whole = {
        "embedding.word_embeddings.weight": (("transformer.wte.weight",), functools.partial(_vocab, m.vocab)),
        "embedding.position_embeddings.weight": (("transformer.wpe.weight",), _same),
        "decoder.final_layernorm.weight": (("transformer.ln_f.weight",), _same),
        "decoder.final_layernorm.bias": (("transformer.ln_f.bias",), _same),
        "output_layer.weight": (("lm_head.weight",), functools.partial(_vocab, m.vocab)),
    }
    return per_layer, whole


def _canonical(suffix: str) -> str:
    for alias, name in _ALIASES.items():
        if suffix == alias:
            return name
    return suffix


def hf_rules(m: HfModel, blocks: dict[str, list[GlobalBlock]], ckpt: str) -> list[Rule]:
    """The rules that turn the checkpoint's global tensors ``blocks`` into model ``m``'s, in the
    order they are written (the embedding, each layer in order, the final norm, the output layer).
    Raises :class:`UnmappableModelError` naming a global key the table does not map, a tensor the
    model needs that the checkpoint lacks, or a shape that does not fit."""
    per_layer, whole = {"llama": _llama, "mixtral": _mixtral, "gpt2": _gpt2}[m.arch](m)
    by_suffix: dict[str, list[str]] = {}  # canonical layer suffix -> the checkpoint's keys for it
    leftover = []
    for key in blocks:
        if key.startswith(LAYERS):
            suffix = _canonical(key[len(LAYERS) :])
            glu = suffix.removesuffix("_w").removesuffix("_v")
            if suffix in per_layer or (glu != suffix and glu in _GLU and glu in per_layer):
                by_suffix.setdefault(glu, []).append(key)
                continue
        elif key in whole and not (key == "output_layer.weight" and m.tied):
            continue
        leftover.append(key)
    if leftover:
        raise UnmappableModelError(
            f"{ckpt}: global tensor {leftover[0]!r} has no place in the Hugging Face {m.config['architectures'][0]} "
            f"this checkpoint's arguments describe ({len(leftover)} unmapped); nothing is exported"
        )
    head, tail = [], []
    for key, (names, cut) in whole.items():
        if key == "output_layer.weight" and m.tied:
            continue
        after = key.startswith("decoder.") or key == "output_layer.weight"
        (tail if after else head).append(_rule(m, blocks, ckpt, (key,), (), names, cut))
    layers = []
    for layer in range(m.layers):
        for suffix, (names, cut) in per_layer.items():
            keys = sorted(by_suffix.get(suffix, ()))
            if suffix in _GLU and len(keys) == 2:  # the GLU halves as keys of their own
                keys, cut = [k for k in keys if k.endswith("_w")] + [k for k in keys if k.endswith("_v")], _pair
            for e in range(m.experts) if suffix.startswith(EXPERTS) else (None,):
                at = (layer,) if e is None else (layer, e)
                out = tuple(n.format(l=layer, e=e) for n in names)
                layers.append(_rule(m, blocks, ckpt, tuple(keys), at, out, cut))
    rules = head + layers + tail
    return rules


def _rule(m: HfModel, blocks, ckpt: str, keys: tuple[str, ...], at: tuple[int, ...], names, cut) -> Rule:
    """One rule, its output shapes found on ``meta`` tensors."""
    if not keys or any(k not in blocks for k in keys):
        raise UnmappableModelError(
            f"{ckpt}: the checkpoint has no global tensor {(keys or names)[0]!r} that {names[0]} is made from "
            f"(a {m.config['architectures'][0]} needs it)"
        )
    metas = []
    for key in keys:
        gshape = blocks[key][0].block.global_shape
        p = blocks[key][0].prepended
        if len(at) != p or (p and gshape[0] != m.layers):
            raise UnmappableModelError(
                f"{ckpt}: global tensor {key!r} of shape {list(gshape)} does not hold the layers of a "
                f"{m.layers}-layer model (--num-layers={m.layers})"
            )
        if p > 1 and gshape[1] != m.experts:
            raise UnmappableModelError(
                f"{ckpt}: global tensor {key!r} of shape {list(gshape)} does not hold the {m.experts} experts "
                f"of each layer (--num-experts={m.experts})"
            )
        metas.append(torch.empty(gshape[p:], device="meta"))
    try:
        shapes = tuple(tuple(t.shape) for t in cut(*metas))
    except (ValueError, RuntimeError) as e:
        raise UnmappableModelError(f"{ckpt}: global tensor {keys[0]!r} does not fit {names[0]}: {e}") from e
    return Rule(tuple(Source(k, at) for k in keys), tuple(names), cut, shapes)
