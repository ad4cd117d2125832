"""Saving to object storage without a node-local directory: each rank file is written into a memfd
(memory-backed and nameless: a ``kill -9`` leaves nothing behind, and the snapshot engine's mapped
write hashes and copies in one pass) and, once complete, stored by the promotion's verified upload
(:func:`.upload.upload_verified`: every checksum verified, then a multipart upload with CRC32 per
part); the memory file is closed when its upload ends.  The persistent tier's committer commits it
as it commits a promoted file: nothing is a checkpoint until the manifest names it.

Memory: a rank file is held in memory from its first write until its upload is done -- at most
``max_inflight`` files per rank, on top of the host cache.

Thread-safety: :meth:`StreamUploads.upload` may be called from any thread; uploads run one at a
time, in order, on the owned thread ``dsm-upload-r{rank}``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

from ..errors import CheckpointError, FlushError
from ..runtime.threads import QueueThread
from .base import Storage
from .survey import iter_prefix
from .upload import upload_verified

__all__ = ["StreamUploads", "memory_file"]


def memory_file(name: str) -> int:
    """A new memfd named ``name`` (a label in ``/proc``, never a path): the caller closes it."""
    return os.memfd_create(name, os.MFD_CLOEXEC)


class StreamUploads(QueueThread):
    """The uploads of one rank's memory files to ``storage``; ``close()`` is idempotent and joins
    the thread after the uploads queued before it."""

    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage, self.rank = storage, rank
        super().__init__(f"dsm-upload-r{rank}")

    def upload(self, written: cf.Future, fd: int, iteration: int, name: str) -> cf.Future:
        """Once ``written`` (the engine's future of the file in ``fd``) settles, store the file as
        ``iter_N/name`` and close ``fd`` (this takes it over).  Resolves to the upload's receipt, or
        to the write's or the upload's error."""
        done: cf.Future = cf.Future()
        self.put((written, fd, iteration, name, done))
        return done

    def _handle(self, item) -> None:
        written, fd, iteration, name, done = item
        key = iter_prefix(iteration) + name
        try:
            written.result()  # the engine settles it, bounded by its timeout_s
            done.set_result(upload_verified(f"memfd:{name}", self.storage, key, iteration, memory_fd=fd))
        except CheckpointError as e:
            done.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - the committer reports it on every rank
            err = FlushError(f"rank {self.rank}: iteration {iteration}: uploading {self.storage.url(key)} failed: {e}")
            err.__cause__ = e
            done.set_exception(err)
        finally:
            os.close(fd)
