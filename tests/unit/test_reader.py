"""The one verifying reader (engine.reader): a plan is validated whole before the first byte reaches a
destination, and the cross-rank agreement is joined exactly once on every path."""

from __future__ import annotations

import errno

import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError, EngineOptions, LayoutMismatchError
from datastates_megatron.engine.load.load_plan import ElementRange, LoadPlan, LoadPlanner, ReadItem, SameLayoutPlanner
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.load.reader import CheckpointReader

from ..faults.damage import flip

W = torch.arange(10_000, dtype=torch.float32)
B = torch.arange(7, dtype=torch.bfloat16)


@pytest.fixture
def ckpt(tmp_path):
    """Iteration 5 of a one-rank save of ``w`` (fp32, 10 checksum chunks of 4 KiB) and ``b`` (bf16)."""
    opts = EngineOptions(cache_bytes=1 << 20, chunk_bytes=4096, small_bytes=0, timeout_s=30)
    with CheckpointManager(str(tmp_path / "root"), opts, keep_last=0) as mgr:
        mgr.register("w", W.clone())
        mgr.register("b", B.clone())
        mgr.save(5, {"iteration": 5})
        mgr.wait()
    d = iter_dir(str(tmp_path / "root"), 5)
    return d, read_manifest(d)


class _Agreement:
    """Records every call of the agreement; raises the error it is given, as one rank alone would."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, error) -> None:
        self.calls.append(error)
        if error is not None:
            raise error


def _plan(*items) -> LoadPlan:
    return LoadPlan("test", tuple(ReadItem(ElementRange(0, t, s, n), dst, label) for t, s, n, dst, label in items))


@pytest.mark.parametrize(
    "bad, exc, message",
    [
        (
            ("w", 0, 1000, torch.zeros(999), "short"),
            LayoutMismatchError,
            r"1000 elements go to destination 'short' of 999",
        ),
        (
            ("w", 9_990, 20, torch.zeros(20), "past"),
            LayoutMismatchError,
            r"has 10000 elements; asked for \[9990, 10010\)",
        ),
        (("w", -1, 2, torch.zeros(2), "before"), LayoutMismatchError, r"has 10000 elements; asked for \[-1, 1\)"),
        (
            ("b", 0, 7, torch.zeros(7), "dtype"),
            LayoutMismatchError,
            r"holds torch.bfloat16, destination 'dtype' is torch.float32",
        ),
        (("nope", 0, 1, torch.zeros(1), "missing"), CorruptCheckpointError, r"rank 0 file has no tensor 'nope'"),
    ],
)
def test_a_bad_plan_is_refused_before_any_destination_is_written(ckpt, bad, exc, message):
    d, m = ckpt
    good = torch.zeros(1000)
    agree = _Agreement()
    with CheckpointReader(d, m) as reader:
        with pytest.raises(exc, match=message) as e:
            reader.execute(_plan(("w", 0, 1000, good, "good"), bad), agree)
    assert m.ranks[0].file in str(e.value) and "rank 0" in str(e.value)  # names file, rank and tensor
    assert not good.any() and not bad[3].any(), "a destination was written by a refused plan"
    assert len(agree.calls) == 1 and agree.calls[0] is e.value


def test_a_good_plan_copies_every_range_and_agrees_once(ckpt):
    d, m = ckpt
    a, b, s = torch.zeros(10, 100), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(20)
    agree = _Agreement()
    with CheckpointReader(d, m, threads=2) as reader:
        stats = reader.execute(_plan(("w", 0, 1000, a, "a"), ("b", 2, 3, b, "b"), ("w", 5110, 20, s, "s")), agree)
    assert agree.calls == [None]
    assert torch.equal(a.view(-1), W[:1000]) and torch.equal(b, B[2:5]) and torch.equal(s, W[5110:5130])
    assert stats.bytes == 4000 + 6 + 80
    assert stats.verified_bytes == 4096 + 14 + 2 * 4096  # chunk 0 of w, all of b, chunks 4 and 5 of w


def test_each_chunk_is_verified_once(ckpt):
    d, m = ckpt
    with CheckpointReader(d, m) as reader:
        # [1020, 1030) straddles chunks 0 and 1; [1000, 1024) is inside chunk 0, verified already
        first = reader.execute(_plan(("w", 1020, 10, torch.zeros(10), "x")))
        again = reader.execute(_plan(("w", 1000, 24, torch.zeros(24), "y")))
    assert first.verified_bytes == 2 * 4096 and again.verified_bytes == 0


def test_a_corrupt_chunk_is_refused_naming_file_rank_tensor_and_chunk(ckpt):
    d, m = ckpt
    with CheckpointReader(d, m) as reader:
        offset = reader.entry(0, "w").offset + 5 * 4096 + 7
    flip(f"{d}/{m.ranks[0].file}", offset, 3)
    ok, bad = torch.zeros(1000), torch.zeros(100)
    agree = _Agreement()
    with CheckpointReader(d, m) as reader:
        with pytest.raises(
            CorruptCheckpointError, match=r"rank 0: .*\.dsck: checksum mismatch in tensor 'w' \(chunk 5,"
        ):
            reader.execute(_plan(("w", 0, 1000, ok, "ok"), ("w", 5200, 100, bad, "bad")), agree)
    assert not ok.any() and not bad.any() and len(agree.calls) == 1


class _Failing(LoadPlanner):
    kind = "failing"

    def plan(self, reader):
        raise PermissionError(errno.EACCES, "Permission denied", "somewhere")


def test_an_os_error_while_planning_still_joins_the_agreement_once(ckpt):
    d, m = ckpt
    agree = _Agreement()
    with CheckpointReader(d, m) as reader:
        with pytest.raises(PermissionError):
            reader.load(_Failing(), agree)
    assert len(agree.calls) == 1 and isinstance(agree.calls[0], PermissionError)


def test_the_same_layout_planner_plans_every_registered_tensor_whole(ckpt):
    d, m = ckpt
    targets = {"w": torch.zeros(10_000), "b": torch.zeros(7, dtype=torch.bfloat16)}
    with CheckpointReader(d, m) as reader:
        plan, stats = reader.load(SameLayoutPlanner(targets, 1, {}))
    assert plan.kind == "same_layout" and plan.objects == {"iteration": 5}
    assert torch.equal(targets["w"], W) and torch.equal(targets["b"], B)
    assert stats.bytes == 40_000 + 14 and stats.verified_bytes == 40_000 + 14


def test_open_rank_says_what_kind_of_file_it_refuses(ckpt, tmp_path):
    """``open_rank`` is the one check of a rank file against its manifest (a load and the CLI use
    it): each refusal names the file and rank and carries its kind and a path-free problem."""
    import dataclasses
    import os
    import shutil

    from datastates_megatron.engine.errors import RankFileError, error_class_named, make_error
    from datastates_megatron.engine.load.reader import open_rank

    d, m = ckpt
    rec = m.ranks[0]
    path = os.path.join(d, rec.file)
    kept = str(tmp_path / "kept.dsck")
    shutil.copyfile(path, kept)

    def refused():
        with pytest.raises(RankFileError) as e:
            open_rank(d, m, 0)
        assert rec.file in str(e.value) and "rank 0" in str(e.value) and d not in e.value.problem
        return e.value.kind, e.value.problem

    with open_rank(d, m, 0) as rf:
        assert rf.header.n_tensors == rec.n_tensors
    os.truncate(path, rec.file_bytes - 1)
    assert refused() == ("size", f"file is truncated: {rec.file_bytes - 1} bytes, manifest says {rec.file_bytes}")
    os.unlink(path)
    assert refused() == ("missing", "file is missing")
    os.symlink(kept, path)
    assert refused() == ("file", "is a symlink (not a regular file inside the checkpoint)")
    os.unlink(path)
    shutil.copyfile(kept, path)  # the committed bytes again, but a manifest that committed another file
    other = dataclasses.replace(m, ranks=(dataclasses.replace(rec, header_xxh64=rec.header_xxh64 ^ 1),))
    with pytest.raises(RankFileError) as e:
        open_rank(d, other, 0)
    assert e.value.kind == "file" and e.value.problem.startswith("rank 0 file is not the one committed by the manifest")
    with pytest.raises(CorruptCheckpointError, match="header checksum mismatch") as e:  # the format's own refusal
        flip(path, 16)
        open_rank(d, m, 0)
    assert not isinstance(e.value, RankFileError)
    # across ranks only the message travels: the class arrives, its kind says "file"
    again = make_error(error_class_named("RankFileError"), "x: rank 0 file is missing")
    assert isinstance(again, RankFileError) and isinstance(again, CorruptCheckpointError) and again.kind == "file"


def _whole(manifest):
    """A plan that reads every tensor whole (the file is read ahead, then verified, then copied)."""
    return SameLayoutPlanner(
        {"w": torch.zeros(10_000), "b": torch.zeros(7, dtype=torch.bfloat16)}, 1, dict(manifest.layout)
    )


def test_a_corrupt_chunk_of_a_file_read_whole_is_refused_before_any_copy(ckpt):
    d, m = ckpt
    with CheckpointReader(d, m) as reader:
        offset = reader.entry(0, "w").offset + 7 * 4096 + 1
    flip(f"{d}/{m.ranks[0].file}", offset, 1)
    planner, agree = _whole(m), _Agreement()
    with CheckpointReader(d, m, threads=2) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in tensor 'w' \(chunk 7,"):
            reader.load(planner, agree)
    assert len(agree.calls) == 1 and not planner.targets["w"].any() and not planner.targets["b"].any()


def test_a_load_reports_its_plan_and_agreement_phases(ckpt):
    d, m = ckpt
    planner, agree = _whole(m), _Agreement()
    with CheckpointReader(d, m) as reader:
        _, stats = reader.load(planner, agree)
    assert torch.equal(planner.targets["w"], W) and torch.equal(planner.targets["b"], B)
    assert stats.plan_s > 0 and stats.agree_s >= 0 and agree.calls == [None]
    assert stats.verified_bytes == stats.bytes == 40_000 + 14


def test_a_strided_destination_is_copied(ckpt):
    d, m = ckpt
    strided = torch.zeros(10_000, 2)[:, 0]
    with CheckpointReader(d, m) as reader:
        reader.execute(_plan(("w", 0, 10_000, strided, "strided")))
    assert torch.equal(strided, W)


def test_copies_go_in_batches_of_similar_bytes_in_plan_order():
    """Many small items (a row-parallel tensor resharded row by row) cost a task per batch, not one
    per item; a large item is a batch of its own; every item is copied once, in order."""
    from datastates_megatron.engine.load.reader import copy_batches

    pairs = [(torch.zeros(10), i) for i in range(1000)] + [(torch.zeros(100_000), "big")]
    pairs += [(torch.zeros(10), 1000 + i) for i in range(1000)]
    batches = copy_batches(pairs, 8)
    assert [item for batch in batches for _, item in batch] == [item for _, item in pairs]
    assert ["big"] in [[item for _, item in b] for b in batches] and len(batches) <= 9
    assert copy_batches([], 8) == [] and len(copy_batches(pairs[:3], 8)) == 3
