"""The CPU launcher's abort for NVRx's in-process restart (megatron/cpu/inprocess_cpu.py): a gloo
collective blocked on a peer that will never join is released when either side shuts down its gloo
connections, as an NCCL abort releases it.  Without that (destroy_process_group, ProcessGroupGloo.abort)
the rank waits in the socket read for the process group's timeout, set here far beyond the test's."""

from __future__ import annotations

import datetime
import time

import pytest

from .ranks import describe, run_ranks

pytest.importorskip("psutil")
HOURS = datetime.timedelta(hours=1)  # the process group's own timeout: never what ends a wait here


def _blocked_rank_is_released(args: list[str]) -> dict:
    import threading

    import torch
    import torch.distributed as dist

    from datastates_megatron.megatron.cpu.inprocess_cpu import shut_down_gloo_connections

    who = args[0]  # "faulty": the peer that never joins cuts; "healthy": the blocked rank cuts its own
    dist.init_process_group("gloo", timeout=HOURS)
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    if rank == 1:  # never enters the collective
        cut = shut_down_gloo_connections() if who == "faulty" else 0
        store.wait(["released"], HOURS)  # until rank 0 has left its collective
        return {"cut": cut}
    if who == "healthy":
        threading.Thread(target=shut_down_gloo_connections, name="abort").start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        error = None
    except RuntimeError as e:
        error = str(e)
    store.set("released", "1")
    return {"error": error, "s": time.monotonic() - t0}


@pytest.mark.parametrize("who", ["faulty", "healthy"])
def test_a_rank_blocked_in_a_gloo_collective_is_released_by_the_abort(who):
    results = run_ranks(_blocked_rank_is_released, 2, [who], timeout=60)
    assert all(r["returncode"] == 0 and r["result"] is not None for r in results), describe(results)
    blocked = results[0]["result"]
    # released with gloo's error (which one depends on whether the cut came before or during the
    # read: "Connection closed by peer", a reset or a broken pipe), never by the hour-long timeout
    assert blocked["error"] is not None and blocked["s"] < 60, blocked
    if who == "faulty":
        assert results[1]["result"]["cut"] >= 1
