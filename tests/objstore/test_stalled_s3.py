"""A stalled S3 server (its moto process stopped with SIGSTOP: connections are accepted by the
kernel, nothing is answered) during promotion from the node-local tier: local commits go on at
pace, the promotion keeps one copy in flight and the newest waiting (the rest skipped, counted,
logged), and once the server resumes (SIGCONT) the newest checkpoint is committed in the bucket and
loads bit-exactly.  ``close()`` with the server stopped returns within its bound and says what it
gave up on.  A request that times out is retried, bounded, then reported: nothing committed, the
next checkpoint is."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time

import pytest
import torch

from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.errors import CacheTimeoutError, PromotionError
from datastates_megatron.engine.names import rank_file_name
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.storage.retry import Retry

from ..unit.rank_files import write_checkpoint
from .conftest import _ENV, S3Server
from .jobs import TOKEN, WORLD, Job

ITERS = 6


class StoppableServer(S3Server):
    """A moto server of this test alone, which :meth:`pause` stops (SIGSTOP) and :meth:`resume`
    continues (SIGCONT), by the pid of the process we started."""

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def stoppable(tmp_path, monkeypatch):
    server = StoppableServer(str(tmp_path / "moto.log"))
    for k, v in {**_ENV, "AWS_ENDPOINT_URL": server.endpoint}.items():
        monkeypatch.setenv(k, v)
    server.client().create_bucket(Bucket="stall")
    try:
        yield server
    finally:
        server.resume()  # never leave it stopped: stop() then ends it
        server.stop()


def _manager(url: str, local: str, timeout_s: float = 60) -> CheckpointManager:
    return CheckpointManager(
        url,
        EngineOptions(cache_bytes=4 << 20, timeout_s=timeout_s),
        local_root=local,
        persist_interval=1,
        local_keep_last=2,
    )


def _local_commit_latencies(mgr, w, iterations) -> list[float]:
    """Save each iteration, waiting for its node-local commit only (what training waits for)."""
    out = []
    for it in iterations:
        w.fill_(float(it))
        t0 = time.perf_counter()
        assert mgr.save(it)
        mgr.wait(persist=False)
        out.append(time.perf_counter() - t0)
    return out


def _manifests(server) -> list[int]:
    c = server.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket="stall", Prefix="run/").get("Contents", ())]
    return sorted(int(k.split("/")[1][5:]) for k in keys if k.endswith("/manifest.json"))


def test_a_stalled_server_never_delays_local_commits_and_the_newest_is_promoted_once_it_resumes(
    stoppable, tmp_path, caplog, monkeypatch
):
    # the held requests wait for the server however long the pause lasts on a loaded machine (the
    # deadline of a request that is never answered is test_deadlines.py's)
    monkeypatch.setenv("DSM_S3_READ_TIMEOUT_S", "300")
    monkeypatch.setenv("DSM_S3_DEADLINE_S", "900")
    url = "s3://stall/run"
    w = torch.zeros(1 << 18)  # 1 MiB
    mgr = _manager(url, str(tmp_path / "node-a"))
    try:
        mgr.register("w", w)
        free = _local_commit_latencies(mgr, w, range(1, ITERS + 1))  # the baseline, server answering
        mgr.wait()
        assert _manifests(stoppable)[-1] == ITERS
        skipped_before = mgr.promotion.skipped
        stoppable.pause()
        first = ITERS + 1
        stalled_its = range(first, first + ITERS)
        with caplog.at_level(logging.INFO, logger="datastates_megatron"):
            stalled = _local_commit_latencies(mgr, w, stalled_its)
        # one copy in flight (the first the copy thread took), the newest waiting, the rest skipped
        assert mgr.promotion.skipped - skipped_before == ITERS - 2, mgr.promotion.skipped
        pending = mgr.promotion.pending()
        assert stalled_its[-1] in pending and len(pending) <= 2 and pending <= set(stalled_its), pending
        reported = [
            ln
            for ln in caplog.text.splitlines()
            if "skipped: a copy is still in flight" in ln and any(f"checkpoint {it} to" in ln for it in stalled_its)
        ]
        assert len(reported) == ITERS - 2, reported
        stoppable.resume()
        mgr.wait()  # the server answers the held requests: the copy in flight, then the newest
        expected = w.clone()
    finally:
        stoppable.resume()
        mgr.close()
    assert stalled_its[-1] in _manifests(stoppable)
    for it in stalled_its[1:-1]:
        assert it not in _manifests(stoppable), it
    # generous: a held request would add its read timeout to a local commit
    assert statistics.median(stalled) < statistics.median(free) + 1.0, (free, stalled)
    assert max(stalled) < 10.0, stalled
    fresh = torch.zeros_like(w)
    with _manager(url, str(tmp_path / "node-b")) as again:  # no local copy: read from the bucket
        again.register("w", fresh)
        result = again.load()
    assert result.iteration == stalled_its[-1] and result.root == url
    assert torch.equal(fresh, expected)


def test_close_with_the_server_stopped_returns_within_its_bound_and_names_what_it_gave_up(
    stoppable, tmp_path, caplog, monkeypatch
):
    monkeypatch.setenv("DSM_JOB_ID", "stalled-job")  # its requeue takes the lock at once
    url = "s3://stall/run"
    w = torch.zeros(1 << 18)
    mgr = _manager(url, str(tmp_path / "node-a"))
    mgr.register("w", w)
    _local_commit_latencies(mgr, w, [1])
    mgr.wait()
    stoppable.pause()
    _local_commit_latencies(mgr, w, [2])  # committed locally; its promotion is held by the server
    bound = 5.0
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="datastates_megatron"):
        with pytest.raises(CacheTimeoutError, match="1 checkpoint.s. not committed after 5s"):
            mgr.close(timeout=bound)  # every thread stopped or given up, the lock released or given up
    took = time.monotonic() - t0
    # each of close's steps waits at most ``bound`` (drain, engine, promotion and its grace, tiers,
    # the lock); a request unanswered until its deadline (30 s), per step, is what an unbounded step would add
    assert took < 12 * bound, took
    assert "giving up the promotions left after 5 s: promoting iteration 2" in caplog.text
    assert "gave up after 5 s releasing the lock" in caplog.text
    stoppable.resume()
    # what close gave up on is not cancelled, but once the lock is released a late commit thread
    # writes no manifest: the same job, requeued on another node, loads iteration 1 bit-exactly.
    fresh = torch.zeros_like(w)
    with _manager(url, str(tmp_path / "node-b")) as again:
        again.register("w", fresh)
        result = again.load()
    assert result.iteration == 1 and torch.equal(fresh, torch.full_like(w, 1.0))


def test_a_request_that_times_out_is_retried_then_reported_and_the_next_checkpoint_is_committed(
    stoppable, tmp_path, caplog
):
    local = str(tmp_path / "local")
    for it in (1, 2, 3):
        write_checkpoint(local, it, WORLD, TOKEN, numel=300_000)
    policy = Retry(attempts=3, base_s=0.05, cap_s=0.2)
    job = Job("stall", local, read_timeout_s=1.0, retry=policy)
    try:
        assert job.promote(1) == [[1]] * WORLD
        stoppable.pause()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="datastates_megatron"):
            out = job.promote(2)  # each request times out after 1 s, 3 tries, then the promotion fails
        took = time.monotonic() - t0
        stoppable.resume()
        # no commit of iteration 2 on any rank, and every rank is told (PromotionError, once)
        assert all(isinstance(o, PromotionError) and "not promoted" in str(o) for o in out), out
        for r in range(WORLD):  # reported like any storage error, naming the object
            assert (
                f"rank {r}: promoting iteration 2 from {local}/iter_0000002/{rank_file_name(r, TOKEN, 1)} to "
                f"s3://stall/job/save/iter_0000002 failed: s3://stall/job/save/iter_0000002/"
                f"{rank_file_name(r, TOKEN, 1)}: create multipart upload failed after 3 tries: ReadTimeoutError"
            ) in caplog.text
        assert "try 2 of at most 3" in caplog.text and "try 3 of at most 3" in caplog.text  # with backoff between
        assert took < 50, took  # bounded: a few requests of 3 x 1 s each, not the default timeouts
        assert job.promote(3) == [[3]] * WORLD  # the next checkpoint is attempted, and committed
    finally:
        stoppable.resume()
        job.close()
    c = stoppable.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket="stall", Prefix="job/save/").get("Contents", ())]
    assert "job/save/iter_0000002/manifest.json" not in keys  # nothing committed of the failed one
    assert {"job/save/iter_0000001/manifest.json", "job/save/iter_0000003/manifest.json"} <= set(keys)
