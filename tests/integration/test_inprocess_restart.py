"""Megatron-LM's own ``pretrain_gpt.py --inprocess-restart --lazy-ckpt`` (nvidia-resiliency-ext's
in-process restart) on 2 gloo CPU ranks: a fault in the forward pass of iteration 5, after the
checkpoint of iteration 4 was scheduled; the wrapper aborts and runs ``pretrain`` again in the same
processes, whose first load retires the aborted attempt's checkpointer (its commit of iteration 4
ends on every rank) and restores iteration 4.  Losses, norms and the final state are bit-exact
against a run that was never interrupted (:func:`.megatron_lm_runs.assert_same_training`).

The faults come from ``DSM_FAULT_AT`` (:mod:`datastates_megatron.megatron.cpu.fault_injection`):
on every rank; on rank 1 only (rank 0 is then blocked in the gradient all-reduce until the CPU
launcher's abort shuts down its gloo connections); a hang on rank 1 (NVRx's soft timeout); a
failed write of checkpoint 4 on rank 1's flush thread; a second fault right after the restart's
restore (``DSM_FAULT_AT_LOAD``).  Each rank restores from its
host copy (``--lazy-ckpt-host-copy``, on under ``--inprocess-restart``): 0 bytes read from storage.
Without host copies, a node-local tier is the restore source, and the restart reads nothing from
``--save`` either.  The restarted checkpointer reuses the host cache's arena.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from pathlib import Path

import pytest

from datastates_megatron.engine.tiers.run_id import local_tier_dir
from tests.integration.megatron_lm_runs import (
    INPROCESS,
    LAZY,
    MEGATRON_LM_DIR,
    assert_same_training,
    latest,
    launch,
    launch_ranks,
)

# scripts/setup.sh installs NVRx 0.4.1 here, apart from .venv (core_v0.19 and main refuse it on import)
APART = Path(__file__).resolve().parents[2] / ".venv-resiliency"
NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None or (APART / "nvidia_resiliency_ext").is_dir()


def _nvrx_needed(tree: str | None) -> str | None:
    """The NVRx version this Megatron-LM tree asserts at import, when above the tested 0.4.1."""
    nvrx = Path(tree or "", "megatron/core/dist_checkpointing/strategies/nvrx.py")
    found = re.search(r'^NVRX_MIN_VERSION = "([\d.]+)"', nvrx.read_text(), re.M) if nvrx.is_file() else None
    if found and tuple(map(int, found[1].split("."))) > (0, 4, 1):
        return found[1]
    return None


pytestmark = [
    pytest.mark.skipif(
        not MEGATRON_LM_DIR,
        reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
    ),
    pytest.mark.skipif(
        not NVRX, reason="nvidia-resiliency-ext is not installed (scripts/setup.sh puts 0.4.1 in .venv-resiliency)"
    ),
    pytest.mark.skipif(
        _nvrx_needed(MEGATRON_LM_DIR) is not None,
        reason=f"this Megatron-LM asserts nvidia-resiliency-ext >= {_nvrx_needed(MEGATRON_LM_DIR)} on import; "
        "the registry's newest is 0.4.1",
    ),
]

ITERS = 8
FAULT_AT = 5  # the checkpoint of iteration 4 is the newest one scheduled before it
# --num-workers 0: the aborted attempt's DataLoader workers are otherwise joined in NVRx's garbage
# collection between attempts, up to 5 s each (torch's MP_STATUS_CHECK_INTERVAL) on a loaded machine:
# rank 0 then reached the next attempt 30 s after rank 1, and was declared unresponsive
BASE = ["--train-iters", str(ITERS), "--bf16", "--num-workers", "0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    run = launch(tmp, "reference", BASE)
    assert run.returncode == 0, run.describe()
    return run


def _faulted(
    tmp_path, monkeypatch, fault: str, rank: int | None, extra: list[str], load: int | None = None, at: int = FAULT_AT
):
    save = tmp_path / "ckpt"
    args = [*BASE, "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY, *INPROCESS, *extra]
    with monkeypatch.context() as m:
        _nvrx_env(m, f"{fault}:{at}", rank)
        if load is not None:
            m.setenv("DSM_FAULT_AT_LOAD", str(load))
        run = launch(tmp_path, "faulted", args)
    assert run.returncode == 0, run.describe()
    return run, save


def _nvrx_env(m: pytest.MonkeyPatch, fault: str, rank: int | None) -> None:
    """The environment of a faulted run: ``fault`` (``DSM_FAULT_AT``) on ``rank`` (all: None), NVRx importable."""
    m.setenv("DSM_FAULT_AT", fault)
    m.setenv("TORCH_CPP_LOG_LEVEL", "error")  # the wrapper's store polls warn each second otherwise
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:  # the ranks import it from APART
        m.setenv("PYTHONPATH", os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(APART)) if p))
    if rank is not None:
        m.setenv("DSM_FAULT_RANK", str(rank))


def _restarted_once_from_4(run, host: bool = True) -> None:
    for rank in (0, 1):
        assert f"rank {rank}: training attempt aborted" in run.log, run.describe()
        from_memory = f"rank {rank}: restored iteration 4 from host memory: 0 bytes read from storage"
        assert (from_memory in run.log) == host, run.describe()
        assert (
            f"rank {rank}: in-process restart: the aborted attempt's lazy checkpointer is closed "
            "(its newest commit: iteration 4)" in run.log
        ), run.describe()
    assert "loaded lazy checkpoint of iteration 4" in run.log, run.describe()
    assert "host cache 0.05 GiB reused from the aborted attempt" in run.log, run.describe()  # rank 0's line
    assert run.log.count("state=initialize") <= 2 * 2, "more than one restart"  # NVRx logs it per rank


@pytest.mark.parametrize("rank", [None, 1], ids=["every-rank", "rank-1"])
def test_exception_in_forward_restarts_in_process_and_resumes_bit_exact(tmp_path, monkeypatch, reference, rank):
    run, save = _faulted(tmp_path, monkeypatch, "raise", rank, [])
    _restarted_once_from_4(run)
    # what scripts/bench_recovery.py measures of this recovery, from the training record
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_recovery

    phases = bench_recovery.phases(run.record, FAULT_AT)
    # split where the fault hit rank 0 too (its record holds the fault's, the abort's and the init's times)
    split = ("partial", "detect", "abort", "reinit") if rank is None else ("until_restore",)
    assert all(phases[k] > 0 for k in (*split, "restore", "first_iteration")), phases
    assert latest(save) == ITERS
    assert_same_training(run, reference, range(1, ITERS + 1))


def test_hang_in_forward_restarts_on_the_soft_timeout_and_resumes_bit_exact(tmp_path, monkeypatch, reference):
    run, save = _faulted(
        tmp_path, monkeypatch, "hang", 1, ["--inprocess-soft-timeout", "15", "--inprocess-hard-timeout", "45"]
    )
    assert "SOFT_TIMEOUT" in run.log, run.describe()
    _restarted_once_from_4(run)
    assert latest(save) == ITERS
    assert_same_training(run, reference, range(1, ITERS + 1))


def test_with_a_node_local_tier_the_restart_reads_nothing_from_save(tmp_path, monkeypatch, reference):
    """Without host copies, the node-local tier (``/dev/shm`` in production: host memory) holds
    iteration 4 on every rank: each rank restores it from there, and reads no checkpoint data from
    ``--save``."""
    local = tmp_path / "node-local"
    extra = ["--lazy-ckpt-local-dir", str(local), "--lazy-ckpt-host-copy", "off"]
    run, save = _faulted(tmp_path, monkeypatch, "raise", None, extra)
    _restarted_once_from_4(run, host=False)
    tier = local_tier_dir(str(local), str(save))
    for rank in (0, 1):
        assert f"rank {rank}: restoring iteration 4 from {tier}: " in run.log, run.describe()
        assert f"rank {rank}: restoring iteration 4 from {save}" not in run.log, run.describe()
    assert latest(save) == ITERS  # the end of the run is promoted to --save
    assert_same_training(run, reference, range(1, ITERS + 1))


def test_a_second_fault_in_the_restarts_restore_restarts_again_consistently(tmp_path, monkeypatch, reference):
    """The forward-pass fault on every rank, then a fault right after the restart's restore (the
    process's 2nd load), both on every rank: a third attempt retires the second one's checkpointer
    (nothing committed) and restores iteration 4 again; still bit-exact."""
    run, save = _faulted(tmp_path, monkeypatch, "raise", None, [], load=2)
    assert "rank 0: injected fault after load 2" in run.log, run.describe()
    assert run.log.count("loaded lazy checkpoint of iteration 4") == 2, run.describe()  # rank 0's, per attempt
    for rank in (0, 1):  # the copy outlives the second attempt too
        assert run.log.count(f"rank {rank}: restored iteration 4 from host memory: 0 bytes") == 2, run.describe()
    for rank in (0, 1):
        assert (
            f"rank {rank}: in-process restart: the aborted attempt's lazy checkpointer is closed (its newest "
            "commit: iteration 4)" in run.log
        ), run.describe()
        assert (
            f"rank {rank}: in-process restart: the aborted attempt's lazy checkpointer is closed (its newest "
            "commit: none)" in run.log
        ), run.describe()
    assert latest(save) == ITERS
    assert_same_training(run, reference, range(1, ITERS + 1))


def test_a_failed_write_on_a_flush_thread_restarts_from_the_last_commit_in_memory(tmp_path, monkeypatch, reference):
    """Rank 1's write of checkpoint 4 fails (EIO on its flush thread): every rank abandons
    checkpoint 4, and the error reaches the training loop at the next poll (``--lazy-ckpt-on-error
    raise``, the default), where the wrapper restarts in-process. Every rank restores iteration 2,
    the newest committed, from its host copy; still bit-exact."""
    run, save = _faulted(tmp_path, monkeypatch, "flush", 1, [], at=4)
    assert "rank 1: injected fault (flush) in the write of checkpoint 4" in run.log, run.describe()
    for rank in (0, 1):
        assert f"rank {rank}: training attempt aborted" in run.log, run.describe()
        assert f"rank {rank}: restored iteration 2 from host memory: 0 bytes read from storage" in run.log, (
            run.describe()
        )
    assert latest(save) == ITERS
    assert_same_training(run, reference, range(1, ITERS + 1))


@pytest.mark.parametrize(
    "fault,restored", [("kill", 4), ("kill-pending", 2)], ids=["after-its-commits", "with-a-commit-pending"]
)
def test_a_spare_takes_a_killed_ranks_place_with_its_shard_from_the_partner_replica(
    tmp_path, monkeypatch, reference, fault, restored
):
    """``--inprocess-active-world-size 2`` on 3 ranks, each its own "node" (its own node-local
    directory, ``{node}``): ranks 0 and 1 train, rank 2 waits as a spare.  Rank 1's process is
    killed (``SIGKILL``: a crash, a lost node) in iteration 5; NVRx's monitor reports it terminated,
    and the wrapper restarts rank 0 in-process and makes the spare rank 1.  Rank 0 restores from its
    host copy; the spare holds nothing, and fetches rank 1's shard from the partner replica that
    rank 0's node keeps (``--lazy-ckpt-replicas 1``): a mixed restore, with nothing read from
    ``--save``, bit-exact against the 2-rank run.  Killed once its checkpoints are committed, it is
    iteration 4; killed while its write of checkpoint 4 never returned, rank 0's commit of 4 is
    pending: it stops waiting for the rank that is gone, abandons 4, and iteration 2 is restored."""
    save, local = tmp_path / "ckpt", tmp_path / "node{node}"
    args = [*BASE, "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY, *INPROCESS]
    args += ["--inprocess-active-world-size", "2", "--lazy-ckpt-local-dir", str(local), "--lazy-ckpt-replicas", "1"]
    with monkeypatch.context() as m:
        _nvrx_env(m, f"{fault}:{FAULT_AT - (fault == 'kill-pending')}", 1)
        run = launch_ranks(tmp_path, "spare", args, world=3)
    assert run.codes == (0, -signal.SIGKILL, 0), run.describe()
    assert f"rank 1: injected fault ({fault}) in the forward pass of iteration 5" in run.log, run.describe()
    assert "rank 0: in-process restart: rank(s) [1] of the aborted attempt are gone" in run.log, run.describe()
    closed = f"rank 0: in-process restart: the aborted attempt's lazy checkpointer is closed (its newest commit: iteration {restored})"
    assert closed in run.log, run.describe()
    it = restored
    assert f"rank 0: restored iteration {it} from host memory: 0 bytes read from storage" in run.log, run.describe()
    spare = f"rank 1: restoring iteration {it} from {tmp_path}/node2/run-"  # its own node's directory
    assert spare in run.log and "/replicas/r00001: the replica held by rank 0" in run.log, run.describe()
    assert f"rank 0: sent rank 1 its file of iteration {it} from the replica held here" in run.log, run.describe()
    assert f"restoring iteration {it} from {save}" not in run.log, run.describe()
    assert latest(save) == ITERS
    assert_same_training(run, reference, range(1, ITERS + 1))
