"""The index codec and its validation (engine.file_format): a record that does not describe its own
bytes (size, place, checksums) is refused when the file is opened."""

import numpy as np
import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError
from datastates_megatron.engine.format.file_format import _parse_index, build_index

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
