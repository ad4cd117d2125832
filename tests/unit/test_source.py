"""engine.source.resolve: rank 0 reads the manifest once, every rank gets only its own record (N
threads standing for N ranks over one in-process c10d store)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
import torch.distributed as dist

from datastates_megatron.engine import LayoutMismatchError, NoCheckpointError
from datastates_megatron.engine.load.load_plan import SameLayoutPlanner
from datastates_megatron.engine.names import iter_dir, rank_file_name
from datastates_megatron.engine.load.reader import CheckpointReader
from datastates_megatron.engine.load.resolve import resolve
from datastates_megatron.engine.dist.store_channel import StoreChannel

from .rank_files import write_checkpoint

WORLD = 4
TOKEN = "00000000000000aa"


@pytest.fixture
def root(tmp_path):
    """Iteration 7 of a 4-rank checkpoint: rank r saved ``w`` = [r, r, r, r]."""
    root = str(tmp_path / "root")
    write_checkpoint(root, 7, WORLD, TOKEN, commit_seq=3)
    return root


def _resolve_on_every_rank(root, layout, iteration=None):
    store = dist.HashStore()
    chans = [StoreChannel(store, r, WORLD, "resolve", 20) for r in range(WORLD)]

    def one(c):
        try:
            return resolve(root, iteration, c, layout), c
        except Exception as e:  # noqa: BLE001 - compared below
            return e, c

    with cf.ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(one, chans))


def test_each_rank_gets_its_own_record_and_loads_from_it(root):
    results = _resolve_on_every_rank(root, {"dp": WORLD})
    for rank, (got, chan) in enumerate(results):
        assert got.ckpt == iter_dir(root, 7)
        assert [r.rank for r in got.manifest.ranks] == [rank]
        assert got.file_of(rank).file == rank_file_name(rank, TOKEN, 1)
        assert (got.manifest.iteration, got.manifest.commit_seq, got.manifest.metadata) == (7, 3, {"note": "x"})
        if rank:
            assert chan.received < 2048  # its record and the header, not the manifest
        w = torch.zeros(4)
        with CheckpointReader(got.ckpt, got.manifest, rank=rank) as reader:
            plan, _ = reader.load(SameLayoutPlanner({"w": w}, WORLD, {"dp": WORLD}))
        assert torch.equal(w, torch.full((4,), float(rank))) and plan.objects == {"rank": rank}


def test_a_layout_mismatch_on_rank0_is_every_rank_error(root):
    for got, _ in _resolve_on_every_rank(root, {"dp": 2}):
        assert isinstance(got, LayoutMismatchError) and "dp=4 in checkpoint, 2 now" in str(got)


def test_a_missing_iteration_is_every_rank_error(root):
    for got, _ in _resolve_on_every_rank(root, {"dp": WORLD}, iteration=9):
        assert isinstance(got, NoCheckpointError) and "iter_0000009" in str(got)


def _decide_on_every_rank(root, decide, check=None):
    store = dist.HashStore()
    chans = [StoreChannel(store, r, WORLD, "resolve", 20) for r in range(WORLD)]

    def one(c):
        try:
            offer = {"mine": 10 + c.rank}
            return resolve(root, None, c, {"dp": WORLD}, check=check, offer=offer, decide=decide), c
        except Exception as e:  # noqa: BLE001 - compared below
            return e, c

    with cf.ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(one, chans))


def test_the_restore_decision_is_made_on_rank0_from_every_ranks_offer_in_the_same_round(root):
    seen = []

    def decide(cols, found):
        seen.append((cols["mine"].tolist(), sorted(found.committed)))
        return 7, {"tier": "persistent", "offers": int(cols["mine"].sum())}

    results = _decide_on_every_rank(root, decide, check=lambda m, c: m.world_size == WORLD)
    assert seen == [([10, 11, 12, 13], [7])]  # once, on rank 0, from one survey
    for rank, (got, chan) in enumerate(results):
        assert got.decision == {"tier": "persistent", "offers": 46} and got.checked is True
        assert [r.rank for r in got.manifest.ranks] == [rank] and got.ckpt == iter_dir(root, 7)
        if rank:
            assert chan.sent < 512 and chan.received < 2048  # one record out; the answer and its record back


def test_a_decision_that_reads_nothing_sends_no_records(root):
    results = _decide_on_every_rank(root, lambda cols, found: (None, {"tier": "local"}))
    for got, _ in results:
        assert (got.ckpt, got.manifest, got.decision, got.checked) == (None, None, {"tier": "local"}, None)


def test_a_failed_decision_is_every_ranks_error(root):
    def decide(cols, found):
        raise NoCheckpointError(f"{found.root}: nothing every rank holds")

    for got, _ in _decide_on_every_rank(root, decide):
        assert isinstance(got, NoCheckpointError) and "nothing every rank holds" in str(got)
