"""Restoring: the load plan, the verifying reader and the one resolve step of a restart."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
