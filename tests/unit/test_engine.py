import os
import threading

import pytest
import torch

from datastates_megatron.engine import (
    CorruptCheckpointError,
    EngineClosedError,
    EngineOptions,
    FlushError,
    FormatVersionError,
    SnapshotEngine,
    load_file,
)
from datastates_megatron.engine.format.file_format import HEADER_BYTES


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = {f"layer{i}.weight": torch.randn(64, 32 + i, generator=g) for i in range(20)}
    ts["big"] = torch.randn(600_000, generator=g)  # 2.4 MB: chunked through small caches
    ts["bf16"] = torch.randn(7, 9, generator=g).to(torch.bfloat16)
    ts["step"] = torch.tensor(3.0)
    ts["empty"] = torch.zeros(0)
    ts["mask"] = torch.rand(17, generator=g) > 0.5
    return ts


def _engine(**kw):
    kw.setdefault("cache_bytes", 1 << 20)
    kw.setdefault("timeout_s", 30)
    return SnapshotEngine(EngineOptions(**kw))


def _register(eng, ts):
    for n, t in ts.items():
        eng.register(n, t)


def test_saved_values_are_those_at_save_time_despite_mutation_after_gate(tmp_path):
    ts = _state()
    ref = {n: t.clone() for n, t in ts.items()}
    with _engine() as eng:
        _register(eng, ts)
        eng.save(1, str(tmp_path / "v1"), {"iteration": 1})
        eng.wait_for_snapshot()
        for t in ts.values():
            t.logical_not_() if t.dtype == torch.bool else t.add_(1)
        receipt = eng.wait()[0]
    assert receipt.version == 1 and receipt.file_bytes == os.path.getsize(tmp_path / "v1")
    tensors, objects = load_file(str(tmp_path / "v1"))
    assert objects["objects"] == {"iteration": 1}
    for n in ref:
        assert torch.equal(tensors[n], ref[n]) and tensors[n].dtype == ref[n].dtype, n


def test_many_versions_in_flight_each_keeps_its_values(tmp_path):
    ts = {"w": torch.zeros(300_000), "b": torch.zeros(10)}
    with _engine(max_inflight=4, cache_bytes=256 << 10) as eng:
        _register(eng, ts)
        for v in range(6):
            eng.save(v, str(tmp_path / f"v{v}"))
            eng.wait_for_snapshot()
            for t in ts.values():
                t.fill_(v + 1)
        receipts = eng.wait()
    assert sorted(r.version for r in receipts) == list(range(6))
    for v in range(6):
        tensors, _ = load_file(str(tmp_path / f"v{v}"))
        assert (tensors["w"] == v).all() and (tensors["b"] == v).all()


def test_cache_smaller_than_state_streams_with_backpressure_within_budget(tmp_path):
    ts = _state()
    total = sum(t.numel() * t.element_size() for t in ts.values())
    with _engine(cache_bytes=128 << 10, flush_threads=2) as eng:
        assert total > 10 * eng.cache.capacity
        _register(eng, ts)
        for v in range(3):
            eng.save(v, str(tmp_path / f"v{v}"))
        eng.wait()
        assert 0 < eng.cache.peak_used <= eng.cache.capacity
        assert eng.cache.wait_seconds > 0  # copies had to wait for flushes to free space
    tensors, _ = load_file(str(tmp_path / "v2"))
    assert torch.equal(tensors["big"], ts["big"])


def test_tensor_larger_than_cache_without_streaming_is_refused(tmp_path):
    with _engine(cache_bytes=64 << 10, streaming=False) as eng:
        eng.register("big", torch.zeros(1 << 20))
        with pytest.raises(ValueError, match="'big'.*streaming is off"):
            eng.save(0, str(tmp_path / "x"))


