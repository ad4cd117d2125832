"""``reshard.block_segments``: a new rank's flattened parameter block, element range by element range,
from the flattened blocks of another tensor-/pipeline-parallel layout (megatron-core's global
coordinates), checked element for element against numpy slicing of one global tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datastates_megatron.megatron.checkpointing.reshard import Block, block_segments


def _blocks(global_shape, axis, parts, prepend=None):
    """``parts`` blocks of ``global_shape`` split evenly on ``axis`` (``prepend``: a leading layer
    axis of which each block holds index ``prepend``)."""
    out = []
    for i in range(parts):
        n = global_shape[axis] // parts
        offset = [0] * len(global_shape)
        shape = list(global_shape)
        offset[axis], shape[axis] = i * n, n
        if prepend is not None:
            offset[0], shape[0] = prepend, 1
        out.append(Block("w", tuple(global_shape), tuple(offset), tuple(shape), False))
    return out


def _local(full: np.ndarray, b: Block) -> np.ndarray:
    return full[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))].reshape(-1)


def _assemble(full, new, olds, start, end):
    segments, gaps = block_segments(new, olds, start, end)
    got = np.full(end - start, -1.0)
    by_name = dict(olds)
    for name, oa, ob, pos in segments:
        got[pos : pos + ob - oa] = _local(full, by_name[name])[oa:ob]
    return got, segments, gaps


CASES = [
    # (global shape, split axis, old parts, new parts, prepended layer axis)
    ((8, 6), 0, 1, 2, False),  # column parallel, TP1 -> TP2
    ((8, 6), 0, 2, 1, False),  # TP2 -> TP1
    ((8, 6), 1, 2, 1, False),  # row parallel, TP2 -> TP1
    ((8, 6), 1, 1, 2, False),  # row parallel, TP1 -> TP2
    ((3, 8, 6), 1, 2, 4, True),  # a layer's column-parallel weight, TP2 -> TP4
    ((3, 8, 6), 2, 3, 2, True),  # a layer's row-parallel weight, TP3 -> TP2
    ((12,), 0, 2, 3, False),  # a bias, TP2 -> TP3
]


@pytest.mark.parametrize("shape,axis,old_parts,new_parts,layer", CASES)
def test_every_element_of_every_range_comes_from_the_right_old_element(shape, axis, old_parts, new_parts, layer):
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    layers = range(shape[0]) if layer else [None]
    olds = [((f"l{li}", f"t{t}"), b) for li in layers for t, b in enumerate(_blocks(shape, axis, old_parts, li))]
    for li in layers:
        for new in _blocks(shape, axis, new_parts, li):
            n = int(np.prod(new.shape))
            for start, end in itertools.combinations(range(0, n + 1, max(1, n // 7)), 2):
                got, segments, gaps = _assemble(full, new, olds, start, end)
                assert gaps == []
                np.testing.assert_array_equal(got, _local(full, new)[start:end])
                assert all(a < b for _, a, b, _ in segments)


def test_whole_rows_of_an_unsplit_axis_are_one_segment_per_old_block():
    """A column-parallel weight (split on rows) TP1 -> TP2: one contiguous read."""
    full_shape = (8, 6)
    olds = [(("o",), b) for b in _blocks(full_shape, 0, 1)]
    new = _blocks(full_shape, 0, 2)[1]
    segments, gaps = block_segments(new, olds, 0, 24)
    assert segments == [(("o",), 24, 48, 0)] and gaps == []


def test_overlapping_old_copies_are_read_once_from_the_first_by_name():
    """A tied embedding is held by the first and the last pipeline stage: one copy is read."""
    shape = (8, 4)
    b = _blocks(shape, 0, 1)[0]
    segments, _ = block_segments(b, [(("pp1", "out"), b), (("pp0", "emb"), b)], 0, 32)
    assert segments == [(("pp0", "emb"), 0, 32, 0)]


def test_rows_past_the_old_vocabulary_padding_are_gaps():
    """Vocabulary padded to 8 rows before, 12 now (allow_shape_mismatch): rows 8..11 are in no old
    block; rows 0..7 come from the old blocks, element for element."""
    old_shape, new_shape = (8, 4), (12, 4)
    full = np.arange(48, dtype=np.float64).reshape(new_shape)
    olds = [
        ((f"t{t}",), Block("emb", old_shape, b.offset, b.shape, True)) for t, b in enumerate(_blocks(old_shape, 0, 2))
    ]
    new = Block("emb", new_shape, (6, 0), (6, 4), True)  # TP2 of 12 rows: rank 1 holds rows 6..11
    got, segments, gaps = _assemble(full, new, olds, 0, 24)
    assert gaps == [(8, 24)]
    np.testing.assert_array_equal(got[:8], full[6:8].reshape(-1))
