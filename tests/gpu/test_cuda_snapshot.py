"""CUDA path of the engine: side-stream copies into pinned memory, event-gated; skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")

from datastates_megatron.engine import EngineOptions, SnapshotEngine, load_file  # noqa: E402


def _state():
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = {f"w{i}": torch.randn(256, 1024 + i, device="cuda", generator=g) for i in range(8)}
    ts["big"] = torch.randn(16 << 20, device="cuda", generator=g)  # 64 MB: streamed through a small cache
    ts["bf16"] = torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16)
    ts["step"] = torch.tensor(3.0, device="cuda")
    return ts


def test_cache_is_pinned_and_values_are_those_at_save_time(tmp_path):
    ts = _state()
    ref = {n: t.cpu() for n, t in ts.items()}
    with SnapshotEngine(EngineOptions(cache_bytes=16 << 20, timeout_s=60)) as eng:
        assert eng.cache.pinned
        for n, t in ts.items():
            eng.register(n, t)
        for t in ts.values():
            t.mul_(1.0)  # pending work on the compute stream when save() is called
        eng.save(1, str(tmp_path / "f"))
        eng.wait_for_snapshot()  # the compute stream now waits for the copies
        for t in ts.values():
            t.add_(1)  # enqueued after the copies on the compute stream
        eng.wait()
    tensors, _ = load_file(str(tmp_path / "f"))
    for n in ref:
        assert torch.equal(tensors[n], ref[n]), n


def test_gate_does_not_block_the_host_when_copies_are_issued(tmp_path):
    ts = _state()
    with SnapshotEngine(EngineOptions(cache_bytes=1 << 30, timeout_s=60)) as eng:
        for n, t in ts.items():
            eng.register(n, t)
        eng.save(1, str(tmp_path / "f"))
        eng.wait_for_snapshot()
        stream = torch.cuda.current_stream()
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()  # everything on the compute stream, copies included via wait_event, is done
        eng.wait()
    tensors, _ = load_file(str(tmp_path / "f"))
    assert torch.equal(tensors["big"], ts["big"].cpu())


def test_many_versions_in_flight_on_cuda(tmp_path):
    w = torch.zeros(4 << 20, device="cuda")
    with SnapshotEngine(EngineOptions(cache_bytes=8 << 20, max_inflight=3, timeout_s=60)) as eng:
        eng.register("w", w)
        for v in range(5):
            eng.save(v, str(tmp_path / f"v{v}"))
            eng.wait_for_snapshot()
            w.fill_(v + 1)
        eng.wait()
    for v in range(5):
        assert (load_file(str(tmp_path / f"v{v}"))[0]["w"] == v).all()
