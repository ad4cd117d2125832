"""``shards.global_blocks`` of a ``ShardedTensorFactory`` (megatron-core's fused GLU weight with
``--swiglu``): its ``w`` and ``v`` halves are recorded as blocks of their own, each with the parameter
element it starts at, and ``reshard.block_segments`` maps a TP2 rank's fused weight onto the TP1
one's halves, checked element for element against the fused weights megatron-core's layout implies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory  # noqa: E402

from datastates_megatron.megatron.checkpointing.reshard import blocks_of, block_segments  # noqa: E402
from datastates_megatron.megatron.checkpointing.shards import _factory_blocks  # noqa: E402

FFN, HIDDEN, LAYERS = 8, 3, 2
W = torch.arange(LAYERS * FFN * HIDDEN, dtype=torch.float32).view(LAYERS, FFN, HIDDEN)
V = -W - 1


def _fused(layer: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s fused fc1 weight at TP ``tp``: its rows of ``w``, then its rows of ``v``."""
    n = FFN // tp
    return torch.cat([W[layer, rank * n : (rank + 1) * n], V[layer, rank * n : (rank + 1) * n]]).contiguous()


def _recorded(layer: int, tp: int, rank: int):
    param = torch.nn.Parameter(_fused(layer, tp, rank))
    sh = ShardedTensor.from_rank_offsets(
        "decoder.layers.mlp.linear_fc1.weight", param, (0, layer, LAYERS), (1, rank, tp), prepend_axis_num=1
    )
    factory = apply_swiglu_sharded_factory(sh, ((0, layer, LAYERS),))
    return param, _factory_blocks(factory, param, ShardedTensor, nested_values)


def test_a_fused_glu_weight_records_its_halves_in_parameter_order():
    param, pieces = _recorded(1, 2, 1)
    assert pieces is not None and [p[5] for p in pieces] == [0, param.numel() // 2]
    w, v = blocks_of(pieces)
    assert w.key == v.key and w.global_shape == v.global_shape == (LAYERS, 2 * FFN, HIDDEN)
    assert (w.offset, v.offset) == ((1, FFN // 2, 0), (1, FFN + FFN // 2, 0))
    assert w.shape == v.shape == (1, FFN // 2, HIDDEN) and w.size + v.size == param.numel()


@pytest.mark.parametrize("layer", range(LAYERS))
@pytest.mark.parametrize("rank", range(2))
def test_a_tp2_fused_weight_maps_onto_the_tp1_halves(layer, rank):
    old_param, old_pieces = _recorded(layer, 1, 0)
    olds = [(("old", i), b) for i, b in enumerate(blocks_of(old_pieces))]
    starts = {name: b.start for name, b in olds}
    flat_old = old_param.detach().view(-1)
    new_param, new_pieces = _recorded(layer, 2, rank)
    got = torch.full((new_param.numel(),), float("nan"))
    for b in blocks_of(new_pieces):
        segments, gaps = block_segments(b, olds, 0, b.size)
        assert not gaps
        for name, oa, ob, pos in segments:
            got[b.start + pos : b.start + pos + ob - oa] = flat_old[starts[name] + oa : starts[name] + ob]
    assert torch.equal(got, new_param.detach().view(-1))


def test_pieces_that_do_not_tile_the_parameter_have_no_global_coordinates():
    param = torch.nn.Parameter(_fused(0, 2, 0))

    class Half:  # a factory building only the first half
        def build(self):
            return [ShardedTensor.from_rank_offsets("k", param.data[: FFN // 2], (0, 0, 4))]

    assert _factory_blocks(Half(), param, ShardedTensor, nested_values) is None
