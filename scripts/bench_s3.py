"""Promotion to S3 and restore from it, against plain boto3 on the same bytes, side by side.

Starts moto's S3 server on a free localhost port (its own process), writes one rank file with the
snapshot engine, then alternates, ``--repeat`` times each:

* promotion -- :func:`datastates_megatron.engine.storage.upload.upload_verified` (verify every
  chunk of the local file, then the CRC32 multipart upload, its composite checksum compared) -- against
  ``boto3``'s ``upload_file`` with a ``TransferConfig`` of the same part size and concurrency
  (what ``aws s3 cp`` does);
* restore -- :func:`datastates_megatron.engine.storage.fetch.fetch_rank` (ranged GETs into a local
  file, every chunk verified, renamed into place) -- against the same number of threads doing
  ranged ``get_object`` reads of the same bytes into memory.

Prints MB/s (median of the repeats) and each ratio ours / plain.  Every figure is bound by the
local server and this machine's cores; the ratio is what to read.  Needs ``boto3`` and
``moto[server]`` (``pip install -e '.[test]'``).

    python scripts/bench_s3.py --mb 256 --part-mb 16 --concurrency 4 --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto server did not start") from None
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def _rank_file(path: str, mb: int) -> int:
    import torch

    from datastates_megatron.engine import EngineOptions, SnapshotEngine

    numel = mb * (1 << 20) // 4
    with SnapshotEngine(EngineOptions(cache_bytes=64 << 20, timeout_s=300)) as eng:
        eng.register("w", torch.randn(numel, generator=torch.Generator().manual_seed(0)))
        eng.save(1, path, {}, tag=os.path.basename(path)).durable.result(300)
    return os.path.getsize(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="rank file size in MiB (default 256)")
    p.add_argument("--part-mb", type=int, default=16, help="multipart part size in MiB (default 16)")
    p.add_argument("--concurrency", type=int, default=4, help="parts / ranges in flight (default 4)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each side (default 3)")
    args = p.parse_args()

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from datastates_megatron.engine.format.manifest import Manifest, RankRecord
    from datastates_megatron.engine.storage import open_storage
    from datastates_megatron.engine.storage.fetch import fetch_rank
    from datastates_megatron.engine.storage.upload import upload_verified

    proc, endpoint = _start_server()
    part = args.part_mb << 20
    try:
        with tempfile.TemporaryDirectory(prefix="dsm-bench-s3-") as tmp:
            name = "r00000-0000000000000001-000001.dsck"
            src = os.path.join(tmp, name)
            size = _rank_file(src, args.mb)
            client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=args.concurrency + 4))
            client.create_bucket(Bucket="bench")
            st = open_storage("s3://bench/ours", endpoint_url=endpoint, part_bytes=part, concurrency=args.concurrency)
            plain_cfg = TransferConfig(
                multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.concurrency
            )
            ours_up, plain_up, ours_down, plain_down = [], [], [], []
            receipt = None
            for i in range(args.repeat):
                t0 = time.perf_counter()
                receipt = upload_verified(src, st, f"iter_0000001/{name}", 1)
                ours_up.append(size / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                client.upload_file(src, "bench", f"plain/{name}", Config=plain_cfg)
                plain_up.append(size / (time.perf_counter() - t0))

            from datastates_megatron.engine.format.file_format import RankFile

            with RankFile(src) as rf:
                data_bytes = sum(e.nbytes for e in rf.entries.values())
            m = Manifest(
                1,
                1,
                "0000000000000001",
                (
                    RankRecord(
                        0,
                        name,
                        receipt.file_bytes,
                        data_bytes,
                        receipt.n_tensors,
                        receipt.index_xxh64,
                        receipt.header_xxh64,
                    ),
                ),
                {},
                {},
            )

            def plain_read() -> None:
                spans = [(lo, min(size, lo + part)) for lo in range(0, size, part)]

                def one(span):
                    lo, hi = span
                    body = client.get_object(Bucket="bench", Key=f"plain/{name}", Range=f"bytes={lo}-{hi - 1}")["Body"]
                    return len(body.read())

                with cf.ThreadPoolExecutor(args.concurrency) as pool:
                    assert sum(pool.map(one, spans)) == size

            for i in range(args.repeat):
                dest = os.path.join(tmp, f"fetched{i}")
                os.mkdir(dest)
                t0 = time.perf_counter()
                fetch_rank(st, m, 0, dest, threads=args.concurrency, range_bytes=part)
                ours_down.append(size / (time.perf_counter() - t0))
                os.unlink(os.path.join(dest, name))
                t0 = time.perf_counter()
                plain_read()
                plain_down.append(size / (time.perf_counter() - t0))
            st.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def mbs(xs):
        return statistics.median(xs) / 1e6

    print(
        f"object {size / 1e6:.0f} MB, parts/ranges {args.part_mb} MiB, {args.concurrency} in flight, "
        f"median of {args.repeat}, moto server on localhost ({os.cpu_count()} CPUs)"
    )
    print(f"{'':28} {'ours MB/s':>10} {'plain MB/s':>11} {'ours/plain':>10}")
    rows = [
        ("promotion vs upload_file", ours_up, plain_up),
        ("restore vs ranged GETs", ours_down, plain_down),
    ]
    for label, ours, plain in rows:
        print(f"{label:28} {mbs(ours):10.1f} {mbs(plain):11.1f} {mbs(ours) / mbs(plain):10.2f}")


if __name__ == "__main__":
    main()
