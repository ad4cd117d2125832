import argparse
import json
import random

import numpy as np
import pytest
import torch

from datastates_megatron.engine.errors import CorruptCheckpointError, EncodingError
from datastates_megatron.engine.format.tagged_json import decode_objects, encode_objects


def test_round_trip_of_training_state():
    value = {
        "iteration": 7,
        "lr": 1.5e-4,
        "nan": float("nan"),
        "inf": float("-inf"),
        "python_rng": random.Random(3).getstate(),
        "numpy_rng": np.random.RandomState(4).get_state(),
        "torch_rng": torch.Generator().manual_seed(5).get_state(),
        "args": argparse.Namespace(save="/x", params_dtype=torch.bfloat16, layers=[1, 2]),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "int_keys": {1: "a", (2, 3): "b"},
        "blob": b"\x00\x01",
        "np_scalar": np.float32(2.5),
        "mixed": [1, True, 2, False, None],  # bools stay bools next to ints
        "np_ints": (np.int64(3), 4),
    }
    out = decode_objects(encode_objects(value))
    assert out["iteration"] == 7 and out["lr"] == 1.5e-4 and np.isnan(out["nan"]) and out["inf"] == float("-inf")
    assert out["python_rng"] == value["python_rng"]
    np.testing.assert_array_equal(out["numpy_rng"][1], value["numpy_rng"][1])
    assert out["numpy_rng"][0] == "MT19937"
    assert torch.equal(out["torch_rng"], value["torch_rng"])
    assert out["args"].params_dtype is torch.bfloat16 and out["args"].layers == [1, 2]
    assert torch.equal(out["bf16"], value["bf16"]) and out["bf16"].dtype == torch.bfloat16
    assert out["int_keys"] == {1: "a", (2, 3): "b"}
    assert out["blob"] == b"\x00\x01" and out["np_scalar"] == np.float32(2.5)
    random.Random().setstate(out["python_rng"])  # usable as-is
    assert out["mixed"] == [1, True, 2, False, None] and [type(v) for v in out["mixed"]] == [
        int,
        bool,
        int,
        bool,
        type(None),
    ]
    assert out["np_ints"] == (np.int64(3), 4) and type(out["np_ints"][0]) is np.int64


def test_strict_refuses_arbitrary_objects_and_lax_stores_repr():
    with pytest.raises(EncodingError, match=r"\$\.fn"):
        encode_objects({"fn": print})
    assert decode_objects(encode_objects({"fn": len}, strict=False))["fn"] == repr(len)


def test_unknown_tag_is_refused_never_executed():
    evil = json.dumps({"__t": "pickle", "v": "Y29zCnN5c3RlbQ=="}).encode()
    with pytest.raises(CorruptCheckpointError, match="unknown object tag"):
        decode_objects(evil)
    with pytest.raises(CorruptCheckpointError):
        decode_objects(b"{not json")
