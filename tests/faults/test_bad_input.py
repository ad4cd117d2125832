"""Bad input on load, at the CheckpointManager level (one process, real files): every damaged or
foreign checkpoint gives an error naming what is wrong, and no registered tensor changes.

Already covered elsewhere and not repeated here: a data bit flip / truncation / missing or foreign-run
rank file / ``../`` in the manifest / world-size mismatch with 2 ranks (tests/distributed), and the
rank-file parser on its own (tests/unit/test_engine.py).  The LazyCheckpointer level (live
model/optimizer unchanged, compared by ``megatron.shards.state_digest``) is test_lazy_bad_load.py."""

from __future__ import annotations

import os
import shutil
import struct


import pytest
import torch

from datastates_megatron.engine import (
    CheckpointError,
    CorruptCheckpointError,
    EngineOptions,
    FormatVersionError,
    LayoutMismatchError,
)
from datastates_megatron.engine.format.file_format import HEADER_BYTES, Header, RankFile
from datastates_megatron.engine.format.hashing import xxh64
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir

from .damage import edit_manifest, flip, reseal_index_record
from tests.workers.fault_worker import fill, is_state_of, make_state

LAYOUT = {"tp": 1, "pp": 1, "dp": 1}
SENTINEL = -7.0


def _manager(root, layout=LAYOUT, **kw):
    return CheckpointManager(
        str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), keep_last=0, layout=layout, **kw
    )


@pytest.fixture
def ckpt(tmp_path):
    """A root with committed iterations 1 and 2 (one rank); returns (root, manifest of 2, rank file of 2)."""
    root = tmp_path / "ckpt"
    ts = make_state(0, 50_000)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2):
            fill(ts, 0, it)
            mgr.save(it, {"iteration": it, "rank": 0}, {"note": "bad-input"})
            mgr.wait()
    m = read_manifest(iter_dir(str(root), 2))
    return str(root), m, os.path.join(iter_dir(str(root), 2), m.ranks[0].file)


def _load(root, iteration=None, layout=LAYOUT, state=None):
    """Load into a fresh sentinel-filled state; returns (error or None, tensors unchanged?, result)."""
    ts = state if state is not None else make_state(0, 50_000)
    for t in ts.values():
        t.fill_(SENTINEL)
    before = {n: t.clone() for n, t in ts.items()}
    with _manager(root, layout) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        try:
            result = mgr.load(iteration)
        except CheckpointError as e:
            return e, all(torch.equal(ts[n], before[n]) for n in ts), None
    return None, False, (result, ts)


def _expect(root, pattern, exc=CorruptCheckpointError, iteration=None, **kw):
    err, untouched, _ = _load(root, iteration, **kw)
    assert err is not None, f"loading succeeded; expected {exc.__name__} matching {pattern!r}"
    assert isinstance(err, exc), repr(err)
    assert untouched, "a failed load modified registered tensors"
    import re

    assert re.search(pattern, str(err)), str(err)
    return err


def test_the_fixture_loads_cleanly(ckpt):
    root, _, _ = ckpt
    err, _, (result, ts) = _load(root)
    assert err is None and result.iteration == 2 and is_state_of(ts, 0, 2)


# ------------------------------------------------------------------------------- the rank file
def test_bit_flip_in_the_index_names_the_file(ckpt):
    root, _, path = ckpt
    with RankFile(path) as rf:
        off = rf.header.index_offset + 9
    flip(path, off, 3)
    # the manifest records the index checksum: the file is refused before it is parsed
    _expect(root, r"r00000-.*\.dsck: index checksum mismatch")


def test_bit_flip_in_the_header_names_the_file(ckpt):
    root, _, path = ckpt
    flip(path, 20, 1)  # inside the data_offset field
    _expect(root, r"r00000-.*\.dsck: header checksum mismatch")


def test_bit_flip_in_the_objects_names_the_file(ckpt):
    root, _, path = ckpt
    with RankFile(path) as rf:
        off = rf.header.objects_offset + 5
    flip(path, off, 2)
    _expect(root, r"r00000-.*\.dsck: objects checksum mismatch")


