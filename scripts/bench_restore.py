#!/usr/bin/env python
"""Restore throughput beside the raw read speed of the same bytes, cold and warm page cache.

    python scripts/bench_restore.py [--size-mb 512] [--out DIR] [--cold auto|drop_caches|fadvise|off] [--json]

Writes one checkpoint with ``CheckpointManager`` (world size 1, ``--size-mb`` across many tensors), then
measures, each ``--repeats`` times (median reported):
  * restore GB/s: ``CheckpointManager.load`` into the registered tensors, verify on and off
    (tensor bytes / wall time of the call: manifest, open, read-ahead of a cold file, checksums,
    copies);
  * raw read GB/s: the same rank file read sequentially with ``os.readv`` into a preallocated buffer
    (file bytes / time), single-threaded.
Cold page cache: ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches`` before each timed run.  Without
permission for that, ``--cold auto`` evicts the checkpoint's own files with
``posix_fadvise(POSIX_FADV_DONTNEED)`` and checks with ``mincore`` that nothing stayed resident; if that
fails too, it says "cold cache: not available" and reports warm only.  "Cold" is this kernel's page
cache: a virtual disk may still be cached by the host underneath.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch

from bench_engine import MB, gbps, machine_info, make_out_dir, make_tensors, render_table  # noqa: E402

from datastates_megatron.engine import EngineOptions  # noqa: E402
from datastates_megatron.engine.manager import CheckpointManager  # noqa: E402
from datastates_megatron.engine.format.manifest import read_manifest  # noqa: E402
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir  # noqa: E402
from datastates_megatron.engine.fs.page_cache import resident_fraction  # noqa: E402

ITERATION = 100
READ_CHUNK = 16 * MB


# ------------------------------------------------------------------------------------ page cache
class ColdCache:
    """Evicts the checkpoint from the page cache before a cold run; ``method`` says how (or None)."""

    def __init__(self, want: str, files: list[str]) -> None:
        self.files = files
        self.method: str | None = None
        self.why_not = ""
        if want == "off":
            self.why_not = "disabled (--cold off)"
            return
        if want in ("auto", "drop_caches"):
            try:
                self._drop_caches()
                self.method = "drop_caches"
                return
            except OSError as e:
                self.why_not = f"drop_caches: {e.strerror or e}"
        if want in ("auto", "fadvise"):
            self._fadvise()
            left = [resident_fraction(p) for p in files]
            if all(x is not None and x < 0.01 for x in left):
                self.method = "fadvise"
                self.why_not = ""
            else:
                self.why_not += f"; fadvise left {left} resident" if self.why_not else f"fadvise left {left} resident"

    @staticmethod
    def _drop_caches() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    def _fadvise(self) -> None:
        os.sync()
        for p in self.files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def evict(self) -> float | None:
        """Evict; returns the largest resident fraction left among the files (None if unknown)."""
        if self.method == "drop_caches":
            self._drop_caches()
        elif self.method == "fadvise":
            self._fadvise()
        else:
            raise RuntimeError("cold cache is not available")
        left = [resident_fraction(p) for p in self.files]
        return None if any(x is None for x in left) else max(left)


# ------------------------------------------------------------------------------------ measures
def raw_read(path: str, buf: np.ndarray) -> int:
    """Read ``path`` sequentially into ``buf`` with ``os.readv``; returns the bytes read."""
    view = memoryview(buf).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            n = os.readv(fd, [view[got : got + READ_CHUNK]])
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
    return got


def measure(
    kind: str, mgr: CheckpointManager, path: str, buf: np.ndarray, cold: ColdCache | None, repeats: int
) -> dict:
    """``repeats`` timed runs of one measure (+ one untimed warm-up when warm); cold runs evict first."""
    secs, nbytes, residual, verify_s, copy_s, ahead_s = [], 0, [], [], [], []
    runs = repeats if cold else repeats + 1
    for i in range(runs):
        if cold:
            residual.append(cold.evict())
        t0 = time.perf_counter()
        if kind == "raw_read":
            nbytes = raw_read(path, buf)
        else:
            res = mgr.load(ITERATION, verify=(kind == "restore_verify"))
            nbytes = res.stats.bytes
            verify_s.append(res.stats.verify_s)
            copy_s.append(res.stats.copy_s)
            ahead_s.append(res.stats.read_ahead_s)
        dt = time.perf_counter() - t0
        if cold or i:  # warm: the first run only warms the cache
            secs.append(dt)
    out = {"bytes": nbytes, "seconds": secs, "gbps": gbps(nbytes, secs)}
    if verify_s:
        out["verify_s"] = statistics.median(verify_s[-repeats:])
        out["copy_s"] = statistics.median(copy_s[-repeats:])
        out["read_ahead_s"] = statistics.median(ahead_s[-repeats:])
    if cold:
        out["resident_before"] = residual
    return out


def check_restored(tensors: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tensors, expected))


# ------------------------------------------------------------------------------------ report
def report(doc: dict) -> str:
    info = doc["machine"]
    rows = []
    labels = {
        "restore_verify": "restore, verify on",
        "restore_noverify": "restore, verify off",
        "raw_read": "raw read (os.readv)",
    }
    for cache in ("warm", "cold"):
        block = doc["results"].get(cache)
        if not block:
            continue
        raw = block["raw_read"]["gbps"]
        for kind in ("raw_read", "restore_verify", "restore_noverify"):
            r = block[kind]
            extra = ""
            if "verify_s" in r:
                extra = f"read-ahead {r['read_ahead_s']:.2f} s, verify {r['verify_s']:.2f} s, copy {r['copy_s']:.2f} s"
            ratio = "1.00" if kind == "raw_read" else f"{r['gbps'] / raw:.2f}"
            rows.append(
                (f"{cache}: {labels[kind]}", f"{r['gbps']:.2f} GB/s", f"{r['bytes'] / MB:.0f} MiB", ratio, extra)
            )
    title = (
        f"bench_restore: {doc['bytes'] / MB:.0f} MiB in {doc['tensors']} tensors (world size 1), median of "
        f"{doc['repeats']} runs; {info['cpus']} CPUs, {doc['restore_threads']} restore threads, out dir "
        f"{info['out_dir']} ({info['fs_type']})"
    )
    notes = [""]
    if doc["cold_method"]:
        worst = doc["cold_resident_max"]
        left = "unknown" if worst is None else f"{worst * 100:.1f}%"
        notes.append(f"cold cache: {doc['cold_method']} before each cold run (largest fraction left resident: {left})")
        if doc["cold_method"] == "fadvise":
            notes.append(
                f"  (drop_caches was not available: {doc['cold_unavailable_reason'] or 'n/a'}; "
                "posix_fadvise(DONTNEED) evicted the checkpoint files instead)"
            )
        notes.append("  'cold' is this kernel's page cache; the virtual disk below may still be cached by the host")
    else:
        notes.append(f"cold cache: not available ({doc['cold_unavailable_reason']}); warm only")
    notes.append(
        "ratio = GB/s / raw read GB/s of the same cache state; restore counts tensor bytes, raw read file bytes"
    )
    notes.append(f"restored values checked equal to the saved ones: {'yes' if doc['restored_ok'] else 'NO'}")
    notes.append(f"checkpoint write (save->commit) {doc['write_s']:.1f} s; wall time {doc['wall_s']:.0f} s")
    return render_table(title, ("measure", "value", "bytes", "ratio", "detail"), rows, notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512, help="checkpoint size, MiB (default 512)")
    p.add_argument("--tensors", type=int, default=64, help="large tensors (plus 32 x 16 KiB); default 64")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measure; the median is reported (default 3)")
    p.add_argument("--threads", type=int, default=4, help="CheckpointManager restore_threads (default 4, its default)")
    p.add_argument(
        "--cold",
        choices=("auto", "drop_caches", "fadvise", "off"),
        default="auto",
        help="how to empty the page cache before cold runs (default auto: drop_caches, else fadvise)",
    )
    p.add_argument("--out", help="parent of the temporary output directory (default: current directory)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)
    if args.size_mb < 1 or args.tensors < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--size-mb, --tensors, --repeats and --threads must be >= 1")
    t_start = time.perf_counter()
    out_dir = make_out_dir(args.out, ".bench_restore-")
    try:
        info = machine_info(out_dir)
        tensors = make_tensors(args.size_mb * MB, args.tensors)
        root = os.path.join(out_dir, "ckpt")
        with CheckpointManager(root, EngineOptions(), keep_last=0, restore_threads=args.threads) as mgr:
            for i, t in enumerate(tensors):
                mgr.register(f"layer{i}.weight", t)
            t0 = time.perf_counter()
            mgr.save(ITERATION, {"iteration": ITERATION})
            mgr.wait()
            write_s = time.perf_counter() - t0
            ckpt = iter_dir(root, ITERATION)
            path = os.path.join(ckpt, read_manifest(ckpt).ranks[0].file)
            buf = np.empty(os.path.getsize(path), np.uint8)
            buf.fill(0)  # fault the destination in before timing
            cold = ColdCache(args.cold, [path, os.path.join(ckpt, MANIFEST_NAME)])
            results: dict = {"warm": {}}
            for kind in ("raw_read", "restore_verify", "restore_noverify"):
                results["warm"][kind] = measure(kind, mgr, path, buf, None, args.repeats)
            if cold.method:
                results["cold"] = {
                    kind: measure(kind, mgr, path, buf, cold, args.repeats)
                    for kind in ("raw_read", "restore_verify", "restore_noverify")
                }
            # last: prove the restore restores (zero the model, load, compare with freshly rebuilt values)
            for t in tensors:
                t.zero_()
            mgr.load(ITERATION)
            restored_ok = check_restored(tensors, make_tensors(args.size_mb * MB, args.tensors))
        residual = [x for block in results.values() for r in block.values() for x in r.get("resident_before", [])]
        doc = {
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "tensors": len(tensors),
            "repeats": args.repeats,
            "restore_threads": args.threads,
            "machine": info,
            "cold_method": cold.method,
            "cold_unavailable_reason": cold.why_not,
            "cold_resident_max": None if any(x is None for x in residual) or not residual else max(residual),
            "results": results,
            "restored_ok": restored_ok,
            "write_s": write_s,
            "wall_s": time.perf_counter() - t_start,
        }
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        print(report(doc))
    return 0 if restored_ok else 1


if __name__ == "__main__":
    sys.exit(main())
