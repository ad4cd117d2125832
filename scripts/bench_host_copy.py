#!/usr/bin/env python
"""What a host copy (``--lazy-ckpt-host-copy``) costs at save and saves at an in-process restart.

    python scripts/bench_host_copy.py [--size-mb 512] [--tensors 8] [--saves 3] [--out DIR] [--json]

One process, world size 1, ``--size-mb`` of state across ``--tensors`` tensors, measured side by side:
  * save: the time from ``save`` until the checkpoint is committed, with and without a host copy
    (median of ``--saves`` saves after one warm-up), and their ratio;
  * restore after an in-process restart (a manager closed with ``keep_cache=True``, a new one in the
    same process): from the host copy (checksums verified, and not), from the rank file with its
    page cache evicted (``posix_fadvise``, best effort: a virtual disk may still cache it), and a
    ``memcpy`` of the same bytes (``torch`` ``copy_`` into the registered tensors) -- each as a ratio
    to the memcpy, and the file restore as a ratio to the host one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_engines import evict_page_cache  # noqa: E402
from bench_engine import MB, make_out_dir, render_table  # noqa: E402

from datastates_megatron.engine import EngineOptions  # noqa: E402
from datastates_megatron.engine.manager import HOST_MEMORY, CheckpointManager  # noqa: E402
from datastates_megatron.engine.tiers import host_copy  # noqa: E402


def _tensors(total: int, n: int) -> list[torch.Tensor]:
    each = total // n // 4
    return [torch.randn(each, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _manager(root: str, tensors, host: bool, cache_bytes: int) -> CheckpointManager:
    mgr = CheckpointManager(root, EngineOptions(cache_bytes=cache_bytes, timeout_s=300), keep_last=2, host_copy=host)
    for i, t in enumerate(tensors):
        mgr.register(f"t{i}", t)
    return mgr


def _save_seconds(
    root: str, tensors, host: bool, saves: int, cache_bytes: int
) -> tuple[list[float], CheckpointManager]:
    """Save ``saves + 1`` times (the first a warm-up); the seconds from each save call to its commit."""
    mgr = _manager(root, tensors, host, cache_bytes)
    out = []
    for it in range(1, saves + 2):
        for t in tensors:
            t.add_(1)
        t0 = time.perf_counter()
        mgr.save(it, {"it": it})
        mgr.wait()
        out.append(time.perf_counter() - t0)
    return out[1:], mgr


def _restore_seconds(root: str, tensors, host: bool, cache_bytes: int, verify: bool) -> tuple[float, str, dict]:
    for t in tensors:
        t.zero_()
    with _manager(root, tensors, host, cache_bytes) as mgr:
        t0 = time.perf_counter()
        got = mgr.load(verify=verify)
        dt = time.perf_counter() - t0
        if host:  # the copy stays for the next measure, as it would for the next restart
            mgr.close(keep_cache=True)
    phases = {"verify": got.stats.verify_s, "copy": got.stats.copy_s, "read_ahead": got.stats.read_ahead_s}
    return dt, got.root, phases


def run(size_mb: int, n_tensors: int, saves: int, out: str | None) -> dict:
    total = size_mb * MB
    tensors = _tensors(total, n_tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    cache_bytes = max(64 * MB, nbytes // 2)
    work = make_out_dir(out, "bench-host-copy-")
    try:
        plain_s, mgr = _save_seconds(os.path.join(work, "plain"), tensors, False, saves, cache_bytes)
        mgr.close()
        host_s, mgr = _save_seconds(os.path.join(work, "host"), tensors, True, saves, cache_bytes)
        expected = [t.clone() for t in tensors]
        mgr.close(keep_cache=True)  # the aborted attempt: its copy goes to the next manager
        root = mgr.root
        restore, phases = {}, {}
        for name, host, verify in (("host_verify", True, True), ("host_noverify", True, False)):
            dt, where, phases[name] = _restore_seconds(root, tensors, host, cache_bytes, verify)
            assert where == HOST_MEMORY, f"{name}: restored from {where}"
            assert all(torch.equal(a, b) for a, b in zip(tensors, expected)), name
            restore[name] = dt
        host_copy.take(0, root).close()
        evict_page_cache(Path(root))
        dt, where, phases["file_verify_evicted"] = _restore_seconds(root, tensors, False, cache_bytes, True)
        assert where == root and all(torch.equal(a, b) for a, b in zip(tensors, expected))
        restore["file_verify_evicted"] = dt
        src = [t.clone() for t in expected]
        t0 = time.perf_counter()
        for a, b in zip(tensors, src):
            a.copy_(b)
        restore["memcpy"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save = {"plain": statistics.median(plain_s), "host_copy": statistics.median(host_s)}
    m = restore["memcpy"]
    return {
        "bytes": nbytes,
        "save_s": save,
        "save_ratio_host_vs_plain": save["host_copy"] / save["plain"],
        "restore_s": restore,
        "restore_phases_s": phases,
        "restore_ratio_vs_memcpy": {k: v / m for k, v in restore.items() if k != "memcpy"},
        "restore_speedup_host_vs_file": restore["file_verify_evicted"] / restore["host_verify"],
    }


def report(doc: dict) -> str:
    r = doc["restore_s"]
    rows = [
        ("save to commit, no host copy", f"{doc['save_s']['plain']:.3f}", "1.00"),
        ("save to commit, host copy", f"{doc['save_s']['host_copy']:.3f}", f"{doc['save_ratio_host_vs_plain']:.2f}"),
    ]
    ph = doc["restore_phases_s"]
    rows += [
        (
            f"restore: {k}",
            f"{r[k]:.3f}",
            f"{r[k] / r['memcpy']:.2f} x memcpy",
            " ".join(f"{p} {v:.3f}" for p, v in ph.get(k, {}).items() if v),
        )
        for k in ("host_verify", "host_noverify", "file_verify_evicted", "memcpy")
    ]
    rows[:2] = [(*row, "") for row in rows[:2]]
    notes = [f"file restore / host restore: {doc['restore_speedup_host_vs_file']:.2f}"]
    return render_table(
        f"host copy, {doc['bytes'] / MB:.0f} MiB of state", ("measure", "seconds", "ratio", "phases (s)"), rows, notes
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--out", default=None, help="parent of the temporary checkpoint directory")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    doc = run(a.size_mb, a.tensors, a.saves, a.out)
    print(json.dumps(doc, indent=1) if a.json else report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
