"""One safetensors file, written tensor by tensor (never the whole model in memory).

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
padded with spaces to a multiple of 8 bytes, then the tensors' bytes, little-endian, row-major,
back to back in header order.  The header is known before any tensor is read (names, shapes and
dtypes come from the checkpoint's index), so each tensor is written as soon as it is assembled.
The library is not needed to write it; the tests read it back with it.

Thread-safety: a :class:`SafetensorsWriter` is used from one thread.
"""

from __future__ import annotations

import json
import math
import struct

import torch

__all__ = ["DTYPES", "SafetensorsWriter"]

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsWriter:
    """``tensors``: ``[(name, shape, dtype)]`` in the order :meth:`write` will be called; the header
    goes to ``f`` (a binary file positioned at 0) at construction."""

    def __init__(self, f, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict | None = None):
        header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
        self._order: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        at = 0
        for name, shape, dtype in tensors:
            if dtype not in DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
            if name in header:
                raise ValueError(f"{name}: named twice")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [at, at + size]}
            self._order.append((name, tuple(int(s) for s in shape), dtype))
            at += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f.write(struct.pack("<Q", len(raw)) + raw)
        self._f = f
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the header's order (its name, shape and dtype must be those declared)."""
        if self._next >= len(self._order):
            raise ValueError(f"{name}: more tensors than declared")
        want = self._order[self._next]
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != want:
            raise ValueError(f"tensor {self._next}: declared {want}, written {got}")
        if tensor.numel():
            self._f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        """Check every declared tensor was written."""
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} declared tensors not written")
