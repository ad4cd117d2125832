"""The checkpoint's global index (``engine/format/global_index.py``): a reshard planned from it opens only the
old rank files overlapping its new shard (and the one whose non-tensor state it takes); a checkpoint
without one, or with a stale or damaged one, is resharded from every file's metadata as before."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from datastates_megatron.engine import EngineOptions, SnapshotEngine
from datastates_megatron.engine.format.global_index import (
    Summaries,
    encode_summary,
    read_index,
    summary_sum,
    write_index,
)
from datastates_megatron.engine.names import INDEX_NAME
from datastates_megatron.engine.load.load_plan import LoadPlan, ReadItem
from datastates_megatron.engine.format.manifest import Manifest, RankRecord, write_manifest
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.engine.names import is_ours_in_iteration
from datastates_megatron.engine.load.reader import CheckpointReader, open_checkpoint
from datastates_megatron.engine.errors import CorruptCheckpointError, LayoutMismatchError
from datastates_megatron.megatron.checkpointing.reshard import CheckpointIndex, index_summary, plan_by_global_index

WORLD, K, TOKEN = 16, 8, "00000000000000aa"


def _meta(rank: int, identity: int = 2) -> dict:
    """Rank ``rank`` holds elements [rank*K, (rank+1)*K) of ``w`` and of its ``exp_avg``, and a step."""
    shard = {"kind": "param_shard", "identity": identity, "chunk": 0, "buffer": "buf0", "bucket": 0}
    shard["params"] = [["w", [WORLD * K], "float32", rank * K, (rank + 1) * K, 0]]
    state = {"kind": "optimizer_state", "identity": identity, "chunk": 0, "param": "w", "shape": [WORLD * K]}
    state.update(dtype="float32", start=rank * K, end=(rank + 1) * K)
    step = dict(state, key="step")
    return {
        "model0.buf0.bucket0.param_shard": shard,
        "opt0.g0.p0.exp_avg": dict(state, key="exp_avg"),
        "opt0.g0.p0.step": step,
    }


def _tensors(rank: int) -> dict:
    w = torch.arange(rank * K, (rank + 1) * K, dtype=torch.float32)
    return {"model0.buf0.bucket0.param_shard": w, "opt0.g0.p0.exp_avg": -w, "opt0.g0.p0.step": torch.tensor(3.0)}


@pytest.fixture
def ckpt(tmp_path):
    """A committed WORLD-rank checkpoint with its global index, built as rank 0's commit does."""
    return _build(str(tmp_path))


def _build(root: str, identity: int = 2):
    """The checkpoint of :func:`ckpt`, its tensors of global identity version ``identity``."""
    d = iter_dir(root, 5)
    os.makedirs(d)
    records, summaries = [], []
    with SnapshotEngine(EngineOptions(cache_bytes=1 << 20, timeout_s=30)) as eng:
        for r in range(WORLD):
            eng.clear()
            tensors = _tensors(r)
            for name, meta in _meta(r, identity).items():
                eng.register(name, tensors[name], meta=meta)
            summaries.append(encode_summary(_summary_of(tensors, _meta(r, identity))))
            name = rank_file_name(r, TOKEN, 1)
            got = eng.save(5, os.path.join(d, name), {"rank": r}, tag=name).durable.result(30)
            records.append(
                RankRecord(r, name, got.file_bytes, got.data_bytes, got.n_tensors, got.index_xxh64, got.header_xxh64)
            )
    manifest = Manifest(5, WORLD, TOKEN, tuple(records), {"dp": WORLD}, {}, commit_seq=2)
    sums = np.array([h for _, h in summaries], dtype=np.int64)
    body = Summaries(WORLD).update(sums, lambda ranks: [summaries[r][0] for r in ranks])
    write_index(root, manifest, body)
    write_manifest(root, manifest)
    return root, manifest


def _summary_of(tensors: dict, metas: dict) -> dict:
    """``index_summary``, or for identity 1 the summary its writers made (keys without a slice)."""
    if all(m["identity"] == 2 for m in metas.values()):
        return index_summary(tensors, metas)
    pieces = [[json.dumps([0, "w", m.get("key", "param")]), r.start, r.stop, n, 0] for n, m, r in _ranges(metas)]
    return {"params": {json.dumps([0, "w"]): [[WORLD * K], "float32"]}, "pieces": pieces}


def _ranges(metas):
    for name, m in metas.items():
        if m.get("key") == "step":
            continue
        lo, hi = (m["params"][0][3], m["params"][0][4]) if m["kind"] == "param_shard" else (m["start"], m["end"])
        yield name, m, range(lo, hi)