@pytest.mark.parametrize("tensor", ["small3", "big", "bf16", "step"])
def test_bit_flip_in_any_tensor_names_file_and_tensor(ckpt, tensor):
    root, _, path = ckpt
    with RankFile(path) as rf:
        e = rf.entries[tensor]
        off = e.offset + e.nbytes - 1  # the last byte: catches a checksum that stops short
    flip(path, off, 7)
    _expect(root, rf"r00000-.*\.dsck: checksum mismatch in tensor '{tensor}'")


def test_unknown_rank_file_format_version_is_named(ckpt):
    root, _, path = ckpt
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    h = Header.unpack(raw, path)
    packed = bytearray(Header(99, *[getattr(h, f) for f in Header.__dataclass_fields__][1:]).pack())
    with open(path, "r+b") as f:
        f.write(packed)  # a well-formed header of a future format version
    _expect(
        root,
        r"r00000-.*\.dsck: written by datastates-megatron an unknown version \(rank file format 99\); this is "
        r"datastates-megatron .* \(reads rank file formats <= 1\): upgrade",
        FormatVersionError,
    )


def test_rank_file_from_another_iteration_of_the_same_run_is_refused(ckpt):
    root, m2, path = ckpt
    m1 = read_manifest(iter_dir(root, 1))
    shutil.copyfile(os.path.join(iter_dir(root, 1), m1.ranks[0].file), path)  # same size, same run
    _expect(root, r"r00000-.*\.dsck: rank 0 file is not the one committed by the manifest")


def test_truncated_to_a_header_only_file_is_refused(ckpt):
    root, m, path = ckpt
    os.truncate(path, HEADER_BYTES)
    _expect(root, rf"rank 0 file has {HEADER_BYTES} bytes, manifest says {m.ranks[0].file_bytes}")


def test_rank_file_replaced_by_a_directory_is_refused(ckpt):
    root, _, path = ckpt
    os.unlink(path)
    os.mkdir(path)
    _expect(root, r"rank 0 file r00000-.*\.dsck is missing")


def test_an_index_declaring_half_a_tensor_is_refused_before_any_tensor_is_copied(tmp_path):
    """A resealed index (every checksum valid) whose record of ``b`` declares half its bytes: the
    load is refused naming the file and tensor, and ``a``, ``b`` and ``c`` keep their bits."""
    root = str(tmp_path / "ckpt")
    ts = {n: torch.full((1000,), float(i + 1)) for i, n in enumerate("abc")}
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        mgr.save(1, {"iteration": 1})
        mgr.wait()
    path = os.path.join(iter_dir(root, 1), read_manifest(iter_dir(root, 1)).ranks[0].file)

    def halve(rec, cks, raw):
        rec[13] //= 2
        cks[rec[14]] = xxh64(bytes(raw[rec[12] : rec[12] + rec[13]]))  # the half is sealed too

    reseal_index_record(path, "b", halve)
    live = {n: torch.full((1000,), -float(i + 1)) for i, n in enumerate("abc")}
    before = {n: t.clone() for n, t in live.items()}
    with _manager(root) as mgr:
        for n, t in live.items():
            mgr.register(n, t)
        with pytest.raises(CorruptCheckpointError, match=r"r00000-.*\.dsck: index record \d \(tensor 'b'\)"):
            mgr.load(1)
    for n in "abc":
        assert torch.equal(live[n], before[n]), f"tensor {n} was written by a refused load"


def test_a_latest_iteration_that_is_a_symlink_is_refused_not_followed(ckpt, tmp_path):
    """``iter_0000002`` replaced by a link to an intact copy elsewhere: load refuses it, naming the
    link, instead of restoring from wherever it points."""
    root, _, _ = ckpt
    elsewhere = str(tmp_path / "elsewhere")
    shutil.move(iter_dir(root, 2), elsewhere)
    os.symlink(elsewhere, iter_dir(root, 2))
    for iteration in (None, 2):
        _expect(root, r"iter_0000002: is a symlink to .*elsewhere.*never read through", iteration=iteration)


