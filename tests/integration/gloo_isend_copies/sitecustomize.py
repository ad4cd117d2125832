"""Put first on ``PYTHONPATH`` of a CPU run of Megatron-LM's interleaved schedule (``launch`` in
megatron_lm_runs does, for those runs only): ``torch.distributed.isend`` of a CPU tensor sends a
private copy of it, and the copy lives as long as the send's ``Work``.

Why: with ``overlap_p2p_comm`` (Megatron-LM's default under the interleaved schedule, and the only
choice at PP = 2) a chunk's output is sent with ``isend`` and, before that send is waited on,
``deallocate_output_tensor`` swaps the tensor's storage for a 1-element one (``out.data = ...``).
Gloo's send reads the tensor's memory from its own thread until it completes, so that memory is
freed and reused by the next microbatch's tensors while it is being sent: the next stage receives
a mix of activations and whatever was allocated there (another loss from run to run, a NaN under
load). Megatron-LM's sources are not changed; the values sent are the same.
"""

import torch.distributed as _dist
from torch.distributed import distributed_c10d as _c10d

_isend = _c10d.isend


def _isend_a_copy(tensor, *args, **kwargs):
    if tensor.device.type == "cpu":
        tensor = tensor.detach().clone()  # held by gloo's SendWork until the send is done
    return _isend(tensor, *args, **kwargs)


_isend_a_copy.__wrapped__ = _isend
_c10d.isend = _dist.isend = _isend_a_copy
