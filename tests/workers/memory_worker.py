"""Memory-pressure worker: a state far larger than the host cache, many checkpoints in flight, slow
storage; samples this process's resident set (psutil) every millisecond and prints ``RESULT <json>``.

One process, no torch.distributed (CheckpointManager works without it).  The baseline is taken after
the state is allocated and written and the manager is built, before the first save; what the engine
adds on top of it is the host cache (touched as regions are used) plus a small constant (thread
stacks, per-thread malloc arenas, per-version index arrays)."""

from __future__ import annotations

import argparse
import json
import threading
import time

import psutil
import torch


from datastates_megatron._output import write_line  # noqa: E402
from datastates_megatron.engine import EngineOptions  # noqa: E402
from datastates_megatron.engine.manager import CheckpointManager  # noqa: E402

MiB = 1 << 20


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_hwm() -> int | None:
    """Reset the kernel's high-water RSS (``VmHWM``) to the RSS now; None where it cannot be (non-Linux).

    Exact where the 1 ms sampler could miss a short peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


class RssSampler:
    """Peak RSS of this process, sampled every ``period_s`` on a named thread."""

    def __init__(self, period_s: float = 0.001) -> None:
        self._proc = psutil.Process()
        self._period = period_s
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self._period)

    def reset(self) -> int:
        self.peak = self._proc.memory_info().rss
        return self.peak

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--state-mb", type=int, default=128)
    p.add_argument("--tensor-mb", type=int, default=8)
    p.add_argument("--cache-mb", type=int, default=4)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--slow-write-ms", type=float, default=1.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.slow_write_ms:
        from tests.workers.fault_worker import slow_writes

        slow_writes(a.slow_write_ms)
    n = a.state_mb // a.tensor_mb
    state = {f"w{i}": torch.full((a.tensor_mb * MiB // 4,), float(i)) for i in range(n)}
    opts = EngineOptions(cache_bytes=a.cache_mb * MiB, max_inflight=a.inflight, flush_threads=2, timeout_s=120)
    # back-to-back saves all taken, streaming through the small cache (skips: test_skip_when_behind)
    mgr = CheckpointManager(a.root, opts, keep_last=2, when_behind="wait")
    for name, t in state.items():
        mgr.register(name, t)
    sampler = RssSampler()
    hwm_base = reset_hwm()
    baseline = sampler.reset()
    t0 = time.perf_counter()
    stall = 0.0
    committed = []
    for it in range(1, a.saves + 1):
        t1 = time.perf_counter()
        mgr.save(it, {"iteration": it})
        if it % a.inflight == 0:  # several versions in flight, then the gate before 'training' mutates
            mgr.wait_for_snapshot()
            for t in state.values():
                t.add_(1)
        stall += time.perf_counter() - t1
        committed += [r.iteration for r in mgr.poll()]
    committed += [r.iteration for r in mgr.wait()]
    save_s = time.perf_counter() - t0
    save_peak = sampler.peak
    hwm_peak = _status_bytes("VmHWM") if hwm_base is not None else None
    eng = mgr.engine
    out = {
        "baseline_rss": baseline,
        "save_peak_rss": save_peak,
        "save_growth": save_peak - baseline,
        "save_hwm_growth": None if hwm_peak is None else hwm_peak - hwm_base,
        "cache_bytes": eng.cache.capacity,
        "cache_peak_used": eng.cache.peak_used,
        "cache_wait_s": eng.cache.wait_seconds,
        "slot_wait_s": eng.slot_wait_s,
        "state_bytes": sum(t.numel() * 4 for t in state.values()),
        "saves": a.saves,
        "committed": committed,
        "save_s": save_s,
        "stall_s": stall,
    }
    base = sampler.reset()
    r = mgr.load()
    out["load_growth"] = sampler.close() - base
    out["loaded"] = r.iteration
    out["exact"] = all(
        bool((t == float(i + (r.iteration - 1) // a.inflight)).all()) for i, t in enumerate(state.values())
    )
    mgr.close()
    return out


if __name__ == "__main__":
    write_line("RESULT " + json.dumps(main()))
