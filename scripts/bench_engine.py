#!/usr/bin/env python
"""Engine micro-benchmarks on this machine, side by side with their hardware references.

    python scripts/bench_engine.py [--size-mb 512] [--out DIR] [--json]

Measures (each warmed up once, then repeated ``--repeats`` times; the median is reported):
  * host memcpy GB/s: ``numpy.copyto`` and ``torch.Tensor.copy_`` of one buffer of ``--size-mb``;
  * XXH64 GB/s on one core (the engine's numba kernel) vs ``zlib.crc32``, and vs memcpy (target >= 1/2);
  * engine flush GB/s: ``SnapshotEngine.save`` -> ``wait`` (copy to the host cache, hash, pwrite, fsync)
    of ``--size-mb`` across many tensors, with ``direct_io`` "auto" and off, vs a plain sequential
    ``write`` + ``fsync`` of the same bytes (target >= 80%);
  * how long ``save()`` blocks for 100 registered tensors (median, p99; target <= 1 ms) and the gate
    (``wait_for_snapshot``) time, each save starting with a free in-flight slot.

GB/s is 1e9 bytes/s of payload (a memcpy of N bytes counts N).  Files go to a temporary directory
under ``--out`` (default: the current directory, so the file system is the one you run from, not a
tmpfs /tmp) and are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np
import torch

from datastates_megatron.engine import EngineOptions, SnapshotEngine
from datastates_megatron.engine.format import hashing

MB = 1 << 20


# ------------------------------------------------------------------------------------ shared helpers
def fs_type(path: str) -> str:
    """File-system type of ``path`` (longest matching mount point in /proc/mounts), or "unknown"."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                    if inside and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def make_out_dir(parent: str | None, prefix: str) -> str:
    """A fresh temporary directory under ``parent`` (default: the current directory)."""
    parent = os.path.abspath(parent or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def timed(fn, repeats: int, warmup: bool = True, setup=None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call; ``setup`` runs untimed before each."""
    out = []
    for i in range(repeats + bool(warmup)):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i or not warmup:
            out.append(time.perf_counter() - t0)
    return out


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def runs(nbytes: int, seconds: list[float]) -> str:
    """Every timed run as GB/s, e.g. "2.0/2.1/1.9" (the spread behind a median)."""
    return "/".join(f"{nbytes / x / 1e9:.2f}" for x in seconds)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def render_table(title: str, header: tuple, rows: list[tuple], notes: list[str]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [title, line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    out += notes
    return "\n".join(out)


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def machine_info(out_dir: str) -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "out_dir": out_dir,
        "fs_type": fs_type(out_dir),
        "cuda": torch.cuda.is_available(),
    }


def o_direct_supported(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


# ------------------------------------------------------------------------------------ measures
def bench_memcpy_and_hash(nbytes: int, repeats: int) -> dict:
    src = np.full(nbytes, 7, np.uint8)
    src[::4099] = 13  # not one repeated value (nothing here depends on content, but keep it honest)
    dst = np.empty_like(src)
    dst.fill(0)  # fault the pages in before timing
    st, dt = torch.from_numpy(src), torch.from_numpy(dst)
    mv = memoryview(src)
    hashing.warmup()
    res = {
        "bytes": nbytes,
        "memcpy_numpy_s": timed(lambda: np.copyto(dst, src), repeats),
        "memcpy_torch_s": timed(lambda: dt.copy_(st), repeats),
        "xxh64_s": timed(lambda: hashing.xxh64(src), repeats),
        "crc32_s": timed(lambda: zlib.crc32(mv), repeats),
    }
    for k in ("memcpy_numpy", "memcpy_torch", "xxh64", "crc32"):
        res[f"{k}_gbps"] = gbps(nbytes, res[f"{k}_s"])
    return res


def make_tensors(total: int, n_large: int, n_small: int = 32, small: int = 16 << 10) -> list[torch.Tensor]:
    """``n_large`` equal float32 tensors plus ``n_small`` small ones, ``total`` bytes in all (pattern-filled)."""
    large = (total - n_small * small) // n_large // 4 * 4
    sizes = [large] * n_large + [small] * n_small
    out = []
    for i, s in enumerate(sizes):
        t = torch.arange(s // 4, dtype=torch.float32)
        t.add_(i)
        out.append(t)
    return out


def _plain_write(path: str, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_flush(tensors: list[torch.Tensor], out_dir: str, repeats: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    res: dict = {"bytes": nbytes, "tensors": len(tensors)}
    plain = os.path.join(out_dir, "plain.bin")
    res["plain_write_fsync_s"] = timed(lambda: _plain_write(plain, tensors), repeats, setup=lambda: remove(plain))
    remove(plain)
    res["plain_write_fsync_gbps"] = gbps(nbytes, res["plain_write_fsync_s"])
    for mode, direct in (("auto", "auto"), ("off", False)):
        opts = EngineOptions(direct_io=direct)
        with SnapshotEngine(opts) as eng:
            for i, t in enumerate(tensors):
                eng.register(f"t{i}", t)
            path = os.path.join(out_dir, f"engine-{mode}.dsck")
            version = [0]
            receipts = []

            def one() -> None:
                version[0] += 1
                eng.save(version[0], path)
                receipts.extend(eng.wait())

            secs = timed(one, repeats, setup=lambda: remove(path))
            remove(path)
        timed_receipts = receipts[1:]
        res[f"engine_{mode}_s"] = secs
        res[f"engine_{mode}_gbps"] = gbps(nbytes, secs)
        res[f"engine_{mode}_copy_s"] = statistics.median(r.copy_s for r in timed_receipts)
        res[f"engine_{mode}_options"] = {
            "cache_bytes": opts.cache_bytes,
            "flush_threads": opts.flush_threads,
            "chunk_bytes": opts.effective_chunk_bytes,
            "direct_io": opts.direct_io,
        }
    return res


def bench_save_call(out_dir: str, repeats: int, saves: int, n_tensors: int = 100, tensor_bytes: int = 16 << 10) -> dict:
    tensors = [torch.full((tensor_bytes // 4,), float(i)) for i in range(n_tensors)]
    calls: list[list[float]] = []
    gates: list[list[float]] = []
    with SnapshotEngine(EngineOptions()) as eng:
        for i, t in enumerate(tensors):
            eng.register(f"layer{i}.weight", t)
        version = 0

        def one_round(n: int, record: bool) -> None:
            nonlocal version
            c, g = [], []
            for _ in range(n):
                version += 1
                path = os.path.join(out_dir, f"save-{version}.dsck")
                t0 = time.perf_counter()
                eng.save(version, path, {"iteration": version})
                t1 = time.perf_counter()
                eng.wait_for_snapshot()
                t2 = time.perf_counter()
                eng.wait()  # durable before the next save: every save() starts with a free slot
                os.unlink(path)
                c.append(t1 - t0)
                g.append(t2 - t1)
            if record:
                calls.append(c)
                gates.append(g)

        one_round(5, record=False)  # warm-up (builds the layout once, as training would)
        for _ in range(repeats):
            one_round(saves, record=True)
    med = statistics.median
    return {
        "tensors": n_tensors,
        "bytes_per_save": n_tensors * tensor_bytes,
        "saves_per_repeat": saves,
        "save_call_median_ms": med([statistics.median(c) * 1e3 for c in calls]),
        "save_call_p99_ms": med([percentile(c, 99) * 1e3 for c in calls]),
        "save_call_max_ms": max(max(c) for c in calls) * 1e3,
        "gate_median_ms": med([statistics.median(g) * 1e3 for g in gates]),
        "gate_p99_ms": med([percentile(g, 99) * 1e3 for g in gates]),
    }


# ------------------------------------------------------------------------------------ report
def report(doc: dict) -> str:
    m, f, s, info = doc["memcpy_hash"], doc["flush"], doc["save_call"], doc["machine"]
    n = m["bytes"]
    rows = [
        ("host memcpy, numpy copyto", f"{m['memcpy_numpy_gbps']:.2f} GB/s", "", "", "", runs(n, m["memcpy_numpy_s"])),
        ("host memcpy, torch copy_", f"{m['memcpy_torch_gbps']:.2f} GB/s", "", "", "", runs(n, m["memcpy_torch_s"])),
        (
            "XXH64 numba, 1 core",
            f"{m['xxh64_gbps']:.2f} GB/s",
            f"zlib.crc32 {m['crc32_gbps']:.2f} GB/s",
            f"{m['xxh64_gbps'] / m['crc32_gbps']:.2f}x",
            "",
            runs(n, m["xxh64_s"]),
        ),
        ("zlib.crc32, 1 core", f"{m['crc32_gbps']:.2f} GB/s", "", "", "", runs(n, m["crc32_s"])),
        (
            "XXH64 vs memcpy (numpy)",
            f"{m['xxh64_gbps']:.2f} GB/s",
            f"memcpy {m['memcpy_numpy_gbps']:.2f} GB/s",
            f"{m['xxh64_gbps'] / m['memcpy_numpy_gbps']:.2f}",
            f">= 0.50 {verdict(m['xxh64_gbps'] / m['memcpy_numpy_gbps'], 0.5)}",
            "",
        ),
        (
            "plain write+fsync",
            f"{f['plain_write_fsync_gbps']:.3f} GB/s",
            "",
            "",
            "",
            runs(f["bytes"], f["plain_write_fsync_s"]),
        ),
    ]
    for mode in ("auto", "off"):
        ratio = f[f"engine_{mode}_gbps"] / f["plain_write_fsync_gbps"]
        rows.append(
            (
                f"engine save->durable, direct_io={mode}",
                f"{f[f'engine_{mode}_gbps']:.3f} GB/s",
                f"write+fsync {f['plain_write_fsync_gbps']:.3f} GB/s",
                f"{ratio:.2f}",
                f">= 0.80 {verdict(ratio, 0.8)}",
                runs(f["bytes"], f[f"engine_{mode}_s"]),
            )
        )
    rows.append(
        (
            f"save() call, {s['tensors']} tensors (median)",
            f"{s['save_call_median_ms']:.3f} ms",
            "",
            "",
            f"<= 1 ms {verdict(s['save_call_median_ms'], 1.0, False)}",
            "",
        )
    )
    rows.append(
        (
            f"save() call, {s['tensors']} tensors (p99)",
            f"{s['save_call_p99_ms']:.3f} ms",
            f"max {s['save_call_max_ms']:.3f} ms",
            "",
            f"<= 1 ms {verdict(s['save_call_p99_ms'], 1.0, False)}",
            "",
        )
    )
    rows.append(
        (
            "gate wait_for_snapshot (median)",
            f"{s['gate_median_ms']:.3f} ms",
            f"p99 {s['gate_p99_ms']:.3f} ms",
            "",
            "",
            "",
        )
    )
    title = (
        f"bench_engine: {m['bytes'] / MB:.0f} MiB, {f['tensors']} tensors for the flush, median of {doc['repeats']} "
        f"runs after a warm-up; {info['cpus']} CPUs, torch threads {info['torch_threads']}, "
        f"out dir {info['out_dir']} ({info['fs_type']}, O_DIRECT {'yes' if doc['o_direct'] else 'no'})"
    )
    o = f["engine_auto_options"]
    notes = [
        "",
        f"engine options: cache {o['cache_bytes'] / MB:.0f} MiB, {o['flush_threads']} flush threads, chunk "
        f"{o['chunk_bytes'] / MB:.0f} MiB; engine copy to host cache (median) auto {f['engine_auto_copy_s'] * 1e3:.0f} ms, "
        f"off {f['engine_off_copy_s'] * 1e3:.0f} ms",
        f"save() rows: {s['saves_per_repeat']} saves x {doc['repeats']} runs of {s['tensors']} tensors "
        f"({s['bytes_per_save'] / MB:.1f} MiB), each started with a free in-flight slot; the gate waits for the host copy",
        f"wall time {doc['wall_s']:.0f} s",
    ]
    return render_table(title, ("measure", "value", "reference", "ratio", "target", "runs (GB/s)"), rows, notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512, help="bytes moved per measure, MiB (default 512)")
    p.add_argument(
        "--tensors", type=int, default=64, help="large tensors in the flush measure (plus 32 x 16 KiB); default 64"
    )
    p.add_argument(
        "--saves", type=int, default=100, help="save() calls per run in the save-latency measure (default 100)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measure; the median is reported (default 3)")
    p.add_argument("--out", help="parent of the temporary output directory (default: current directory)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)
    if args.size_mb < 1 or args.tensors < 1 or args.saves < 1 or args.repeats < 1:
        p.error("--size-mb, --tensors, --saves and --repeats must be >= 1")
    t_start = time.perf_counter()
    out_dir = make_out_dir(args.out, ".bench_engine-")
    try:
        info = machine_info(out_dir)
        if info["fs_type"] in ("tmpfs", "ramfs"):
            print(
                f"warning: {out_dir} is on {info['fs_type']}: write numbers measure memory, not storage",
                file=sys.stderr,
            )
        nbytes = args.size_mb * MB
        doc = {"repeats": args.repeats, "machine": info, "o_direct": o_direct_supported(out_dir)}
        doc["memcpy_hash"] = bench_memcpy_and_hash(nbytes, args.repeats)
        doc["flush"] = bench_flush(make_tensors(nbytes, args.tensors), out_dir, args.repeats)
        doc["save_call"] = bench_save_call(out_dir, args.repeats, args.saves)
        doc["wall_s"] = time.perf_counter() - t_start
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        print(report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
