"""Data layout of a rank file (Numba): where each tensor goes and how the data is cut into cache regions."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["plan_layout", "warmup"]


@numba.njit(nogil=True, cache=True)
def _align_up(x, a):
    return (x + a - 1) // a * a


@numba.njit(nogil=True, cache=True)
def plan_layout(nbytes, chunk_bytes, small_bytes, pack_bytes, align, small_align):
    """Place tensors in the data section and cut them into cache regions.

    Tensors of at most ``small_bytes`` are coalesced, ``small_align``-aligned, into packs of at most
    ``pack_bytes``; larger tensors start ``align``-aligned and are cut into ``chunk_bytes`` pieces.
    Every region starts ``align``-aligned and its length is padded to ``align`` (O_DIRECT-friendly).

    Returns ``(tensor_offset, regions, items)``: ``regions[r] = (offset, padded_len, first_item,
    n_items)``; ``items[k] = (tensor, chunk, offset_in_region, length)``.  Checksums are per item,
    so a tensor has ``ceil(nbytes / chunk_bytes)`` checksums (at least one).
    """
    n = nbytes.shape[0]
    tensor_offset = np.zeros(n, np.int64)
    max_items = 0
    for t in range(n):
        max_items += max(1, (nbytes[t] + chunk_bytes - 1) // chunk_bytes)
    regions = np.zeros((max_items, 4), np.int64)
    items = np.zeros((max_items, 4), np.int64)
    n_regions = 0
    n_items = 0
    cursor = 0  # next free byte in the data section
    pack_open = False
    pack_start = 0
    pack_fill = 0
    for t in range(n):
        size = nbytes[t]
        if size <= small_bytes:
            start = _align_up(pack_fill, small_align)
            if pack_open and start + size > pack_bytes:
                regions[n_regions - 1, 1] = _align_up(pack_fill, align)
                cursor = pack_start + regions[n_regions - 1, 1]
                pack_open = False
            if not pack_open:
                pack_open = True
                pack_start = cursor
                pack_fill = 0
                start = 0
                regions[n_regions, 0] = pack_start
                regions[n_regions, 2] = n_items
                regions[n_regions, 3] = 0
                n_regions += 1
            tensor_offset[t] = pack_start + start
            items[n_items, 0] = t
            items[n_items, 1] = 0
            items[n_items, 2] = start
            items[n_items, 3] = size
            n_items += 1
            regions[n_regions - 1, 3] += 1
            pack_fill = start + size
        else:
            if pack_open:
                regions[n_regions - 1, 1] = _align_up(max(pack_fill, 1), align)
                cursor = pack_start + regions[n_regions - 1, 1]
                pack_open = False
            tensor_offset[t] = cursor
            n_chunks = (size + chunk_bytes - 1) // chunk_bytes
            for c in range(n_chunks):
                length = min(chunk_bytes, size - c * chunk_bytes)
                regions[n_regions, 0] = cursor
                regions[n_regions, 1] = _align_up(length, align)
                regions[n_regions, 2] = n_items
                regions[n_regions, 3] = 1
                items[n_items, 0] = t
                items[n_items, 1] = c
                items[n_items, 2] = 0
                items[n_items, 3] = length
                n_items += 1
                n_regions += 1
                cursor += _align_up(length, align)
    if pack_open:
        regions[n_regions - 1, 1] = _align_up(max(pack_fill, 1), align)
        cursor = pack_start + regions[n_regions - 1, 1]
    return tensor_offset, regions[:n_regions].copy(), items[:n_items].copy()


def warmup() -> None:
    """Compile (or load from cache) :func:`plan_layout` with the argument types the engine uses."""
    plan_layout(np.array([1, 1 << 20], np.int64), 1 << 16, 1 << 10, 1 << 16, 4096, 64)
