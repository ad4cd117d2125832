"""The index codec and its validation (engine.file_format): a record that does not describe its own
bytes (size, place, checksums) is refused when the file is opened."""

import numpy as np
import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError
from datastates_megatron.engine.format.file_format import RankFile, _parse_index, build_index

from .rank_files import write_rank_file

DATA = (4096, 8194, 16)  # data section [4096, 8194), 16-byte checksum chunks


def _index(shapes=((2, 3), ()), offsets=(4096, 8192), nbytes=(24, 2), cks=((1, 2), (3,))):
    return build_index(
        ["a.weight", "b"],
        [torch.float32, torch.bfloat16],
        list(shapes),
        list(offsets),
        list(nbytes),
        [np.array(c, np.uint64) for c in cks],
    )


def test_index_round_trip():
    entries = _parse_index(memoryview(_index()), 2, "x", DATA)
    assert [e.name for e in entries] == ["a.weight", "b"]
    assert entries[0].shape == (2, 3) and entries[1].shape == () and entries[1].dtype == torch.bfloat16
    assert list(entries[0].checksums) == [1, 2] and list(entries[1].checksums) == [3]


@pytest.mark.parametrize(
    "edit, what",
    [
        ({"nbytes": (12, 2), "cks": ((1,), (3,))}, "declares 12 bytes for torch.float32 \\[2, 3\\]"),
        ({"offsets": (4000, 8192)}, "outside the data section"),
        ({"offsets": (4096, 8193)}, "outside the data section"),
        ({"cks": ((1,), (3,))}, "1 checksums for 24 bytes"),
    ],
)
def test_an_index_record_that_does_not_describe_its_bytes_is_refused(edit, what):
    with pytest.raises(CorruptCheckpointError, match=f"x: index record \\d \\(tensor '.+'\\).*{what}"):
        _parse_index(memoryview(_index(**edit)), 2, "x", DATA)


def test_verify_all_checks_every_chunk_of_every_tensor_and_names_the_bad_one(tmp_path):
    """The one whole-file check (promotion, replication): the tensor bytes of a clean file; the first
    bad chunk of any tensor, whichever it is, raises naming the file and tensor."""
    path = str(tmp_path / "r.dsck")
    state = write_rank_file(path, tensors=3, numel=300_000, seed=1, cache_bytes=1 << 20)
    with RankFile(path) as rf:
        assert rf.verify_all() == sum(t.numel() * t.element_size() for t in state.values())
        last = max(rf.entries.values(), key=lambda e: e.offset)
        assert len(last.checksums) > 1  # several chunks: the bad one is not the first
        spot = last.offset + last.nbytes - 10  # in the last chunk of the last tensor
    with open(path, "r+b") as f:
        f.seek(spot)
        byte = f.read(1)
        f.seek(spot)
        f.write(bytes([byte[0] ^ 0xFF]))
    with (
        RankFile(path) as rf,
        pytest.raises(CorruptCheckpointError, match=rf"{path}: checksum mismatch in tensor '{last.name}'"),
    ):
        rf.verify_all()


def test_whole_files_are_verified_by_verify_all_only():
    """Promotion and replication verify a whole file with :meth:`RankFile.verify_all`, not loops of
    their own: no module but the file format calls ``verify_entry``."""
    import ast
    import pathlib

    import datastates_megatron

    root = pathlib.Path(datastates_megatron.__file__).parent
    callers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "verify_entry"
    )
    assert callers == ["engine/format/file_format.py"], callers
