"""A tier and what it owns: commit, retention and its deleter, foreign refusal, the run id, promotion and replication."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
