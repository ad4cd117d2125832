"""Taking a snapshot: the host cache, device copies and the snapshot engine's threads."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