def _reshard(root: str, new_rank: int, new_world: int):
    """New rank ``new_rank`` of ``new_world``: its shard of ``w``, ``exp_avg`` and the step."""
    n = WORLD * K // new_world
    start, end = new_rank * n, (new_rank + 1) * n
    dst = {"param": torch.empty(n), "exp_avg": torch.empty(n)}
    step = torch.empty(())

    def plan(index):
        pairs = [(r, dst[w][at : at + r.count]) for w in dst for r, at in index.ranges(("", 0, "w", w), start, end)]
        return pairs + [(index.scalar(("", 0, "w", "step"), start, end), step)]

    ckpt, manifest = open_checkpoint(root, 5)
    with CheckpointReader(ckpt, manifest, rank=new_rank, threads=1) as reader:
        planned = plan_by_global_index(reader, plan, source=new_rank)
        pairs = planned[0] if planned else plan(CheckpointIndex.from_reader(reader))
        stats = reader.execute(LoadPlan("reshard", tuple(ReadItem(r, d) for r, d in pairs)))
        opened = sorted(reader.opened)
    assert torch.equal(dst["param"], torch.arange(start, end, dtype=torch.float32))
    assert torch.equal(dst["exp_avg"], -dst["param"]) and float(step) == 3.0
    return planned is not None, opened, stats


def test_a_resharding_rank_opens_only_the_files_overlapping_its_shard(ckpt):
    root, _ = ckpt
    for new_rank in range(4):  # 16 -> 4: new rank q holds old ranks 4q..4q+3, and takes old rank q's objects
        used, opened, stats = _reshard(root, new_rank, 4)
        assert used
        assert opened == sorted({*range(4 * new_rank, 4 * new_rank + 4), new_rank})
        assert stats.files_opened == len(opened)
    used, opened, _ = _reshard(root, 5, 8)  # 16 -> 8, a shard inside old ranks 10 and 11
    assert used and opened == [5, 10, 11]


def test_a_checkpoint_of_identity_1_is_refused_naming_the_conversion(tmp_path, caplog):
    """Identity 1 recorded no model-parallel slice: by identity it is refused (its index is not used),
    naming the conversion that still works; the consolidating export (TP=PP=EP=1) still reads it."""
    root, _ = _build(str(tmp_path), identity=1)
    with pytest.raises(LayoutMismatchError) as refused:
        _reshard(root, 1, 4)
    msg = str(refused.value)
    assert "has global identity version 1, not 2 or 3" in msg and "--lazy-ckpt-convert-to OUT_DIR" in msg, msg
    assert "is not [slice, chunk, parameter]" in caplog.text  # the index was not used
    ckpt, manifest = open_checkpoint(root, 5)
    with CheckpointReader(ckpt, manifest, threads=1) as reader:
        legacy = CheckpointIndex.from_reader(reader, legacy=True)
    assert legacy.params == {("", 0, "w"): ((WORLD * K,), "float32")}


def test_without_an_index_every_file_is_read(ckpt):
    root, _ = ckpt
    os.unlink(os.path.join(iter_dir(root, 5), INDEX_NAME))  # a checkpoint written before the index
    used, opened, _ = _reshard(root, 1, 4)
    assert not used and opened == list(range(WORLD))


def test_an_index_of_another_commit_is_not_used(ckpt):
    root, manifest = ckpt
    body = open(os.path.join(iter_dir(root, 5), INDEX_NAME), "rb").read()
    other = Manifest(5, WORLD, TOKEN, manifest.ranks, manifest.layout, {}, commit_seq=3)  # an uncommitted re-save
    assert read_index(iter_dir(root, 5), other) is None
    assert body  # (and the committed one still is)
    assert read_index(iter_dir(root, 5), manifest) is not None


def _parts(path: str) -> tuple[int, int]:
    """``(body start, body length)`` of a format-2 index file."""
    data = open(path, "rb").read()
    (hlen,) = struct.unpack_from("<Q", data, 8)
    return 24 + hlen, json.loads(data[16 : 16 + hlen])["body_bytes"]


