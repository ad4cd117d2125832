import numpy as np
import pytest

from datastates_megatron.engine import serializer


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 4097, 1 << 16])
def test_xxh64_matches_reference(n):
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert serializer.xxh64(data) == xxhash.xxh64_intdigest(data.tobytes())
    assert serializer.xxh64(data, 7) == xxhash.xxh64_intdigest(data.tobytes(), 7)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 4097, 1 << 16])
def test_xxh64_copy_copies_every_byte_and_hashes_like_xxh64(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    out = np.full(n + 8, 0xAB, np.uint8)  # guard bytes after the destination stay untouched
    assert serializer.xxh64_copy(data, out[:n], 7) == serializer.xxh64(data, 7)
    assert np.array_equal(out[:n], data)
    assert (out[n:] == 0xAB).all()


def test_xxh64_copy_rejects_a_destination_of_another_length():
    with pytest.raises(ValueError, match="destination"):
        serializer.xxh64_copy(np.zeros(64, np.uint8), np.zeros(32, np.uint8))


def test_xxh64_detects_single_bit_flip():
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    before = serializer.xxh64(data)
    data[1234] ^= 1
    assert serializer.xxh64(data) != before


def test_plan_layout_is_aligned_disjoint_and_covers_every_byte():
    sizes = np.array([10, 20, 5000, 100_000, 3, 0, 65_536, 7], np.int64)
    offs, regions, items = serializer.plan_layout(sizes, 32768, 4096, 16384, 4096, 64)
    assert (regions[:, 0] % 4096 == 0).all() and (regions[:, 1] % 4096 == 0).all()
    ends = regions[:, 0] + regions[:, 1]
    assert (regions[1:, 0] >= ends[:-1]).all()  # regions do not overlap
    covered = np.zeros(len(sizes), np.int64)
    for r, (roff, rlen, first, count) in enumerate(regions):
        for t, chunk, ioff, length in items[first : first + count]:
            assert ioff + length <= rlen
            assert roff + ioff == offs[t] + chunk * 32768  # item sits where the tensor's chunk belongs
            covered[t] += length
    assert (covered == sizes).all()
    small = [0, 1, 4, 5, 7]
    small_regions = {int(np.searchsorted(regions[:, 0], offs[t], side="right") - 1) for t in small[:2]}
    assert len(small_regions) == 1  # the first two small tensors share one coalesced region


def test_index_round_trip():
    from datastates_megatron.engine.file_format import _parse_index, build_index
    import torch

    cks = [np.array([1, 2], np.uint64), np.array([3], np.uint64)]
    raw = build_index(["a.weight", "b"], [torch.float32, torch.bfloat16], [(2, 3), ()], [4096, 8192], [24, 2], cks)
    entries = _parse_index(memoryview(raw), 2, "x")
    assert [e.name for e in entries] == ["a.weight", "b"]
    assert entries[0].shape == (2, 3) and entries[1].shape == () and entries[1].dtype == torch.bfloat16
    assert list(entries[0].checksums) == [1, 2] and list(entries[1].checksums) == [3]
