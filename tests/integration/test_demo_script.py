"""``bash scripts/demo.sh`` (README.md: the main job, what a new user runs first): it sets up
``.venv`` (``scripts/setup.sh``, which a test must not run: it repoints the environment) and then
runs ``python -m datastates_megatron.demo.run_demo`` with the arguments it was given.  Here that
demo runs end to end on 2 CPU ranks with a tiny model: a reference run, a run killed with
``kill -9`` after its checkpoint of iteration 2, the restart, and the bit-exact comparison."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "--num-layers 2 --hidden-size 64 --seq-length 32 --vocab-size 256"


def test_demo_sh_runs_the_demo_module_with_its_arguments():
    lines = (REPO / "scripts" / "demo.sh").read_text().strip().splitlines()
    assert "bash scripts/setup.sh" in lines and ". .venv/bin/activate" in lines
    assert lines[-1] == 'exec python -m datastates_megatron.demo.run_demo "$@"'


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_the_demo_passes_with_a_tiny_model(tmp_path):
    """The demo end to end, small: 30 iterations, killed after checkpoint 2 (run_demo polls for
    that commit every 50 ms; 28 iterations, each with a checkpoint, are still to run), the
    resumed run equal to the bit, every summary row and ``DEMO PASSED``."""
    work = tmp_path / "demo"
    args = ["--iters", "30", "--kill-after", "2", f"--model={TINY}", "--workdir", str(work)]
    done = subprocess.run(
        [sys.executable, "-m", "datastates_megatron.demo.run_demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "killed every rank with SIGKILL after checkpoint" in out, out
    assert "losses after resume equal the uninterrupted run to the bit: True" in out, out
    assert "final parameters + optimizer state equal to the bit on every rank: True" in out, out
    assert "iteration time, checkpoint every iteration" in out and out.rstrip().endswith("DEMO PASSED"), out


def test_the_summary_of_a_short_run_keeps_its_warm_up_iterations():
    """A resumed run killed late trains one or two iterations: the summary's median keeps them (it
    left out two warm-up iterations and raised ``StatisticsError`` on what remained, after the
    checks had passed); none at all is NaN, not a traceback."""
    import math

    from datastates_megatron.demo.run_demo import _median_iteration_s

    rows = [{"iter_s": s} for s in (5.0, 4.0, 1.0, 2.0, 3.0)]
    assert _median_iteration_s(rows) == 2.0  # the first two left out
    assert _median_iteration_s(rows[:1]) == 5.0 and _median_iteration_s(rows[:2]) == 4.5
    assert math.isnan(_median_iteration_s([]))


def test_a_workdir_the_demo_did_not_make_is_refused_and_left_alone(tmp_path):
    """``--workdir`` of a directory that holds someone's files: one line, nothing removed (it was
    emptied with ``rmtree`` before); a new one, or the one an earlier demo made, is used."""
    from datastates_megatron.demo.run_demo import MARK, fresh_workdir

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit) as e:
        fresh_workdir(str(mine))
    assert f"--workdir {mine}: not empty and not made by the demo (no {MARK}): nothing removed" in str(e.value)
    assert (mine / "notes.txt").read_text() == "keep" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(SystemExit, match="not a directory the demo made"):
        fresh_workdir(str(tmp_path / "link"))
    demo = tmp_path / "demo"
    fresh_workdir(str(demo))  # new: made, and marked
    (demo / "reference.log").write_text("an earlier run")
    fresh_workdir(str(demo))  # ours: emptied
    assert sorted(p.name for p in demo.iterdir()) == [MARK]