@pytest.mark.parametrize("where", ["header", "contents", "rows"])
def test_a_damaged_index_is_named_and_the_reshard_reads_every_file(ckpt, caplog, where):
    """A byte changed in the header or the contents is found when the index is opened; one in a
    block of rows when a lookup reads that block (the step's, which every plan here looks up)."""
    root, manifest = ckpt
    path = os.path.join(iter_dir(root, 5), INDEX_NAME)
    body_at, body = _parts(path)
    at = {"header": 20, "contents": body_at + 20, "rows": body_at + body - 3}[where]
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    if where == "rows":
        gi = read_index(iter_dir(root, 5), manifest)
        with pytest.raises(CorruptCheckpointError, match=f"{path}: global index checksum mismatch"):
            gi.pieces(json.dumps(["", 0, "w", "step", "scalar"]), 0, 1)
        gi.close()
    else:
        with pytest.raises(CorruptCheckpointError, match=f"{path}: global index (checksum mismatch|header)"):
            read_index(iter_dir(root, 5), manifest)
    used, opened, _ = _reshard(root, 2, 4)
    assert not used and opened == list(range(WORLD))
    assert INDEX_NAME in caplog.text and "reading every rank file" in caplog.text


def test_an_index_that_disagrees_with_the_files_is_not_trusted(ckpt, caplog):
    """A consistent, checksummed index whose pieces are not what the files' metadata say (a
    summary sent before the registrations changed): found out on the files the plan opens."""
    root, manifest = ckpt
    wrong = [encode_summary(index_summary(_tensors(r), _meta((r + 1) % WORLD))) for r in range(WORLD)]
    sums = np.array([h for _, h in wrong], dtype=np.int64)
    write_index(root, manifest, Summaries(WORLD).update(sums, lambda ranks: [wrong[r][0] for r in ranks]))
    used, opened, _ = _reshard(root, 1, 4)
    assert not used and opened == list(range(WORLD))
    assert "its file's metadata does not" in caplog.text


def test_summaries_are_fetched_once_per_change():
    fetched = []
    docs = {r: encode_summary({"pieces": [["k", r, r + 1, "t", 0]], "params": {}}) for r in range(4)}

    def fetch(ranks):
        fetched.append(list(ranks))
        return [docs[r][0] for r in ranks]

    s = Summaries(4)
    sums = np.array([docs[r][1] for r in range(4)], dtype=np.int64)
    body = s.update(sums, fetch)
    assert body is not None and s.update(sums, fetch) is body and fetched == [[0, 1, 2, 3]]
    docs[2] = encode_summary({"pieces": [["k", 2, 3, "u", 0]], "params": {}})
    sums[2] = docs[2][1]
    assert s.update(sums, fetch) != body and fetched[-1] == [2]
    sums[3] = 0  # a rank without a summary: no index
    assert s.update(sums, fetch) is None
    bad = b'{"pieces":[]},{"params":{}}'  # not one summary (its checksum matches: sent as it is)
    docs[3] = (bad, summary_sum(bad))
    sums[3] = docs[3][1]
    assert s.update(sums, fetch) is None and fetched[-1] == [3]


def test_the_index_and_its_temp_file_are_ours():
    assert is_ours_in_iteration(INDEX_NAME) and is_ours_in_iteration(INDEX_NAME + ".tmp-123")
    assert not is_ours_in_iteration(INDEX_NAME + ".bak")


def _partial(root: str, new_rank: int, new_world: int, monkeypatch):
    """:func:`_reshard` with the manifest as the resolve step gives it (the header and this rank's
    record); the number of times the whole manifest was read."""
    from datastates_megatron.engine.load import reader as reader_mod

    _, whole = open_checkpoint(root, 5)
    own = Manifest(5, WORLD, TOKEN, (whole.record(new_rank),), whole.layout, {}, commit_seq=whole.commit_seq)
    reads = []
    real = reader_mod.read_manifest
    monkeypatch.setattr(reader_mod, "read_manifest", lambda ckpt: reads.append(ckpt) or real(ckpt))
    n = WORLD * K // new_world
    start, end = new_rank * n, (new_rank + 1) * n
    dst = torch.empty(n)
    with CheckpointReader(iter_dir(root, 5), own, rank=new_rank, threads=1, partial=True) as reader:
        planned = plan_by_global_index(
            reader,
            lambda index: [(r, dst[at : at + r.count]) for r, at in index.ranges(("", 0, "w", "param"), start, end)],
            new_rank,
        )
        pairs = planned[0] if planned else None
        if pairs is None:
            from datastates_megatron.megatron.checkpointing.reshard import CheckpointIndex

            idx = CheckpointIndex.from_reader(reader)
            pairs = [(r, dst[at : at + r.count]) for r, at in idx.ranges(("", 0, "w", "param"), start, end)]
        reader.execute(LoadPlan("reshard", tuple(ReadItem(r, d) for r, d in pairs)))
        opened = sorted(reader.opened)
    assert torch.equal(dst, torch.arange(start, end, dtype=torch.float32))
    return planned is not None, opened, len(reads)


