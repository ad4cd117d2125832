"""The gate (``wait_for_snapshot``) waits for the copies into the host cache, never for the rank
file to be created, allocated or mapped (on tmpfs a ``posix_fallocate`` and a populated mapping of
the whole file: about 0.6 s per GiB).  Opening the file is made artificially slow here."""

import time

import pytest
import torch

from datastates_megatron.engine import EngineOptions, FlushError, SnapshotEngine, load_file
from datastates_megatron.engine.save import snapshot as snapshot_mod

DELAY_S = 1.0  # injected into opening each rank file
GATE_LIMIT_S = 0.4  # far below DELAY_S; leaves room for the cache copy itself on a loaded machine


@pytest.fixture
def slow_open(monkeypatch):
    class SlowWriter(snapshot_mod.RankFileWriter):
        def __init__(self, *args, **kw):
            time.sleep(DELAY_S)  # stands in for fallocate + a populated mapping of a big file
            super().__init__(*args, **kw)

    monkeypatch.setattr(snapshot_mod, "RankFileWriter", SlowWriter)


def _gate_after_save(path, nbytes: int, **kw):
    tensor = torch.arange(nbytes // 4, dtype=torch.int32)  # distinct words: a misplaced byte shows
    ref = tensor.clone()
    opts = EngineOptions(cache_bytes=nbytes + (8 << 20), timeout_s=30, **kw)
    with SnapshotEngine(opts) as eng:
        eng.register("w", tensor)
        eng.save(0, str(path) + ".warm")  # touches the cache's pages, as every save after a run's first
        eng.wait()
        eng.save(1, str(path), {"iteration": 1})  # a fresh rank file
        t0 = time.perf_counter()
        eng.wait_for_snapshot()
        gate_s = time.perf_counter() - t0
        tensor.add_(1)  # the next optimizer step: must not reach the file
        (receipt,) = eng.wait()
    assert receipt.version == 1 and receipt.path == str(path)
    tensors, objects = load_file(str(path))
    assert torch.equal(tensors["w"], ref) and objects["objects"]["iteration"] == 1 and objects["version"] == 1
    return gate_s


@pytest.mark.parametrize("nbytes", [8 << 20, 256 << 20], ids=["8MiB", "256MiB"])
@pytest.mark.parametrize("where", ["shm", "disk"])
def test_gate_does_not_wait_for_the_rank_file(where, nbytes, slow_open, tmp_path, request):
    directory = request.getfixturevalue("shm_dir") if where == "shm" else tmp_path
    gate_s = _gate_after_save(directory / "f", nbytes, source_writes=False)
    assert gate_s < GATE_LIMIT_S, f"gate waited {gate_s:.3f}s with opening the file delayed {DELAY_S}s"


def test_gate_still_waits_for_writes_straight_from_the_source(slow_open, tmp_path):
    # with source_writes the tensor itself is what gets written: the gate must cover the file
    gate_s = _gate_after_save(tmp_path / "f", 8 << 20, source_writes=True)
    assert gate_s >= DELAY_S * 0.9


def test_a_file_that_cannot_be_opened_fails_its_version_not_the_gate(monkeypatch, tmp_path):
    real = snapshot_mod.RankFileWriter

    def refuse(path, *args, **kw):
        if path.endswith("v1"):
            raise OSError(28, "No space left on device")
        return real(path, *args, **kw)

    monkeypatch.setattr(snapshot_mod, "RankFileWriter", refuse)
    with SnapshotEngine(EngineOptions(cache_bytes=4 << 20, chunk_bytes=1 << 20, timeout_s=30)) as eng:
        eng.register("w", torch.ones(1 << 20))  # 4 MiB: several regions
        handle = eng.save(1, str(tmp_path / "v1"))
        eng.wait_for_snapshot(timeout=10)
        with pytest.raises(FlushError, match=r"rank 0: version 1: cannot create .*v1: .*No space left"):
            eng.wait()
        assert isinstance(handle.durable.exception(10), FlushError)
        eng.save(2, str(tmp_path / "v2"))  # the engine stays usable
        eng.wait()
    assert not (tmp_path / "v1").exists()
    assert load_file(str(tmp_path / "v2"))[0]["w"].sum() == 1 << 20