# ------------------------------------------------------------------------------- the manifest
def _edit_manifest(root, iteration, edit, reseal=True):
    edit_manifest(iter_dir(root, iteration), edit, reseal=reseal)


def test_unknown_manifest_format_version_is_named(ckpt):
    root, _, _ = ckpt
    _edit_manifest(root, 2, lambda b: b.update(format_version=2), reseal=False)
    _expect(
        root,
        r"manifest\.json: written by datastates-megatron \S+ \(manifest format 2\); this is "
        r"datastates-megatron .* \(reads manifest formats <= 1\): upgrade",
        FormatVersionError,
        iteration=2,
    )
    # discovering the latest checkpoint reports it too (rather than silently falling back to iteration 1)
    _expect(root, r"\(manifest format 2\).*upgrade", FormatVersionError)


@pytest.mark.parametrize("name", ["/etc/passwd", "..", ".", "sub/file.dsck", "", "r00000 x.dsck", "..\\x"])
def test_manifest_naming_a_path_outside_the_checkpoint_is_refused(ckpt, name):
    root, _, _ = ckpt
    _edit_manifest(root, 2, lambda b: b["ranks"][0].update(file=name))
    _expect(root, r"rank 0 file .* is not a plain file name inside the checkpoint directory", iteration=2)


def test_manifest_that_is_not_json_is_named(ckpt):
    root, _, _ = ckpt
    path = os.path.join(iter_dir(root, 2), MANIFEST_NAME)
    flip(path, 0, 2)  # '{' -> '\x7f'
    _expect(root, r"manifest\.json: manifest is not valid JSON", iteration=2)


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("file_bytes", 123, r"rank 0 file has \d+ bytes, manifest says 123"),
        ("index_xxh64", 1, r"rank 0 file is not the one committed"),
        ("header_xxh64", 1, r"rank 0 file is not the one committed"),
    ],
)
def test_manifest_rank_record_that_disagrees_with_the_file_is_refused(ckpt, field, value, pattern):
    root, _, _ = ckpt
    _edit_manifest(root, 2, lambda b: b["ranks"][0].update({field: value}))
    _expect(root, pattern, iteration=2)


def test_manifest_in_the_wrong_directory_is_refused(ckpt):
    root, _, _ = ckpt
    _edit_manifest(root, 2, lambda b: b.update(iteration=3))
    _expect(root, r"manifest is for iteration 3, directory says 2", iteration=2)


def test_manifest_missing_a_field_is_named(ckpt):
    root, _, _ = ckpt
    _edit_manifest(root, 2, lambda b: b.pop("commit_seq"), reseal=False)
    _expect(
        root,
        r"manifest is missing or has a malformed field: 'commit_seq'|manifest\.json: .*(checksum|damaged)",
        iteration=2,
    )


