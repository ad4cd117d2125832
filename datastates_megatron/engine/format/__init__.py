"""What a checkpoint is on disk: checksums, data layout, the tagged-JSON codec, the rank file format, its writer, the manifest and the global index."""

from ..._deps import check_runtime

check_runtime()  # its modules import torch, numpy or numba: a missing one is named in one line
