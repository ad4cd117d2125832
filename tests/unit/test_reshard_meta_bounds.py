"""Issue #40, item 4: what one resharding rank reads of the global index (format 2,
``engine/format/index_sections.py``) to plan its shards and find the records of the files it
opens stays bounded as the world grows -- the same bound at 1k and at 16k simulated ranks, counted
in bytes through the index reader (not in time)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datastates_megatron.engine.format.global_index import Summaries, encode_summary, read_index, write_index
from datastates_megatron.engine.format.manifest import Manifest, RankRecord
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.megatron.checkpointing.reshard import GlobalIndexView

K, TOKEN, IT = 16, "00000000000000bb", 7
BOUND = 32 << 10  # bytes of the index one resharding rank reads, at any N


def _summary(rank: int, tp: int, pp: int, dp: int) -> dict:
    """Rank ``rank`` (TP fastest, then DP, PP slowest) holds DP shard ``d`` of its slice's ``w``
    and of its ``exp_avg`` (what a Megatron rank's summary holds, in little)."""
    t, rest = rank % tp, rank // tp
    p, d = rest // dp, rest % dp
    sl = f"pp{p}.tp{t}"
    pieces = [
        [json.dumps([sl, 0, "w", what]), d * K, (d + 1) * K, name, 0]
        for what, name in (("param", "model0.buf0.bucket0.param_shard"), ("exp_avg", "opt0.g0.p0.exp_avg"))
    ]
    return {"params": {json.dumps([sl, 0, "w"]): [[dp * K], "float32"]}, "pieces": pieces}


def _index(root: str, tp: int, pp: int, dp: int) -> Manifest:
    """The committed index of a ``tp``x``pp``x``dp`` checkpoint (no rank files: the index alone)."""
    import os

    world = tp * pp * dp
    raws = [encode_summary(_summary(r, tp, pp, dp)) for r in range(world)]
    body = Summaries(world).update(np.array([h for _, h in raws], dtype=np.int64), lambda rs: [raws[r][0] for r in rs])
    records = tuple(
        RankRecord(r, rank_file_name(r, TOKEN, 3), 4096 + r, 2 * K * 4, 2, 1000 + r, (1 << 63) + r)
        for r in range(world)
    )
    manifest = Manifest(IT, world, TOKEN, records, {"tp": tp, "pp": pp, "dp": dp}, {}, commit_seq=4)
    os.makedirs(iter_dir(root, IT))
    write_index(root, manifest, body)
    return manifest


def _plan(root: str, manifest: Manifest, tp: int, pp: int, dp: int, new_dp: int, rank: int):
    """New rank ``rank`` of ``tp``x``pp``x``new_dp``: its ranges of ``w`` and ``exp_avg`` and the
    records of the old files they name, through the index; ``(old ranks, bytes read)``."""
    t, rest = rank % tp, rank // tp
    p, d = rest // new_dp, rest % new_dp
    start, end = d * dp * K // new_dp, (d + 1) * dp * K // new_dp
    sl = f"pp{p}.tp{t}"
    gi = read_index(iter_dir(root, IT), manifest)
    try:
        view = GlobalIndexView(gi)
        assert view.params_of({sl}) == {(sl, 0, "w"): ((dp * K,), "float32")}
        ranks = set()
        for what in ("param", "exp_avg"):
            pos = start
            for r, at in view.ranges((sl, 0, "w", what), start, end):
                assert at == pos - start and r.start == pos % K
                assert r.rank == t + tp * (pos // K + dp * p)
                pos += r.count
                ranks.add(r.rank)
            assert pos == end
        for r in sorted(ranks):
            assert gi.record(r) == manifest.record(r)
        return sorted(ranks), gi.bytes_read
    finally:
        gi.close()


@pytest.mark.parametrize("dp", [32, 512])  # tp4pp8: 1,024 and 16,384 ranks
def test_a_resharding_rank_reads_the_same_bounded_bytes_at_1k_and_16k_ranks(tmp_path, dp):
    tp, pp = 4, 8
    manifest = _index(str(tmp_path), tp, pp, dp)
    new_dp = dp - dp // 32  # the DP change of a lost node or so
    new_world = tp * pp * new_dp
    for rank in (0, new_world // 2 + 1, new_world - 1):
        ranks, read = _plan(str(tmp_path), manifest, tp, pp, dp, new_dp, rank)
        assert 1 <= len(ranks) <= 3
        assert read <= BOUND, f"{read} bytes of the index read by rank {rank} at {tp * pp * dp} ranks"


def test_what_a_rank_reads_does_not_grow_with_the_world_beyond_its_fences(tmp_path):
    """At 16k ranks a rank reads at most a few KB more than at 1k (its key's fences and the rank
    records' sums, ~1/40 of a row per old rank): no section whose size is the world's."""
    reads = []
    for dp in (32, 512):
        root = str(tmp_path / f"dp{dp}")
        manifest = _index(root, 4, 8, dp)
        reads.append(_plan(root, manifest, 4, 8, dp, dp - dp // 32, 4 * 8 * (dp - dp // 32) // 2 + 1)[1])
    assert reads[1] - reads[0] <= 8 << 10, reads
