"""Cross-rank agreement: start-up and load collectives, and the commit's c10d store channel."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
