"""Writes straight from host-resident tensors (``EngineOptions.source_writes``): no cache copy, and the
gate waits for the writes instead."""

import os
import threading

import pytest
import torch

from datastates_megatron.engine import CacheTimeoutError, EngineOptions, FlushError, SnapshotEngine, load_file
from datastates_megatron.engine.format import writer as writer_mod
from datastates_megatron.engine.format.writer import RankFileWriter


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = {f"layer{i}.weight": torch.randn(256, 300 + i, generator=g) for i in range(4)}  # > small_bytes: own regions
    ts["big"] = torch.randn(600_000, generator=g)  # 2.4 MB: several chunks
    ts["bf16"] = torch.randn(7, 9, generator=g).to(torch.bfloat16)  # small: packed and copied
    ts["step"] = torch.tensor(3.0)
    return ts


def _engine(**kw):
    kw.setdefault("cache_bytes", 4 << 20)
    kw.setdefault("chunk_bytes", 1 << 20)
    kw.setdefault("timeout_s", 30)
    return SnapshotEngine(EngineOptions(**kw))


def _save(path, ts, **kw):
    with _engine(**kw) as eng:
        for n, t in ts.items():
            eng.register(n, t)
        eng.save(1, str(path), {"iteration": 1})
        eng.wait()
        return eng.source_bytes, eng.cache.peak_used


def test_file_is_byte_identical_to_a_copied_save_and_skips_the_cache(tmp_path):
    ts = _state()
    src_bytes, src_peak = _save(tmp_path / "src", ts, source_writes=True)
    cp_bytes, cp_peak = _save(tmp_path / "copy", ts, source_writes=False)
    assert (tmp_path / "src").read_bytes() == (tmp_path / "copy").read_bytes()
    big = sum(t.numel() * t.element_size() for n, t in ts.items() if n not in ("bf16", "step"))
    assert src_bytes == big and cp_bytes == 0
    assert src_peak < 64 << 10 < cp_peak  # only the packed small tensors went through the cache


def test_values_are_those_at_save_time_and_the_gate_waits_for_the_writes(tmp_path, monkeypatch):
    ts = _state()
    ref = {n: t.clone() for n, t in ts.items()}
    release, entered = threading.Event(), threading.Event()
    real = RankFileWriter.write

    def slow(self, data, offset):
        if data.nbytes > 64 << 10:  # a region written from its source
            entered.set()
            assert release.wait(30)
        return real(self, data, offset)

    monkeypatch.setattr(writer_mod.RankFileWriter, "write", slow)
    with _engine(source_writes=True) as eng:
        for n, t in ts.items():
            eng.register(n, t)
        handle = eng.save(1, str(tmp_path / "v1"))
        gate = threading.Thread(target=eng.wait_for_snapshot)
        gate.start()
        assert entered.wait(10)
        gate.join(0.5)
        assert gate.is_alive() and not handle.snapshot_done  # blocked on the writes, not on a copy
        release.set()
        gate.join(10)
        assert not gate.is_alive() and handle.snapshot_done
        for t in ts.values():
            t.add_(1)
        eng.wait()
    tensors, _ = load_file(str(tmp_path / "v1"))
    for n in ref:
        assert torch.equal(tensors[n], ref[n]), n


def test_gate_timeout_abandons_the_version(tmp_path, monkeypatch):
    release = threading.Event()
    real = RankFileWriter.write

    def stuck(self, data, offset):
        if data.nbytes > 64 << 10:
            assert release.wait(30)
        return real(self, data, offset)

    monkeypatch.setattr(writer_mod.RankFileWriter, "write", stuck)
    with _engine(source_writes=True) as eng:
        eng.register("w", torch.ones(1 << 18))
        handle = eng.save(4, str(tmp_path / "v4"))
        with pytest.raises(CacheTimeoutError, match=r"rank 0: version 4: writes of .*v4 straight from the registered"):
            eng.wait_for_snapshot(timeout=0.3)
        release.set()
        with pytest.raises(CacheTimeoutError):
            handle.durable.result(10)
        assert not (tmp_path / "v4").exists()  # never finished: the tensors may have changed under it
        eng.save(5, str(tmp_path / "v5"))  # the engine stays usable
        eng.wait()
    assert load_file(str(tmp_path / "v5"))[0]["w"].sum() == 1 << 18


def test_write_error_releases_the_gate_and_surfaces(tmp_path, monkeypatch):
    def failing(self, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_mod.RankFileWriter, "write", failing)
    with _engine(source_writes=True) as eng:
        eng.register("w", torch.ones(1 << 18))
        eng.save(2, str(tmp_path / "v2"))
        eng.wait_for_snapshot(timeout=10)  # returns: nothing reads the tensor any more
        with pytest.raises(FlushError, match=r"rank 0: version 2: writing .*v2 \(tensor 'w'.*No space left"):
            eng.wait()
    assert not (tmp_path / "v2").exists()


def _auto_uses_source(directory, **kw) -> bool:
    ts = {"w": torch.randn(1 << 18)}
    n, _ = _save(os.path.join(directory, "f"), ts, **kw)
    os.unlink(os.path.join(directory, "f"))
    return n > 0


def test_auto_writes_from_source_only_on_a_memory_filesystem(tmp_path):
    probe = RankFileWriter(str(tmp_path / "probe"))
    in_memory = probe.memory_backed
    probe.close()
    assert _auto_uses_source(str(tmp_path)) == in_memory
    assert _auto_uses_source(str(tmp_path), direct_io=False) == in_memory  # a buffered disk write may block
    assert _auto_uses_source(str(tmp_path), source_writes=True)
    assert not _auto_uses_source(str(tmp_path), source_writes=False)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_auto_writes_from_source_on_tmpfs(tmp_path):
    d = f"/dev/shm/dsm-test-source-{os.getpid()}"
    os.makedirs(d)
    try:
        probe = RankFileWriter(os.path.join(d, "probe"))
        is_memory = probe.memory_backed
        probe.close()
        if not is_memory:
            pytest.skip("/dev/shm is not tmpfs here")
        assert _auto_uses_source(d)
    finally:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
