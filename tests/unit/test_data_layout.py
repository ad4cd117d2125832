"""The rank-file data layout planner (engine.data_layout)."""

import numpy as np

from datastates_megatron.engine.format import data_layout


def test_plan_layout_is_aligned_disjoint_and_covers_every_byte():
    sizes = np.array([10, 20, 5000, 100_000, 3, 0, 65_536, 7], np.int64)
    offs, regions, items = data_layout.plan_layout(sizes, 32768, 4096, 16384, 4096, 64)
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
