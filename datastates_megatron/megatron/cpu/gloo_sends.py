"""On gloo CPU ranks, ``torch.distributed.isend`` of a CPU tensor sends a private copy of it, which
lives as long as the send's ``Work``.

Why: with ``overlap_p2p_comm`` (Megatron-LM's default under the interleaved schedule, and the only
choice at PP = 2) a chunk's output is sent with ``isend`` and, before that send is waited on,
``deallocate_output_tensor`` swaps the tensor's storage for a 1-element one (``out.data = ...``).
NCCL's sends are ordered on the stream, so this is safe on a GPU; gloo's send reads the tensor's
memory from its own thread until it completes, so that memory is freed and reused by the next
microbatch's tensors while it is being sent, and the next stage receives a mix of activations and
whatever was allocated there (another loss from run to run, a NaN under load).  The values sent
are the same; Megatron-LM's sources are not changed.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["install"]


def _isend_a_copy(tensor, *args, **kwargs):
    if tensor.device.type == "cpu":
        tensor = tensor.detach().clone()  # held by gloo's send work until the send is done
    return _isend_a_copy.__wrapped__(tensor, *args, **kwargs)


def install() -> None:
    """Replace ``isend`` (idempotent); call before Megatron-LM is imported."""
    if distributed_c10d.isend is not _isend_a_copy:
        _isend_a_copy.__wrapped__ = distributed_c10d.isend
        distributed_c10d.isend = dist.isend = _isend_a_copy
