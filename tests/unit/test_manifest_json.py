"""Manifest.to_json writes exactly what ``json.dumps(body, indent=1, sort_keys=True)`` would (its
records come from a template, for speed at thousands of ranks), and reads back equal."""

from __future__ import annotations

import dataclasses
import json

import pytest

from datastates_megatron import __version__
from datastates_megatron.engine.format.manifest import Manifest, RankRecord, _body_xxh64


@pytest.mark.parametrize("n", [0, 1, 5])
def test_the_text_is_json_dumps_indent_1_byte_for_byte(n):
    ranks = tuple(
        RankRecord(i, f'r{i:05d}-\u00e9"x-000001.dsck', 7 * i + 1, i, 2, (1 << 64) - 1 - i, i) for i in range(n)
    )
    metadata = {"ranks": [], "note": 'a,"{', "nested": {"x": [1, {"y": 2}]}, "u": "\u00e9"}
    m = Manifest(4, max(n, 1), "tok", ranks, {"dp": 2, "ranks": []}, metadata, commit_seq=9, tier="local")
    body = {
        "format": "datastates-megatron-manifest",
        "format_version": 1,
        "iteration": 4,
        "world_size": max(n, 1),
        "run_token": "tok",
        "commit_seq": 9,
        "created": m.created,
        "tier": "local",
        "layout": m.layout,
        "metadata": metadata,
        "ranks": [dataclasses.asdict(r) for r in ranks],
        "writer_version": __version__,
    }
    body["checksum"] = _body_xxh64(body)
    assert m.to_json() == json.dumps(body, indent=1, sort_keys=True).encode("utf-8")
    plain = dataclasses.replace(m, ranks=tuple(dataclasses.replace(r, file=f"r{r.rank:05d}.dsck") for r in ranks))
    if n:  # a manifest lists some rank
        assert Manifest.from_json(plain.to_json(), "p") == plain