def test_a_resharding_rank_takes_the_records_of_the_files_it_opens_from_the_index(ckpt, monkeypatch):
    """Given its own record only (as rank 0's resolve sends it), a resharding rank reads no
    manifest: the records of the old files it opens come from the index, bound to the same commit."""
    root, _ = ckpt
    used, opened, manifest_reads = _partial(root, 1, 4, monkeypatch)
    assert used and opened == [1, 4, 5, 6, 7] and manifest_reads == 0


def test_damaged_rank_records_in_the_index_make_the_rank_read_the_manifest(ckpt, monkeypatch, caplog):
    """Records that fail their block's checksum are not used: the whole manifest is read, once."""
    root, _ = ckpt
    path = os.path.join(iter_dir(root, 5), INDEX_NAME)
    data = bytearray(open(path, "rb").read())
    body_at, body = _parts(path)
    data[body_at + body + 3] ^= 0x01  # the first block of rank records
    with open(path, "wb") as f:
        f.write(data)
    used, opened, manifest_reads = _partial(root, 1, 4, monkeypatch)
    assert manifest_reads == 1 and "global index checksum mismatch (ranks 0..)" in caplog.text
    assert used and opened == [1, 4, 5, 6, 7]  # its pieces are in blocks of their own, checked apart


def test_the_committer_writes_the_manifests_records_into_the_index(tmp_path):
    """Rank 0's commit puts its status columns in the index as the manifest's records, byte for
    byte what the manifest says (the file name from the save's token and sequence)."""
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.manager import CheckpointManager

    root = str(tmp_path / "ckpt")
    opts = EngineOptions(cache_bytes=1 << 20, timeout_s=30)
    with CheckpointManager(root, opts, layout={"dp": 1}, keep_last=0, summarize=index_summary) as mgr:
        for name, meta in _meta(0).items():
            mgr.register(name, _tensors(0)[name], meta=meta)
        for it in (1, 2):
            mgr.save(it, {"rank": 0})
            mgr.wait()
    manifest = read_manifest(iter_dir(root, 2))
    gi = read_index(iter_dir(root, 2), manifest)
    try:
        assert gi.record(0) == manifest.record(0) and gi.record(1) is None
    finally:
        gi.close()


def _format1(root: str, manifest: Manifest) -> None:
    """Replace the index with a format-1 one of the same pieces, as the code of its day wrote it:
    one body (tables, then every row sorted by key, start and rank) under one checksum."""
    from datastates_megatron.engine.format.global_index import MAGIC
    from datastates_megatron.engine.format.hashing import xxh64

    keys, tensors, params, rows = {}, {}, {}, []
    for r in range(WORLD):
        doc = index_summary(_tensors(r), _meta(r))
        params.update(doc["params"])
        for key, start, end, tensor, offset in doc["pieces"]:
            rows.append(
                (keys.setdefault(key, len(keys)), start, end, r, tensors.setdefault(tensor, len(tensors)), offset)
            )
    table = np.array(rows, dtype=np.int64)
    table = table[np.lexsort((table[:, 3], table[:, 1], table[:, 0]))]
    tables = json.dumps({"keys": list(keys), "tensors": list(tensors), "params": params}, sort_keys=True).encode()
    body = struct.pack("<Q", len(tables)) + tables + table.astype("<i8").tobytes()
    head = {"format_version": 1, "iteration": 5, "commit_seq": manifest.commit_seq, "run_token": TOKEN}
    head.update(world_size=WORLD, body_bytes=len(body), body_xxh64=xxh64(body))
    raw = json.dumps(head, sort_keys=True).encode()
    with open(os.path.join(iter_dir(root, 5), INDEX_NAME), "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(raw)) + raw + body)


def test_an_index_of_format_1_is_still_read(ckpt, monkeypatch):
    """A checkpoint written before format 2 reshards from its index as before (read whole); it
    holds no rank records, so a rank given only its own record reads the whole manifest, once."""
    root, manifest = ckpt
    _format1(root, manifest)
    gi = read_index(iter_dir(root, 5), manifest)
    assert gi.record(3) is None and len(gi.keys) == 3
    used, opened, _ = _reshard(root, 1, 4)
    assert used and opened == [1, 4, 5, 6, 7]
    used, opened, manifest_reads = _partial(root, 1, 4, monkeypatch)
    assert used and opened == [1, 4, 5, 6, 7] and manifest_reads == 1
