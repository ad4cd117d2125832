"""Promotion to object storage: a verified local rank file streamed into one object.

As :func:`..format.verified_copy.copy_verified` does for a directory: every chunk checksum of the local file
is verified first, then the verified mapping itself is uploaded (:meth:`.base.Storage.put_file`:
parts sliced from the mapping, CRC32 end to end -- no second copy of the file), and the file's
header is read again afterwards: a local file rewritten in place meanwhile (a recycled file) fails
the promotion instead of committing mixed bytes.  The object is not a checkpoint until the
persistent manifest names it (:mod:`.object_tier`).
"""

from __future__ import annotations

import os
import time

from ..errors import FlushError
from ..runtime.faults import crash_point
from ..format.file_format import HEADER_BYTES, FileReceipt, RankFile
from .base import Storage

__all__ = ["upload_verified"]


def upload_verified(
    src: str, storage: Storage, key: str, version: int, pace=None, memory_fd: int | None = None
) -> FileReceipt:
    """Verify every checksum of the local rank file ``src`` (or of the memory file ``memory_fd``,
    which ``src`` then only names), then store it at ``key``."""
    t0 = time.perf_counter()
    with RankFile(src, memory_fd) as rf:
        data_bytes = rf.verify_all()
        header = rf.header
        storage.put_file(key, rf.span(0, header.file_bytes), pace=pace)
        if os.pread(rf.fileno(), HEADER_BYTES, 0) != header.pack():
            raise FlushError(f"{src}: the local file was rewritten while it was promoted to {storage.url(key)}")
    crash_point("promote")
    dt = time.perf_counter() - t0
    return FileReceipt.of(header, data_bytes, version, storage.url(key), copy_s=dt, flush_s=dt)
