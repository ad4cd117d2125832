"""Issue 41, item 4: Megatron-LM's own ``pretrain_gpt.py`` (``MEGATRON_LM_DIR``, core_v0.16.1 in
/work/trees) on 2 CPU ranks, a checkpoint every iteration, ``--save`` on the fault filesystem.
Once a checkpoint of iteration ``FROM`` or later is committed, every write, create, mkdir, fsync,
rename, unlink, truncate and fallocate of rank 1's rank files is held for ``STALL_S`` seconds (a
storage target of one rank that stops answering and recovers).

Checked: training keeps its pace -- no iteration overlapping the stall lasts ``LONGEST_S`` (a save
that waited for the storage would last the stall), and their median is <= ``PACE``x the median
before it, from the iterations' wall-clock times in the training record -- the
job finishes, rank 1 reports its skipped checkpoints (the stall warning), a checkpoint saved after
the stall commits before the run's final one, and a run resumed from the run's last checkpoint
trains bit-exactly as a run that was never interrupted (every grad norm and params norm, and the
final digest of the model and optimizer state)."""

from __future__ import annotations

import os
import statistics
import time

import pytest

from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir, iteration_of, rank_file_name
from datastates_megatron.engine.tiers.tier import committed_iterations, latest_committed
from tests.integration.megatron_lm_runs import CUDA, LAZY, MEGATRON_LM_DIR, assert_same_training, launch

pytestmark = [
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="MEGATRON_LM_DIR is not set"),
    pytest.mark.skipif(CUDA, reason="the fault filesystem's stall of a CPU job (gloo ranks)"),
    pytest.mark.slow,
]

STALL_S = float(os.environ.get("DSM_TEST_STALL_S", "30"))  # the 30 s
FROM = 10  # the stall begins once a checkpoint of this iteration (or a later one) is committed
# outlasts the stall at this model's pace (~100-150 ms an iteration on two loaded cores)
ITERS = int(os.environ.get("DSM_TEST_PRETRAIN_ITERS", "330"))
MORE = 10  # the resumed run's iterations after the stalled run's last
LONGEST_S = 5.0
# not the demo's 1.2x: on two cores shared with other jobs (load average near 20 here), the
# reference run without any checkpoint swings between 73 and 145 ms per 20 iterations, and the
# window before the stall is only the first ~10 iterations
PACE = 2.0
WRITE_OPS = ["write", "create", "mkdir", "fsync", "rename", "unlink", "truncate", "fallocate"]
# rank 1's rank files, wherever they are (an iteration directory, the recycle pool's reused names)
RANK1_FILES = "ckpt/**/*" + rank_file_name(1, "*", 0).replace("000000", "*")
STALL_WARNING = "storage behind: checkpoint of iteration"


class Stall:
    """Polled by the launcher's supervisor every 50 ms (as ``kill_when``, never asking for a kill):
    holds rank 1's files once iteration ``FROM`` or later is committed (read in the filesystem's
    source directory, not through the mount), lets them go after ``STALL_S``."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.source = os.path.join(fs.source, "ckpt")
        self.rule = self.start = self.end = None

    def _committed_from(self) -> bool:
        try:
            names = os.listdir(self.source)
        except FileNotFoundError:
            return False
        its = (iteration_of(n) for n in names)
        return any(
            i is not None and i >= FROM and os.path.exists(os.path.join(iter_dir(self.source, i), MANIFEST_NAME))
            for i in its
        )

    def __call__(self) -> bool:
        if self.start is None:
            if self._committed_from():
                self.rule = self.fs.fault(op=WRITE_OPS, path=RANK1_FILES, hold=True)
                self.start = time.time()
        elif self.end is None and time.time() >= self.start + STALL_S:
            self.fs.clear(self.rule)
            self.end = time.time()
        return False


def _pace(run, rank: int, stall: Stall) -> tuple[float, float, int, int, float]:
    """(median before, median during, how many before, how many during, longest during) of
    ``rank``'s iteration times: the time between two iterations' log lines (a save every iteration,
    so each includes it)."""
    its = run.iterations(rank)
    times = [(i, its[i]["t"] - its[i - 1]["t"], its[i]["t"]) for i in sorted(its) if i - 1 in its and i > 3]
    before = [d for _, d, t in times if t <= stall.start]
    during = [d for _, d, t in times if t > stall.start and t - d < stall.end]
    assert len(before) >= 3 and len(during) >= 5, (rank, len(before), len(during))
    return statistics.median(before), statistics.median(during), len(before), len(during), max(during)


def test_pretrain_gpt_with_one_ranks_storage_stalled_keeps_its_pace_commits_after_and_resumes_bit_exactly(
    fault_fs, tmp_path
):
    save = os.path.join(fault_fs.root, "ckpt")
    reference = launch(tmp_path, "reference", ["--train-iters", str(ITERS + MORE)], timeout=900)
    assert reference.returncode == 0, reference.describe()

    # the same --train-iters as the reference (the LR schedule is checked at resume); the stalled run
    # ends at ITERS through --exit-interval, with its (final) save
    args = ["--save", save, "--load", save, "--save-interval", "1", "--train-iters", str(ITERS + MORE), *LAZY]
    stall = Stall(fault_fs)
    stalled = launch(tmp_path, "stalled", [*args, "--exit-interval", str(ITERS)], timeout=900, kill_when=stall)
    assert stalled.returncode == 0, stalled.describe()  # the job finishes
    assert stall.start is not None, f"iteration {FROM} never committed\n{stalled.describe()}"
    if stall.end is None:  # the run ended inside the stall (its final save waited for it)
        fault_fs.clear(stall.rule)
        stall.end = time.time()
    assert fault_fs.stats()["rules"] == []
    assert STALL_WARNING in stalled.log and "rank 1: storage behind" in stalled.log, stalled.describe()

    for rank in (0, 1):
        b, d, nb, nd, longest = _pace(stalled, rank, stall)
        print(
            f"pretrain_gpt rank {rank}: median iteration {1e3 * b:.1f} ms before the stall ({nb}), "
            f"{1e3 * d:.1f} ms during it ({nd}): {d / b:.2f}x; longest during it {longest:.2f} s"
        )
        assert longest < LONGEST_S and d <= PACE * b, (rank, b, d, longest)

    # a checkpoint saved after the stall commits, before the final one (the final save never skips)
    its = stalled.iterations(0)
    after = [i for i, e in its.items() if e["t"] > stall.end + 1.0 and i < ITERS]
    assert after, f"the stall outlasted the run ({STALL_S} s): raise DSM_TEST_PRETRAIN_ITERS"
    committed = committed_iterations(save)
    late = [i for i in committed if min(after) <= i < ITERS]
    print(f"pretrain_gpt: committed after the stall: {late} (iterations {min(after)}..{ITERS - 1}), final {ITERS}")
    assert late, (min(after), committed[-10:])
    assert latest_committed(save) == ITERS

    resumed = launch(tmp_path, "resumed", args, timeout=900)
    assert resumed.returncode == 0, resumed.describe()
    assert f"loaded lazy checkpoint of iteration {ITERS}" in resumed.log, resumed.describe()
    assert_same_training(resumed, reference, range(ITERS + 1, ITERS + MORE + 1))
