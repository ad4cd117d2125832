"""Non-tensor state as tagged JSON: round-trips Python/numpy/torch values without pickle.

Loading never executes code from the file: only the tags below are understood, anything else is an
error.  Supported: None, bool, int, float (incl. nan/inf), str, bytes, list, tuple, dict (any
encodable keys), numpy arrays and scalars, torch tensors (copied to CPU), torch dtypes,
``argparse.Namespace``.  With ``strict=False`` other values are stored as their ``repr`` string
(used for Megatron's args, which hold functions and enums nobody needs to restore).
"""

from __future__ import annotations

import argparse
import base64
import enum
import json
import math

import numpy as np
import torch

from ..errors import CorruptCheckpointError, EncodingError

__all__ = ["encode_objects", "decode_objects"]

_TAG = "__t"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown torch dtype {name!r} in stored objects")
    return dtype


def _encode(value, strict: bool, path: str):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        if strict:
            raise EncodingError(f"cannot store enum {value!r} at {path} without pickle")
        return {_TAG: "repr", "v": repr(value)}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "v": repr(value)}
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):  # Python's RNG state: 625 ints, on every save
            items = list(value)
        else:
            items = [_encode(v, strict, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {_TAG: "tuple", "v": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, strict, f"{path}.{k}") for k, v in value.items()}
        return {
            _TAG: "dict",
            "v": [[_encode(k, strict, path), _encode(v, strict, f"{path}[{k!r}]")] for k, v in value.items()],
        }
    if isinstance(value, bytes):
        return {_TAG: "bytes", "v": _b64(value)}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise EncodingError(f"cannot store object-dtype numpy array at {path}")
        arr = np.ascontiguousarray(value)
        return {_TAG: "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape), "v": _b64(arr.tobytes())}
    if isinstance(value, np.generic):
        return {_TAG: "npscalar", "dtype": value.dtype.str, "v": _b64(value.tobytes())}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "v": _b64(raw)}
    if isinstance(value, torch.dtype):
        return {_TAG: "torch_dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, argparse.Namespace):
        return {_TAG: "namespace", "v": {k: _encode(v, strict, f"{path}.{k}") for k, v in vars(value).items()}}
    if strict:
        raise EncodingError(f"cannot store {type(value).__name__} at {path} without pickle")
    return {_TAG: "repr", "v": repr(value)}


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v) for k, v in value.items()}
    v = value.get("v")
    if tag == "tuple":
        return tuple(_decode(x) for x in v)
    if tag == "dict":
        return {_hashable(_decode(k)): _decode(x) for k, x in v}
    if tag == "float":
        return float(v)
    if tag == "bytes":
        return _unb64(v)
    if tag == "ndarray":
        return np.frombuffer(_unb64(v), dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if tag == "npscalar":
        return np.frombuffer(_unb64(v), dtype=np.dtype(value["dtype"]))[0]
    if tag == "tensor":
        dtype = _torch_dtype(value["dtype"])
        raw = bytearray(_unb64(v))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"]).clone()
    if tag == "torch_dtype":
        return _torch_dtype(v)
    if tag == "namespace":
        return argparse.Namespace(**{k: _decode(x) for k, x in v.items()})
    if tag == "repr":
        return v
    raise CorruptCheckpointError(f"unknown object tag {tag!r} in stored objects")


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode_objects(value, *, strict: bool = True) -> bytes:
    """Serialise ``value`` to UTF-8 JSON bytes; raises :class:`EncodingError` naming the bad path."""
    return json.dumps(_encode(value, strict, "$"), separators=(",", ":")).encode("utf-8")


def decode_objects(data: bytes | memoryview | str):
    """Inverse of :func:`encode_objects` (of its bytes, or of their text once checked by
    :class:`.json_budget.DecodeBudget`); raises :class:`CorruptCheckpointError` on malformed input."""
    try:
        return _decode(json.loads(data if isinstance(data, str) else bytes(data).decode("utf-8")))
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptCheckpointError(f"stored objects are malformed: {e}") from e
