"""The pieces of the export from global coordinates that need no checkpoint: the single-rank names of
a global tensor, the share of blocks among processes, and the safetensors file read back by the
``safetensors`` library."""

from __future__ import annotations

import pytest
import torch

from datastates_megatron.megatron.checkpointing.reshard import Block
from datastates_megatron.megatron.export.dist_export import share
from datastates_megatron.megatron.export.global_tensors import GlobalBlock, exported_names, megatron_key
from datastates_megatron.megatron.export.safetensors_file import SafetensorsWriter


def _gb(name: str, key: str, global_shape, offset, shape, prepended: int) -> GlobalBlock:
    return GlobalBlock(
        ("pp1.tp0", 0, name), Block(key, tuple(global_shape), tuple(offset), tuple(shape), False), "float32", prepended
    )


def test_the_layer_axis_becomes_global_layer_numbers_in_the_parameters_own_name():
    # stage 1 of PP2 holds local layer 0 = global layer 2 of 4; the name keeps the local number's place
    gb = _gb(
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        (4, 12, 4),
        (2, 0, 0),
        (1, 6, 4),
        1,
    )
    names = exported_names(gb.block.key, [gb])
    assert names == [(f"decoder.layers.{i}.self_attention.linear_qkv.weight", (i,)) for i in range(4)]


def test_layer_and_expert_axes_both_expand():
    key = "decoder.layers.mlp.experts.local_experts.linear_fc1.weight"
    gb = _gb(
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
        key,
        (2, 4, 8, 4),
        (1, 2, 0, 0),
        (1, 1, 8, 4),
        2,
    )
    names = dict(exported_names(key, [gb]))
    assert len(names) == 8
    assert names["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (1, 3)


def test_a_key_without_prepended_axes_is_its_own_name_and_an_unaligned_one_stays_whole():
    gb = _gb("output_layer.weight", "embedding.word_embeddings.weight", (768, 64), (384, 0), (384, 64), 0)
    assert exported_names(gb.block.key, [gb]) == [("embedding.word_embeddings.weight", ())]
    odd = _gb("decoder.other.weight", "decoder.layers.weight", (2, 3), (0, 0), (1, 3), 1)
    assert exported_names(odd.block.key, [odd]) == [("decoder.layers.weight", ())]


def test_a_key_the_module_renames_still_gets_the_layer_number_and_loses_the_wrappers_prefix():
    key = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    gb = _gb("module.decoder.layers.0.input_layernorm.weight", "module." + key, (2, 64), (1, 0), (1, 64), 1)
    blocks = {"k": [gb]}
    assert megatron_key(gb.block.key) == key
    assert [n for n, _ in exported_names(key, blocks["k"])] == [
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
    ]


def test_blocks_are_shared_largest_first_and_the_same_everywhere():
    blocks = [_gb(f"p{i}", f"k{i}", (n,), (0,), (n,), 0) for i, n in enumerate([5, 40, 7, 30, 1])]
    owner = share(blocks, 2)
    assert owner == share(list(blocks), 2)
    load = [sum(b.numel for b, o in zip(blocks, owner) if o == p) for p in range(2)]
    assert sorted(load) == [41, 42]  # 40 | 30, 7, 5 | then 1
    assert share(blocks, 1) == [0] * 5


def test_the_safetensors_library_reads_the_file_back(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {
        "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c.steps": torch.arange(3, dtype=torch.int64),
    }
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        w = SafetensorsWriter(f, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], {"iteration": 4})
        for k, v in tensors.items():
            w.write(k, v)
        w.close()
    got = safetensors.load_file(str(path))
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"iteration": "4"}


def test_the_writer_refuses_what_the_header_did_not_declare(tmp_path):
    with open(tmp_path / "m.safetensors", "wb") as f:
        w = SafetensorsWriter(f, [("a", (2,), torch.float32)])
        with pytest.raises(ValueError, match="declared"):
            w.write("a", torch.zeros(3))
        with pytest.raises(ValueError, match="not written"):
            w.close()


def _index(params: dict):
    """A checkpoint index of ``{parameter name: (local shape, blocks)}`` (slice ``pp1.tp0``, chunk 0)."""
    from datastates_megatron.megatron.checkpointing.reshard import CheckpointIndex

    index = CheckpointIndex()
    for name, (shape, blocks) in params.items():
        index.params[("pp1.tp0", 0, name)] = (tuple(shape), "float32")
        index.blocks[("pp1.tp0", 0, name)] = tuple(blocks)
        index.origins[("pp1.tp0", 0, name)] = f"ckpt/rank_0.bin: rank 0 tensor {name}"
    return index


def test_global_blocks_takes_a_parameter_of_one_block_and_a_factorys_pieces():
    # a fused GLU weight (--swiglu) records its w and v halves, each a block of its own global key with
    # the parameter element it starts at; a plain parameter records one block
    from datastates_megatron.megatron.export.global_tensors import global_blocks

    w = Block("decoder.layers.mlp.linear_fc1.weight_w", (1, 8, 4), (0, 0, 0), (1, 8, 4), False, 0)
    v = Block("decoder.layers.mlp.linear_fc1.weight_v", (1, 8, 4), (0, 0, 0), (1, 8, 4), False, 32)
    emb = Block("embedding.word_embeddings.weight", (16, 4), (0, 0), (16, 4), False)
    index = _index(
        {
            "decoder.layers.0.mlp.linear_fc1.weight": ((16, 4), [v, w]),
            "embedding.word_embeddings.weight": ((16, 4), [emb]),
        }
    )
    got = global_blocks(index, "ckpt")
    assert sorted(got) == sorted([emb.key, v.key, w.key])
    assert got[v.key][0].block.start == 32 and got[v.key][0].prepended == 1


@pytest.mark.parametrize(
    "offset,shape,named",
    [
        ((4, 0), (8, 4), "over element .* which the block at offset"),  # overlaps the first, right count
        ((20, 0), (8, 4), "outside its global shape"),  # past the end of the tensor
        ((8, 0), (-8, 4), "a negative offset or size"),  # a negative extent
    ],
    ids=["overlap", "past_the_end", "negative_shape"],
)
def test_blocks_that_do_not_tile_the_tensor_exactly_are_refused_naming_it(offset, shape, named):
    from datastates_megatron.engine.errors import CheckpointError
    from datastates_megatron.megatron.export.global_tensors import global_blocks

    key = "embedding.word_embeddings.weight"
    first = Block(key, (16, 4), (0, 0), (8, 4), False)
    other = Block(key, (16, 4), offset, shape, False)
    index = _index({"a.weight": ((8, 4), [first]), "b.weight": ((8, 4), [other])})
    with pytest.raises(CheckpointError, match=named) as refused:
        global_blocks(index, "ckpt")
    assert "\n" not in str(refused.value) and "b.weight" in str(refused.value)
