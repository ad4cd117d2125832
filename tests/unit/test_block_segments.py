"""``reshard.block_segments``: a new rank's flattened parameter block, element range by element range,
from the flattened blocks of another tensor-/pipeline-parallel layout (megatron-core's global
coordinates), checked element for element against numpy slicing of one global tensor; and what is
checked of the old blocks before any is read (``blocks.record_problem``, ``blocks.tiling_problem``)
and of the vocabularies before another padding's rows are zero-filled (``reshard.check_vocabulary``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datastates_megatron.megatron.checkpointing.blocks import record_problem, tiling_problem
from datastates_megatron.megatron.checkpointing.reshard import Block, block_segments, check_vocabulary


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


# ---------------------------------------------------------------------------------------------- checks (#49)
def _emb(offset, shape, global_shape=(256, 64), start=0):
    return Block("emb", tuple(global_shape), tuple(offset), tuple(shape), True, start)


TP2 = [(("tp0",), _emb((0, 0), (128, 64))), (("tp1",), _emb((128, 0), (128, 64)))]


def test_megatron_cores_blocks_pass_both_checks():
    assert record_problem((TP2[1][1],), 128 * 64) is None
    assert tiling_problem(TP2) is None
    norms = [((f"tp{t}",), Block("norm", (64,), (0,), (64,), False)) for t in range(4)]  # replicated over TP
    assert tiling_problem(norms) is None
    layers = [((f"l{li}", f"t{t}"), b) for li in range(3) for t, b in enumerate(_blocks((3, 8, 6), 1, 2, li))]
    assert tiling_problem(layers) is None


@pytest.mark.parametrize(
    "offset,shape,says",
    [
        ((256, 0), (128, 64), "outside its global shape [256, 64]"),
        ((128, 0), (-128, 64), "a negative offset or size"),
        ((-128, 0), (128, 64), "a negative offset or size"),
        ((128,), (128, 64), "not the 2 dimensions of its global shape"),
        ((128, 0), (64, 64), "blocks of 4096 elements in all, for a parameter of 8192"),
    ],
)
def test_a_block_out_of_its_tensor_or_of_another_size_is_a_record_problem(offset, shape, says):
    bad = record_problem((_emb(offset, shape),), 128 * 64)
    assert bad is not None and says in bad[1], bad


def test_factory_pieces_must_be_the_parameters_elements_in_order():
    w, v = _emb((0, 0), (64, 64), (256, 64), 0), _emb((128, 0), (64, 64), (256, 64), 4096)
    assert record_problem((w, v), 8192) is None
    bad = record_problem((w, _emb((128, 0), (64, 64), (256, 64), 2048)), 8192)
    assert bad is not None and "from its element 2048, where its element 4096 is due" in bad[1], bad


def test_an_overlap_with_the_right_element_count_is_named_at_the_later_block():
    crafted = [TP2[0], (("tp1",), _emb((64, 0), (128, 64)))]
    name, text, other = tiling_problem(crafted)
    assert name == ("tp1",) and other == ("tp0",), (name, other)
    assert "over element [64, 0] of emb, which the block at offset [0, 0] with shape [128, 64] holds" in text, text


def test_a_replica_where_another_block_was_due_leaves_rows_uncovered():
    name, text, other = tiling_problem([TP2[0], (("tp1",), TP2[0][1])])
    assert name == ("tp1",) and other is None and "leave its element [128, 0] in no block" in text, text


def test_blocks_of_two_global_shapes_and_a_crafted_cut_are_refused_before_any_grid_is_allocated():
    _, text, _ = tiling_problem([TP2[0], (("tp1",), _emb((128, 0), (128, 64), (512, 64)))])
    assert "in a global shape [512, 64], another block of emb in [256, 64]" in text, text
    slivers = [((f"r{i}",), _emb((i, i), (1, 1), (1 << 20, 1 << 20))) for i in range(100)]
    _, text, _ = tiling_problem(slivers)
    assert "not a grid" in text, text


@pytest.mark.parametrize(
    "recorded,declared,change,says",
    [
        (256, 256, False, None),  # the same vocabulary, padded otherwise
        (256, 512, False, "another vocabulary (256 in the checkpoint, 512 in this run)"),
        (256, 512, True, None),
        (None, 256, False, "the checkpoint records no vocabulary"),
        (256, None, False, "this run declares no vocabulary"),
        (300, 300, False, "fewer than the vocabulary of 300"),
    ],
)
def test_rows_of_another_padding_need_both_vocabularies_the_same_or_the_flag(recorded, declared, change, says):
    resized = {("pp0.tp0", 0, "embedding.word_embeddings.weight"): ("emb", 256, 512)}
    why = check_vocabulary(resized, recorded, declared, change)
    assert (why is None) if says is None else (says in why), why


def test_a_global_shape_past_any_tensor_is_a_record_problem():
    bad = record_problem((_emb((0, 0), (128, 64), (1 << 62, 64)),), 128 * 64)
    assert bad is not None and "more elements than any tensor holds" in bad[1], bad


def test_a_grid_of_many_blocks_is_told_at_once_and_one_crafted_block_in_it_is_found():
    """96 layers × 64 experts × TP8 (the numpy path), then its last block moved onto another's rows."""
    shape = (96, 64, 64, 64)
    olds = [
        (((f"tp{t}", 0, f"l{li}.e{e}"), 0), Block("k", shape, (li, e, 8 * t, 0), (1, 1, 8, 64), False))
        for li in range(96)
        for e in range(64)
        for t in range(8)
    ]
    assert tiling_problem(olds) is None
    olds[-1] = (olds[-1][0], Block("k", shape, (95, 63, 52, 0), (1, 1, 8, 64), False))
    name, text, other = tiling_problem(olds)
    assert name == olds[-1][0] and "over element [95, 63, 52, 0]" in text and other is not None, text