def test_unwritable_directory_surfaces_once_on_next_call(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "file"
    eng = _engine()
    eng.register("w", torch.ones(1000))
    eng.save(5, str(missing))
    with pytest.raises(FlushError, match=r"rank 0: version 5: cannot create .*no/such/dir/file"):
        eng.wait()
    eng.wait()  # raised exactly once
    eng.save(6, str(tmp_path / "ok"))
    eng.close()
    assert load_file(str(tmp_path / "ok"))[0]["w"].sum() == 1000


def test_write_error_mid_flush_removes_partial_file_and_keeps_engine_usable(tmp_path, monkeypatch):
    from datastates_megatron.engine.format import writer

    real = writer.RankFileWriter.write
    calls = {"n": 0}

    def failing(self, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, data, offset)

    monkeypatch.setattr(writer.RankFileWriter, "write", failing)
    with _engine(cache_bytes=128 << 10) as eng:
        _register(eng, _state())
        eng.save(1, str(tmp_path / "v1"))
        with pytest.raises(FlushError, match=r"rank 0: version 1: writing .*v1 .*No space left"):
            eng.wait()
        assert not (tmp_path / "v1").exists()
        eng.save(2, str(tmp_path / "v2"))
    assert load_file(str(tmp_path / "v2"))[0]["big"].numel() == 600_000


def _saved(tmp_path):
    ts = _state()
    path = str(tmp_path / "f")
    with _engine() as eng:
        _register(eng, ts)
        eng.save(1, path)
    return path, ts


def test_corrupted_byte_is_detected_naming_file_and_tensor(tmp_path):
    path, ts = _saved(tmp_path)
    from datastates_megatron.engine import RankFile

    with RankFile(path) as rf:
        off = rf.entries["layer3.weight"].offset + 17
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=r"f: checksum mismatch in tensor 'layer3.weight'"):
        load_file(path)
    tensors, _ = load_file(path, verify=False)  # unverified read still works, with the damaged value
    assert not torch.equal(tensors["layer3.weight"], ts["layer3.weight"])


def test_truncated_file_and_bad_magic_and_unknown_version(tmp_path):
    path, _ = _saved(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_file(path)
    open(path, "wb").write(data[:1000])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_file(path)
    open(path, "wb").write(b"NOTACKPT" + data[8:])
    with pytest.raises(CorruptCheckpointError, match="not a datastates checkpoint"):
        load_file(path)
    open(path, "wb").write(data[:8] + (99).to_bytes(4, "little") + data[12:])
    with pytest.raises(
        FormatVersionError, match=r"written by datastates-megatron an unknown version \(rank file format 99\)"
    ):
        load_file(path)
    bad_index = bytearray(data)
    from datastates_megatron.engine.format.file_format import Header

    h = Header.unpack(data[:HEADER_BYTES], path)
    bad_index[h.index_offset + 3] ^= 1
    open(path, "wb").write(bytes(bad_index))
    with pytest.raises(CorruptCheckpointError, match="index checksum mismatch"):
        load_file(path)


def test_close_twice_joins_every_thread(tmp_path):
    before = {t.name for t in threading.enumerate()}
    eng = _engine()
    eng.register("w", torch.ones(10))
    eng.save(0, str(tmp_path / "a"))
    eng.close()
    eng.close()
    assert {t.name for t in threading.enumerate()} == before
    assert not any(t.name.startswith("dsm-") for t in threading.enumerate())
    with pytest.raises(EngineClosedError):
        eng.save(1, str(tmp_path / "b"))


def test_save_call_is_fast_for_100_tensors(tmp_path):
    import time

    with _engine(cache_bytes=8 << 20) as eng:
        for i in range(100):
            eng.register(f"t{i}", torch.randn(1000))
        eng.save(0, str(tmp_path / "warm"))
        eng.wait()
        t0 = time.perf_counter()
        eng.save(1, str(tmp_path / "timed"), {"iteration": 1})
        took = time.perf_counter() - t0
        eng.wait()
    assert took < 0.005  # the target is 1 ms; leave slack for a loaded CI machine


def test_save_id_reads_token_and_sequence_only_from_names_this_version_writes():
    from datastates_megatron.engine.names import rank_file_name, save_id

    assert save_id(rank_file_name(3, "00000000000000ff", 7)) == (255, 7)
    assert save_id(rank_file_name(0, "7fffffffffffffff", 0)) == ((1 << 63) - 1, 0)
    for token in (
        "8000000000000000",
        "00000000000000FF",
        "ff",
        "0000000000000g00",
    ):  # int64 range, lower-case hex, 16 digits
        assert save_id(rank_file_name(0, token, 1)) is None, token
    assert save_id("manifest.json") is None and save_id("r00000-00000000000000ff.dsck") is None
