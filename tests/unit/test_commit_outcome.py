"""The store commit protocol with N committers in one process (threads standing for ranks, one
in-process c10d store): every rank learns the outcome, and a failure on any rank -- its file, or
rank 0's manifest -- is every rank's error, never a wait that runs into the timeout."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest
import torch.distributed as dist

from datastates_megatron.engine.tiers.commit import Ticket
from datastates_megatron.engine.errors import CheckpointError, CommitError
from datastates_megatron.engine.format.file_format import FileReceipt
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.format.rank_table import RankTable
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.dist.store_channel import StoreChannel
from datastates_megatron.engine.tiers import tier as tier_module
from datastates_megatron.engine.tiers.tier import Tier

WORLD = 4
TOKEN = "00000000000000cc"


def _commit_on_every_rank(root: str, metadata: dict, failing: set[int] = frozenset()):
    """One save of iteration 3 on WORLD committers; each rank's committed iteration or error."""
    os.makedirs(iter_dir(root, 3))  # made by the save, before the commit
    store = dist.HashStore()
    tiers = []
    for rank in range(WORLD):
        tier = Tier("persistent", root, rank=rank, token=TOKEN, writes=list(range(WORLD)) if rank == 0 else [])
        tier.open(StoreChannel(store, rank, WORLD, "t", 20.0), WORLD, {"dp": WORLD}, 20.0)
        tiers.append(tier)
    for rank, tier in enumerate(tiers):
        done: cf.Future = cf.Future()
        if rank in failing:
            done.set_exception(CheckpointError(f"rank {rank}: disk full"))
        else:
            done.set_result(FileReceipt(3, "f", 4096 + rank, 64, 1, 7 + rank, 9 + rank))
        tier.submit(Ticket(3, 1, done, dict(metadata), time.perf_counter(), token=TOKEN))
    out = []
    for tier in tiers:
        tier.drain(30)
        try:
            out.append([r.iteration for r in tier.poll()])
        except CommitError as e:
            out.append(e)
        tier.close()
    return out


def test_every_rank_commits_and_rank0_writes_every_record(tmp_path):
    root = str(tmp_path / "root")
    assert _commit_on_every_rank(root, {"note": "x"}) == [[3]] * WORLD
    m = read_manifest(iter_dir(root, 3))
    assert [(r.rank, r.file_bytes, r.index_xxh64, r.header_xxh64) for r in m.ranks] == [
        (r, 4096 + r, 7 + r, 9 + r) for r in range(WORLD)
    ]


def test_rank0_writes_its_records_as_columns(tmp_path):
    """Rank 0's commit makes no object per rank (issue 49, item 6: at 16k ranks, making 16k records
    and formatting each was most of its commit): the manifest it wrote and remembers holds a
    :class:`RankTable`, equal to what a reader of the file gets."""
    root = str(tmp_path / "root")
    assert _commit_on_every_rank(root, {"note": "x"}) == [[3]] * WORLD
    written = tier_module._MANIFESTS.read(iter_dir(root, 3))  # remembered by the writer, not read back
    assert isinstance(written.ranks, RankTable), type(written.ranks)
    assert written == read_manifest(iter_dir(root, 3))


def test_a_failed_file_is_every_other_rank_error(tmp_path):
    out = _commit_on_every_rank(str(tmp_path / "root"), {}, failing={2})
    assert out[2] == []  # its own error is the engine's to report
    for rank in (0, 1, 3):
        assert isinstance(out[rank], CommitError) and "rank(s) [2] failed" in str(out[rank])


@pytest.mark.parametrize("metadata", [{"bad": object()}])
def test_a_manifest_that_cannot_be_written_is_every_rank_error(tmp_path, metadata):
    out = _commit_on_every_rank(str(tmp_path / "root"), metadata)
    assert isinstance(out[0], CommitError) and "writing the persistent manifest" in str(out[0])
    for rank in range(1, WORLD):
        assert isinstance(out[rank], CommitError) and "could not be written (by rank(s) [0])" in str(out[rank])


@pytest.mark.parametrize("sent", [None, 2], ids=["died-before-its-status", "sent-another-save-then-died"])
def test_a_rank_gone_fails_the_pending_commit_on_every_live_rank_once_forgotten(tmp_path, sent):
    """Rank 3 died (an in-process restart went on without it): once the live ranks' channels are
    told (``forget``), the pending commit ends at once, with no manifest, on every live rank: as
    failed when rank 3 never sent its status (rank 3 named as failed, not as out of step); as out of
    step when it had sent one of another save (a real row is never taken for a filled one)."""
    root = str(tmp_path / "root")
    os.makedirs(iter_dir(root, 3))
    store = dist.HashStore()
    tiers, chans = [], []
    for rank in range(WORLD - 1):  # rank 3 never runs
        chan = StoreChannel(store, rank, WORLD, "t", 60.0)
        tier = Tier("persistent", root, rank=rank, token=TOKEN, writes=list(range(WORLD)) if rank == 0 else [])
        tier.open(chan, WORLD, {"dp": WORLD}, 60.0)
        tiers.append(tier)
        chans.append(chan)
    if sent is not None:  # rank 3's status of another save (sequence 2), then it died
        dead = Tier("persistent", root, rank=3, token=TOKEN, writes=[])
        dead.open(StoreChannel(store, 3, WORLD, "t", 60.0), WORLD, {"dp": WORLD}, 60.0)
        done: cf.Future = cf.Future()
        done.set_result(FileReceipt(3, "f", 4099, 64, 1, 10, 12))
        dead.submit(Ticket(3, sent, done, {}, time.perf_counter(), token=TOKEN))
        while store.add("t/0/count", 0) < 1:  # its row is in
            time.sleep(0.01)
        for chan in chans:  # told before rank 0 gathers: its real row must still count as sent
            chan.forget([3])
    for rank, tier in enumerate(tiers):
        done: cf.Future = cf.Future()
        done.set_result(FileReceipt(3, "f", 4096 + rank, 64, 1, 7 + rank, 9 + rank))
        tier.submit(Ticket(3, 1, done, {}, time.perf_counter(), token=TOKEN))
    time.sleep(0.3)  # rank 0 is waiting for rank 3's status
    t0 = time.monotonic()
    for chan in chans:
        chan.forget([3])
    for tier in tiers:
        tier.drain(10)
        with pytest.raises(CommitError, match=r"rank\(s\) \[3\] failed" if sent is None else "out of step") as e:
            tier.poll()
        assert ("out of step" in str(e.value)) == (sent is not None)
        tier.close()
    assert time.monotonic() - t0 < 10
    assert not os.path.exists(os.path.join(iter_dir(root, 3), "manifest.json"))
    if sent is not None:  # its commit thread heard the outcome too
        dead.drain(10)
        dead.close()
