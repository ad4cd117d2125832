"""Crafted files under the size caps (issue 33, finding 3): a 64 MiB manifest of ``[{},{},...]``,
a rank file with ``chunk_bytes = 1``, a 96 MiB objects section, a 1 TiB sparse rank file.  Each is
refused -- one line, no traceback, no partial restore, nothing outside the save directory changed --
within the stated bound (docs/reliability.md): peak memory growth <= 64 MiB + 2x the crafted bytes,
CPU time <= 2 s per 64 MiB (wall time within 5x that, so a machine shared with other work does
not fail it by chance).  Measured in a forked child (``resource.getrusage`` peak RSS growth),
``ls``/``verify``/``inspect`` through the CLI, loads and a trainer's start-up through the manager."""

from __future__ import annotations

import os

import pytest

from tests.faults import attacks

CRAFTED = [
    a
    for a in attacks.ATTACKS
    if a.plant.__name__ in ("_dense_manifest", "_chunk_bytes_1", "_big_objects", "_sparse_tib")
]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    attacks.warm_up(str(tmp_path_factory.mktemp("warm")))


def test_every_crafted_file_of_the_issue_is_attacked():
    assert len(CRAFTED) == 13


@pytest.mark.parametrize("attack", CRAFTED, ids=[a.name for a in CRAFTED])
def test_a_crafted_file_is_refused_within_the_stated_bound(attack, tmp_path, warm):
    got = attacks.run_attack(attack, str(tmp_path), limit_s=120)
    assert "TRACEBACK" not in got["outcome"] and "PARTIAL" not in got["outcome"], got
    assert got["as_specified"] and got["outside_unchanged"], got
    memory, seconds = attacks.bound(got["planted"])
    assert got["rss_growth"] <= memory, f"peak RSS growth {got['rss_growth'] >> 20} MiB over {memory >> 20} MiB: {got}"
    assert got["cpu_s"] <= seconds, f"{got['cpu_s']:.1f} s of CPU over {seconds:.1f} s: {got}"
    assert got["wall_s"] <= attacks.WALL_SLACK * seconds, f"{got['wall_s']:.1f} s of wall time: {got}"


def test_manifests_are_surveyed_incrementally_not_all_reread_at_every_commit(tmp_path, monkeypatch):
    import os
    import time

    from datastates_megatron.engine.tiers import tier
    from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir

    root = str(tmp_path / "ckpt")
    attacks.commit(root, iterations=(1, 2, 3, 4))
    old = time.time() - 60
    for it in (1, 2, 3, 4):
        os.utime(os.path.join(iter_dir(root, it), MANIFEST_NAME), (old, old))
    later = time.time_ns() + 60_000_000_000  # a minute on: every file here is past the "racily clean" window

    class Clock:
        @staticmethod
        def time_ns():
            return later

    monkeypatch.setattr(tier, "time", Clock)
    reads = []
    real = tier.read_manifest
    monkeypatch.setattr(tier, "read_manifest", lambda d: reads.append(d) or real(d))
    first = tier.survey(root)
    assert len(reads) == 4 and sorted(first.committed) == [1, 2, 3, 4]
    reads.clear()
    again = tier.survey(root)
    assert reads == [] and again.committed == first.committed  # nothing read again
    path = os.path.join(iter_dir(root, 3), MANIFEST_NAME)
    data = open(path, "rb").read()
    with open(path, "wb") as f:  # same size, one byte changed, same mtime: the ctime still moves
        f.write(data.replace(b'"world_size": 1', b'"world_size": 2'))
    os.utime(path, (old, old))
    third = tier.survey(root)
    assert reads == [iter_dir(root, 3)] and 3 in third.damaged and 3 not in third.committed


def test_the_survey_cache_forgets_manifests_of_deleted_checkpoints(tmp_path, monkeypatch):
    import shutil
    import time

    from datastates_megatron.engine.tiers import tier
    from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir

    later = time.time_ns() + 60_000_000_000

    class Clock:
        @staticmethod
        def time_ns():
            return later

    monkeypatch.setattr(tier, "time", Clock)
    root = str(tmp_path / "ckpt")
    attacks.commit(root, iterations=(1, 2, 3))

    def cached():
        return sorted(p for p in tier._MANIFESTS._entries if p.startswith(root + os.sep))

    tier.survey(root)
    assert cached() == [os.path.join(iter_dir(root, it), MANIFEST_NAME) for it in (1, 2, 3)]
    shutil.rmtree(iter_dir(root, 1))  # retention
    tier.survey(root)
    assert cached() == [os.path.join(iter_dir(root, it), MANIFEST_NAME) for it in (2, 3)]


