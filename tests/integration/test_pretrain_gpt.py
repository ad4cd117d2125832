"""Megatron-LM's own ``pretrain_gpt.py --lazy-ckpt`` end to end: trains, saves, is killed with
``kill -9``, resumes, and trains on exactly as a run that was never interrupted.

Each comparison is against a run without any checkpointing, to the bit: every iteration's grad
norm and params norm (the lm loss Megatron logs averages over the iterations since the last log,
so after a resume it is not comparable) and a digest of every model and optimizer tensor at the
end (:mod:`datastates_megatron.megatron.cpu.training_record`). Dropout is 0; on CPU the shim maps the
CUDA generator onto the CPU one. 2 ranks, gloo on CPU (NCCL on a GPU: as many ranks as GPUs, up to 2).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from datastates_megatron.engine.tiers.run_id import local_tier_dir
from datastates_megatron.engine.tiers.tier import committed_iterations
from datastates_megatron.megatron.megatron_lm import versions
from tests.integration.megatron_lm_runs import (
    LAZY,
    MEGATRON_LM_DIR,
    RANKS,
    assert_same_training,
    committed_at_least,
    latest,
    launch,
    logged,
)

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (scripts/test.sh unpacks and patches one from ../shared/megatron-lm)",
)

ITERS = 8
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
# The other trees of MEGATRON_LM_DIRS that the table runs end to end (main): the kill -9 test runs on
# each of them too, in bf16 (the other tests here run on MEGATRON_LM_DIR only).
END_TO_END = [
    d
    for d in (os.environ.get("MEGATRON_LM_DIRS") or "").split(os.pathsep)
    if d and d != MEGATRON_LM_DIR and any(r.end_to_end and r.source == Path(d).name for r in versions.TESTED)
]


@pytest.fixture(scope="module")
def reference(uninterrupted):
    """Uninterrupted runs without checkpointing, per precision and tree (built on first use, shared
    with the session: test_pretrain_gpt_s3.py compares against the same bf16 runs)."""

    def get(precision: str, tree: str | None = None):
        return uninterrupted(["--train-iters", str(ITERS), *PRECISIONS[precision]], tree)

    return get


# fp32 is slow-only: test_node_local_tier_... kills fp32 runs with -9 and resumes them bit-exactly too.
# main is slow-only here for CI time: objstore/test_pretrain_gpt_s3.py's msc-main case runs main's
# pretrain_gpt.py save -> kill -9 -> resume bit-exact in the default set (to a bucket, through its node-local tier)
@pytest.mark.parametrize(
    "precision, tree",
    [
        pytest.param("fp32", None, marks=pytest.mark.slow, id="fp32"),
        pytest.param("bf16", None, id="bf16"),
        *(pytest.param("bf16", d, id=f"bf16-{Path(d).name}", marks=pytest.mark.slow) for d in END_TO_END),
    ],
)
def test_kill_9_after_a_commit_then_resume_is_bit_exact(tmp_path, reference, precision, tree):
    save = tmp_path / "ckpt"
    args = [
        "--train-iters",
        str(ITERS),
        *PRECISIONS[precision],
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "2",
        *LAZY,
    ]
    # killed at the first commit: the rest of the run (6 iterations) is the margin for the kill to land
    killed = launch(tmp_path, "killed", args, kill_when=committed_at_least(save, 2), megatron_lm_dir=tree)
    assert killed.returncode != 0, "the run ended before it was killed:\n" + killed.describe()
    resume_from = latest(save)
    assert resume_from is not None and 2 <= resume_from < ITERS, resume_from
    tensorboard = tmp_path / "tb"
    resumed = launch(tmp_path, "resumed", [*args, "--tensorboard-dir", str(tensorboard)], megatron_lm_dir=tree)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {resume_from}" in resumed.log
    want = reference(precision, tree)
    assert_same_training(killed, want, None)
    assert_same_training(resumed, want, range(resume_from + 1, ITERS + 1))
    # the commit telemetry reaches the writer Megatron-LM made (on its last rank)
    tags = _scalar_tags(tensorboard)
    assert {
        f"lazy-ckpt/{n}" for n in ("stall-ms", "d2h-GBps", "flush-GBps", "bytes-total", "save-to-commit-s")
    } <= tags, tags


def _scalar_tags(directory) -> set:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in directory.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_sigterm_with_exit_signal_handler_commits_the_final_save_before_exit(tmp_path, reference):
    """(A requeued job resuming from this checkpoint: tests/integration/test_slurm_megatron_lm.py.)"""
    save = tmp_path / "ckpt"
    args = [
        "--train-iters",
        str(ITERS),
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "100",
        "--exit-signal-handler",
        *LAZY,
    ]
    first = launch(tmp_path, "first", args, term_when=logged(tmp_path, "first", 2))
    assert first.returncode == 0, first.describe()
    last = max(first.iterations())
    assert 2 <= last < ITERS, last  # stopped by the signal, not at the end
    assert "exiting program after receiving SIGTERM" in first.log
    assert latest(save) == last  # committed before the process exited
    assert_same_training(first, reference("fp32"), range(1, last + 1))


@pytest.fixture(scope="module")
def exited_at_4(tmp_path_factory):
    """A run that saved every 2 iterations and left at 4 (--exit-interval); tests resume copies."""
    tmp = tmp_path_factory.mktemp("exited")
    save = tmp / "ckpt"
    first = launch(tmp, "first", [*_saving(save), "--exit-interval", "4"])
    assert first.returncode == 0, first.describe()
    assert sorted(first.iterations()) == [1, 2, 3, 4] and latest(save) == 4
    return save


def _saving(save) -> list[str]:
    return ["--train-iters", str(ITERS), "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY]


def _copy(save, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(save, dst, ignore=shutil.ignore_patterns(".datastates.lock"))
    return dst


def test_exit_interval_then_resume_from_an_older_ckpt_step(tmp_path, reference, exited_at_4):
    save = _copy(exited_at_4, tmp_path)
    older = launch(tmp_path, "older", [*_saving(save), "--ckpt-step", "2"])
    assert older.returncode == 0, older.describe()
    assert "loaded lazy checkpoint of iteration 2" in older.log
    assert_same_training(older, reference("fp32"), range(3, ITERS + 1))


@pytest.mark.skipif(RANKS < 2, reason="needs 2 ranks (one GPU per rank under NCCL)")
def test_resume_on_one_rank_from_a_two_rank_run(tmp_path, reference, exited_at_4):
    """DP 2 -> DP 1: the optimizer shards are resharded on load; the same global batch is then
    accumulated in 4 micro-batches instead of 2 per rank, so the sums are ordered differently and
    the comparison is to 1e-5, not to the bit."""
    save = _copy(exited_at_4, tmp_path)
    one = launch(tmp_path, "one", _saving(save), nproc=1)
    assert one.returncode == 0, one.describe()
    assert "loaded lazy checkpoint of iteration 4" in one.log
    assert_same_training(one, reference("fp32"), range(5, ITERS + 1), ranks=1, exact=False)


def test_node_local_tier_promotes_and_a_lost_node_resumes_from_save(tmp_path, reference, monkeypatch):
    """The node-local tier set up with Megatron-LM's own local-checkpoint flags: a checkpoint every
    iteration (non-persistent) in the local directory, every 2nd (--save-interval) promoted."""
    save, local = tmp_path / "ckpt", tmp_path / "node-local"
    args = [
        "--train-iters",
        str(ITERS),
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "2",
        "--non-persistent-save-interval",
        "1",
        "--lazy-ckpt-when-behind",  # every checkpoint is taken: the test counts them (skips: test_skip_when_behind)
        "wait",
        "--non-persistent-ckpt-type",
        "local",
        "--non-persistent-local-ckpt-dir",
        str(local),
        *LAZY,
    ]
    # killed (kill -9, every rank) in its second promotion, of 4: --save holds 2, the node-local tier 3 and 4
    with monkeypatch.context() as m:
        m.setenv("DSM_CRASH_AT", "promote:2")
        killed = launch(tmp_path, "killed", args)
    assert killed.returncode != 0, "the run ended before it was killed:\n" + killed.describe()
    promoted = latest(save)
    assert committed_iterations(str(save)) == [promoted] == [2]
    assert any(it % 2 for it in committed_iterations(local_tier_dir(str(local), str(save))))  # non-persistent
    shutil.rmtree(local)  # the node is gone: only --save is left
    resumed = launch(tmp_path, "resumed", args)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {promoted}" in resumed.log
    assert_same_training(resumed, reference("fp32"), range(promoted + 1, ITERS + 1))


def _tree_digest(root):
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_save_dir_holding_a_native_megatron_checkpoint_is_refused_and_left_byte_for_byte(tmp_path):
    """Switching an existing run to --lazy-ckpt on its --save: nothing of Megatron's is deleted, and
    the run does not silently start from iteration 0 beside it."""
    import os

    save = tmp_path / "ckpt"
    native = save / "iter_0000500"
    native.mkdir(parents=True)
    for name in ("common.pt", ".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"):
        (native / name).write_bytes(os.urandom(4096))
    (save / "latest_checkpointed_iteration.txt").write_text("500")
    before = _tree_digest(save)
    args = ["--train-iters", str(ITERS), "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY]
    run = launch(tmp_path, "refused", args)
    assert run.returncode != 0, run.describe()
    assert "iteration 500" in run.log and "torch_dist" in run.log and "another --save" in run.log, run.describe()
    assert run.iterations() == {}, "trained although it was refused"
    after = {k: v for k, v in _tree_digest(save).items() if k != ".datastates.lock"}
    assert after == before
