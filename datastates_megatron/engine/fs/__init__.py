"""Filesystem primitives: safe opens that never follow a link, page cache, mapped files, the directory lock, iteration directories."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