def test_a_sparse_terabyte_rank_file_is_refused_from_its_header_not_with_cannot_allocate_memory(tmp_path):
    from datastates_megatron.engine import CorruptCheckpointError
    from datastates_megatron.engine.format.file_format import RankFile

    from tests.faults.damage import rebuild_rank_file

    root = str(tmp_path / "ckpt")
    attacks.commit(root, iterations=(1,))
    path = attacks._rank_file(root, 1)
    rebuild_rank_file(path, file_bytes=1 << 40)
    assert os.path.getsize(path) == 1 << 40
    with pytest.raises(CorruptCheckpointError, match=r"file_bytes says 1099511627776") as err:
        RankFile(path)
    assert "allocate" not in str(err.value)


def test_a_damaged_manifest_kept_by_a_survey_holds_no_traceback_nor_cause(tmp_path):
    from datastates_megatron.engine.tiers import tier
    from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir

    root = str(tmp_path / "ckpt")
    attacks.commit(root, iterations=(1, 2))
    with open(os.path.join(iter_dir(root, 1), MANIFEST_NAME), "r+b") as f:
        f.seek(30)
        f.write(b"#")  # not JSON any more: the read raises from deep in the parser
    found = tier.survey(root)
    (err,) = found.damaged.values()
    assert sorted(found.committed) == [2]
    assert err.__traceback__ is None and err.__cause__ is None and err.__context__ is None


@pytest.mark.parametrize("attack", attacks.INDEX_ATTACKS, ids=[a.name for a in attacks.INDEX_ATTACKS])
def test_a_crafted_global_index_costs_no_more_than_the_stated_bound(attack, tmp_path, warm):
    """Issue 41, item 7.2: a ``global_index.dsgi`` under a valid seal is read (or refused) within
    the manifest's bound -- 64 MiB + 2x the crafted bytes, 2 s per 64 MiB."""
    got = attacks.run_attack(attack, str(tmp_path), limit_s=120)
    assert "TRACEBACK" not in got["outcome"], got
    assert got["as_specified"] and got["outside_unchanged"], got
    memory, seconds = attacks.bound(got["planted"])
    assert got["rss_growth"] <= memory, f"peak RSS growth {got['rss_growth'] >> 20} MiB over {memory >> 20} MiB: {got}"
    assert got["cpu_s"] <= seconds, f"{got['cpu_s']:.1f} s of CPU over {seconds:.1f} s: {got}"
    assert got["wall_s"] <= attacks.WALL_SLACK * seconds, f"{got['wall_s']:.1f} s of wall time: {got}"


def test_a_text_is_charged_what_its_strings_decode_to_before_it_is_decoded(tmp_path):
    """Issue 49, item 4: a string holding one character past Latin-1 is stored at 2 or 4 bytes per
    character; JSON we write escapes it, so the charge is read off the bytes (escape-aware: an
    escaped backslash before ``u0101`` is no escape), and a text that is not ASCII is not ours."""
    import json

    from datastates_megatron.engine import CorruptCheckpointError
    from datastates_megatron.engine.format.json_budget import DecodeBudget, wide_string_bytes

    text = json.dumps(["a" * 10, "b\u00e9", "c\u0101dd", "x\\u0101", {"k": "\U0001f600"}])
    assert wide_string_bytes(text.encode()) == len('"c\\u0101dd') + len('"\\ud83d\\ude00')
    assert wide_string_bytes(json.dumps(["a" * 100, "b\u00e9"]).encode()) == 0
    budget = DecodeBudget("f.json", limit=3 * 1000 + 100 * 10, value_bytes=100)
    assert budget.text(json.dumps(["s" * 997 + "\u0101"]).encode(), "t") and budget.spent == 3 * 1004 + 100 * 2
    with pytest.raises(CorruptCheckpointError, match=r"^f\.json: u would take ~0\.0 MiB to parse \(after 0\.0 MiB"):
        budget.text(json.dumps(["\u0101"] * 10).encode(), "u")  # the file's earlier texts count
    with pytest.raises(CorruptCheckpointError, match=r"^f\.json: v is not ASCII"):
        DecodeBudget("f.json").text('["\U0001f600"]'.encode(), "v")


def test_a_manifest_with_text_past_latin1_is_read_and_one_not_ascii_is_refused(tmp_path):
    from datastates_megatron.engine import CorruptCheckpointError
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir

    root = str(tmp_path / "ckpt")
    attacks.commit(root, iterations=(1,))
    path = os.path.join(iter_dir(root, 1), MANIFEST_NAME)
    assert read_manifest(iter_dir(root, 1)).iteration == 1
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:  # a raw UTF-8 character: never written by json.dumps (it escapes)
        f.write(data.replace(b'"format": ', '"\U0001f600": 1, "format": '.encode(), 1))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: manifest is not ASCII"):
        read_manifest(iter_dir(root, 1))
