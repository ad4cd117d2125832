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


@pytest.fixture
def fault_fs(tmp_path):
    """The fault filesystem (:mod:`tests.fusefs`): a FUSE passthrough of ``tmp_path/fuse-source``
    mounted on ``tmp_path/fuse``, served by its own process, unmounted afterwards.  Skips, saying
    why, where no FUSE filesystem can be mounted -- unless ``DSM_REQUIRE_FUSE=1`` (CI), where that
    is a failure."""
    from tests.fusefs.control import FaultFS, MountError, why_not_available

    def unavailable(why: str):
        if os.environ.get("DSM_REQUIRE_FUSE") == "1":
            pytest.fail(f"the fault filesystem is required here (DSM_REQUIRE_FUSE=1): {why}")
        pytest.skip(f"no fault filesystem: {why}")

    why = why_not_available()
    if why:
        unavailable(why)
    try:
        fs = FaultFS(str(tmp_path / "fuse-source"), str(tmp_path / "fuse"))
    except MountError as e:
        unavailable(str(e))
    try:
        yield fs
    finally:
        fs.close()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``get(args, tree=None)``: ``pretrain_gpt.py`` of ``tree`` (default MEGATRON_LM_DIR) run to the
    end with ``args`` and no checkpointing, once per session for the same arguments: the reference
    that several modules compare a killed and resumed run against (each launch costs the imports of
    torch and Megatron-LM, about half of it on CPU)."""
    from tests.integration.megatron_lm_runs import launch

    runs = {}

    def get(args: list[str], tree: str | None = None):
        key = (tuple(args), tree)
        if key not in runs:
            run = launch(tmp_path_factory.mktemp("uninterrupted"), "reference", list(args), megatron_lm_dir=tree)
            assert run.returncode == 0, run.describe()
            runs[key] = run
        return runs[key]

    return get
