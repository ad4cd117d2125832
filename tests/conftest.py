import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir():
    """A fresh directory on tmpfs (/dev/shm, or the memory-backed directory ``DSM_TEST_MEMFS``
    names, e.g. a ramfs mount), removed afterwards; skips where there is none.  Rank files there
    are memory-backed: written through kept mappings (``mapped_writes``)."""
    from datastates_megatron.engine.fs.page_cache import memory_backed

    base = os.environ.get("DSM_TEST_MEMFS", "/dev/shm")
    if not os.path.isdir(base):
        pytest.skip(f"no {base}")
    d = Path(base) / f"dsm-test-{os.getpid()}-{os.urandom(4).hex()}"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    try:
        on_tmpfs = memory_backed(fd)
    finally:
        os.close(fd)
    if not on_tmpfs:
        d.rmdir()
        pytest.skip(f"{base} is not memory-backed (tmpfs/ramfs) here")
    yield d
    shutil.rmtree(d, ignore_errors=True)