def _flip_in_value(root, iteration, key, bit=0):
    """Flip ``bit`` of a character in the middle of ``key``'s value in the manifest's text, so the JSON
    stays valid (a digit becomes another digit, a hex letter another letter): a silent bit flip.
    (The middle: the last digit of a float may be below double precision.)"""
    path = os.path.join(iter_dir(root, iteration), MANIFEST_NAME)
    text = open(path, "rb").read()
    start = text.index(f'"{key}": '.encode()) + len(key) + 4
    end = text.index(b"\n", start)
    chars = [i for i in range(start, end) if chr(text[i]).isalnum()]
    at = chars[len(chars) // 2]
    c = chr(text[at])
    # the first bit from ``bit`` on that keeps the character's class ('a' ^ 1 is a backtick: 'a' ^ 2)
    flipped = next(f for b in range(bit, 8) if (f := chr(text[at] ^ (1 << b))).isalnum() and f.isdigit() == c.isdigit())
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(flipped.encode())


@pytest.mark.parametrize("key", ["commit_seq", "metadata", "run_token", "created"])
def test_any_bit_flip_in_the_manifest_is_detected(ckpt, key):
    """The manifest is the commit point but carries no checksum of its own, so a flip in a field that
    no other check covers is loaded silently.  ``commit_seq`` is the dangerous one: it decides which
    checkpoint is the latest (see the next test)."""
    root, _, _ = ckpt
    _flip_in_value(root, 2, "note" if key == "metadata" else key)  # metadata: {"note": "bad-input"}
    _expect(root, r"manifest", iteration=2)


def test_bit_flip_in_an_older_commit_seq_does_not_silently_roll_back(ckpt):
    root, _, _ = ckpt
    assert read_manifest(iter_dir(root, 1)).commit_seq == 0
    _flip_in_value(root, 1, "commit_seq", bit=3)  # '0' -> '8': iteration 1 now looks like the newest commit
    err, untouched, loaded = _load(root)
    # refused (the damaged manifest was modified after the newest commit), or skipped as an older
    # damaged checkpoint (file times are coarse: the flip may carry the newest commit's mtime) --
    # never iteration 1 restored as the latest
    if err is None:
        assert loaded[0].iteration == 2, f"a damaged manifest silently made iteration {loaded[0].iteration} the latest"
    else:
        assert untouched


# ------------------------------------------------------------------------------- the world
def test_parallel_layout_mismatch_names_every_difference(ckpt):
    root, _, _ = ckpt
    err = _expect(
        root,
        r"checkpoint layout differs from this run: dp=1 in checkpoint, 2 now; tp=1 in checkpoint, 4 now",
        LayoutMismatchError,
        layout={"tp": 4, "pp": 1, "dp": 2},
    )
    assert iter_dir(root, 2) in str(err)


def test_tensor_shape_or_dtype_or_set_mismatch_names_the_tensor(ckpt):
    root, _, _ = ckpt
    ts = make_state(0, 50_000)
    ts["small3"] = torch.zeros(99)
    ts["bf16"] = torch.zeros(33, 5)  # fp32 instead of bf16
    del ts["step"]
    ts["extra"] = torch.zeros(3)
    err = _expect(
        root,
        r"rank 0: .*missing from checkpoint: \['extra'\]; not expected by this model: \['step'\]",
        LayoutMismatchError,
        state=ts,
    )
    assert "tensor 'bf16': checkpoint has torch.bfloat16 [33, 5], model has torch.float32 [33, 5]" in str(err)
    assert "tensor 'small3': checkpoint has torch.float32 [13], model has torch.float32 [99]" in str(err)


def test_no_partial_checkpoint_is_ever_loadable(ckpt):
    """A directory with rank files but no manifest (a crash before the commit) is not a checkpoint:
    asking for it by number is an error, and the latest stays the previous one."""
    root, m, path = ckpt
    os.makedirs(iter_dir(root, 3))
    shutil.copyfile(path, os.path.join(iter_dir(root, 3), m.ranks[0].file))
    err, untouched, _ = _load(root, 3)
    # the start-up cleanup of the loading manager removed the leftover directory first
    assert err is not None and "iter_0000003: no such checkpoint directory" in str(err) and untouched
    assert not os.path.exists(iter_dir(root, 3))
    err, _, (result, ts) = _load(root)
    assert err is None and result.iteration == 2 and is_state_of(ts, 0, 2)


def test_tracker_temp_file_left_by_a_crash_is_removed_at_start_up(ckpt):
    root, _, _ = ckpt
    stale = os.path.join(root, "latest_checkpointed_iteration.txt.tmp-99999")
    with open(stale, "w") as f:
        f.write("3")
    err, _, (result, _) = _load(root)
    assert err is None and result.iteration == 2
    assert not os.path.exists(stale)
    assert os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))


def test_header_struct_is_what_the_tests_assume():
    assert struct.calcsize("<8sII" + "Q" * 11) + 8 <= HEADER_BYTES
