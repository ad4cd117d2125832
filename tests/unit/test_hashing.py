"""XXH64 kernels (engine.hashing) against the reference implementation."""

import numpy as np
import pytest

from datastates_megatron.engine.format import hashing


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 4097, 1 << 16])
def test_xxh64_matches_reference(n):
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert hashing.xxh64(data) == xxhash.xxh64_intdigest(data.tobytes())
    assert hashing.xxh64(data, 7) == xxhash.xxh64_intdigest(data.tobytes(), 7)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 4097, 1 << 16])
def test_xxh64_copy_copies_every_byte_and_hashes_like_xxh64(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    out = np.full(n + 8, 0xAB, np.uint8)  # guard bytes after the destination stay untouched
    assert hashing.xxh64_copy(data, out[:n], 7) == hashing.xxh64(data, 7)
    assert np.array_equal(out[:n], data)
    assert (out[n:] == 0xAB).all()


def test_xxh64_copy_rejects_a_destination_of_another_length():
    with pytest.raises(ValueError, match="destination"):
        hashing.xxh64_copy(np.zeros(64, np.uint8), np.zeros(32, np.uint8))


def test_xxh64_detects_single_bit_flip():
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    before = hashing.xxh64(data)
    data[1234] ^= 1
    assert hashing.xxh64(data) != before
