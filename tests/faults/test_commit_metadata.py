"""Issue 41, item 6: a commit's metadata work does not grow with the checkpoints kept.  Counted under
``strace`` (real system calls, every thread of the process): the calls that name a path under the
save directory or the node-local root -- by path or by a descriptor open on one -- made by one
commit (saved, committed locally, promoted, committed on ``--save``, retention done), with 10 and
with 1,000 checkpoints kept; and how often a 300-commit run touches its first checkpoint's paths.
Megatron's default keeps every checkpoint; before, every commit re-surveyed every kept directory
and manifest (957 touches of the first checkpoint in a 300-commit demo run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.workers.commit_calls_worker import MARK_BEGIN, MARK_END

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strace_or_skip() -> str:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (scripts/setup.sh installs it: apt-get install strace)")
    probe = subprocess.run([strace, "-f", "-o", os.devnull, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace refused?): {probe.stderr.strip()[:200]}")
    return strace


def traced_calls(directory: str, kept: int, commits: int) -> list[str]:
    """The system calls of the worker's counted commits (one line each, as ``strace -y`` prints
    them: descriptors shown with their paths) that name ``directory``."""
    strace = _strace_or_skip()
    log = os.path.join(directory, "strace.log")
    work = os.path.join(directory, "run")
    os.makedirs(work)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [strace, "-f", "-y", "-qq", "-e", "trace=%file,%desc", "-o", log]
    cmd += [sys.executable, "-m", "tests.workers.commit_calls_worker", work, str(kept), str(commits)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert done.returncode == 0 and "RESULT" in done.stdout, done.stderr[-3000:]
    with open(log, errors="replace") as f:
        text = f.read()
    begin, end = text.find(f'"{MARK_BEGIN}"'), text.find(f'"{MARK_END}"')
    assert 0 < begin < end, "markers not found in the strace log"
    window = text[text.find("\n", begin) + 1 : text.rfind("\n", 0, end)]
    # a call interrupted by another thread's is printed twice ("unfinished", then "resumed"): once here
    return [line for line in window.splitlines() if work in line and "resumed>" not in line]


def _by_call(lines: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in lines:
        m = re.match(r"\s*\d+\s+(\w+)\(", line)
        name = m.group(1) if m else "?"
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


@pytest.mark.slow
def test_a_commits_metadata_calls_are_the_same_with_10_and_1000_checkpoints_kept(tmp_path):
    few = traced_calls(str(tmp_path / "few"), kept=10, commits=1)
    many = traced_calls(str(tmp_path / "many"), kept=1000, commits=1)
    assert len(few) == len(many), (
        f"{len(few)} calls with 10 kept, {len(many)} with 1,000: {_by_call(few)} vs {_by_call(many)}"
    )


@pytest.mark.slow
def test_a_300_commit_run_touches_its_first_checkpoint_a_bounded_number_of_times(tmp_path):
    """The first checkpoint (committed before the count) is touched once more in 300 commits: its
    deletion from the node-local tier (``local_keep_last=2``, ~20 calls); on ``--save``, never."""
    lines = traced_calls(str(tmp_path / "run300"), kept=0, commits=300)
    first = [line for line in lines if "iter_0000001" in line]
    on_save = [line for line in first if f"{os.sep}save{os.sep}iter_0000001" in line]
    assert on_save == [], f"{len(on_save)} calls touched --save's iter_0000001 in 300 commits: {_by_call(on_save)}"
    assert len(first) <= 40, f"{len(first)} calls touched iter_0000001 in 300 commits: {_by_call(first)}"
